"""A tiny Qwen-Image-2.1 on DiffSynth's own 2.1 classes, loaded by DiffSynth's own loader.

The 2.1 counterpart of ``build.py``, for the same reason: tests and CPU demos of the second model family
must drive the *real* code path (``QwenImage21Pipeline``, its prompt and reference units,
``model_fn_qwen_image_21`` with its prefix KV cache, DiffSynth's hash-based detection and its Qwen3-VL
state-dict converter) in milliseconds.

- the DiT is DiffSynth's real ``QwenImage21DiT`` (its sizes are constructor arguments): 2 single-stream
  layers, 2 heads x 32, RoPE axes (8, 12, 12), text width 32, 64 latent channels;
- the VAE is the real ``QwenImage21VAE`` with five levels (16x, as the real one) at width 8, 64 latent
  channels, RGBA in and out;
- ``TinyQwenImage21TextEncoder`` keeps DiffSynth's ``forward`` (the hidden state before the final norm)
  around a tiny ``Qwen3VLConfig`` with a vision tower (patch 16, merge 2, one DeepStack layer); it is saved
  with Hugging Face key names so DiffSynth's real ``QwenImage21TextEncoderStateDictConverter`` runs on load;
- the tokenizer is the tiny Edit model's (same Qwen special tokens), wrapped with the image processor in a
  ``Qwen3VLProcessor`` whose chat template renders the system turn as Qwen's does (the pipeline measures
  the template prefix it drops with it).

Files are in the real repository's layout (``transformer/``, ``text_encoder/``, ``vae/``, ``processor/``).
"""
from __future__ import annotations

import copy
import functools
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from diffsynth.models.qwen_image_21_text_encoder import QwenImage21TextEncoder

from .install import ensure_built, register_model_configs
from .text import TOKEN_ID, build_tokenizer

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
DIT_FILE = "transformer/diffusion_pytorch_model.safetensors"
TEXT_ENCODER_FILE = "text_encoder/model.safetensors"
VAE_FILE = "vae/diffusion_pytorch_model.safetensors"
PROCESSOR_DIR = "processor"
INFO_FILE = "tiny_model.json"
_LAYOUT_ENTRIES = {"transformer", "text_encoder", "vae", PROCESSOR_DIR, INFO_FILE}

DIT_KWARGS = dict(num_layers=2, attention_head_dim=32, num_attention_heads=2, context_in_dim=32,
                  axes_dims_rope=[8, 12, 12])
VAE_KWARGS = dict(base_dim=8, decoder_base_dim=8, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1)
TEXT_CONFIG = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    head_dim=16, vocab_size=384, hidden_act="silu", attention_bias=False, rms_norm_eps=1e-6, rope_theta=5000000,
    max_position_embeddings=4096, model_type="qwen3_vl_text",
    rope_scaling={"mrope_interleaved": True, "mrope_section": [2, 3, 3], "rope_type": "default"},
    bos_token_id=TOKEN_ID["<|endoftext|>"], eos_token_id=TOKEN_ID["<|im_end|>"])
VISION_CONFIG = dict(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=16,
    spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0], num_position_embeddings=64,
    hidden_act="gelu_pytorch_tanh", in_channels=3, model_type="qwen3_vl")
# The image processor's pixel range for the encoder's view of a reference (its shortest_edge is also the
# pipeline's floor when it resizes a reference).
PROCESSOR_PIXELS = dict(shortest_edge=32 * 32, longest_edge=128 * 128)
# Qwen's chat format for the system turn, which the pipeline renders to measure the prefix it drops.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_SEED_OFFSETS = {"dit": 10, "text_encoder": 11, "vae": 12}


def tiny_dit(num_layers: int | None = None):
    """The tiny 2.1 DiT (DiffSynth's ``QwenImage21DiT``; ``num_layers`` overrides the depth)."""
    from diffsynth.models.qwen_image_21_dit import QwenImage21DiT

    return QwenImage21DiT(**{**DIT_KWARGS, **({} if num_layers is None else {"num_layers": num_layers})})


def tiny_encoders():
    """The tiny 2.1 text encoder and (random-model) VAE, as modules of the current default device and dtype (the
    fake-device checks of a tiny preset build these beside :func:`tiny_dit`)."""
    from diffsynth.models.qwen_image_21_vae import QwenImage21VAE

    return TinyQwenImage21TextEncoder(), QwenImage21VAE(**VAE_KWARGS)


def text_encoder_config():
    from transformers import Qwen3VLConfig

    # (deep copies: transformers writes into the nested rope_scaling dict, which the base's fingerprint reads)
    return Qwen3VLConfig(
        text_config=copy.deepcopy(TEXT_CONFIG), vision_config=copy.deepcopy(VISION_CONFIG), tie_word_embeddings=False,
        image_token_id=TOKEN_ID["<|image_pad|>"], video_token_id=TOKEN_ID["<|video_pad|>"],
        vision_start_token_id=TOKEN_ID["<|vision_start|>"], vision_end_token_id=TOKEN_ID["<|vision_end|>"])


class TinyQwenImage21TextEncoder(QwenImage21TextEncoder):
    """``QwenImage21TextEncoder`` (its real ``forward`` and fp32-buffer handling) around a tiny Qwen3-VL."""

    def __init__(self):
        torch.nn.Module.__init__(self)
        from transformers import Qwen3VLForConditionalGeneration

        self.config = text_encoder_config()
        self.model = Qwen3VLForConditionalGeneration(self.config)
        self._fp32_buffers = {name: buffer.detach().clone() for name, buffer in self.model.named_buffers()
                              if buffer.dtype == torch.float32}


def _to_hf_keys(state_dict: dict) -> dict:
    """Inverse of DiffSynth's ``QwenImage21TextEncoderStateDictConverter`` (Hugging Face checkpoint names)."""
    out = {}
    for key, value in state_dict.items():
        if key == "model.lm_head.weight":
            key = "lm_head.weight"
        elif key.startswith("model.model."):
            key = key[len("model."):]
        out[key] = value
    return out


def _component_state_dicts(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    from diffsynth.models.qwen_image_21_dit import QwenImage21DiT
    from diffsynth.models.qwen_image_21_vae import QwenImage21VAE

    builders = {"dit": lambda: QwenImage21DiT(**DIT_KWARGS), "text_encoder": TinyQwenImage21TextEncoder,
                "vae": lambda: QwenImage21VAE(**VAE_KWARGS)}
    out = {}
    for name, build in builders.items():
        with torch.random.fork_rng(devices=[]):  # the caller's RNG stream stays as it was
            torch.manual_seed(seed * 1000 + _SEED_OFFSETS[name])
            model = build()
        sd = {k: v.detach().to(torch.float32).contiguous().clone() for k, v in model.state_dict().items()}
        out[name] = _to_hf_keys(sd) if name == "text_encoder" else sd
    return out


def build_processor():
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    image_processor = Qwen2VLImageProcessor(size=dict(PROCESSOR_PIXELS), patch_size=VISION_CONFIG["patch_size"],
                                            merge_size=VISION_CONFIG["spatial_merge_size"],
                                            temporal_patch_size=VISION_CONFIG["temporal_patch_size"])
    return Qwen3VLProcessor(image_processor=image_processor, tokenizer=build_tokenizer(),
                            video_processor=Qwen3VLVideoProcessor(), chat_template=CHAT_TEMPLATE)


def build_tiny21(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write a complete tiny Qwen-Image-2.1 to ``out_dir`` (deterministic per seed) and register it."""
    import transformers
    from safetensors.torch import save_file

    from ..utils.atomic import atomic_path, atomic_write_json

    out_dir = Path(out_dir)
    (out_dir / INFO_FILE).unlink(missing_ok=True)  # present only once every file below is written
    register_tiny21_model_configs()
    state_dicts = _component_state_dicts(seed)
    for name, rel in {"dit": DIT_FILE, "text_encoder": TEXT_ENCODER_FILE, "vae": VAE_FILE}.items():
        with atomic_path(out_dir / rel) as tmp:
            save_file(state_dicts[name], str(tmp), metadata={"format": "pt"})
    if (out_dir / PROCESSOR_DIR).exists():
        shutil.rmtree(out_dir / PROCESSOR_DIR)
    build_processor().save_pretrained(str(out_dir / PROCESSOR_DIR))
    atomic_write_json(out_dir / INFO_FILE, {
        "format_version": FORMAT_VERSION, "family": "qwen-image-2.1", "seed": seed,
        "transformers_version": transformers.__version__, "dit": DIT_KWARGS, "vae": VAE_KWARGS,
        "text_encoder": {"text": TEXT_CONFIG, "vision": VISION_CONFIG}, "processor": PROCESSOR_PIXELS,
        "num_params": {name: int(sum(t.numel() for t in sd.values())) for name, sd in state_dicts.items()},
    })
    log.info("tiny Qwen-Image-2.1 (seed %d) written to %s", seed, out_dir)
    return out_dir


def is_complete21(model_dir: str | os.PathLike, seed: int | None = None) -> bool:
    """True if ``model_dir`` holds a finished tiny-2.1 build usable by the installed transformers."""
    import transformers

    model_dir = Path(model_dir)
    try:
        info = json.loads((model_dir / INFO_FILE).read_text())
    except (OSError, ValueError):
        return False
    same_major = str(info.get("transformers_version", "")).split(".")[0] == transformers.__version__.split(".")[0]
    return (info.get("format_version") == FORMAT_VERSION and info.get("family") == "qwen-image-2.1" and same_major
            and (seed is None or info.get("seed") == seed)
            and all((model_dir / rel).is_file() for rel in (DIT_FILE, TEXT_ENCODER_FILE, VAE_FILE))
            and (model_dir / PROCESSOR_DIR).is_dir())


def replaceable21(model_dir: str | os.PathLike) -> bool:
    """True if ``model_dir`` is missing, empty or holds only tiny-2.1 entries (safe to replace)."""
    model_dir = Path(model_dir)
    return not model_dir.exists() or (model_dir.is_dir() and all(p.name in _LAYOUT_ENTRIES
                                                                 for p in model_dir.iterdir()))


def ensure_tiny21(out_dir: str | os.PathLike, seed: int | None = None) -> Path:
    """``out_dir`` with a complete tiny 2.1, built atomically when missing (see ``install.ensure_built``)."""
    if is_complete21(out_dir, seed=seed):
        register_tiny21_model_configs()
        return Path(out_dir)
    return ensure_built(out_dir, seed, build_tiny21, is_complete21, replaceable21, "tiny Qwen-Image-2.1")


# What `qie make-tiny --model tiny-2.1` builds with (found through the preset's provider, this module).
MAKE_TINY = {"replaceable": replaceable21, "complete": is_complete21, "ensure": ensure_tiny21,
             "what": "tiny Qwen-Image-2.1"}


_TEXT_ENCODER_CLASS = f"{__name__}.TinyQwenImage21TextEncoder"


@functools.lru_cache(maxsize=1)
def tiny21_model_configs() -> tuple[dict, ...]:
    """The ``MODEL_CONFIGS`` entries of the three tiny-2.1 weight files (hashes by DiffSynth's own
    ``hash_state_dict_keys``, on freshly built models: equal to the saved files' without reading them)."""
    from diffsynth.core.loader import hash_state_dict_keys

    sds = _component_state_dicts(seed=0)
    return (
        {"model_hash": hash_state_dict_keys(sds["dit"]), "model_name": "qwen_image_21_dit",
         "model_class": "diffsynth.models.qwen_image_21_dit.QwenImage21DiT", "extra_kwargs": dict(DIT_KWARGS)},
        {"model_hash": hash_state_dict_keys(sds["text_encoder"]), "model_name": "qwen_image_21_text_encoder",
         "model_class": _TEXT_ENCODER_CLASS,
         "state_dict_converter": "diffsynth.utils.state_dict_converters.qwen_image_21_text_encoder."
                                 "QwenImage21TextEncoderStateDictConverter"},
        {"model_hash": hash_state_dict_keys(sds["vae"]), "model_name": "qwen_image_21_vae",
         "model_class": "diffsynth.models.qwen_image_21_vae.QwenImage21VAE", "extra_kwargs": dict(VAE_KWARGS)},
    )


def register_tiny21_model_configs() -> None:
    from .vae21 import register_tiny_vae21_config

    register_tiny_vae21_config()  # the pretrained base's conv VAE (tiny/vae21.py)
    register_model_configs(tiny21_model_configs(), {
        _TEXT_ENCODER_CLASS: "diffsynth.models.qwen_image_21_text_encoder.QwenImage21TextEncoder"})


def prepare_tiny21(model_dir: str | os.PathLike | None) -> Path:
    """The ``tiny-2.1`` preset's provider: register its MODEL_CONFIGS; build the default model when no
    directory is given (an explicit one is used as it is, and checked by the loader)."""
    from ..models.load.loading import qie_home

    register_tiny21_model_configs()
    return Path(model_dir) if model_dir is not None else ensure_tiny21(qie_home() / "models" / "Qwen-Image-2.1-tiny")
