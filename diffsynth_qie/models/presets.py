"""Registry of the Qwen image-editing models we support, with their per-model flags.

A preset says where each component comes from (a ModelScope model id + file pattern,
mirroring DiffSynth-Studio's own examples, or the same relative path inside a local
``--model_dir``) and how the model must be driven:

- ``zero_cond_t``: 2511 checkpoints were trained with the reference images' tokens
  modulated at timestep 0; 2509 and the original Edit must not use it.
- ``multi_image_prompt``: 2509/2511 encode prompts with DiffSynth's multi-image
  template ("Picture 1: ..."), i.e. ``edit_image`` is passed as a list even for one
  image; the original Edit takes a single image.
- ``lora_target_modules``: default LoRA targets on the DiT.
- ``family``: the model family (``models/family.py``): Qwen-Image-Edit or Qwen-Image-2.1, which differ in
  architecture, not in a flag.
- ``sigmas``: a distilled variant's fixed sampling schedule (Qwen-Image-2.1-Turbo).

This module is pure data (no torch, no diffsynth) so the CLI can list presets fast.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from .family import EDIT, EDIT_LORA_TARGETS, QWEN21, Family, get_family

DEFAULT_LORA_TARGETS: tuple[str, ...] = EDIT_LORA_TARGETS
# The 2511 default also adapts the DiT's input/output projections: the nn.Linear
# modules QwenImageDiT.img_in, .txt_in and .proj_out (top-level, so each matches once).
LORA_TARGETS_2511: tuple[str, ...] = DEFAULT_LORA_TARGETS + ("img_in", "txt_in", "proj_out")

# Longest prompt (tokens of the user's text, without the template) that is encoded.
# Qwen-Image was trained on prompts of up to 512 tokens (DiffSynth warns beyond that);
# 1024 leaves room for long edit instructions while refusing pasted documents, whose
# tens of thousands of tokens make the cache and every training step that much slower.
DEFAULT_MAX_PROMPT_TOKENS = 1024

# The components a pipeline can be built from, in the order DiffSynth loads them.
COMPONENTS: tuple[str, ...] = ("dit", "text_encoder", "vae", "tokenizer", "processor")


@dataclass(frozen=True)
class Source:
    """Where one component's files live.

    ``pattern`` is DiffSynth's ``origin_file_pattern``: a glob for weight files or a
    folder ending in ``/`` for tokenizer/processor. With ``--model_dir`` the same
    pattern is resolved inside that directory (the repos' own layout).
    """

    model_id: str
    pattern: str

    @property
    def is_folder(self) -> bool:
        return self.pattern.endswith("/")


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    # Model repo that a ``modelscope download --local_dir`` fetches for --model_dir.
    repo_id: str
    dit: Source
    text_encoder: Source
    vae: Source
    tokenizer: Optional[Source]  # None: the processor holds the tokenizer (Qwen-Image-2.1)
    processor: Source
    family: str = EDIT.name
    sigmas: Optional[tuple[float, ...]] = None  # a distilled variant's fixed schedule (without the final 0)
    zero_cond_t: bool = False
    multi_image_prompt: bool = False
    lora_target_modules: tuple[str, ...] = DEFAULT_LORA_TARGETS
    is_tiny: bool = False
    # "module:function" that registers a locally built model's MODEL_CONFIGS and returns its
    # directory (``fn(model_dir or None) -> Path``). Named by dotted path, as DiffSynth's
    # MODEL_CONFIGS name their classes, so that ``models/`` never imports the builders above it.
    provider: str = ""
    licence: str = "Apache-2.0"

    def source(self, component: str) -> Optional[Source]:
        if component not in COMPONENTS:
            raise ValueError(f"unknown component {component!r}; valid: {', '.join(COMPONENTS)}")
        return getattr(self, component)


def _real(name: str, repo_id: str, description: str, **flags) -> Preset:
    # Mirrors DiffSynth-Studio's examples: the DiT from the Edit repo, text encoder,
    # VAE and tokenizer from Qwen/Qwen-Image (identical weights in every Edit repo),
    # the processor from Qwen/Qwen-Image-Edit.
    return Preset(
        name=name, description=description, repo_id=repo_id,
        dit=Source(repo_id, "transformer/diffusion_pytorch_model*.safetensors"),
        text_encoder=Source("Qwen/Qwen-Image", "text_encoder/model*.safetensors"),
        vae=Source("Qwen/Qwen-Image", "vae/diffusion_pytorch_model.safetensors"),
        tokenizer=Source("Qwen/Qwen-Image", "tokenizer/"),
        processor=Source("Qwen/Qwen-Image-Edit", "processor/"),
        **flags,
    )


def _qwen21(name: str, repo_id: str, description: str, **flags) -> Preset:
    # Every component from the model's own repo, in the layout diffusers' QwenImage21Pipeline uses.
    return Preset(
        name=name, description=description, repo_id=repo_id, family=QWEN21.name, licence=QWEN21.licence,
        dit=Source(repo_id, "transformer/diffusion_pytorch_model*.safetensors"),
        text_encoder=Source(repo_id, "text_encoder/model*.safetensors"),
        vae=Source(repo_id, "vae/diffusion_pytorch_model.safetensors"),
        tokenizer=None, processor=Source(repo_id, "processor/"),
        multi_image_prompt=True, lora_target_modules=QWEN21.lora_targets, **flags,
    )


# The 8-step grid published for Qwen-Image-2.1's distilled checkpoints (the scheduler appends the final 0);
# a checkpoint's own ``model_index.json`` ``sample_sigmas``, when present, take precedence.
TURBO_SIGMAS: tuple[float, ...] = (1.0, 14 / 15, 6 / 7, 10 / 13, 2 / 3, 6 / 11, 0.4, 2 / 9)

PRESETS: dict[str, Preset] = {
    "edit": _real("edit", "Qwen/Qwen-Image-Edit", "Qwen-Image-Edit (original, single reference image)"),
    "2509": _real("2509", "Qwen/Qwen-Image-Edit-2509", "Qwen-Image-Edit-2509 (multi-image)",
                  multi_image_prompt=True),
    "2511": _real("2511", "Qwen/Qwen-Image-Edit-2511", "Qwen-Image-Edit-2511 (multi-image, zero_cond_t)",
                  zero_cond_t=True, multi_image_prompt=True, lora_target_modules=LORA_TARGETS_2511),
    # The tiny model (tiny/build.py) in the same layout; a local directory only.
    # It behaves like 2509 (multi-image template) so tests cover that path; tests
    # turn zero_cond_t on explicitly.
    "tiny": Preset(
        name="tiny", description="tiny random Qwen-Image-Edit for tests and CPU demos",
        repo_id="(built locally by `qie make-tiny`)",
        dit=Source("", "transformer/diffusion_pytorch_model*.safetensors"),
        text_encoder=Source("", "text_encoder/model.safetensors"),
        vae=Source("", "vae/diffusion_pytorch_model.safetensors"),
        tokenizer=Source("", "tokenizer/"),
        processor=Source("", "processor/"),
        multi_image_prompt=True, is_tiny=True, provider="diffsynth_qie.tiny.build:prepare_tiny",
    ),
    "2.1": _qwen21("2.1", "Qwen/Qwen-Image-2.1", "Qwen-Image-2.1 (up to 10 references, CFG 1; non-commercial)"),
    "2.1-turbo": _qwen21("2.1-turbo", "Qwen/Qwen-Image-2.1-Turbo",
                         "Qwen-Image-2.1-Turbo (8 fixed steps; non-commercial)", sigmas=TURBO_SIGMAS),
    # The tiny 2.1 (tiny/qwen21.py): DiffSynth's real 2.1 classes at small sizes; a local directory only.
    "tiny-2.1": dataclasses.replace(
        _qwen21("tiny-2.1", "", "tiny random Qwen-Image-2.1 for tests and CPU demos"),
        repo_id="(built locally by `qie make-tiny --model tiny-2.1`)", is_tiny=True, licence="Apache-2.0",
        provider="diffsynth_qie.tiny.qwen21:prepare_tiny21"),
}

ALIASES: dict[str, str] = {
    "qwen-image-edit": "edit", "qwen/qwen-image-edit": "edit", "original": "edit",
    "qwen-image-edit-2509": "2509", "qwen/qwen-image-edit-2509": "2509", "edit-2509": "2509",
    "qwen-image-edit-2511": "2511", "qwen/qwen-image-edit-2511": "2511", "edit-2511": "2511",
    "qwen-image-edit-tiny": "tiny",
    "qwen-image-2.1": "2.1", "qwen/qwen-image-2.1": "2.1", "21": "2.1",
    "qwen-image-2.1-turbo": "2.1-turbo", "qwen/qwen-image-2.1-turbo": "2.1-turbo", "turbo": "2.1-turbo",
    "qwen-image-2.1-tiny": "tiny-2.1", "tiny21": "tiny-2.1",
}


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str | Preset, zero_cond_t: bool | None = None) -> Preset:
    """Return the preset called ``name`` (or an alias), with an explicit ``zero_cond_t`` override.

    ``zero_cond_t=None`` keeps the preset's own value (on for 2511 only).
    """
    if isinstance(name, Preset):
        preset = name
    else:
        key = str(name).strip()
        key = key if key in PRESETS else ALIASES.get(key.lower(), key.lower())
        if key not in PRESETS:
            raise ValueError(
                f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)} "
                f"(aliases: {', '.join(sorted(ALIASES))})")
        preset = PRESETS[key]
    if zero_cond_t is not None and bool(zero_cond_t) != preset.zero_cond_t:
        preset = dataclasses.replace(preset, zero_cond_t=bool(zero_cond_t))
    return preset


def family_of(preset: str | Preset) -> Family:
    """The model family of a preset (or of a preset name or alias)."""
    return get_family(get_preset(preset).family)
