"""Reading LoRA files of every common key format into a :class:`LoraState`.

Every key is either used or reported, and a damaged file (NaN/inf, absurd values,
an empty ``.alpha``, rank-0 pairs) is refused with the file and key named.

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


Alpha in metadata: diffusers (>= 0.33) keeps ``lora_alpha`` only in the safetensors
metadata (read in ``adapter_metadata.py``). An explicit ``<module>.alpha`` tensor takes precedence.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Mapping

import torch

from .adapter_metadata import adapter_config, checked_alpha, config_alpha
from .state import FORMAT_NAME, LoraModule, LoraState, listing, problems

log = logging.getLogger(__name__)

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
# A trained LoRA never holds a value this large (see :func:`check_tensors`).
MAX_ABS_VALUE = 1e4


def lora_header(path: str | os.PathLike) -> tuple[bool, dict[str, str]]:
    """(whether a safetensors file names LoRA pairs: ``lora_A``/``lora_B``, ``lora_down``/``lora_up``; its metadata).

    Reads only the header, once, so a picker can tell LoRAs from cache shards and other tensors cheaply and label
    them. A file that is not safetensors at all is logged and reported as not a LoRA, with no metadata.
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return any(_LORA_KEY.match(k) for k in f.keys()), dict(f.metadata() or {})
    except (SafetensorError, OSError) as e:
        log.info("not listed as a LoRA: %s is not a readable safetensors file (%s)", path, e)
        return False, {}


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
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"{path} is not a LoRA file: not a readable safetensors file ({first})") from e
        return tensors, metadata
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # text, truncated or pickled-object files: torch's own message is pages long
        raise ValueError(f"{path} is not a LoRA file: neither a safetensors file nor a torch state dict of "
                         "tensors") from e
    if isinstance(obj, dict) and len(obj) == 1 and next(iter(obj)) in ("state_dict", "module", "model_state"):
        obj = next(iter(obj.values()))
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{path} is not a LoRA file: it holds no flat dict of tensors")
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
            alpha = checked_alpha(float(value.float().reshape(-1)[0]), f"LoRA {source}: {key}")
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
                         f"supported: {listing(text_encoder)}")
    if unsupported:
        raise ValueError(f"LoRA {source} has {len(unsupported)} key(s) this loader does not understand "
                         f"(not a plain LoRA on the DiT: DoRA/LoKr/LoHa, .diff patches, or duplicates): "
                         f"{listing(unsupported)}")
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
            alpha = config_alpha(config, name, int(a.shape[0]), source)
        modules[name] = LoraModule(A=a, B=b, alpha=alpha)
    both = sorted(n for n in modules if f"{n}.weight" in full)
    if both:
        raise ValueError(f"LoRA {source} has both a LoRA pair and a full weight for: {listing(both)}; "
                         "keep one of them per module")
    if incomplete or bad_shape or rank_zero:
        raise ValueError(f"LoRA {source} is malformed: " + problems(
            ("incomplete LoRA pairs", incomplete), ("not 2-D low-rank pairs of matching rank", bad_shape),
            ("rank-0 pairs (lora_A with no rows)", rank_zero), counted=False))
    if not modules and not full:
        raise ValueError(f"LoRA {source} holds no LoRA tensors")
    modules = split_fused_gate_up(_diffsynth_names(modules))
    return LoraState(modules=modules, full=full, format=_format_name(formats, metadata), metadata=metadata,
                     source=source, underscore_names=underscore == {True})


def _diffsynth_names(modules: dict[str, LoraModule]) -> dict[str, LoraModule]:
    """vLLM-Omni's Qwen-Image attention holds its output projection as ``attn.to_out`` itself, where DiffSynth's
    and diffusers' DiT have ``attn.to_out.0`` (a ModuleList): a PEFT folder written for vLLM-Omni reads back."""
    return {n + ".0" if n.endswith(".attn.to_out") else n: m for n, m in modules.items()}


# ComfyUI's Qwen-Image-2.1 may hold the feed-forward's two input projections as one fused weight,
# ``img_mlp.gate_up`` = [gate_layer; proj] stacked by rows (comfy/ldm/qwen_image21/model.py, SwiGLUFeedForward);
# DiffSynth's and diffusers' DiT keep ``gate_layer`` and ``proj`` apart.
_FUSED_GATE_UP = ("img_mlp.gate_up", "img_mlp_gate_up")


def split_fused_gate_up(modules: dict[str, LoraModule]) -> dict[str, LoraModule]:
    """A LoRA pair on a fused ``gate_up`` as the exact pairs of ``gate_layer`` (the first half of B's rows) and
    ``proj`` (the second half), sharing A; other modules unchanged."""
    out = {}
    for name, mod in modules.items():
        suffix = next((s for s in _FUSED_GATE_UP if name.endswith(s)), None)
        if suffix is None:
            out[name] = mod
            continue
        if mod.B.shape[0] % 2:
            raise ValueError(f"LoRA module {name}: a fused gate_up needs an even number of output rows, "
                             f"got {mod.B.shape[0]}")
        half, stem, sep = mod.B.shape[0] // 2, name[: -len(suffix)], suffix[len("img_mlp")]
        out[f"{stem}img_mlp{sep}gate_layer"] = LoraModule(A=mod.A, B=mod.B[:half], alpha=mod.alpha)
        out[f"{stem}img_mlp{sep}proj"] = LoraModule(A=mod.A, B=mod.B[half:], alpha=mod.alpha)
    return out


_WIDE_OR_NARROW = (torch.float64,) + tuple(getattr(torch, n) for n in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n))


def check_tensors(tensors: Mapping[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """The LoRA's tensors, checked: float64 and float8 are cast to fp32 (float8 holds no NaN check and
    most operators refuse it); integer or boolean weights are refused by key (no LoRA is stored that way,
    only an ``.alpha`` scalar may be an integer); NaN/inf, or values beyond ``MAX_ABS_VALUE``, are refused.

    Such a file (a diverged run, a damaged download) would otherwise render black or
    noise images with no error. ``.alpha`` scalars are exempt from the size limit:
    their effect is bounded by the delta check in :func:`match_lora`.
    """
    out = {}
    for key, value in tensors.items():
        if value.dtype in _WIDE_OR_NARROW:
            value = value.to(torch.float32)
        elif not value.is_floating_point() and not (key.endswith(".alpha") and value.numel() == 1):
            raise ValueError(f"LoRA {source}: tensor {key} is {str(value.dtype).replace('torch.', '')}; LoRA weights "
                             "are floating point (fp32, bf16 or fp16): the file is not a LoRA, or it is damaged")
        out[key] = value
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
    return out


def _format_name(formats: set[str], metadata: Mapping[str, str]) -> str:
    for fmt in ("kohya", "comfyui", "diffusers", "peft"):
        if fmt in formats:
            return fmt
    return "diffsynth_qie" if metadata.get("format") == FORMAT_NAME else "diffsynth"


def read_lora_file(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A LoRA file's tensors (checked: :func:`check_tensors`) and metadata, keys as the file holds them."""
    tensors, metadata = _read_file(Path(path))
    return check_tensors(tensors, str(path)), metadata


def load_lora_state(path: str | os.PathLike) -> LoraState:
    """Read a LoRA file of any supported format into a :class:`LoraState`."""
    tensors, metadata = read_lora_file(path)
    return parse_lora_state_dict(tensors, metadata, source=str(path))
