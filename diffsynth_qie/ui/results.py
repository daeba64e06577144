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
from dataclasses import dataclass
from pathlib import Path

from PIL import Image
from PIL.PngImagePlugin import PngInfo

from ..utils.atomic import atomic_save

PNG_KEY = "diffsynth-qie"


@dataclass(frozen=True)
class EditSettings:
    """The settings of one generation, as the UI's widgets hold them (LoRAs by their name in the LoRA folder)."""

    prompt: str
    model: str
    negative_prompt: str = ""
    mode: str = "flow"           # flow | lbm | lightning
    steps: int = 40              # flow matching / Lightning
    lbm_steps: int = 1
    cfg: float = 4.0
    seed: int = 0
    lora: str | None = None
    lora_scale: float = 1.0
    lora2: str | None = None
    lora2_scale: float = 1.0
    strength: float = 1.0
    mask_blend: float = 1.0
    mask_grow: int = 0
    mask_invert: bool = False
    mask_feather: float = 0.0

    def with_seed(self, seed: int) -> "EditSettings":
        return dataclasses.replace(self, seed=seed)

    def loras(self) -> list[tuple[str, float]]:
        return [(n, s) for n, s in ((self.lora, self.lora_scale), (self.lora2, self.lora2_scale)) if n]

    def sampler(self) -> str:
        if self.mode == "lbm":
            return f"LBM, {self.lbm_steps} step{'s' if self.lbm_steps != 1 else ''}"
        return f"{'Lightning' if self.mode == 'lightning' else 'flow matching'}, {self.steps} steps, CFG {self.cfg:g}"

    def summary(self) -> str:
        """One line: prompt, sampler, seed, LoRAs, model (the PNG's ``parameters`` text)."""
        parts = [self.prompt]
        if self.negative_prompt:
            parts.append(f"negative: {self.negative_prompt}")
        parts += [self.sampler(), f"seed {self.seed}"]
        parts += [f"LoRA {n} × {s:g}" for n, s in self.loras()] or ["no LoRA"]
        if self.strength < 1:
            parts.append(f"strength {self.strength:g}")
        parts.append(f"model {self.model}")
        return " · ".join(parts)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "EditSettings":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def _slug(text: str, limit: int = 40) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")[:limit] or "x"


def file_stem(settings: EditSettings) -> str:
    """``edit_seed42_run1-lora`` (LBM: ``edit-lbm_...``): the download's name says what it holds."""
    kind = "edit" if settings.mode == "flow" else f"edit-{settings.mode}"
    parts = [kind, f"seed{settings.seed}"]
    if settings.lora:
        parts.append(_slug(str(settings.lora).removesuffix(".safetensors")))
    return "_".join(parts)


def png_info(settings: EditSettings) -> PngInfo:
    info = PngInfo()
    info.add_text("parameters", settings.summary())
    info.add_text(PNG_KEY, json.dumps(settings.to_json(), sort_keys=True))
    return info


def save_png(image: Image.Image, folder: Path, settings: EditSettings, suffix: str = "") -> Path:
    """Write ``image`` as ``<folder>/<file_stem><suffix>.png`` with the settings in its text chunks (atomically)."""
    path = Path(folder) / f"{file_stem(settings)}{suffix}.png"
    atomic_save(path, lambda tmp: image.save(tmp, format="PNG", pnginfo=png_info(settings)))
    return path


def read_settings(path: str | Path) -> EditSettings | None:
    """The settings a PNG written by :func:`save_png` carries (None for any other image)."""
    with Image.open(path) as im:
        text = getattr(im, "text", {}) or {}
    return EditSettings.from_json(json.loads(text[PNG_KEY])) if PNG_KEY in text else None


def qie_edit_command(settings: EditSettings, image: str | Path, mask: str | Path | None, *, lora_dir: str | Path,
                     model_dir: str | None = None, lightning_lora: str | None = None, out: str | None = None) -> str:
    """The ``qie edit`` command line that repeats this generation (same seed, LoRAs, sampler)."""
    argv = ["qie", "edit", "--model", settings.model]
    if model_dir:
        argv += ["--model_dir", str(model_dir)]
    argv += ["--image", str(image), "--prompt", settings.prompt]
    if settings.negative_prompt:
        argv += ["--negative_prompt", settings.negative_prompt]
    if mask is not None:
        argv += ["--mask", str(mask)]
        if settings.mask_blend != 1.0:
            argv += ["--mask_blend", f"{settings.mask_blend:g}"]
        if settings.mask_feather:
            argv += ["--mask_feather", f"{settings.mask_feather:g}"]
    if settings.mode == "lbm":
        argv += ["--lbm_steps", str(settings.lbm_steps)]
    else:
        argv += ["--steps", str(settings.steps), "--cfg", f"{settings.cfg:g}"]
        if settings.mode == "lightning":
            argv += ["--scheduler", "lightning"]
    argv += ["--seed", str(settings.seed)]
    for name, scale in settings.loras():
        argv += ["--lora", str(Path(lora_dir) / name), "--lora_scale", f"{scale:g}"]
    if settings.mode == "lightning" and lightning_lora:
        argv += ["--lora", str(lightning_lora), "--lora_scale", "1"]
    if settings.strength != 1.0:
        argv += ["--strength", f"{settings.strength:g}"]
    argv += ["--out", out or f"{file_stem(settings)}.png"]
    return shlex.join(argv)
