"""The UI's one model: loaded once (on the first Generate, or in the background at launch) and shared by every
tab; LoRAs are switched on it, never a second copy. ``load_count`` lets tests prove no reload happens, and the
model status line says where the load stands."""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

from .config import UIConfig
from .messages import user_message
from .model_fit import licence_note

if TYPE_CHECKING:  # heavy imports (torch, diffsynth) stay out of `app_gradio.py --help`
    from ..inference.editor import Editor

log = logging.getLogger(__name__)


class ModelHolder:
    """The lazily loaded :class:`Editor` of ``config.model`` (``editor_factory``, for tests, replaces
    ``Editor.from_preset``); thread-safe: it loads once."""

    def __init__(self, config: UIConfig, editor_factory: Callable[[], "Editor"] | None = None):
        self.config = config
        self._factory = editor_factory or self._load_editor
        self._editor: Editor | None = None
        self._load_lock = threading.Lock()   # one model load
        self._loading = False
        self.load_count = 0
        self.load_seconds: float | None = None
        self.load_error: str | None = None
        self.model_dir: str | None = config.model_dir   # what was loaded (the pretrained tiny base for plain tiny)
        self.model_label = ""

    def _load_editor(self) -> "Editor":
        """The Editor of ``--model``: with its CPU threads set, and for the tiny preset without ``--model_dir`` the
        pretrained tiny base (installed on first use) rather than random weights."""
        from ..inference.editor import Editor, device_map_with
        from .startup import apply_threads, model_label, random_label, resolve_model_dir

        c = self.config
        apply_threads(c)
        self.model_dir = resolve_model_dir(c)  # an explicit --model_dir is used as it is, never written
        self.model_label = model_label(self.model_dir) or random_label(c.model, self.model_dir)
        return Editor.from_preset(model=c.model, model_dir=self.model_dir, device=c.device,
                                  device_map=device_map_with(None, text_encoder=c.text_encoder_device,
                                                             vae=c.vae_device, dit=c.dit_device) or None,
                                  lora_merge=c.lora_merge, fp8_base=c.fp8_base, blocks_to_swap=c.blocks_to_swap)

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
                log.info("loading model %r ...", self.config.model)
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
                log.info("model %r loaded in %.1f s (model_dir=%s)", self.config.model, self.load_seconds,
                         self.model_dir)
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
        label = f" ({self.model_label})" if self.model_label else ""
        where = f"{label} from `{self.model_dir}`" if self.model_dir else label
        note = licence_note(self.config.model)
        if self._editor is not None:
            return f"Model **{self.config.model}**{where}: loaded in {self.load_seconds:.1f} s." + (
                f"\n\n{note}" if note else "")
        if self.loading:
            return (f"Model **{self.config.model}**{where}: loading in the background… "
                    "Generate waits for it.")
        if self.load_error:
            return (f"Model **{self.config.model}**{where}: failed to load; Generate retries.\n\n"
                    f"```\n{self.load_error}\n```")
        return (f"Model **{self.config.model}**{where}: not loaded yet — it loads on the first "
                "Generate (the first run takes longer).")
