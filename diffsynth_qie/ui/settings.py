"""Every value Generate reads, declared once: :data:`SETTINGS`.

One :class:`Setting` row says, for one widget of the UI:

- its widget: the gradio class and arguments (``value`` is the row's default; ``elem_id`` is the name with
  ``-`` for ``_``);
- how Generate checks it (``check``: the widget's value -> the checked value, or a :class:`UIError` naming the fix);
- whether the record of a result keeps it (``record``: a field of :class:`~diffsynth_qie.ui.results.EditSettings`,
  so of the PNG's JSON text and of the history);
- its :class:`~diffsynth_qie.inference.editor.EditRequest` field (``request``: the field of the same name);
- its ``qie edit`` flag (``flag``, given when ``flag_when`` holds, as ``flag_value``); the flag's argparse
  destination is the row's name wherever the row also sets an ``EditRequest`` field, as ``qie edit`` passes
  ``args.<name>`` on to ``EditRequest(<name>=...)``;
- its part of the one-line summary, the PNG's ``parameters`` text (``summary``);
- whether clicking a history entry brings it back (``restore``).

Derived from this table, not listed anywhere else: ``GenerateInputs`` (``ui/job.py``), ``EditSettings``, its
summary and the copied ``qie edit`` command (``ui/results.py``), the restore list (``ui/history.py``), the
widgets and Generate's inputs (``ui/app.py``, ``ui/events.py``) and the ``EditRequest`` (``ui/handlers.py``).
The row order is the order of the checks, the flags and the summary.
"""
from __future__ import annotations

import dataclasses
import math
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from ..utils.text import is_empty_prompt, visible_text
from .lora_picker import NO_LORA
from .uploads import UIError

MODE_FLOW = "flow"
MODE_LBM = "lbm"
MODE_LIGHTNING = "lightning"
MODES: tuple[str, ...] = (MODE_FLOW, MODE_LBM, MODE_LIGHTNING)
LBM_MAX_STEPS = 4
MAX_VARIATIONS = 8
MAX_STEPS = 1000
SIZE_STEP, MAX_SIDE = 16, 8192  # output sides: multiples of 16 (0 = automatic: the input fitted to 1 MP)
MAX_GROW = 64
REQUIRED: Any = dataclasses.MISSING  # a setting Generate cannot run without (no default)


@dataclass(frozen=True)
class CommandContext:
    """What the ``qie edit`` flags of a result need besides its settings."""

    lora_dir: str | Path = "."
    has_mask: bool = False


@dataclass(frozen=True)
class Setting:
    """One widget's value: where it comes from and everything it feeds (see the module docstring)."""

    name: str
    default: Any = REQUIRED
    widget: str = ""                                   # gradio component class
    options: Mapping[str, Any] = field(default_factory=dict)  # its arguments besides value and elem_id
    check: Callable[[Any, Any], Any] | None = None     # (value, all of Generate's inputs) -> checked value
    record: bool = False                               # kept in EditSettings (PNG text, history)
    request: bool | Callable[[Any], Any] = False       # EditRequest.<name>: the value, or f(settings)
    flag: str | None = None                            # the `qie edit` flag
    flag_when: Callable[[Any, CommandContext], bool] = lambda s, ctx: True
    flag_value: Callable[[Any, CommandContext], str] | None = None  # default: the value (floats as %g)
    summary: Callable[[Any], str | None] | None = None
    restore: bool = False                              # a history click restores it

    @property
    def elem_id(self) -> str:
        return self.name.replace("_", "-")

    def cli_value(self, settings: Any, ctx: CommandContext) -> str:
        if self.flag_value is not None:
            return self.flag_value(settings, ctx)
        value = getattr(settings, self.name)
        return f"{value:g}" if isinstance(value, float) else str(value)


# --- checks ------------------------------------------------------------------------------------
def whole(label: str, lo: int, hi: int) -> Callable[[Any, Any], int]:
    def check(value: Any, _inputs: Any = None) -> int:
        try:
            as_float = float(value)
        except (TypeError, ValueError):
            raise UIError(f"{label} must be a whole number, got {value!r}") from None
        if not math.isfinite(as_float) or as_float != int(as_float) or not lo <= as_float <= hi:
            raise UIError(f"{label} must be a whole number in {lo}..{hi}, got {value!r}")
        return int(as_float)
    return check


def number(label: str, lo: float, hi: float) -> Callable[[Any, Any], float]:
    def check(value: Any, _inputs: Any = None) -> float:
        try:
            out = float(value)
        except (TypeError, ValueError):
            raise UIError(f"{label} must be a number, got {value!r}") from None
        if not math.isfinite(out) or not lo <= out <= hi:
            raise UIError(f"{label} must be in {lo:g}..{hi:g}, got {value!r}")
        return out
    return check


def _prompt(value: Any, _inputs: Any) -> str:
    prompt = visible_text(value)
    if is_empty_prompt(prompt):
        raise UIError("type a prompt describing the edit")
    return prompt


def _mode(value: Any, _inputs: Any) -> str:
    if value not in MODES:
        raise UIError(f"unknown mode {value!r}; valid: {', '.join(MODES)}")
    return value


def _cache(value: Any, _inputs: Any) -> str:
    from ..models.samplers.step_cache import LEVEL_NAMES

    value = "off" if value in (None, "") else value
    if value not in LEVEL_NAMES:
        raise UIError(f"unknown speed {value!r}; valid: {', '.join(LEVEL_NAMES)}")
    return value


def _seed(value: Any, _inputs: Any) -> int:
    seed = whole("seed", -1, 2**32 - 1)(value) if value is not None else 0
    return secrets.randbelow(2**31) if seed < 0 else seed  # < 0 = random


def _lora_name(value: Any, _inputs: Any) -> str | None:
    return None if value is None or not str(value).strip() or value == NO_LORA else str(value).strip()


def _lbm_steps(value: Any, inputs: Any) -> int:
    return whole("LBM steps", 1, LBM_MAX_STEPS)(value) if inputs.mode == MODE_LBM else 1


def output_side(value: Any, label: str = "size", step: int = SIZE_STEP) -> int:
    """An output side as the model takes it: 0 (automatic) or a multiple of ``step`` (the nearest; a family that
    needs more, 2.1's 32, is checked before queueing: ``ui/model_fit.check_output_size``)."""
    side = whole(label, 0, MAX_SIDE)(0 if value in (None, "") else value)
    return 0 if side == 0 else max(step, round(side / step) * step)


def _height(value: Any, inputs: Any) -> int:
    height, width = output_side(value, "height"), output_side(inputs.width, "width")
    if bool(height) != bool(width):
        raise UIError(f"give both width and height (got {width}×{height}), or 0 for both: the automatic size")
    return height


def _loras(s: Any) -> str:
    return " · ".join(f"LoRA {n} × {v:g}" for n, v in s.loras()) or "no LoRA"


def _lora_path(name: str) -> Callable[[Any, CommandContext], str]:
    return lambda s, ctx: str(Path(ctx.lora_dir) / getattr(s, name))


def _not_lbm(s: Any, _ctx: CommandContext) -> bool:
    return s.mode != MODE_LBM  # flow matching and Lightning take steps and CFG


_SLIDER = "Slider"


SETTINGS: tuple[Setting, ...] = (
    Setting("prompt", REQUIRED, "Textbox", dict(label="Prompt", lines=2, placeholder="what should change"),
            check=_prompt, record=True, request=True, flag="--prompt", summary=lambda s: s.prompt, restore=True),
    Setting("negative_prompt", "", "Textbox", dict(label="Negative prompt", lines=1),
            check=lambda v, _: v or "", record=True, request=True, flag="--negative_prompt",
            flag_when=lambda s, ctx: bool(s.negative_prompt),
            summary=lambda s: f"negative: {s.negative_prompt}" if s.negative_prompt else None, restore=True),
    Setting("mode", MODE_FLOW, "Radio", dict(label="Sampler"), check=_mode, record=True,
            flag="--scheduler", flag_when=lambda s, ctx: s.mode == MODE_LIGHTNING,
            flag_value=lambda s, ctx: "lightning", summary=lambda s: s.sampler(), restore=True),
    # A number box, not a slider: a slider clips a typed 200 to its maximum when it loses focus (the check takes
    # 1..MAX_STEPS; past it, the check's message names the range).
    Setting("steps", 40, "Number", dict(precision=0, step=1, label=f"Steps (1–{MAX_STEPS})"),
            check=whole("steps", 1, MAX_STEPS), record=True, request=True, flag="--steps", flag_when=_not_lbm,
            restore=True),
    Setting("lbm_steps", 1, _SLIDER, dict(minimum=1, maximum=LBM_MAX_STEPS, step=1, label="LBM steps", visible=False),
            check=_lbm_steps, record=True, request=lambda s: s.lbm_steps if s.mode == MODE_LBM else None,
            flag="--lbm_steps", flag_when=lambda s, ctx: s.mode == MODE_LBM, restore=True),
    Setting("cfg", 4.0, _SLIDER, dict(minimum=1.0, maximum=10.0, step=0.5, label="CFG"),
            check=number("CFG", 0.0, 100.0), record=True, request=True, flag="--cfg", flag_when=_not_lbm,
            restore=True),
    Setting("cache", "off", "Radio", dict(choices=[("Exact", "off"), ("Balanced", "balanced"), ("Fast", "fast")],
                                          label="Speed (reuse some steps' DiT work; no effect with LBM)"),
            check=_cache, record=True, request=True, flag="--cache", flag_when=lambda s, ctx: s.cache != "off",
            summary=lambda s: f"speed {s.cache}" if s.cache != "off" else None, restore=True),
    Setting("seed", 0, "Number", dict(precision=0, label="Seed (-1 = random)"), check=_seed, record=True,
            request=True, flag="--seed", summary=lambda s: f"seed {s.seed}", restore=True),
    Setting("variations", 1, _SLIDER, dict(minimum=1, maximum=MAX_VARIATIONS, step=1,
                                           label="Variations (seed, seed+1, …)"),
            check=whole("variations", 1, MAX_VARIATIONS)),
    # Not a setting of the result (the pixels are the same with and without previews): no record, flag or restore.
    Setting("live_preview", 5, "Number", dict(precision=0, minimum=0, step=1,
                                              label="Live preview every N steps (0 = off; each costs a VAE decode)"),
            check=whole("live preview", 0, MAX_STEPS)),
    Setting("lora", None, "Dropdown", dict(label="LoRA", scale=5), check=_lora_name, record=True, flag="--lora",
            flag_when=lambda s, ctx: bool(s.lora), flag_value=_lora_path("lora"), summary=_loras, restore=True),
    Setting("lora_scale", 1.0, _SLIDER, dict(minimum=-2.0, maximum=2.0, step=0.05, label="LoRA scale"),
            check=number("LoRA scale", -10.0, 10.0), record=True, flag="--lora_scale",
            flag_when=lambda s, ctx: bool(s.lora), restore=True),
    Setting("lora2", None, "Dropdown", dict(label="Second LoRA", value=NO_LORA), check=_lora_name, record=True,
            flag="--lora", flag_when=lambda s, ctx: bool(s.lora2), flag_value=_lora_path("lora2"), restore=True),
    Setting("lora2_scale", 1.0, _SLIDER, dict(minimum=-2.0, maximum=2.0, step=0.05, label="Second LoRA scale"),
            check=number("second LoRA scale", -10.0, 10.0), record=True, flag="--lora_scale",
            flag_when=lambda s, ctx: bool(s.lora2), restore=True),
    Setting("mask_grow", 0, _SLIDER, dict(minimum=0, maximum=MAX_GROW, step=1, label="Grow mask (px)"),
            check=whole("mask grow", 0, MAX_GROW), record=True, restore=True),  # already in the mask file
    Setting("strength", 1.0, _SLIDER, dict(minimum=0.0, maximum=1.0, step=0.05,
                                           label="Edit strength (0 = source, 1 = full)"),
            check=number("edit strength", 0.0, 1.0), record=True, request=True, flag="--strength",
            flag_when=lambda s, ctx: s.strength != 1.0,
            summary=lambda s: f"strength {s.strength:g}" if s.strength < 1 else None, restore=True),
    Setting("mask_blend", 1.0, _SLIDER, dict(minimum=0.0, maximum=1.0, step=0.05, label="Mask blend strength"),
            check=number("mask blend", 0.0, 1.0), record=True, request=True, flag="--mask_blend",
            flag_when=lambda s, ctx: ctx.has_mask and s.mask_blend != 1.0, restore=True),
    Setting("mask_feather", 0.0, _SLIDER, dict(minimum=0, maximum=32, step=0.5, label="Feather (px)"),
            check=number("mask feather", 0.0, 64.0), record=True, request=True, flag="--mask_feather",
            flag_when=lambda s, ctx: ctx.has_mask and bool(s.mask_feather), restore=True),
    Setting("mask_invert", False, "Checkbox", dict(label="Invert mask (edit all but the painted part)"),
            check=lambda v, _: bool(v), record=True, restore=True),  # already in the mask file
    Setting("width", 0, "Number", dict(precision=0, label="Width (0 = automatic)"),
            check=lambda v, _: output_side(v, "width"), record=True, request=lambda s: s.width or None,
            flag="--width", flag_when=lambda s, ctx: bool(s.width), restore=True),
    Setting("height", 0, "Number", dict(precision=0, label="Height (0 = automatic)"), check=_height, record=True,
            request=lambda s: s.height or None, flag="--height", flag_when=lambda s, ctx: bool(s.height),
            summary=lambda s: f"{s.width}×{s.height}" if s.width else None, restore=True),
    # Images, read by ui/job.py (which checks them): no record, no flag of their own.
    Setting("editor", REQUIRED, "ImageEditor", dict(
        label="Image and mask (paint the region to edit)", type="filepath", image_mode="RGBA",
        sources=["upload", "clipboard"], transforms=(), layers=False, format="png")),
    Setting("references", None, "Gallery", dict(
        label="Extra reference images (optional)", type="filepath", interactive=True, columns=4, height=160,
        file_types=["image"], object_fit="contain", scale=3)),
    Setting("mask_file", None, "Image", dict(  # an uploaded mask (white = may change), united with the paint
        label="Mask file (optional; white = edit)", type="filepath", image_mode="L", sources=["upload", "clipboard"],
        height=160, scale=1)),
    # masks.loaded_record of the image the UI last put into the editor (events.Callbacks.lock_generate)
    Setting("loaded_image", None, "Textbox", dict(visible=False)),
)

# --- what each sampler shows ------------------------------------------------------------------------
LIGHTNING_DEFAULT_STEPS = 8
FLOW_DEFAULT_STEPS = 40


def steps_for_mode(new: str, prev: str, steps: float, saved: float | None) -> tuple[float, float | None]:
    """(steps to show, steps to remember) when the sampler changes from ``prev`` to ``new``.

    Entering Lightning remembers the user's steps and shows 8; leaving it gives them back
    (never leaves a flow-matching run silently at Lightning's 8).
    """
    if new == MODE_LIGHTNING and prev != MODE_LIGHTNING:
        return LIGHTNING_DEFAULT_STEPS, steps
    if prev == MODE_LIGHTNING and new != MODE_LIGHTNING:
        return saved or FLOW_DEFAULT_STEPS, saved
    return steps, saved


def shown_for_mode(mode: str) -> dict[str, bool]:
    """Which sampler widgets ``mode`` shows: LBM has its own steps and no CFG; Lightning runs 4/8 steps at CFG 1;
    the negative prompt only where CFG applies (it has no effect at CFG 1)."""
    lbm, few = mode == MODE_LBM, mode == MODE_LIGHTNING
    return {"steps": not lbm, "cfg": not (lbm or few), "lbm_steps": lbm, "negative_prompt": not (lbm or few)}


SETTING: dict[str, Setting] = {s.name: s for s in SETTINGS}
INPUT_NAMES: tuple[str, ...] = tuple(SETTING)                      # Generate's inputs
RECORDED: tuple[str, ...] = tuple(s.name for s in SETTINGS if s.record)
RESTORED: tuple[str, ...] = tuple(s.name for s in SETTINGS if s.restore)


def checked_values(inputs: Any) -> dict[str, Any]:
    """Each checked setting of ``inputs`` (a ``GenerateInputs``), checked in table order: the first problem raises."""
    return {s.name: s.check(getattr(inputs, s.name), inputs) for s in SETTINGS if s.check is not None}


def request_fields(settings: Any) -> dict[str, Any]:
    """The ``EditRequest`` fields the settings give (the images, the mask and the schedule come from the job)."""
    return {s.name: s.request(settings) if callable(s.request) else getattr(settings, s.name)
            for s in SETTINGS if s.request}


def command_flags(settings: Any, ctx: CommandContext) -> list[str]:
    """The ``qie edit`` flags of the settings, in table order."""
    argv: list[str] = []
    for s in SETTINGS:
        if s.flag and s.flag_when(settings, ctx):
            argv += [s.flag, s.cli_value(settings, ctx)]
    return argv


def summary_parts(settings: Any) -> list[str]:
    """The settings' parts of the one-line summary, in table order."""
    parts = (s.summary(settings) for s in SETTINGS if s.summary is not None)
    return [p for p in parts if p]


def build_widget(name: str, **extra: Any):
    """The gradio component of setting ``name``: its declared arguments, then ``extra`` (what the layout knows:
    choices, a computed value)."""
    import gradio as gr

    s = SETTING[name]
    kwargs = {"elem_id": s.elem_id, **s.options, **extra}
    if s.default is not REQUIRED and s.default is not None:
        kwargs.setdefault("value", s.default)
    return getattr(gr, s.widget)(**kwargs)
