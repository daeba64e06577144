"""What the web UI's buttons do, as plain Python: testable without gradio or a browser.

``ui/app.py`` only lays out widgets and forwards their values here; everything that
can go wrong is decided in this module and the ones it uses:

- **Inputs** are checked by ``ui/job.py`` before anything is queued (mask semantics
  are those of ``qie edit --mask``: painted = white = may change; see ``ui/uploads.py``).
- **LoRA picker containment and labels**: ``ui/lora_picker.py``.
- **One model, many LoRAs**: the base model is loaded once (lazily, or in the
  background at launch) and LoRAs are switched on it with ``Editor.set_loras``;
  ``load_count`` lets tests prove no reload happens.
- **Results** are PNGs with their settings in text chunks, kept in the UI's temp
  folder for download and for the session history (``ui/outputs.py``, ``ui/results.py``, ``ui/history.py``).
- **Settings** (each widget's value, its ``EditRequest`` field, ``qie edit`` flag, summary
  text and history restore) are declared once, in ``ui/settings.py``.
- **Stop** ends a running generation at its next denoising step. **Errors** become one-line messages
  (:func:`user_message`); unexpected ones log their traceback on the server, never in the browser.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .config import UIConfig
from .lora_state import LoraChoices
from .job import GenerateInputs, Job, check_job, lightning_loras  # noqa: F401
from .lora_picker import LORA_SUFFIX, NO_LORA, LoraInfo, list_loras, lora_info, resolve_lora  # noqa: F401
from .outputs import GenerateOutput, save_entry, save_inputs, status_line
from .model_fit import check_lora_size, check_output_size, check_prompt_tokens, check_sampler, licence_note
from .runner import PreviewFn, ProgressFn, Stopped, Where, previews, queue_eta, run_variations
from .settings import LBM_MAX_STEPS, MODE_FLOW, MODE_LBM, MODE_LIGHTNING, MODES, request_fields  # noqa: F401
from .uploads import UIError, prune_temp_files

if TYPE_CHECKING:  # heavy imports (torch, diffsynth) stay out of `app_gradio.py --help`
    from ..inference.editor import Editor

log = logging.getLogger(__name__)

# --- errors ------------------------------------------------------------------------------
def check_branches(editor) -> None:
    """After a LoRA switch: every unmerged branch must sit where its layer's weight is (one on the host while the
    weight is on the GPU is copied at every forward, or fails; ``qie edit``'s preflight checks the same switch on
    the fake device). A ``RuntimeError`` (a bug, not the user's) before the edit runs."""
    from ..preflight.lora_files import misplaced_branch

    dit = getattr(getattr(editor, "pipe", None), "dit", None)
    line = misplaced_branch(dit, "Editor.set_loras") if dit is not None else None
    if line is not None:
        raise RuntimeError(line)


def user_message(exc: BaseException) -> str:
    """A one-line message for the browser; unexpected errors log their traceback here.

    ``ValueError`` is this project's "user error" (it names the bad value and the fix),
    so its text is shown as is, as are missing model files (the list and the download
    command). Anything else is a bug or an environment problem: the user gets its type
    and a pointer to the server log, never a stack trace.
    """
    from ..models.load.loading import MissingModelFiles

    if isinstance(exc, Stopped):  # (logged where it stopped: ui/runner.run_variations)
        return str(exc)
    if isinstance(exc, (ValueError, MissingModelFiles)):
        log.warning("refused: %s", exc)
        return str(exc)
    if type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower():
        log.error("generation ran out of memory", exc_info=exc)
        return ("out of memory: try a smaller image, fewer reference images or steps, "
                "or free memory on the device")
    log.error("generation failed", exc_info=exc)
    return f"internal error ({type(exc).__name__}); the details are in the server log"


class UIHandlers(LoraChoices):
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
        self._stop = threading.Event()       # set by Stop; cleared when the next generation starts
        self._running: str | None = None     # the browser session whose generation runs
        self._stop_queued: set[str] = set()  # sessions whose generation was stopped before it ran
        self._stop_lock = threading.Lock()
        self._load_lock = threading.Lock()   # one model load
        self._loading = False
        self.load_count = 0
        self.load_seconds: float | None = None
        self.load_error: str | None = None
        self.model_dir: str | None = config.model_dir   # what was loaded (the pretrained tiny base for plain tiny)
        self.model_label = ""
        self.where: Where | None = None      # the running generation (its time left: a queue's ETA)
        self.last_run_seconds: float | None = None  # the last generation's time, as measured
        self.known_images: frozenset[str] = frozenset()  # the examples' images, which the editor may be given
        self._given: dict[str, set[str]] = {}  # browser session -> the files the UI put into its editor

    # model ------------------------------------------------------------------------------
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

    # generate ---------------------------------------------------------------------------
    def give(self, session: str | None, path: str) -> str:
        """Record that the UI put ``path`` into ``session``'s editor (a result, a cleared image): the files a
        session's Generate may read back are the examples and what was given to it."""
        if session is not None:
            self._given.setdefault(session, set()).add(str(path))
        return str(path)

    def given(self, session: str | None) -> frozenset[str] | None:
        """The files given to ``session``'s editor (None for an in-process caller: the UI's folders)."""
        return None if session is None else frozenset(self._given.get(session, ()))

    def check(self, inputs: GenerateInputs, session: str | None = None) -> Job:
        """Validate everything Generate needs without loading the model (UIError says what to fix). A browser
        ``session`` reads back only its own files (:meth:`give`); None (an in-process caller) the UI's temp folder."""
        lightning = self.lightning_lora() if inputs.mode == MODE_LIGHTNING else None
        job = check_job(inputs, self.config, lightning, self.known_images, own=self.given(session))
        self.check_model_fit(job)
        return job

    def check_model_fit(self, job: Job) -> None:
        """What only the served model decides, checked before queueing: the sampler of its family, the LoRAs of its
        size and, once it is loaded, the prompt's tokens (UIError with the fix)."""
        model = self.config.model
        check_sampler(model, job.settings.mode)
        check_output_size(model, job.settings.width, job.settings.height)
        for name, _ in job.settings.loras():
            check_lora_size(model, self.lora_info(name))
        if self._editor is not None:
            check_prompt_tokens(self._editor, job.settings.prompt, self.config.max_prompt_tokens)

    def queue_eta(self, ahead: int) -> float | None:
        """Seconds until a job queued behind ``ahead`` others starts (None: nothing measured yet)."""
        return queue_eta(ahead, self.where, self.last_run_seconds)

    def request_stop(self, session: str | None = None) -> bool:
        """Stop ``session``'s generation: the running one at its next denoising step (True), a queued one as it
        starts (False). Another tab's generation is left alone; None stops whichever runs (API callers, tests)."""
        with self._stop_lock:
            if session is None or session == self._running:
                self._stop.set()
                return True
            self._stop_queued.add(session)
            return False

    def stopping(self, session: str | None) -> bool:
        """True while ``session``'s running generation has a Stop it has not reached yet."""
        with self._stop_lock:
            return self._stop.is_set() and self._running == session

    def forget_session(self, session: str | None) -> None:
        """A tab that went away: drop what it was given (a reload starts a new session)."""
        self._given.pop(session, None)

    def forget_stop(self, session: str | None) -> None:
        """Drop a Stop that found nothing left to stop (the generation had ended): it must not stop the next one."""
        with self._stop_lock:
            self._stop_queued.discard(session)

    def generate(self, inputs: GenerateInputs, progress: ProgressFn | None = None,
                 queued_at: float | None = None, session: str | None = None,
                 preview: PreviewFn | None = None) -> GenerateOutput:
        """Check, then run one edit per variation seed. Raises UIError for user mistakes, Stopped on a Stop before
        any variation finished (a later Stop keeps the finished ones and says where it stopped).

        ``session`` names the browser tab asking, so its Stop stops only its own generation. ``preview(before,
        image)`` gets a live preview every ``live_preview`` steps (the input at the preview's size, the preview).
        """
        from ..inference.editor import EditRequest

        report = progress or (lambda done, total, desc: None)
        job = self.check(inputs, session)
        s = job.settings
        lbm = s.mode == MODE_LBM
        folder = self.config.resolved_outputs_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**9:09d}"

        show = None if preview is None or not job.preview_every else previews(job.image, preview)

        def edit(seed: int, step) -> object:
            return editor.edit(EditRequest(
                images=[job.image, *job.references], mask=job.mask, scheduler=job.scheduler, sigmas=job.sigmas,
                max_prompt_tokens=self.config.max_prompt_tokens, progress=step, preview=show,
                preview_every=job.preview_every if show else 0, **request_fields(s.with_seed(seed))))

        with self._lock, self._running_as(session):
            if self._stop.is_set():  # stopped while queued: before any work
                log.info("generation stopped by the user before it started")
                raise Stopped("Stopped before it started; the settings are kept: press Generate to run again")
            started = time.time()
            if not self.loaded:
                report(0, 1, f"loading model {self.config.model} (first run only)")
            editor = self.editor()
            self.check_model_fit(job)
            editor.set_loras(job.loras)
            check_branches(editor)
            t0 = time.perf_counter()
            self.where = Where(total=len(job.seeds), steps=s.lbm_steps if lbm else s.steps)
            try:
                results, stopped = run_variations(job.seeds, edit, self.where.steps, self._stop, report, self.where)
            finally:
                self.where = None
            seconds = self.last_run_seconds = time.perf_counter() - t0
            saved = save_inputs(folder, job, results[0][1].image.size)
            entries = [save_entry(folder, job, s.with_seed(seed), result, saved, lora_dir=self.config.lora_dir,
                                  model_dir=self.model_dir) for seed, result in results]
            prune_temp_files(self.config.resolved_temp_dir, self.config.max_temp_bytes)
        first = results[0][1]
        if lbm and first.sub_image is None:
            raise RuntimeError("the editor returned no sub-stream image in LBM mode")
        log.info("generated %d image(s) in %.2f s (%s)%s", len(results), seconds, s.summary(),
                 f"; {stopped}" if stopped else "")
        status = status_line(job, first, seconds, started - (queued_at or started), len(results))
        return GenerateOutput(image=first.image, sub_image=first.sub_image if lbm else None, seed=s.seed,
                              status=f"{stopped} (the others were not made). {status}" if stopped else status,
                              result=first, entries=entries)

    @contextlib.contextmanager
    def _running_as(self, session: str | None):
        with self._stop_lock:
            self._stop.clear()
            self._running = session
            if session is not None and session in self._stop_queued:  # stopped while it waited in the queue
                self._stop_queued.discard(session)
                self._stop.set()
        try:
            yield
        finally:
            self._running = None
