"""What one UI result was made with, and the files a user takes away from it.

:class:`EditSettings` is the record of a generation. The same record

- names the download (``edit_seed42_run1-lora.png``: what it is, at a glance),
- is written into the PNG's text chunks (``parameters``: a one-line summary as A1111
  and ComfyUI users read it; ``diffsynth-qie``: the record as JSON),
- becomes the equivalent ``qie edit ...`` command (:func:`qie_edit_command`), and
- restores the widgets when a history entry is clicked (``ui/history.py``).
"""
from __future__ import annotations

import dataclasses
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from PIL import Image
from PIL.PngImagePlugin import PngInfo

from ..utils.atomic import atomic_save
from .settings import (MODE_FLOW, MODE_LBM, MODE_LIGHTNING, RECORDED, SETTING, CommandContext, command_flags,
                       summary_parts)

PNG_KEY = "diffsynth-qie"
FILES_KEY = "diffsynth-qie-files"  # {"image", "mask", "references"}: the input files' absolute paths (JSON)
COMMAND_KEY = "diffsynth-qie-command"        # the `qie edit` command that repeats the result


class _SettingsRecord:
    """The methods of :class:`EditSettings` (its fields come from ``ui/settings.py``)."""

    def with_seed(self, seed: int) -> "EditSettings":
        return dataclasses.replace(self, seed=seed)

    def loras(self) -> list[tuple[str, float]]:
        return [(n, s) for n, s in ((self.lora, self.lora_scale), (self.lora2, self.lora2_scale)) if n]

    def sampler(self) -> str:
        if self.mode == MODE_LBM:
            return f"LBM, {self.lbm_steps} step{'s' if self.lbm_steps != 1 else ''}"
        return f"{'Lightning' if self.mode == MODE_LIGHTNING else 'flow matching'}, {self.steps} steps, CFG {self.cfg:g}"

    def summary(self) -> str:
        """One line: prompt, sampler, seed, LoRAs, model (the PNG's ``parameters`` text)."""
        return " · ".join([*summary_parts(self), f"model {self.model}"])

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "EditSettings":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


# The settings of one generation, as the UI's widgets hold them (LoRAs by their name in the LoRA folder): the
# model, then every setting SETTINGS records. Frozen; keyword arguments only.
EditSettings = dataclasses.make_dataclass(
    "EditSettings", [("model", str), *((n, Any, dataclasses.field(default=SETTING[n].default)) for n in RECORDED)],
    bases=(_SettingsRecord,), frozen=True, kw_only=True, namespace={"__module__": __name__})


def _slug(text: str, limit: int = 40) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")[:limit] or "x"


def file_stem(settings: EditSettings) -> str:
    """``edit_seed42_run1-lora`` (LBM: ``edit-lbm_...``): the download's name says what it holds."""
    kind = "edit" if settings.mode == MODE_FLOW else f"edit-{settings.mode}"
    parts = [kind, f"seed{settings.seed}"]
    if settings.lora:
        parts.append(_slug(str(settings.lora).removesuffix(".safetensors")))
    return "_".join(parts)


def png_info(settings: EditSettings, files: dict | None = None, command: str = "") -> PngInfo:
    """The text chunks: ``parameters`` (the summary), the settings (JSON), the input files and the command."""
    info = PngInfo()
    refs = (files or {}).get("references") or []
    info.add_text("parameters", settings.summary() + (f" · references: {', '.join(Path(r).name for r in refs)}"
                                                      if refs else ""))
    info.add_text(PNG_KEY, json.dumps(settings.to_json(), sort_keys=True))
    if files:
        info.add_text(FILES_KEY, json.dumps(files, sort_keys=True))
    if command:
        info.add_text(COMMAND_KEY, command)
    return info


def save_png(image: Image.Image, folder: Path, settings: EditSettings, suffix: str = "",
             files: dict | None = None, command: str = "") -> Path:
    """Write ``image`` as ``<folder>/<file_stem><suffix>.png`` with the settings, the input files ({"image",
    "mask", "references"}) and the command in its text chunks (atomically)."""
    path = Path(folder) / f"{file_stem(settings)}{suffix}.png"
    atomic_save(path, lambda tmp: image.save(tmp, format="PNG", pnginfo=png_info(settings, files, command)))
    return path


def _text(path: str | Path) -> dict:
    with Image.open(path) as im:
        return dict(getattr(im, "text", {}) or {})


def read_settings(path: str | Path) -> EditSettings | None:
    """The settings a PNG written by :func:`save_png` (the UI or ``qie edit``) carries (None for any other image),
    each through Generate's own check (``SETTINGS``): a value a crafted PNG holds (``cfg: "abc"``, a list for the
    record) is a ``ValueError`` naming it, never a broken widget or summary later."""
    text = _text(path)
    if PNG_KEY not in text:
        return None
    try:
        data = json.loads(text[PNG_KEY])
    except ValueError:
        raise ValueError(f"its {PNG_KEY} settings are not readable JSON") from None
    if not isinstance(data, dict):
        raise ValueError(f"its {PNG_KEY} settings are not a JSON object")
    settings = EditSettings.from_json(data)
    return dataclasses.replace(settings, **{name: SETTING[name].check(getattr(settings, name), settings)
                                            for name in RECORDED if SETTING[name].check is not None})


def read_extras(path: str | Path) -> tuple[dict, str]:
    """(input files {"image", "mask", "references"}, command) of a PNG written by :func:`save_png` (empty when
    absent or unreadable)."""
    text = _text(path)
    try:
        files = json.loads(text.get(FILES_KEY, "{}"))
    except (TypeError, ValueError):
        files = {}
    if not isinstance(files, dict):
        files = {}
    refs = files.get("references")
    return {"image": files.get("image"), "mask": files.get("mask"),
            "references": [str(r) for r in refs] if isinstance(refs, list) else []}, str(text.get(COMMAND_KEY, ""))


def qie_program() -> list[str]:
    """The command that runs ``qie`` in a fresh shell: this environment's own ``qie`` script by its absolute path
    (no activated virtual environment needed), else ``qie`` on the PATH."""
    script = Path(sys.executable).parent / "qie"
    return [str(script)] if script.is_file() else ["qie"]


def _absolute(path: str | Path) -> str:
    return str(Path(path).expanduser().absolute())


def qie_edit_command(settings: EditSettings, image: str | Path, mask: str | Path | None, *, lora_dir: str | Path,
                     model_dir: str | None = None, lightning_lora: str | None = None, out: str | None = None,
                     references: list[str | Path] | tuple = ()) -> str:
    """The ``qie edit`` command line that repeats this generation (same seed, LoRAs, sampler, reference images):
    the flags of ``SETTINGS``, the files as absolute quoted paths (it runs from any folder, in a fresh shell), and
    the Lightning LoRA the Lightning sampler stacked."""
    argv = [*qie_program(), "edit", "--model", settings.model]
    if model_dir:
        argv += ["--model_dir", _absolute(model_dir)]
    for path in (image, *references):
        argv += ["--image", _absolute(path)]
    if mask is not None:
        argv += ["--mask", _absolute(mask)]
    argv += command_flags(settings, CommandContext(lora_dir=_absolute(lora_dir), has_mask=mask is not None))
    if settings.mode == MODE_LIGHTNING and lightning_lora:
        argv += ["--lora", _absolute(lightning_lora), "--lora_scale", "1"]
    argv += ["--out", out or f"{file_stem(settings)}.png"]
    return shlex.join(argv)


def cli_png_info(args: Any, loras: list[tuple[Any, float]]) -> PngInfo:
    """The text chunks ``qie edit`` writes into a PNG output: the same record as the UI's results (settings,
    input files, the command), so a ``qie edit`` PNG dropped on the UI brings its settings back. ``args`` are
    ``qie edit``'s parsed flags after its schedule plan; ``loras`` its (path, scale) pairs (the first two are
    recorded, by absolute path)."""
    mode = MODE_LBM if args.lbm_steps else MODE_LIGHTNING if args.scheduler == "lightning" else MODE_FLOW
    named = [(_absolute(p), float(s)) for p, s in loras] + [(None, 1.0)] * 2
    (lora, lora_scale), (lora2, lora2_scale) = named[:2]
    settings = EditSettings(
        model=args.model, prompt=args.prompt or "", negative_prompt=args.negative_prompt or "", mode=mode,
        steps=int(args.steps), lbm_steps=int(args.lbm_steps or 1), cfg=float(args.cfg), seed=int(args.seed),
        lora=lora, lora_scale=lora_scale, lora2=lora2, lora2_scale=lora2_scale, strength=float(args.strength),
        mask_blend=float(args.mask_blend), mask_feather=float(args.mask_feather), cache=getattr(args, "cache", "off"))
    images = [_absolute(p) for p in args.image]
    mask = _absolute(args.mask) if args.mask else None
    files = {"image": images[0] if images else None, "mask": mask, "references": images[1:]}
    command = qie_edit_command(settings, images[0], mask, lora_dir="/", references=images[1:],
                               out=_absolute(args.out)) if images else ""
    return png_info(settings, files, command)
