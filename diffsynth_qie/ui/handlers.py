"""What the web UI's buttons do, as plain Python: testable without gradio or a browser.

``ui/app.py`` only lays out widgets and forwards their values here; everything that
can go wrong is decided in this module:

- **Mask semantics** are those of ``qie edit --mask``: white = the region that may
  change. In the image editor every painted pixel (any colour, any opacity, on any
  layer) is white in the mask; unpainted pixels are black. No stroke at all means
  "no mask": the whole image may change.
- **LoRA picker containment**: the UI only ever sends a *name relative to the LoRA
  folder*; :func:`resolve_lora` refuses absolute paths, ``..`` components and
  symlinks whose target leaves the folder, so a crafted request cannot make the
  server read an arbitrary file.
- **Upload limit**: image files larger than ``--max_upload_mb`` (as they reach the
  server) are refused here, with a message. Gradio's own ``max_file_size`` is set far
  higher (``UIConfig.transport_cap_bytes``): the image editor uploads its canvas when
  Generate is pressed, and a file gradio refuses at that point leaves the editor
  hanging without any message.
- **One model, many LoRAs**: the base model is loaded once (lazily, on the first
  Generate) and LoRAs are switched on it with ``Editor.set_loras``; ``load_count``
  lets tests prove no reload happens.
- **Errors** become one-line messages for the user (:func:`user_message`); unexpected
  ones log their traceback on the server, never in the browser.
"""
from __future__ import annotations

import logging
import math
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
from PIL import Image

from ..utils.text import is_empty_prompt, visible_text
from .config import UIConfig
from .uploads import UIError, image_from_editor, mask_from_editor, prune_temp_files, reference_images

if TYPE_CHECKING:  # heavy imports (torch, diffsynth) stay out of `app_gradio.py --help`
    from ..inference.editor import Editor, EditResult

log = logging.getLogger(__name__)

NO_LORA = "(none)"
LORA_SUFFIX = ".safetensors"
MODE_FLOW = "flow"
MODE_LBM = "lbm"
MODE_LIGHTNING = "lightning"
MODES: tuple[str, ...] = (MODE_FLOW, MODE_LBM, MODE_LIGHTNING)
LBM_MAX_STEPS = 4

# progress(done, total, description)
ProgressFn = Callable[[int, int, str], None]


# --- LoRA picker -----------------------------------------------------------------------
def _inside(path: Path, root: Path) -> bool:
    return path == root or path.is_relative_to(root)


def list_loras(lora_dir: str | os.PathLike) -> list[str]:
    """The LoRA files under ``lora_dir`` (recursive), as sorted POSIX paths relative to it.

    Hidden files and folders are skipped (atomic writes leave ``.name.XXXX.tmp.safetensors``
    while saving). Symlinks are listed only if their target stays inside the folder,
    so everything listed is also accepted by :func:`resolve_lora`. Only files whose header names
    LoRA pairs are listed (not cache shards), and not a checkpoint's ``trainable.safetensors`` (the raw
    training tensors; the checkpoint's ``lora.safetensors`` beside it is the loadable LoRA).
    """
    from ..lora.formats import holds_lora_tensors
    from ..training.checkpoint import TRAINABLE_NAME

    root = Path(lora_dir).expanduser()
    if not root.is_dir():
        return []
    root = root.resolve()
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith(".") or not name.endswith(LORA_SUFFIX):
                continue
            path = Path(dirpath) / name
            try:
                real = path.resolve(strict=True)
            except (OSError, RuntimeError):  # dangling or looping symlink
                continue
            if _inside(real, root) and real.is_file() and name != TRAINABLE_NAME and holds_lora_tensors(real):
                found.append(path.relative_to(root).as_posix())
    return sorted(found)


def resolve_lora(lora_dir: str | os.PathLike, name: str | None) -> Path | None:
    """The real path of the LoRA ``name`` (relative to ``lora_dir``), or None for "no LoRA".

    Refuses (UIError) absolute paths, drive letters, ``..`` components, names that are
    not ``.safetensors``, and anything whose resolved path leaves ``lora_dir``
    (symlinks included) — the picker must not become a way to read other files.
    """
    if name is None or not str(name).strip() or name == NO_LORA:
        return None
    name = str(name).strip()
    shown = name if len(name) <= 120 else name[:117] + "..."
    posix = PurePosixPath(name.replace("\\", "/"))
    if "\x00" in name or posix.is_absolute() or PureWindowsPath(name).drive or PureWindowsPath(name).is_absolute():
        raise UIError(f"LoRA {shown!r} is not a name inside the LoRA folder; pick one from the list")
    if ".." in posix.parts:
        raise UIError(f"LoRA {shown!r} points outside the LoRA folder ('..'); pick one from the list")
    if posix.suffix != LORA_SUFFIX:
        raise UIError(f"LoRA {shown!r} is not a {LORA_SUFFIX} file; pick one from the list")
    root = Path(lora_dir).expanduser().resolve()
    try:
        real = (root / posix).resolve(strict=True)
    except (OSError, RuntimeError):
        raise UIError(f"LoRA {shown!r} no longer exists; press the refresh button and pick again") from None
    if not _inside(real, root):
        raise UIError(f"LoRA {shown!r} links outside the LoRA folder; refusing to load it")
    if not real.is_file():
        raise UIError(f"LoRA {shown!r} is not a file; pick one from the list")
    return real


# --- errors ------------------------------------------------------------------------------
def user_message(exc: BaseException) -> str:
    """A one-line message for the browser; unexpected errors log their traceback here.

    ``ValueError`` is this project's "user error" (it names the bad value and the fix),
    so its text is shown as is. Anything else is a bug or an environment problem: the
    user gets its type and a pointer to the server log, never a stack trace.
    """
    if isinstance(exc, ValueError):
        log.warning("refused: %s", exc)
        return str(exc)
    if type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower():
        log.error("generation ran out of memory", exc_info=exc)
        return ("out of memory: try a smaller image, fewer reference images or steps, "
                "or free memory on the device")
    log.error("generation failed", exc_info=exc)
    return f"internal error ({type(exc).__name__}); the details are in the server log"


def lightning_loras(loras: list, lightning_lora: str | None, steps: int) -> tuple[list, int, float]:
    """The LoRAs, steps and CFG of the Lightning sampler: the chosen LoRA stacked with the
    configured Lightning LoRA; 4 or 8 steps (else the Lightning LoRA's own count); CFG 1."""
    from ..models.lightning import LIGHTNING_STEPS, is_lightning_lora, lightning_steps

    if lightning_lora and not any(Path(p) == Path(lightning_lora) for p, _ in loras):
        if not Path(lightning_lora).is_file():
            raise UIError(f"Lightning LoRA {lightning_lora} not found; fix --lightning_lora")
        loras = [*loras, (Path(lightning_lora), 1.0)]
    paths = [str(p) for p, _ in loras]
    if not any(is_lightning_lora(p) for p in paths):
        raise UIError("the Lightning sampler needs a Lightning LoRA: start the UI with --lightning_lora FILE, "
                      "or pick a LoRA whose name contains 'Lightning'")
    return loras, steps if steps in LIGHTNING_STEPS else lightning_steps(paths), 1.0


# --- the generate action -----------------------------------------------------------------
@dataclass
class GenerateInputs:
    """The values of the UI's widgets when Generate is pressed."""

    editor: Any                      # ImageEditor value {"background", "layers", "composite"}
    prompt: str
    negative_prompt: str = ""
    references: Sequence[Any] | None = None   # gallery value: [(path, caption), ...]
    steps: int = 40
    cfg: float = 4.0
    seed: int = 0                    # < 0 = random
    mask_blend: float = 1.0
    lora: str | None = None          # name relative to the LoRA folder, or NO_LORA
    lora_scale: float = 1.0
    strength: float = 1.0            # edit strength: 0 = the source, 1 = the full edit
    mode: str = MODE_FLOW
    lbm_steps: int = 1


@dataclass
class GenerateOutput:
    image: Image.Image
    sub_image: Image.Image | None    # LBM's sub-stream output; None in flow-matching mode
    seed: int
    status: str
    result: "EditResult"


def _int(value: Any, name: str, lo: int, hi: int) -> int:
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        raise UIError(f"{name} must be a whole number, got {value!r}") from None
    if not math.isfinite(as_float) or as_float != int(as_float) or not lo <= as_float <= hi:
        raise UIError(f"{name} must be a whole number in {lo}..{hi}, got {value!r}")
    return int(as_float)


def _float(value: Any, name: str, lo: float, hi: float) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise UIError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(out) or not lo <= out <= hi:
        raise UIError(f"{name} must be in {lo:g}..{hi:g}, got {value!r}")
    return out


class UIHandlers:
    """State behind one UI: the lazily loaded :class:`Editor` and the LoRA folder.

    ``editor_factory`` (tests) replaces ``Editor.from_preset``. Generation is
    serialised by a lock (the UI's queue already runs one at a time; the lock also
    covers API callers), because LoRA switching mutates the model in place. The
    model loads on first use or, with :meth:`start_background_load`, on a thread
    started at launch.
    """

    def __init__(self, config: UIConfig, editor_factory: Callable[[], "Editor"] | None = None):
        self.config = config
        self._factory = editor_factory or self._load_editor
        self._editor: Editor | None = None
        self._lock = threading.Lock()        # one generation at a time
        self._load_lock = threading.Lock()   # one model load
        self._loading = False
        self.load_count = 0
        self.load_seconds: float | None = None
        self.load_error: str | None = None

    # model ------------------------------------------------------------------------------
    def _load_editor(self) -> "Editor":
        from ..inference.editor import Editor
        from ..models.presets import get_preset

        get_preset(self.config.model)  # (an explicit --model_dir is used as it is, never written, as `qie edit` does)
        from ..inference.editor import device_map_with

        c = self.config
        return Editor.from_preset(model=c.model, model_dir=c.model_dir, device=c.device,
                                  device_map=device_map_with(None, text_encoder=c.text_encoder_device,
                                                             vae=c.vae_device, dit=c.dit_device) or None,
                                  lora_merge=self.config.lora_merge,
                                  fp8_base=self.config.fp8_base, blocks_to_swap=self.config.blocks_to_swap)

    @property
    def loaded(self) -> bool:
        return self._editor is not None

    @property
    def loading(self) -> bool:
        """True while a (background) model load is under way."""
        return self._loading and self._editor is None

    def editor(self) -> "Editor":
        """The one Editor of this UI, loaded on first use (thread-safe: loads once)."""
        with self._load_lock:
            if self._editor is None:
                t0 = time.perf_counter()
                self._loading = True
                log.info("loading model %r (model_dir=%s) ...", self.config.model, self.config.model_dir)
                try:
                    self._editor = self._factory()
                    self.load_error = None
                except Exception as exc:
                    self.load_error = user_message(exc)
                    raise
                finally:
                    self._loading = False
                self.load_count += 1
                self.load_seconds = time.perf_counter() - t0
                log.info("model %r loaded in %.1f s", self.config.model, self.load_seconds)
            return self._editor

    def start_background_load(self) -> threading.Thread:
        """Load the model on a daemon thread, so it is ready by the time a user has painted a mask.

        A failure is logged and shown in the model status; the next Generate retries.
        """
        def load() -> None:
            try:
                self.editor()
            except Exception:  # noqa: BLE001 - reported through load_error / the next Generate
                pass
            finally:
                self._loading = False

        thread = threading.Thread(target=load, name="qie-ui-model-load", daemon=True)
        self._loading = self._editor is None
        thread.start()
        return thread

    def model_status(self) -> str:
        where = f" from `{self.config.model_dir}`" if self.config.model_dir else ""
        if self._editor is not None:
            return f"Model **{self.config.model}**{where}: loaded in {self.load_seconds:.1f} s."
        if self.loading:
            return (f"Model **{self.config.model}**{where}: loading in the background… "
                    "Generate waits for it.")
        if self.load_error:
            return f"Model **{self.config.model}**{where}: failed to load ({self.load_error}); Generate retries."
        return (f"Model **{self.config.model}**{where}: not loaded yet — it loads on the first "
                "Generate (the first run takes longer).")

    # LoRAs ------------------------------------------------------------------------------
    def lora_choices(self) -> list[str]:
        """The LoRA files under the folder, without those trained for the other model family (by metadata)."""
        from ..lora.manager import lora_family
        from ..models.presets import family_of

        family, root = family_of(self.config.model).name, Path(self.config.lora_dir).expanduser()
        return [NO_LORA] + [n for n in list_loras(root) if lora_family(root / n) in (None, family)]

    def lora_status(self) -> str:
        root = Path(self.config.lora_dir).expanduser()
        if not root.is_dir():
            return f"LoRA folder `{self.config.lora_dir}` does not exist yet (training writes there)."
        n = len(self.lora_choices()) - 1
        return f"{n} LoRA file{'s' if n != 1 else ''} under `{self.config.lora_dir}`."

    # generate ---------------------------------------------------------------------------
    def generate(self, inputs: GenerateInputs, progress: ProgressFn | None = None) -> GenerateOutput:
        """Validate everything, then run one edit. Raises UIError for user mistakes."""
        from ..inference.editor import EditRequest

        report = progress or (lambda done, total, desc: None)
        limit = self.config.max_upload_bytes
        prompt = visible_text(inputs.prompt)
        if is_empty_prompt(prompt):
            raise UIError("type a prompt describing the edit")
        if inputs.mode not in MODES:
            raise UIError(f"unknown mode {inputs.mode!r}; valid: {', '.join(MODES)}")
        lbm = inputs.mode == MODE_LBM
        steps = _int(inputs.steps, "steps", 1, 1000)
        lbm_steps = _int(inputs.lbm_steps, "LBM steps", 1, LBM_MAX_STEPS) if lbm else None
        cfg = _float(inputs.cfg, "CFG", 0.0, 100.0)
        mask_blend = _float(inputs.mask_blend, "mask blend", 0.0, 1.0)
        lora_scale = _float(inputs.lora_scale, "LoRA scale", -10.0, 10.0)
        strength = _float(inputs.strength, "edit strength", 0.0, 1.0)
        seed = _int(inputs.seed, "seed", -1, 2**32 - 1) if inputs.seed is not None else 0
        if seed < 0:
            seed = secrets.randbelow(2**31)

        image = image_from_editor(inputs.editor, limit)
        mask = mask_from_editor(inputs.editor, size=image.size, max_bytes=limit)
        refs = reference_images(inputs.references, limit)
        lora = resolve_lora(self.config.lora_dir, inputs.lora)
        loras = [(lora, lora_scale)] if lora is not None else []
        scheduler = "default"
        if inputs.mode == MODE_LIGHTNING:
            loras, steps, cfg = lightning_loras(loras, self.config.lightning_lora, steps)
            scheduler = "lightning"

        with self._lock:
            if not self.loaded:
                report(0, 1, f"loading model {self.config.model} (first run only)")
            editor = self.editor()
            editor.set_loras(loras)
            total = lbm_steps if lbm else steps
            report(0, total, "denoising")
            t0 = time.perf_counter()
            result = editor.edit(EditRequest(
                images=[image, *refs], prompt=prompt, negative_prompt=inputs.negative_prompt or "",
                mask=mask, steps=steps, cfg=cfg, seed=seed, mask_blend=mask_blend,
                lbm_steps=lbm_steps, max_prompt_tokens=self.config.max_prompt_tokens, scheduler=scheduler,
                strength=strength, progress=lambda step, n: report(step, n, "denoising")))
            seconds = time.perf_counter() - t0
            prune_temp_files(self.config.resolved_temp_dir, self.config.max_temp_bytes)
        if lbm and result.sub_image is None:
            raise RuntimeError("the editor returned no sub-stream image in LBM mode")

        sampler = (f"LBM, {lbm_steps} step{'s' if lbm_steps != 1 else ''}" if lbm
                   else f"{'Lightning' if scheduler == 'lightning' else 'flow matching'}, {steps} steps, CFG {cfg:g}")
        parts = [f"Done in {seconds:.1f} s", f"seed {seed}", sampler, f"{result.image.width}×{result.image.height}"]
        parts.append(f"LoRA `{inputs.lora}` × {lora_scale:g}" if lora is not None else "no LoRA")
        if strength < 1.0:
            parts.append(f"strength {strength:g}")
        if mask is None:
            parts.append("no mask painted: the whole image may change")
        else:
            coverage = float(np.asarray(mask).mean()) / 255.0
            parts.append(f"mask covers {coverage:.0%} of the image")
        return GenerateOutput(image=result.image, sub_image=result.sub_image if lbm else None,
                              seed=seed, status=" · ".join(parts) + ".", result=result)
