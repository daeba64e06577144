"""LoRA files: read every common key format, merge into the DiT, switch, save, export.

Why this module exists: users' most common complaint about trainers is that a LoRA
from one tool does not load in another, and that a mismatching LoRA is silently
ignored. Here every format is normalised to one canonical form, every key is either
used or reported, and a LoRA that does not fit the model raises ``ValueError``.

Canonical format (what :func:`save_lora` writes, "diffsynth_qie")
------------------------------------------------------------------
Exactly what DiffSynth's ``pipe.load_lora(pipe.dit, path, alpha=...)`` loads:

- ``<module>.lora_A.weight`` ``[rank, in]`` and ``<module>.lora_B.weight`` ``[out, rank]``,
  ``<module>`` being the DiT's own module path (``transformer_blocks.0.attn.to_q``,
  ``transformer_blocks.0.attn.to_out.0``, ``transformer_blocks.0.img_mlp.net.0.proj``,
  ``transformer_blocks.0.img_mod.1``, ``img_in``, ``proj_out`` ...). DiffSynth's
  ``QwenImageDiT`` has no state-dict converter, so these are also the diffusers and
  ComfyUI module names of Qwen-Image.
- optional ``<module>.alpha`` (0-dim float32): the delta is ``alpha / rank * B @ A``;
  without it ``B @ A``. Written only when alpha != rank (PEFT's ``lora_alpha`` differs
  from ``r``), so LoRAs trained with DiffSynth's default (alpha = rank) carry none.
- optional full module weights under their parameter names (``img_in.weight``,
  ``img_in.bias``) for modules trained fully rather than with LoRA.
- safetensors metadata: ``format``, ``format_version``, ``rank``, ``alpha``,
  ``target_modules``, ``preset`` and whatever the trainer adds (JSON strings).

DiffSynth's convention, as read in diffsynth 2.1.12
---------------------------------------------------
- Training (``diffusion/training_module.py``): ``add_lora_to_model`` calls PEFT's
  ``inject_adapter_in_model(LoraConfig(r, lora_alpha=r if None, target_modules))``;
  ``ModelLogger.save_model`` (``diffusion/logger.py``) keeps the trainable parameters
  (``export_trainable_state_dict``), strips ``remove_prefix_in_ckpt`` and saves keys
  ``<module>.lora_A.default.weight`` / ``lora_B.default.weight``, no alpha.
- Loading (``pipe.load_lora`` -> ``utils/lora/general.py: GeneralLoRALoader``): keys
  containing ``lora_B`` (or ``lora_up``) name a module; one extra component after
  ``lora_B`` (PEFT's adapter name) is dropped, a leading ``diffusion_model.`` is
  dropped, ``<module>.alpha`` multiplies ``lora_A`` by ``alpha / rank``; the LoRA is
  fused as ``W += alpha_arg * B @ A``. Modules absent from the model and non-LoRA
  keys are silently skipped, and ``transformer.`` / ``base_model.model.`` prefixes
  are *not* stripped -- hence this module.

Formats read by :func:`load_lora_state`
---------------------------------------
``diffsynth_qie`` (ours), ``diffsynth`` (bare keys), ``peft`` (``.lora_A.default.``
keys and/or a ``base_model.model.`` prefix), ``diffusers`` (``transformer.`` prefix),
``comfyui`` (``diffusion_model.`` prefix, ``lora_A``/``lora_B`` or ``lora_down``/
``lora_up``, ``.alpha``, and the ``.set_weight`` full-weight patches our ComfyUI
export writes), ``kohya`` (kohya-ss / musubi-tuner: ``lora_unet_<module with
underscores>.lora_down.weight`` / ``lora_up.weight`` / ``.alpha``; also
``lora_transformer_`` and SimpleTuner's ``lycoris_``). Kohya names lose the dots, so
they are mapped back with the *model's* module names in :func:`match_lora` (or, when
exporting without a model, with the module names of DiffSynth's ``QwenImageDiT``).

What the target tools accept (checked against their sources)
-----------------------------------------------------------
- ComfyUI ``comfy/lora.py`` (Comfy-Org/ComfyUI), ``model_lora_keys_unet``: for every
  model weight ``diffusion_model.<k>.weight`` it maps ``diffusion_model.<k>`` (the
  "generic lora format") and ``lora_unet_<k with _>``; for ``comfy.model_base.QwenImage``
  additionally bare ``<k>``, ``transformer.<k>`` and ``lycoris_<k with _>``; non-weight
  keys (biases) map to themselves. ``load_lora`` reads ``<x>.alpha`` and, through
  ``comfy/weight_adapter/lora.py: LoRAAdapter.load``, ``<x>.lora_up/lora_down.weight``,
  ``<x>.lora_B/lora_A.weight`` and (newer versions) ``<x>.lora_B.default.weight``; the
  patch is ``W += strength * alpha / rank * up @ down``. Full tensors: ``<x>.set_weight``
  replaces the weight (``"set"`` patch). Our ComfyUI export therefore writes
  ``diffusion_model.<module>.lora_A.weight`` / ``lora_B.weight`` / ``.alpha`` and
  ``diffusion_model.<module>.set_weight`` / ``diffusion_model.<module>.bias.set_weight``.
- diffusers ``loaders/lora_conversion_utils.py: _convert_non_diffusers_qwen_lora_to_diffusers``
  (used by ``QwenImageLoraLoaderMixin.lora_state_dict`` when it sees ``.alpha``,
  ``lora_unet_``, ``diffusion_model.`` or ``default.`` keys): for ``lora_A``/``lora_B``
  keys it *drops* ``.alpha`` (scale 1), and the pipeline rejects any key without
  "lora" ("Invalid LoRA checkpoint"). Our diffusers export therefore writes only
  ``transformer.<module>.lora_A.weight`` / ``lora_B.weight`` with ``alpha / rank`` folded
  into ``lora_A``, and refuses full module weights unless asked to drop them.
- Users hit exactly this: DiffSynth-trained LoRAs log "lora key not loaded" in ComfyUI,
  fixed by dropping ``.default`` and prefixing ``diffusion_model.``
  (github.com/nv-tlabs/ChronoEdit issue 22).
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Sequence

import torch

from ..utils.atomic import atomic_save

log = logging.getLogger(__name__)

FORMAT_NAME = "diffsynth_qie.lora"
FORMAT_VERSION = 1
EXPORT_FORMATS = ("comfyui", "diffusers")
ExportFormat = Literal["comfyui", "diffusers"]

# Dotted prefixes other tools put before the module path, and the format they signal.
_DOTTED_PREFIXES = (
    ("pipe.dit.", "diffsynth"),  # DiffSynth's ModelLogger without --remove_prefix_in_ckpt
    ("base_model.model.", "peft"),
    ("diffusion_model.", "comfyui"),
    ("transformer.", "diffusers"),
)
# Kohya-style prefixes: the rest of the name is the module path with "." -> "_".
_UNDERSCORE_PREFIXES = ("lora_unet_", "lora_transformer_", "lycoris_")
_TEXT_ENCODER_PREFIXES = ("lora_te_", "lora_te1_", "lora_te2_", "text_encoder.", "text_encoders.")
_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_down|lora_up)(?:\.(?P<adapter>[^.]+))?\.weight$")
_KIND = {"lora_A": "A", "lora_down": "A", "lora_B": "B", "lora_up": "B"}
_MAX_LISTED = 12
# diffusers (>= 0.33) stores the PEFT LoraConfig of each component as JSON under this
# safetensors metadata key: ``{"transformer.r": 4, "transformer.lora_alpha": 8,
# "transformer.alpha_pattern": {...}, ...}`` from a pipeline's ``save_lora_weights``, the
# same keys without the component prefix from a model's ``save_lora_adapter``.
ADAPTER_METADATA_KEY = "lora_adapter_metadata"
# Sanity limits for LoRA files (see :func:`check_tensors` and :func:`match_lora`): a trained
# LoRA never holds a value this large, and its delta never dwarfs the weight it changes.
MAX_ABS_VALUE = 1e4
MAX_DELTA_RATIO = 100.0


# --- data ------------------------------------------------------------------------
@dataclass(frozen=True)
class LoraModule:
    """One module's low-rank pair; the weight delta is ``scale * B @ A``."""

    A: torch.Tensor  # [rank, in]
    B: torch.Tensor  # [out, rank]
    alpha: float | None = None

    @property
    def rank(self) -> int:
        return int(self.A.shape[0])

    @property
    def scale(self) -> float:
        """``alpha / rank`` (kohya / PEFT convention), 1.0 without alpha."""
        return 1.0 if self.alpha is None else self.alpha / self.rank

    def delta(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The fp32 weight delta, computed in DiffSynth's order (``B @ (A * scale)``)."""
        a = self.A.to(device=device, dtype=torch.float32)
        if self.alpha is not None:
            a = a * self.scale
        return torch.mm(self.B.to(device=device, dtype=torch.float32), a)


@dataclass(frozen=True)
class LoraState:
    """A LoRA file normalised to canonical module names.

    ``modules`` maps module path -> :class:`LoraModule`; ``full`` maps parameter name
    -> tensor for fully trained modules. When ``underscore_names`` is true (kohya
    files) the keys of ``modules`` are still ``transformer_blocks_0_attn_to_q`` style
    and :meth:`resolve` must map them to module paths.
    """

    modules: dict[str, LoraModule]
    full: dict[str, torch.Tensor] = field(default_factory=dict)
    format: str = "diffsynth_qie"
    metadata: dict[str, str] = field(default_factory=dict)
    source: str = "<memory>"
    underscore_names: bool = False

    @property
    def ranks(self) -> set[int]:
        return {m.rank for m in self.modules.values()}

    def resolve(self, module_names: Iterable[str]) -> "LoraState":
        """Map kohya underscore names back to module paths using ``module_names``."""
        if not self.underscore_names:
            return self
        lookup: dict[str, str | None] = {}
        for name in module_names:
            key = name.replace(".", "_")
            lookup[key] = None if (key in lookup and lookup[key] != name) else name  # None: ambiguous
        modules, unknown, ambiguous = {}, [], []
        for key, mod in self.modules.items():
            if key not in lookup:
                unknown.append(f"lora_unet_{key}")
            elif lookup[key] is None:
                ambiguous.append(f"lora_unet_{key}")
            else:
                modules[lookup[key]] = mod
        if unknown or ambiguous:
            parts = []
            if unknown:
                parts.append(f"{len(unknown)} kohya module(s) not found in the model: {_listing(unknown)}")
            if ambiguous:
                parts.append(f"{len(ambiguous)} kohya module name(s) match several modules: {_listing(ambiguous)}")
            raise ValueError(f"LoRA {self.source} does not match the model: " + "; ".join(parts)
                             + ". Check that the LoRA was trained for this model.")
        return replace(self, modules=modules, underscore_names=False)


@dataclass
class LoadReport:
    """What :func:`apply_lora` changed: LoRA deltas merged and full weights loaded."""

    source: str
    format: str
    scale: float
    lora_modules: list[str]
    full_weights: list[str]

    def summary(self) -> str:
        text = (f"LoRA {self.source} ({self.format}, scale {self.scale:g}): "
                f"{len(self.lora_modules)} module(s) with a LoRA delta")
        if self.full_weights:
            text += f", {len(self.full_weights)} full weight(s) loaded: {', '.join(self.full_weights)}"
        return text


# --- reading ---------------------------------------------------------------------
def _listing(names: Sequence[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")


def _read_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    if not path.is_file():
        raise ValueError(f"LoRA file not found: {path} (give the path of a .safetensors LoRA file)")
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        tensors = {}
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                metadata = dict(f.metadata() or {})
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ValueError(f"LoRA file {path} is not a readable safetensors file: {e}") from e
        return tensors, metadata
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"LoRA file {path} could not be read (expected .safetensors or a torch state dict): {e}") from e
    if isinstance(obj, dict) and len(obj) == 1 and next(iter(obj)) in ("state_dict", "module", "model_state"):
        obj = next(iter(obj.values()))
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"LoRA file {path} does not hold a flat dict of tensors")
    return dict(obj), {}


def parse_lora_state_dict(state_dict: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None,
                          source: str = "<memory>") -> LoraState:
    """Normalise a LoRA state dict of any supported format (see the module docstring).

    Every key is either used or reported: unknown LoRA variants (DoRA, LoKr, LoHa,
    ``.diff`` patches), text-encoder LoRAs and incomplete pairs raise ``ValueError``.
    """
    metadata = dict(metadata or {})
    pairs: dict[str, dict[str, Any]] = {}
    full: dict[str, torch.Tensor] = {}
    formats: set[str] = set()
    adapters: set[str] = set()
    underscore: set[bool] = set()
    unsupported: list[str] = []
    text_encoder: list[str] = []
    for key, value in state_dict.items():
        if key.startswith(_TEXT_ENCODER_PREFIXES):
            text_encoder.append(key)
            continue
        body, is_underscore = key, False
        stripped = True
        while stripped:
            stripped = False
            for prefix, fmt in _DOTTED_PREFIXES:
                if body.startswith(prefix):
                    body, stripped = body[len(prefix):], True
                    formats.add(fmt)
        for prefix in _UNDERSCORE_PREFIXES:
            if body.startswith(prefix):
                body, is_underscore = body[len(prefix):], True
                formats.add("kohya")
                break
        m = _LORA_KEY.match(body)
        if m:
            if m.group("adapter"):
                adapters.add(m.group("adapter"))
                formats.add("peft")
            entry = pairs.setdefault(m.group("module"), {})
            kind = _KIND[m.group("kind")]
            if kind in entry:
                unsupported.append(key)  # the same module twice (e.g. two adapters)
            entry[kind] = value
            underscore.add(is_underscore)
        elif body.endswith(".alpha"):
            if value.numel() != 1:
                raise ValueError(f"LoRA {source}: {key} must hold one number (the LoRA alpha), "
                                 f"it holds {value.numel()} values of shape {tuple(value.shape)}")
            alpha = float(value.float().reshape(-1)[0])
            if not math.isfinite(alpha):
                raise ValueError(f"LoRA {source}: {key} is {alpha}; the file is damaged")
            pairs.setdefault(body[: -len(".alpha")], {})["alpha"] = alpha
            underscore.add(is_underscore)
        elif body.endswith(".set_weight") and not is_underscore:  # ComfyUI "set" patch (our export)
            target = body[: -len(".set_weight")]
            full[target if target.endswith(".bias") else target + ".weight"] = value
        elif (body.endswith(".weight") or body.endswith(".bias")) and "lora" not in body and not is_underscore:
            full[body] = value
        else:
            unsupported.append(key)
    if len(adapters) > 1:
        raise ValueError(f"LoRA {source} holds several PEFT adapters ({', '.join(sorted(adapters))}); "
                         "save one adapter per file")
    if text_encoder:
        raise ValueError(f"LoRA {source} has {len(text_encoder)} text-encoder key(s); only DiT LoRAs are "
                         f"supported: {_listing(text_encoder)}")
    if unsupported:
        raise ValueError(f"LoRA {source} has {len(unsupported)} key(s) this loader does not understand "
                         f"(not a plain LoRA on the DiT: DoRA/LoKr/LoHa, .diff patches, or duplicates): "
                         f"{_listing(unsupported)}")
    if len(underscore) > 1:
        raise ValueError(f"LoRA {source} mixes kohya (lora_unet_...) and dotted module names")
    config = adapter_config(metadata, source)
    modules: dict[str, LoraModule] = {}
    incomplete, bad_shape, rank_zero = [], [], []
    for name, entry in pairs.items():
        if "A" not in entry or "B" not in entry:
            missing = [k for k in ("A", "B") if k not in entry]
            incomplete.append(f"{name} (missing lora_{'/lora_'.join(missing)})")
            continue
        a, b = entry["A"], entry["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            bad_shape.append(f"{name}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}")
            continue
        if a.shape[0] == 0:
            rank_zero.append(name)
            continue
        alpha = entry.get("alpha")
        if alpha is None and config is not None:
            alpha = _config_alpha(config, name, int(a.shape[0]), source)
        modules[name] = LoraModule(A=a, B=b, alpha=alpha)
    both = sorted(n for n in modules if f"{n}.weight" in full)
    if both:
        raise ValueError(f"LoRA {source} has both a LoRA pair and a full weight for: {_listing(both)}; "
                         "keep one of them per module")
    if incomplete or bad_shape or rank_zero:
        parts = []
        if incomplete:
            parts.append(f"incomplete LoRA pairs: {_listing(incomplete)}")
        if bad_shape:
            parts.append(f"not 2-D low-rank pairs of matching rank: {_listing(bad_shape)}")
        if rank_zero:
            parts.append(f"rank-0 pairs (lora_A with no rows): {_listing(rank_zero)}")
        raise ValueError(f"LoRA {source} is malformed: " + "; ".join(parts))
    if not modules and not full:
        raise ValueError(f"LoRA {source} holds no LoRA tensors")
    return LoraState(modules=modules, full=full, format=_format_name(formats, metadata), metadata=metadata,
                     source=source, underscore_names=underscore == {True})


def adapter_config(metadata: Mapping[str, str], source: str = "<memory>") -> dict[str, Any] | None:
    """The DiT's PEFT ``LoraConfig`` dict from diffusers' ``lora_adapter_metadata``, or None."""
    raw = metadata.get(ADAPTER_METADATA_KEY)
    if not raw:
        return None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"LoRA {source}: metadata {ADAPTER_METADATA_KEY!r} is not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"LoRA {source}: metadata {ADAPTER_METADATA_KEY!r} is not a JSON object")
    if any("." in k for k in config):  # a pipeline's file: one prefixed config per component
        config = {k[len("transformer."):]: v for k, v in config.items() if k.startswith("transformer.")}
    return config or None


def _pattern_value(patterns: Mapping[str, Any] | None, name: str) -> Any:
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup (``peft.utils.other.get_pattern_key``):
    a key matches a module path that it ends, as a regular expression after a dot."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return None


def _config_alpha(config: Mapping[str, Any], name: str, rank: int, source: str) -> float | None:
    """Module ``name``'s alpha from a PEFT config, in our ``alpha / rank`` convention."""
    r = _pattern_value(config.get("rank_pattern"), name) or config.get("r")
    alpha = _pattern_value(config.get("alpha_pattern"), name)
    if alpha is None:
        alpha = config.get("lora_alpha")
    if alpha is None:
        return None
    if r is not None and int(r) != rank:
        raise ValueError(f"LoRA {source}: {ADAPTER_METADATA_KEY} gives rank {r} for {name}, but its "
                         f"tensors have rank {rank}; the metadata does not describe this file")
    alpha = float(alpha)
    if not math.isfinite(alpha):
        raise ValueError(f"LoRA {source}: {ADAPTER_METADATA_KEY} gives lora_alpha {alpha} for {name}")
    if config.get("use_rslora"):  # PEFT scales rsLoRA by alpha / sqrt(r)
        alpha *= math.sqrt(rank)
    return alpha


def check_tensors(tensors: Mapping[str, torch.Tensor], source: str) -> None:
    """Refuse a LoRA file holding NaN/inf, or values beyond ``MAX_ABS_VALUE``.

    Such a file (a diverged run, a damaged download) would otherwise render black or
    noise images with no error. ``.alpha`` scalars are exempt from the size limit:
    their effect is bounded by the delta check in :func:`match_lora`.
    """
    for key, value in tensors.items():
        if not value.is_floating_point() or value.numel() == 0:
            continue
        finite = torch.isfinite(value)
        if not bool(finite.all()):
            bad = int((~finite).sum())
            raise ValueError(f"LoRA {source}: tensor {key} holds {bad} NaN/inf value(s); the file is damaged "
                             "or its training diverged. Use an earlier checkpoint or retrain.")
        if key.endswith(".alpha"):
            continue
        peak = float(value.abs().max())
        if peak > MAX_ABS_VALUE:
            raise ValueError(f"LoRA {source}: tensor {key} holds a value of magnitude {peak:.3g}, beyond "
                             f"{MAX_ABS_VALUE:g}, which no trained LoRA reaches; the file is damaged.")


def _format_name(formats: set[str], metadata: Mapping[str, str]) -> str:
    for fmt in ("kohya", "comfyui", "diffusers", "peft"):
        if fmt in formats:
            return fmt
    return "diffsynth_qie" if metadata.get("format") == FORMAT_NAME else "diffsynth"


def load_lora_state(path: str | os.PathLike) -> LoraState:
    """Read a LoRA file of any supported format into a :class:`LoraState`."""
    path = Path(path)
    tensors, metadata = _read_file(path)
    check_tensors(tensors, str(path))
    return parse_lora_state_dict(tensors, metadata, source=str(path))


# --- applying --------------------------------------------------------------------
def match_lora(model: torch.nn.Module, state: LoraState) -> LoraState:
    """Resolve ``state``'s names against ``model`` and check every tensor fits.

    Raises ``ValueError`` naming LoRA modules / full weights the model lacks, modules
    without a 2-D weight, and shape mismatches. Nothing is modified.
    """
    modules = dict(model.named_modules())
    state = state.resolve(modules.keys())
    params = dict(model.named_parameters())
    missing, not_linear, mismatched = [], [], []
    for name, mod in state.modules.items():
        target = modules.get(name)
        weight = getattr(target, "weight", None) if target is not None else None
        if target is None:
            missing.append(name)
        elif not isinstance(weight, torch.Tensor) or weight.ndim != 2:
            not_linear.append(name)
        elif tuple(weight.shape) != (mod.B.shape[0], mod.A.shape[1]):
            mismatched.append(f"{name} (LoRA {mod.B.shape[0]}x{mod.A.shape[1]} vs weight "
                              f"{weight.shape[0]}x{weight.shape[1]})")
        else:
            _check_delta(name, mod, weight, state.source)
    for name, tensor in state.full.items():
        if name not in params:
            missing.append(name)
        elif params[name].shape != tensor.shape:
            mismatched.append(f"{name} ({tuple(tensor.shape)} vs {tuple(params[name].shape)})")
    if missing or not_linear or mismatched:
        parts = []
        if missing:
            parts.append(f"{len(missing)} key(s) not found in the model: {_listing(missing)}")
        if not_linear:
            parts.append(f"{len(not_linear)} module(s) without a 2-D weight: {_listing(not_linear)}")
        if mismatched:
            parts.append(f"{len(mismatched)} shape mismatch(es): {_listing(mismatched)}")
        raise ValueError(f"LoRA {state.source} does not match the model ({type(model).__name__}): "
                         + "; ".join(parts) + ". Check that the LoRA was trained for this model/preset.")
    return state


@torch.no_grad()
def _check_delta(name: str, mod: LoraModule, weight: torch.Tensor, source: str) -> None:
    """Refuse a delta whose norm exceeds ``MAX_DELTA_RATIO`` times the weight's (at least 1).

    A real LoRA changes a weight by a fraction of its norm; a hundred times the weight
    wipes out the model (all-black images). The cheap bound ``|scale| |B| |A|`` avoids
    computing the delta for every module.
    """
    if weight.device.type == "meta":
        return
    limit = MAX_DELTA_RATIO * max(float(torch.linalg.vector_norm(weight, dtype=torch.float32)), 1.0)
    bound = abs(mod.scale) * float(torch.linalg.vector_norm(mod.A, dtype=torch.float32)) \
        * float(torch.linalg.vector_norm(mod.B, dtype=torch.float32))
    if math.isfinite(bound) and bound <= limit:
        return
    norm = float(torch.linalg.vector_norm(mod.delta(weight.device)))
    if not math.isfinite(norm) or norm > limit:
        raise ValueError(f"LoRA {source}: the delta for {name} has norm {norm:.3g}, more than "
                         f"{MAX_DELTA_RATIO:g} times the weight's ({limit / MAX_DELTA_RATIO:.3g}); "
                         f"check its alpha ({mod.alpha}) and rank ({mod.rank}), or the file is damaged.")


@torch.no_grad()
def _merge(model: torch.nn.Module, state: LoraState, scale: float) -> None:
    """Add the deltas / load the full weights of an already matched ``state``."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    for name, mod in state.modules.items():
        weight = modules[name].weight
        delta = mod.delta(weight.device)
        if scale != 1.0:
            delta = delta * scale
        weight.add_(delta.to(weight.dtype))
    for name, tensor in state.full.items():
        param = params[name]
        value = tensor.to(device=param.device, dtype=param.dtype)
        if scale == 1.0:
            param.copy_(value)
        else:  # treat the trained weight as a delta from the current one
            param.lerp_(value, scale)


def apply_lora(model: torch.nn.Module, state: LoraState, scale: float = 1.0) -> LoadReport:
    """Merge ``state`` into ``model``'s weights (``W += scale * alpha/rank * B @ A``).

    Full module weights are copied (at ``scale != 1`` interpolated from the current
    weight). The whole LoRA is checked before any weight changes.
    """
    state = match_lora(model, state)
    _merge(model, state, scale)
    report = LoadReport(source=state.source, format=state.format, scale=scale,
                        lora_modules=sorted(state.modules), full_weights=sorted(state.full))
    log.info("%s", report.summary())
    return report


def peft_state_dict(state: LoraState, peft_scale: float = 1.0, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """Keys for ``model.load_state_dict(strict=False)`` on a PEFT-injected model.

    PEFT computes ``lora_alpha / r * B @ A``; ``peft_scale`` is that factor of the
    model being trained, and each module's own ``alpha / rank`` is folded into
    ``lora_A`` so training resumes from exactly the LoRA's delta. Full weights keep
    their plain names (a module both PEFT-wrapped and fully trained would need PEFT's
    ``base_layer`` inserted; that is the caller's concern).
    """
    assert not state.underscore_names, "resolve() kohya names before converting"
    out: dict[str, torch.Tensor] = {}
    for name, mod in state.modules.items():
        out[f"{name}.lora_A.{adapter_name}.weight"] = mod.A * (mod.scale / peft_scale)
        out[f"{name}.lora_B.{adapter_name}.weight"] = mod.B
    out.update(state.full)
    return out


# --- switching without reloading the base model ----------------------------------
class LoraManager:
    """Merge LoRAs into a model for fast inference and switch them without reloading.

    The first time a LoRA touches a parameter, its original value is copied to
    ``backup_device``; :meth:`clear` copies the originals back, so the base weights
    are bit-identical afterwards (no subtract-the-delta rounding). Memory cost: one
    copy of every touched weight (on CPU by default). Loaded files are cached by
    (path, mtime, size), so re-selecting a LoRA does not re-read it. Not thread-safe:
    call it from the one worker that runs generations.
    """

    def __init__(self, model: torch.nn.Module, backup_device: str | torch.device = "cpu", cache_size: int = 8):
        self.model = model
        self.backup_device = torch.device(backup_device)
        self.cache_size = cache_size
        self._cache: OrderedDict[Path, tuple[tuple[int, int], LoraState]] = OrderedDict()
        self._backup: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (live tensor, original)
        self._active: list[tuple[Path, float]] = []
        self._reports: list[LoadReport] = []
        self._states: list[LoraState] = []

    @property
    def active(self) -> list[tuple[Path, float]]:
        """The LoRAs currently merged, as (resolved path, scale)."""
        return list(self._active)

    def load(self, path: str | os.PathLike) -> LoraState:
        """The :class:`LoraState` of ``path``, from the cache while the file is unchanged."""
        path = Path(path).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"LoRA file not found: {path} (give the path of a .safetensors LoRA file)")
        st = path.stat()
        stamp = (st.st_mtime_ns, st.st_size)
        hit = self._cache.get(path)
        if hit is not None and hit[0] == stamp:
            self._cache.move_to_end(path)
            return hit[1]
        state = load_lora_state(path)
        self._cache[path] = (stamp, state)
        self._cache.move_to_end(path)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return state

    def set_loras(self, loras: Sequence[tuple[str | os.PathLike, float]]) -> list[LoadReport]:
        """Make exactly ``loras`` (path, scale) active, in order, on top of the base weights.

        Every file is read and checked against the model first; if any fails, the
        model is left as it was and ``ValueError`` is raised.
        """
        wanted = [(Path(p).expanduser().resolve(), float(s)) for p, s in loras]
        states = [self.load(p) for p, _ in wanted]
        if wanted == self._active and all(a is b for a, b in zip(states, self._states)):
            return list(self._reports)  # same files, unchanged on disk, same scales
        matched = [(match_lora(self.model, st), s) for st, (_, s) in zip(states, wanted)]
        self.clear()
        modules = dict(self.model.named_modules())
        params = dict(self.model.named_parameters())
        try:
            reports = []
            for state, scale in matched:
                touched = {f"{m}.weight": modules[m].weight for m in state.modules}
                touched.update({n: params[n] for n in state.full})
                for name, tensor in touched.items():
                    if name not in self._backup:
                        self._backup[name] = (tensor, tensor.detach().to(self.backup_device, copy=True))
                _merge(self.model, state, scale)
                reports.append(LoadReport(source=state.source, format=state.format, scale=scale,
                                          lora_modules=sorted(state.modules), full_weights=sorted(state.full)))
                log.info("%s", reports[-1].summary())
        except BaseException:
            self.clear()
            raise
        self._active, self._reports, self._states = wanted, reports, states
        return list(reports)

    @torch.no_grad()
    def clear(self) -> None:
        """Restore the original value of every parameter a LoRA touched."""
        for tensor, original in self._backup.values():
            tensor.copy_(original.to(tensor.device))
        self._backup.clear()
        self._active, self._reports, self._states = [], [], []


# --- writing ---------------------------------------------------------------------
def _default_module_names(state: LoraState) -> list[str]:
    """Module names of DiffSynth's ``QwenImageDiT`` (built on the meta device), for
    resolving kohya names when no model is at hand; as many blocks as the LoRA uses."""
    from diffsynth.models.qwen_image_dit import QwenImageDiT

    with torch.device("meta"):
        dit = QwenImageDiT(num_layers=1, use_additional_t_cond=True)
    names = [n for n, _ in dit.named_modules() if n]
    blocks = [int(m.group(1)) for k in state.modules for m in [re.match(r"transformer_blocks_(\d+)_", k)] if m]
    out = [n for n in names if not n.startswith("transformer_blocks")]
    for i in range(max(blocks, default=-1) + 1):
        out += [n.replace("transformer_blocks.0", f"transformer_blocks.{i}", 1)
                for n in names if n.startswith("transformer_blocks.0")]
    return out


def _resolved(state: LoraState) -> LoraState:
    return state.resolve(_default_module_names(state)) if state.underscore_names else state


def _cpu(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=dtype or t.dtype).contiguous().clone()


def _write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> Path:
    from safetensors.torch import save_file

    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items() if v is not None}
    atomic_save(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))
    return path


def save_lora(path: str | os.PathLike, state_dict: Mapping[str, torch.Tensor] | LoraState,
              metadata: Mapping[str, Any] | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write a LoRA in our canonical format, atomically.

    ``state_dict`` is a LoRA in any supported key format (typically the trainable
    parameters of a PEFT-injected DiT: ``<module>.lora_A.default.weight``, plus any
    fully trained ``<module>.weight``) or a :class:`LoraState`. ``metadata`` keys
    ``rank``, ``alpha``, ``target_modules``, ``preset`` (and any others) are stored as
    JSON strings; ``alpha`` is PEFT's ``lora_alpha`` of the run and becomes each
    module's ``.alpha`` where the module has none and alpha != its rank.
    """
    state = state_dict if isinstance(state_dict, LoraState) else parse_lora_state_dict(state_dict, source=str(path))
    state = _resolved(state)
    metadata = dict(metadata or {})
    run_alpha = metadata.get("alpha")
    tensors: dict[str, torch.Tensor] = {}
    for name, mod in sorted(state.modules.items()):
        alpha = mod.alpha if mod.alpha is not None else (float(run_alpha) if run_alpha is not None else None)
        tensors[f"{name}.lora_A.weight"] = _cpu(mod.A, dtype)
        tensors[f"{name}.lora_B.weight"] = _cpu(mod.B, dtype)
        if alpha is not None and not math.isclose(alpha, mod.rank):
            tensors[f"{name}.alpha"] = torch.tensor(float(alpha), dtype=torch.float32)
    for name, tensor in sorted(state.full.items()):
        tensors[name] = _cpu(tensor, dtype)
    ranks = sorted(state.ranks)
    info = {"rank": ranks[0] if len(ranks) == 1 else (ranks or None), "target_modules": sorted(state.modules),
            "full_weights": sorted(state.full)}
    info.update(metadata)
    info.update(format=FORMAT_NAME, format_version=FORMAT_VERSION)
    return _write(Path(path), tensors, info)


def comfyui_state_dict(state: LoraState) -> dict[str, torch.Tensor]:
    """ComfyUI keys: ``diffusion_model.<module>.lora_A/lora_B.weight``, ``.alpha``, ``.set_weight``."""
    state = _resolved(state)
    out: dict[str, torch.Tensor] = {}
    for name, mod in sorted(state.modules.items()):
        out[f"diffusion_model.{name}.lora_A.weight"] = _cpu(mod.A)
        out[f"diffusion_model.{name}.lora_B.weight"] = _cpu(mod.B)
        if mod.alpha is not None:
            out[f"diffusion_model.{name}.alpha"] = torch.tensor(float(mod.alpha), dtype=torch.float32)
    for name, tensor in sorted(state.full.items()):
        target = name[: -len(".weight")] if name.endswith(".weight") else name
        out[f"diffusion_model.{target}.set_weight"] = _cpu(tensor)
    return out


def diffusers_state_dict(state: LoraState, drop_full_weights: bool = False) -> dict[str, torch.Tensor]:
    """diffusers keys: ``transformer.<module>.lora_A/lora_B.weight``, alpha folded into ``lora_A``."""
    state = _resolved(state)
    if state.full and not drop_full_weights:
        raise ValueError(f"LoRA {state.source} holds full module weights ({_listing(list(state.full))}) that "
                         "diffusers' LoRA loader cannot load; export with --format comfyui, or pass "
                         "--drop_full_weights to export only the LoRA part")
    if state.full:
        log.warning("dropping %d full module weight(s) for the diffusers export: %s",
                    len(state.full), _listing(list(state.full)))
    out: dict[str, torch.Tensor] = {}
    for name, mod in sorted(state.modules.items()):
        a = mod.A if mod.alpha is None else (mod.A.float() * mod.scale).to(mod.A.dtype)
        out[f"transformer.{name}.lora_A.weight"] = _cpu(a)
        out[f"transformer.{name}.lora_B.weight"] = _cpu(mod.B)
    return out


def export_lora(in_path: str | os.PathLike, out_path: str | os.PathLike, fmt: ExportFormat,
                drop_full_weights: bool = False) -> Path:
    """Convert any supported LoRA file to ComfyUI's or diffusers' key names."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(EXPORT_FORMATS)}")
    state = load_lora_state(in_path)
    if fmt == "comfyui":
        tensors = comfyui_state_dict(state)
    else:
        tensors = diffusers_state_dict(state, drop_full_weights=drop_full_weights)
    # alpha is written as .alpha tensors (comfyui) or folded into lora_A (diffusers); a copied
    # lora_adapter_metadata would make diffusers apply it a second time.
    metadata = {k: v for k, v in state.metadata.items() if k not in ("format", "format_version", ADAPTER_METADATA_KEY)}
    metadata.update(format=fmt, converted_by=FORMAT_NAME, source_format=state.format)
    out = _write(Path(out_path), tensors, metadata)
    log.info("wrote %s LoRA %s (%d tensors, from %s format)", fmt, out, len(tensors), state.format)
    return out
