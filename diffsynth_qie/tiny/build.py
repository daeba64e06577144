"""A tiny Qwen-Image-Edit built from DiffSynth's own blocks, loaded by DiffSynth's own loader.

Why: every test, the CPU demo and the README's first command need a model that runs
in milliseconds yet exercises the *real* code path — DiffSynth's hash-based model
detection, its text-encoder state-dict converter, ``model_fn_qwen_image``, the
prompt-encoding units (templates, ``drop_idx``), the VAE. So the tiny model is:

- ``TinyQwenImageDiT``: ``QwenImageDiT`` with the same attribute names rebuilt from
  DiffSynth's blocks at small sizes (dim 64, 2 heads x 32, RoPE axes [8, 12, 12],
  text dim 32, 2 layers, 64 in/out channels = 16 latent channels x 2x2 patch).
- ``TinyQwenImageTextEncoder``: ``QwenImageTextEncoder`` (real ``forward``) around a
  tiny ``Qwen2_5_VLConfig`` with a vision tower; saved with Hugging Face key names so
  DiffSynth's real ``QwenImageTextEncoderStateDictConverter`` runs on load.
- the real ``QwenImageVAE(base_dim=8, z_dim=16, dim_mult=[1,1,1,1], num_res_blocks=1)``
  (z_dim 16 and four levels = 8x downscale are what the pipeline assumes).
- a byte-level BPE tokenizer trained with ``tokenizers`` and wrapped as
  ``Qwen2Tokenizer``, plus a ``Qwen2VLProcessor``; both built with the installed
  transformers, because folders saved by transformers 4.x and 5.x don't load in the
  other.

Files are written in the real repositories' layout (``transformer/``, ``text_encoder/``,
``vae/``, ``tokenizer/``, ``processor/``) and :func:`register_tiny_model_configs`
appends the three weight files' hashes to ``diffsynth.configs.MODEL_CONFIGS``, so
``QwenImagePipeline.from_pretrained(model_configs=[ModelConfig(path=...)])`` works
unchanged. Nothing downstream knows the model is tiny.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from diffsynth.models.general_modules import AdaLayerNorm, RMSNorm, TimestepEmbeddings
from diffsynth.models.qwen_image_dit import QwenEmbedRope, QwenImageDiT, QwenImageTransformerBlock
from diffsynth.models.qwen_image_text_encoder import QwenImageTextEncoder

from .install import ensure_built, register_model_configs
from .text import (PROCESSOR_PIXELS, SPECIAL_TOKENS, TEXT_SIZES, TOKEN_ID, VISION_SIZES,  # noqa: F401
                        build_processor, build_tokenizer)

log = logging.getLogger(__name__)

FORMAT_VERSION = 1

# Files of a complete tiny model, relative to its directory (the real repos' layout).
DIT_FILE = "transformer/diffusion_pytorch_model.safetensors"
TEXT_ENCODER_FILE = "text_encoder/model.safetensors"
VAE_FILE = "vae/diffusion_pytorch_model.safetensors"
TOKENIZER_DIR = "tokenizer"
PROCESSOR_DIR = "processor"
INFO_FILE = "tiny_model.json"

# --- sizes -----------------------------------------------------------------------
DIT_SIZES = dict(dim=64, num_heads=2, head_dim=32, axes_dim=(8, 12, 12), text_dim=32,
                 num_layers=2, in_channels=64)
VAE_KWARGS = dict(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
# Seed offsets per component, so each component's weights depend only on the seed.
_SEED_OFFSETS = {"dit": 0, "text_encoder": 1, "vae": 2}


# --- models ----------------------------------------------------------------------
class TinyQwenImageDiT(QwenImageDiT):
    """``QwenImageDiT`` at small sizes: same attribute names, DiffSynth's own blocks.

    ``QwenImageDiT.__init__`` hard-codes the 20B sizes, so this skips it and rebuilds
    the attributes ``model_fn_qwen_image`` touches; ``forward`` and the entity-mask
    helpers are inherited unchanged.
    """

    def __init__(self, dim: int = 64, num_heads: int = 2, head_dim: int = 32,
                 axes_dim=(8, 12, 12), text_dim: int = 32, num_layers: int = 2,
                 in_channels: int = 64):
        torch.nn.Module.__init__(self)
        assert num_heads * head_dim == dim and sum(axes_dim) == head_dim
        self.pos_embed = QwenEmbedRope(theta=10000, axes_dim=list(axes_dim), scale_rope=True)
        self.time_text_embed = TimestepEmbeddings(256, dim, diffusers_compatible_format=True, scale=1000,
                                                  align_dtype_to_timestep=False, use_additional_t_cond=False)
        self.txt_norm = RMSNorm(text_dim, eps=1e-6)
        self.img_in = torch.nn.Linear(in_channels, dim)
        self.txt_in = torch.nn.Linear(text_dim, dim)
        self.transformer_blocks = torch.nn.ModuleList(
            [QwenImageTransformerBlock(dim=dim, num_attention_heads=num_heads, attention_head_dim=head_dim)
             for _ in range(num_layers)]
        )
        self.norm_out = AdaLayerNorm(dim, single=True)
        self.proj_out = torch.nn.Linear(dim, in_channels)


def tiny_dit(num_layers: int | None = None) -> TinyQwenImageDiT:
    """The tiny DiT at its sizes (``num_layers`` overrides the depth), on the current default device."""
    return TinyQwenImageDiT(**{**DIT_SIZES, **({} if num_layers is None else {"num_layers": num_layers})})


def tiny_encoders():
    """The tiny text encoder and (random-model) VAE, as modules of the current default device and dtype (the
    fake-device checks of a tiny preset build these beside :func:`tiny_dit`)."""
    from diffsynth.models.qwen_image_vae import QwenImageVAE

    return TinyQwenImageTextEncoder(), QwenImageVAE(**VAE_KWARGS)


def tiny_text_encoder_config():
    """The tiny ``Qwen2_5_VLConfig`` (text + vision tower), special-token ids from the tokenizer."""
    from transformers import Qwen2_5_VLConfig

    rope = {"mrope_section": list(TEXT_SIZES["mrope_section"]), "rope_type": "default", "type": "default"}
    text = {k: v for k, v in TEXT_SIZES.items() if k != "mrope_section"}
    common = dict(
        bos_token_id=TOKEN_ID["<|endoftext|>"], eos_token_id=TOKEN_ID["<|im_end|>"],
        vision_start_token_id=TOKEN_ID["<|vision_start|>"], vision_end_token_id=TOKEN_ID["<|vision_end|>"],
        vision_token_id=TOKEN_ID["<|vision_pad|>"],
    )
    return Qwen2_5_VLConfig(
        **text, **common,
        image_token_id=TOKEN_ID["<|image_pad|>"], video_token_id=TOKEN_ID["<|video_pad|>"],
        hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=rope,
        max_position_embeddings=4096, attention_dropout=0.0, tie_word_embeddings=False,
        use_sliding_window=False, initializer_range=0.02,
        text_config=dict(
            **text, **common, model_type="qwen2_5_vl_text", hidden_act="silu", rms_norm_eps=1e-6,
            rope_theta=1000000.0, rope_scaling=rope, max_position_embeddings=4096,
            attention_dropout=0.0, use_sliding_window=False, sliding_window=None,
            layer_types=["full_attention"] * TEXT_SIZES["num_hidden_layers"], initializer_range=0.02,
        ),
        vision_config=dict(**VISION_SIZES, hidden_act="silu", in_channels=3, in_chans=3,
                           spatial_patch_size=VISION_SIZES["patch_size"], tokens_per_second=2,
                           initializer_range=0.02),
    )


class TinyQwenImageTextEncoder(QwenImageTextEncoder):
    """``QwenImageTextEncoder`` (its real ``forward``) around a tiny Qwen2.5-VL with vision tower."""

    def __init__(self):
        torch.nn.Module.__init__(self)
        from transformers import Qwen2_5_VLModel

        config = tiny_text_encoder_config()
        self.model = Qwen2_5_VLModel(config)
        self.lm_head = torch.nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
        self.config = config


def _to_hf_text_encoder_keys(state_dict: dict) -> dict:
    """Inverse of DiffSynth's ``QwenImageTextEncoderStateDictConverter`` (HF checkpoint names)."""
    out = {}
    for k, v in state_dict.items():
        if k.startswith("model.visual."):
            k = k[len("model."):]
        elif k.startswith("model.language_model."):
            k = "model." + k[len("model.language_model."):]
        out[k] = v
    return out


def _new_vae():
    from diffsynth.models.qwen_image_vae import QwenImageVAE

    return QwenImageVAE(**VAE_KWARGS)


def _component_state_dicts(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """Freshly initialised weights for each component, keyed by the files' key names."""
    builders = {
        "dit": lambda: TinyQwenImageDiT(**DIT_SIZES),
        "text_encoder": TinyQwenImageTextEncoder,
        "vae": _new_vae,
    }
    out = {}
    for name, build in builders.items():
        # fork_rng: building the model must not disturb the caller's RNG stream.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 1000 + _SEED_OFFSETS[name])
            model = build()
        sd = {k: v.detach().to(torch.float32).contiguous().clone() for k, v in model.state_dict().items()}
        if name == "text_encoder":
            sd = _to_hf_text_encoder_keys(sd)
        out[name] = sd
    return out


# --- build / ensure --------------------------------------------------------------
def build_tiny(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write a complete tiny Qwen-Image-Edit to ``out_dir`` and register it with DiffSynth.

    Deterministic: the same seed gives byte-identical weight files (and, with the same
    transformers, identical tokenizer/processor files). Overwrites the model files in
    ``out_dir`` in place; use :func:`ensure_tiny` for an atomic build. Returns ``out_dir``.
    """
    from safetensors.torch import save_file
    import transformers

    from ..utils.atomic import atomic_path, atomic_write_json
    from ..utils.logging import library_warnings_once

    library_warnings_once()
    out_dir = Path(out_dir)
    # The info file marks a finished build: drop an old one first so a build killed
    # half-way through overwriting never looks complete.
    (out_dir / INFO_FILE).unlink(missing_ok=True)
    register_tiny_model_configs()
    state_dicts = _component_state_dicts(seed)
    files = {"dit": DIT_FILE, "text_encoder": TEXT_ENCODER_FILE, "vae": VAE_FILE}
    for name, rel in files.items():
        with atomic_path(out_dir / rel) as tmp:
            save_file(state_dicts[name], str(tmp), metadata={"format": "pt"})
    tokenizer = build_tokenizer()
    processor = build_processor(tokenizer)
    for rel, obj in ((TOKENIZER_DIR, tokenizer), (PROCESSOR_DIR, processor)):
        if (out_dir / rel).exists():
            shutil.rmtree(out_dir / rel)
        obj.save_pretrained(str(out_dir / rel))
    info = {
        "format_version": FORMAT_VERSION,
        "seed": seed,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__.split("+")[0],
        "dit": {k: list(v) if isinstance(v, tuple) else v for k, v in DIT_SIZES.items()},
        "text_encoder": {"text": TEXT_SIZES, "vision": VISION_SIZES},
        "vae": VAE_KWARGS,
        "processor": PROCESSOR_PIXELS,
        "num_params": {name: int(sum(t.numel() for t in sd.values())) for name, sd in state_dicts.items()},
    }
    # Written last: its presence marks a complete build (see ensure_tiny).
    atomic_write_json(out_dir / INFO_FILE, info)
    log.info("tiny Qwen-Image-Edit (seed %d) written to %s", seed, out_dir)
    return out_dir


_LAYOUT_ENTRIES = {"transformer", "text_encoder", "vae", TOKENIZER_DIR, PROCESSOR_DIR, INFO_FILE}


def is_complete(model_dir: str | os.PathLike, seed: int | None = None) -> bool:
    """True if ``model_dir`` holds a finished tiny-model build usable by the installed transformers.

    With ``seed``, the build must also come from that seed.
    """
    import transformers

    model_dir = Path(model_dir)
    try:
        info = json.loads((model_dir / INFO_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    processor_ok = any((model_dir / PROCESSOR_DIR / f).is_file()
                       for f in ("processor_config.json", "preprocessor_config.json"))
    needed = [DIT_FILE, TEXT_ENCODER_FILE, VAE_FILE, f"{TOKENIZER_DIR}/tokenizer_config.json"]
    # Tokenizer/processor folders don't load across transformers major versions.
    same_major = str(info.get("transformers_version", "")).split(".")[0] == transformers.__version__.split(".")[0]
    return (info.get("format_version") == FORMAT_VERSION and same_major and processor_ok
            and (seed is None or info.get("seed") == seed)
            and all((model_dir / rel).is_file() for rel in needed))


def looks_like_tiny_dir(model_dir: str | os.PathLike) -> bool:
    """True if ``model_dir`` is missing, empty or holds only tiny-model entries (safe to replace)."""
    model_dir = Path(model_dir)
    if not model_dir.exists():
        return True
    return model_dir.is_dir() and all(p.name in _LAYOUT_ENTRIES for p in model_dir.iterdir())


def ensure_tiny(out_dir: str | os.PathLike, seed: int | None = None) -> Path:
    """Return ``out_dir`` with a complete tiny model, building it if missing or incomplete.

    ``seed=None`` accepts a complete build from any seed (and builds seed 0); an
    explicit seed also rebuilds a complete build made from another seed.

    The build goes into a temporary sibling directory that is renamed into place, so
    a killed build or two processes racing never leave a half-written model behind.
    A directory holding anything but tiny-model files is never replaced (ValueError).
    """
    if is_complete(out_dir, seed=seed):
        register_tiny_model_configs()
        return Path(out_dir)
    return ensure_built(out_dir, seed, build_tiny, is_complete, looks_like_tiny_dir, "tiny Qwen-Image-Edit")


# What `qie make-tiny --model tiny` builds with (found through the preset's provider, this module).
MAKE_TINY = {"replaceable": looks_like_tiny_dir, "complete": is_complete, "ensure": ensure_tiny,
             "what": "tiny Qwen-Image-Edit"}


# --- DiffSynth registry ----------------------------------------------------------
_DIT_CLASS = f"{__name__}.TinyQwenImageDiT"
_TEXT_ENCODER_CLASS = f"{__name__}.TinyQwenImageTextEncoder"


@functools.lru_cache(maxsize=1)
def tiny_model_configs() -> tuple[dict, ...]:
    """The ``MODEL_CONFIGS`` entries for the three tiny weight files.

    Hashes come from DiffSynth's own ``hash_state_dict_keys`` (md5 over sorted
    ``key:shape``), computed on freshly built models, so they equal
    ``hash_model_file`` of the saved files without reading any file and follow the
    installed transformers' parameter names.
    """
    from diffsynth.core.loader import hash_state_dict_keys

    sds = _component_state_dicts(seed=0)
    return (
        {"model_hash": hash_state_dict_keys(sds["dit"]), "model_name": "qwen_image_dit",
         "model_class": _DIT_CLASS,
         "extra_kwargs": {k: list(v) if isinstance(v, tuple) else v for k, v in DIT_SIZES.items()}},
        {"model_hash": hash_state_dict_keys(sds["text_encoder"]), "model_name": "qwen_image_text_encoder",
         "model_class": _TEXT_ENCODER_CLASS,
         "state_dict_converter": "diffsynth.utils.state_dict_converters.qwen_image_text_encoder."
                                 "QwenImageTextEncoderStateDictConverter"},
        {"model_hash": hash_state_dict_keys(sds["vae"]), "model_name": "qwen_image_vae",
         "model_class": "diffsynth.models.qwen_image_vae.QwenImageVAE",
         "extra_kwargs": dict(VAE_KWARGS)},
    )


def prepare_tiny(model_dir: str | os.PathLike | None) -> Path:
    """The tiny preset's provider: register its MODEL_CONFIGS; build the default model when no
    directory is given (an explicit directory is used as it is, and checked by the loader)."""
    from ..models.load.loading import default_tiny_dir

    register_tiny_model_configs()
    return Path(model_dir) if model_dir is not None else ensure_tiny(default_tiny_dir())


def register_tiny_model_configs() -> None:
    """Append the tiny models to ``diffsynth.configs.MODEL_CONFIGS`` (idempotent).

    Appends to the list object itself: DiffSynth's ``ModelPool`` iterates that same
    object, so rebinding the name would do nothing. Also maps our subclasses to
    their parents' VRAM-management module maps so CPU offload treats them alike.
    """
    from .vae import register_tiny_vae_config

    register_tiny_vae_config()  # the pretrained base's conv VAE (tiny/vae.py)
    register_model_configs(tiny_model_configs(), {
        _DIT_CLASS: "diffsynth.models.qwen_image_dit.QwenImageDiT",
        _TEXT_ENCODER_CLASS: "diffsynth.models.qwen_image_text_encoder.QwenImageTextEncoder"})
