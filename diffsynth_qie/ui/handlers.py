"""What the web UI's buttons do, as plain Python: testable without gradio or a browser.

``ui/app.py`` only lays out widgets and forwards their values here; everything that
can go wrong is decided in this module and the ones it uses:

- **Inputs** are checked by ``ui/job.py`` before anything is queued (mask semantics
  are those of ``qie edit --mask``: painted = white = may change; see ``ui/uploads.py``).
- **LoRA picker containment and labels**: ``ui/lora_picker.py``.
- **One model, many LoRAs**: the base model is loaded once (lazily, or in the
  background at launch: ``ui/model_holder.py``) and LoRAs are switched on it with ``Editor.set_loras``;
  ``load_count`` lets tests prove no reload happens.
- **Results** are PNGs with their settings in text chunks, kept in the UI's temp
  folder for download and for the session history (``ui/outputs.py``, ``ui/results.py``, ``ui/history.py``).
- **Settings** (each widget's value, its ``EditRequest`` field, ``qie edit`` flag, summary
  text and history restore) are declared once, in ``ui/settings.py``.
- **Stop** ends a running generation at its next denoising step, and only that tab's (``ui/sessions.py``).
  **Errors** become one-line messages (``ui/messages.user_message``); unexpected ones log their traceback on the
  server, never in the browser.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

from .config import UIConfig
from .lora_state import LoraChoices
from .job import GenerateInputs, Job, check_job, lightning_loras  # noqa: F401
from .lora_picker import LORA_SUFFIX, NO_LORA, LoraInfo, list_loras, lora_info, resolve_lora  # noqa: F401
from .messages import user_message  # noqa: F401 (imported from here by the callbacks)
from .model_fit import check_lora_size, check_output_size, check_prompt_tokens, check_sampler
from .model_holder import ModelHolder
from .outputs import GenerateOutput, save_entry, save_inputs, status_line
from .runner import PreviewFn, ProgressFn, Stopped, Where, previews, queue_eta, run_variations  # noqa: F401
from .sessions import TabSessions
from .settings import LBM_MAX_STEPS, MODE_FLOW, MODE_LBM, MODE_LIGHTNING, MODES, request_fields  # noqa: F401
from .uploads import UIError, prune_temp_files  # noqa: F401 (UIError: imported from here)

if TYPE_CHECKING:  # heavy imports (torch, diffsynth) stay out of `app_gradio.py --help`
    from ..inference.editor import Editor

log = logging.getLogger(__name__)


def check_branches(editor) -> None:
    """After a LoRA switch: every unmerged branch must sit where its layer's weight is (one on the host while the
    weight is on the GPU is copied at every forward, or fails; ``qie edit``'s preflight checks the same switch on
    the fake device). A ``RuntimeError`` (a bug, not the user's) before the edit runs."""
    from ..lora.branch import misplaced_branch

    dit = getattr(getattr(editor, "pipe", None), "dit", None)
    line = misplaced_branch(dit, "Editor.set_loras") if dit is not None else None
    if line is not None:
        raise RuntimeError(line)


class UIHandlers(ModelHolder, TabSessions, LoraChoices):
    """State behind one UI: the lazily loaded :class:`Editor` (``ui/model_holder.py``), each tab's files and Stop
    (``ui/sessions.py``) and the LoRA folder (``ui/lora_state.py``).

    ``editor_factory`` (tests) replaces ``Editor.from_preset``. Generation is
    serialised by a lock (the UI's queue already runs one at a time; the lock also
    covers API callers), because LoRA switching mutates the model in place. The
    model loads on first use or, with :meth:`start_background_load`, on a thread
    started at launch.
    """

    def __init__(self, config: UIConfig, editor_factory: Callable[[], "Editor"] | None = None):
        ModelHolder.__init__(self, config, editor_factory)
        TabSessions.__init__(self)
        self._lock = threading.Lock()        # one generation at a time
        self.where: Where | None = None      # the running generation (its time left: a queue's ETA)
        self.last_run_seconds: float | None = None  # the last generation's time, as measured
        self.known_images: frozenset[str] = frozenset()  # the examples' images, which the editor may be given

    # generate ---------------------------------------------------------------------------
    def check(self, inputs: GenerateInputs, session: str | None = None) -> Job:
        """Validate everything Generate needs without loading the model (UIError says what to fix). A browser
        ``session`` reads back only its own files (:meth:`give`); None (an in-process caller) the UI's temp folder."""
        with self.one_look() as folder:  # each LoRA header read once
            lightning = self.lightning_lora() if inputs.mode == MODE_LIGHTNING else None
            job = check_job(inputs, self.config, lightning, self.known_images, own=self.given(session), folder=folder)
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

    def generate(self, inputs: GenerateInputs, progress: ProgressFn | None = None,
                 queued_at: float | None = None, session: str | None = None,
                 preview: PreviewFn | None = None) -> GenerateOutput:
        """Check, then run one edit per variation seed. Raises UIError for user mistakes, Stopped on a Stop before
        any variation finished (a later Stop keeps the finished ones and says where it stopped).

        ``session`` names the browser tab asking, so its Stop stops only its own generation. ``preview(before,
        image)`` gets a live preview every ``live_preview`` steps (the input at the preview's size, the preview).
        """
        with self.one_look():  # the checks before and after the model loads read each LoRA header once
            return self._generate(inputs, progress, queued_at, session, preview)

    def _generate(self, inputs: GenerateInputs, progress: ProgressFn | None, queued_at: float | None,
                  session: str | None, preview: PreviewFn | None) -> GenerateOutput:
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
