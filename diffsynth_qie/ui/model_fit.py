"""What the served model can run, decided before a job is queued (so a refusal is a toast, never a failed run):
the samplers of its family, the LoRAs of its size, the prompt length of its tokenizer; and the defaults and notes
that follow the model (CFG, the family's name and licence)."""
from __future__ import annotations

from typing import Any

from .lora_picker import LoraInfo
from .settings import MODE_LBM
from .uploads import UIError


def family_supports_lbm(model: str) -> bool:
    from ..models.family_ops import ops_for
    from ..models.presets import family_of

    return ops_for(family_of(model)).supports_lbm


def check_sampler(model: str, mode: str) -> None:
    """LBM on a family without an LBM path is refused here, not after the model ran."""
    if mode == MODE_LBM and not family_supports_lbm(model):
        from ..models.presets import family_of

        raise UIError(f"--model {model} is {family_of(model).label}, which has no LBM sampler: pick Flow "
                      "matching")


def size_divisor(model: str) -> int:
    """What the model's output sides are multiples of (16; 32 for Qwen-Image-2.1)."""
    from ..models.presets import family_of

    return family_of(model).size_divisor


def check_output_size(model: str, width: int, height: int) -> None:
    """An explicit W×H the served family cannot take (a multiple of 16 but not of 32 on 2.1) is refused before
    queueing, with the nearest sizes it takes."""
    step = size_divisor(model)
    bad = [(name, v) for name, v in (("width", width), ("height", height)) if v and v % step]
    if bad:
        name, v = bad[0]
        lower, upper = max(step, v // step * step), (v // step + 1) * step
        raise UIError(f"{name} {v} is not a multiple of {step}, which {family_label(model)} needs: use {lower} or "
                      f"{upper} (\"Keep the input's size\" rounds to it), or 0 for the automatic size")


def check_lora_size(model: str, info: LoraInfo | None) -> None:
    """A LoRA trained on a model of another size (the tiny test model against a real one) cannot load: refused."""
    from ..models.presets import get_preset

    if info is None or not info.preset:
        return
    try:
        trained, serving = get_preset(str(info.preset)), get_preset(model)
    except ValueError:  # a preset this build does not know: its load says what is wrong
        return
    if trained.is_tiny != serving.is_tiny:
        raise UIError(f"LoRA {info.name} was trained on {trained.name}, a model of another size than this UI's "
                      f"{serving.name}: its weights cannot load; pick a LoRA trained on {serving.name}")


def check_prompt_tokens(editor: Any, prompt: str, max_tokens: int) -> None:
    """The prompt's token count against ``--max_prompt_tokens`` with the loaded model's tokenizer."""
    from ..models.prompts import check_prompt_length

    pipe = getattr(editor, "pipe", None)
    if pipe is not None:
        try:
            check_prompt_length(pipe, prompt, max_tokens)
        except ValueError as exc:
            raise UIError(str(exc)) from None


def default_cfg(model: str) -> float:
    from ..models.presets import family_of

    return family_of(model).default_cfg


def family_label(model: str) -> str:
    from ..models.presets import family_of

    return family_of(model).label


def licence_note(model: str) -> str:
    """A line about the model's licence when it is not Apache-2.0 (Qwen-Image-2.1's is non-commercial)."""
    from ..models.presets import family_of, get_preset

    preset, family = get_preset(model), family_of(model)
    if preset.licence != "Apache-2.0":
        return f"⚠ Licence: {preset.licence}. Check it before you use the results."
    if family.licence != "Apache-2.0":
        return (f"Licence: this test model is Apache-2.0; the real {family.label} models are under the "
                f"{family.licence}.")
    return ""
