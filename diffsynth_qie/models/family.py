"""The model-family seam: what differs between Qwen-Image-Edit (original, 2509, 2511) and Qwen-Image-2.1.

Every preset names its family (``Preset.family``); code that must behave differently per family asks the
family (``presets.family_of``) instead of testing a name. A family is data plus dotted paths to its few
behaviours, resolved lazily, so this module stays import-light (no torch, no diffsynth), like
``presets.py``:

| | Qwen-Image-Edit | Qwen-Image-2.1 |
| --- | --- | --- |
| DiffSynth pipeline | ``QwenImagePipeline`` | ``QwenImage21Pipeline`` |
| DiT | 60 dual-stream blocks, 20.4 B | 32 single-stream layers, 7 B |
| text encoder | Qwen2.5-VL-7B (tokenizer + processor) | Qwen3-VL-8B, before its final norm (processor only) |
| VAE | 16 channels, 8x, RGB | 64 channels, 16x, RGBA |
| image token | a 2x2 patch of latents (16 px) | one latent (16 px) |
| output sizes | multiples of 16 | multiples of 32 |
| references | in the prompt template ("Picture 1: ...") and as latent tokens | a prefix at t=0 whose keys and values are cached across steps |
| sampler defaults | 40 steps, true CFG 4 | 40 steps, CFG 1 (the Turbo preset: 8 fixed sigmas) |
| licence | Apache-2.0 | Qwen Research License (non-commercial) |

See ``docs/DEVELOPING.md`` ("The model-family seam") for what lives behind it and what does not yet.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class Family:
    name: str
    label: str
    pipeline_class: str                  # dotted path of DiffSynth's pipeline class
    model_names: dict                    # our component -> DiffSynth's ``model_name`` in MODEL_CONFIGS
    latent_channels: int
    vae_factor: int                      # pixels per latent pixel
    token_pixels: int                    # pixels per image-token side (VAE factor x DiT patch)
    size_divisor: int                    # output height and width are multiples of this
    default_steps: int
    default_cfg: float
    max_references: int
    licence: str
    has_tokenizer: bool                  # a tokenizer folder beside the processor (the Edit family)
    lora_targets: tuple[str, ...]        # default LoRA target module names
    ops: str                             # dotted path of its ``family_ops.FamilyOps`` (the behaviour)
    training_template: str               # DiffSynth's ``FlowMatchScheduler`` template of the training σ schedule
    # The tensors of an encoded prompt the cache stores beside its embedding [L, D], one per name, as
    # ``prompt_<name>.<k>`` / ``empty_prompt_<name>`` (``FamilyOps.split_prompt`` makes them).
    prompt_tensors: tuple[str, ...]
    fullsize_verify: bool = False        # ``qie plan --verify`` and the preflight run this family at full size
    # Dotted path of a context manager the fake-device checks enter inside ``FakeCuda()``: a stand-in for host
    # bookkeeping DiffSynth's DiT of this family does on token masks ("" when its DiT needs none)
    fake_standin: str = ""
    # DiffSynth's classes at their real sizes (default arguments), for ``qie plan``'s census on the meta device
    dit_class: str = ""
    text_encoder_class: str = ""
    vae_class: str = ""
    streams: int = 2                     # token streams per block with their own LoRA targets (image, text)
    # A DiT block's call as the step cache sees it (``models/samplers/cached_blocks.py``): its tensor inputs in
    # positional order, the first being the stream whose residual is cached, and its outputs in order (one name:
    # the block returns that tensor bare)
    block_io: tuple[tuple[str, ...], tuple[str, ...]] = (("image", "text"), ("text", "image"))
    # Fixed sampling sigmas of a distilled variant are a preset's, not the family's: ``Preset.sigmas``.
    notes: dict = field(default_factory=dict)

    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        """Latent height and width of an output of ``height`` x ``width`` pixels."""
        return height // self.vae_factor, width // self.vae_factor

    @property
    def patch(self) -> int:
        """Latent pixels per DiT token side (2 for Qwen-Image-Edit's 2x2 patches, 1 for Qwen-Image-2.1)."""
        return self.token_pixels // self.vae_factor

    def image_tokens(self, height: int, width: int) -> int:
        """DiT tokens of one image of ``height`` x ``width`` pixels."""
        return (height // self.token_pixels) * (width // self.token_pixels)

    def fake_device_standin(self):
        """A fresh instance of :attr:`fake_standin` (a no-op context without one; imports it)."""
        import contextlib

        return _resolve(self.fake_standin)() if self.fake_standin else contextlib.nullcontext()

    def pipeline_type(self):
        """DiffSynth's pipeline class (imports diffsynth)."""
        return _resolve(self.pipeline_class)

    def component_type(self, component: str):
        """DiffSynth's class of ``dit``, ``text_encoder`` or ``vae`` (imports diffsynth)."""
        return _resolve(getattr(self, f"{component}_class"))


def _resolve(dotted: str):
    import importlib

    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


# DiffSynth's usual Qwen-Image LoRA targets (examples/qwen_image/model_training/lora/*.sh).
EDIT_LORA_TARGETS: tuple[str, ...] = (
    "to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out",
    "img_mlp.net.2", "img_mod.1", "txt_mlp.net.2", "txt_mod.1",
)
# Qwen-Image-2.1's single-stream layer (``QwenImage21TransformerBlock``): the attention's q/k/v/out
# projections and the SwiGLU feed-forward (``img_mlp.proj``, ``.gate_layer``, ``.out``).
QWEN21_LORA_TARGETS: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0", "img_mlp.proj", "img_mlp.gate_layer",
                                        "img_mlp.out")

EDIT = Family(
    name="qwen-image-edit", label="Qwen-Image-Edit",
    pipeline_class="diffsynth.pipelines.qwen_image.QwenImagePipeline",
    model_names={"dit": "qwen_image_dit", "text_encoder": "qwen_image_text_encoder", "vae": "qwen_image_vae"},
    latent_channels=16, vae_factor=8, token_pixels=16, size_divisor=16, default_steps=40, default_cfg=4.0,
    max_references=3, licence="Apache-2.0", has_tokenizer=True, lora_targets=EDIT_LORA_TARGETS,
    ops="diffsynth_qie.models.qwen_image_edit.edit_ops.EditOps", training_template="Qwen-Image", prompt_tensors=(),
    fullsize_verify=True, dit_class="diffsynth.models.qwen_image_dit.QwenImageDiT",
    text_encoder_class="diffsynth.models.qwen_image_text_encoder.QwenImageTextEncoder",
    vae_class="diffsynth.models.qwen_image_vae.QwenImageVAE", streams=2,
)
QWEN21 = Family(
    name="qwen-image-2.1", label="Qwen-Image-2.1",
    pipeline_class="diffsynth.pipelines.qwen_image_21.QwenImage21Pipeline",
    model_names={"dit": "qwen_image_21_dit", "text_encoder": "qwen_image_21_text_encoder",
                 "vae": "qwen_image_21_vae"},
    latent_channels=64, vae_factor=16, token_pixels=16, size_divisor=32, default_steps=40, default_cfg=1.0,
    max_references=10, licence="Qwen Research License (non-commercial use only)", has_tokenizer=False,
    lora_targets=QWEN21_LORA_TARGETS, ops="diffsynth_qie.models.qwen_image_21.qwen21_ops.Qwen21Ops",
    training_template="Qwen-Image", prompt_tensors=("pad",),  # pad: the references' slots in the prompt [L], bool
    fullsize_verify=True, fake_standin="diffsynth_qie.fakegpu.standin21.host_bookkeeping21",
    dit_class="diffsynth.models.qwen_image_21_dit.QwenImage21DiT",
    text_encoder_class="diffsynth.models.qwen_image_21_text_encoder.QwenImage21TextEncoder",
    vae_class="diffsynth.models.qwen_image_21_vae.QwenImage21VAE", streams=1,
    block_io=(("hidden_states",), ("hidden_states",)),
)
FAMILIES: dict[str, Family] = {f.name: f for f in (EDIT, QWEN21)}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; valid: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of_pipe(pipe) -> Optional[Family]:
    """The family of a loaded pipeline (by the preset attached at load, else by its DiffSynth class)."""
    preset = getattr(pipe, "qie_preset", None)
    if preset is not None:
        return get_family(preset.family)
    cls = f"{type(pipe).__module__}.{type(pipe).__name__}"
    return next((f for f in FAMILIES.values() if f.pipeline_class == cls), None)
