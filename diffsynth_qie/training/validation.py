"""Validation renders during training: a few held-out cache entries edited by the current model.

There is one sampler for inference and validation: this module only builds the
inputs and hands them to ``models.sampling`` exactly as ``Editor`` does, so a
validation image is what ``qie edit`` would produce with the same conditioning and
seed (tests/test_validation.py pins that).

Phase 2 has no text encoder, so the conditioning comes from the cache: each held-out
entry's prompt embedding (its first prompt alternative), its reference latents, its
empty-prompt embedding (the negative prompt when ``--validation_cfg_scale`` != 1), and
the run's ``zero_cond_t``. What is rendered follows the loss the module trains (its
own ``RunConfig``, so the trainer needs no extra wiring):

- ``--loss sft``: flow matching (``sample_flow_match`` + ``dit_velocity``,
  ``--validation_steps`` steps) from ``seeded_noise(seed=NOISE_SEED + k)`` for the k-th
  held-out entry: the same noise at every validation, so steps are comparable;
- ``--loss lbm``: 1-step bridge sampling (``sample_bridge``, bridge noise from the
  run's ``LBMConfig``) of both streams as the loss defines them
  (``lbm.stream_ends``): main from ``lbm_source_latents``, sub from the white-image
  ``sub_noise`` (``sub_noise_ref_gt`` -> ``ref_gt`` with ``--lbm_sub_target ref_gt``).
  A row without a source renders the sub-stream only.

Entries of equal shape are sampled as one batch. The DiT is called through the
*wrapped* training module (``module(predict=fn)`` runs ``fn(dit)`` inside its
forward), so DDP/DeepSpeed hooks fire and under ZeRO-3 every rank takes part; all
ranks call :meth:`Validator.run`. The trainer puts the weights users would get in
place around it (``validate_step``: ``eval()``, schedule-free average ``x``, then
back); the validator itself changes no weight, no training mode and no global RNG.

Each image is a strip [reference | target | output] (``side_by_side``; a loss with a frozen teacher, ``--loss
dmd``, adds the teacher before the output: it at ``--validation_steps`` and its CFG, the student at its own
steps), written
atomically to ``<output_dir>/validation/step-<n>/<k>-<entry>.png`` (LBM:
``<k>-<entry>_main.png`` and ``<k>-<entry>_sub.png``) and logged to WandB when it is
on. Each output is scored (``validation_metrics``: against its target, and the edit scorecard against its
source, and with ``--val_judge`` by a judge: ``val_judge``); the means are in :attr:`Validator.metrics` (the trainer logs them to ``loss.jsonl`` and WandB), each
output's in ``scores.jsonl`` beside the strips; the time taken is logged. The VAE side (loaded alone, lazily, only
when validation runs; reference and target panels decoded once and reused) is ``validation_decode.py``.
"""
from __future__ import annotations

import contextlib
import logging
import re
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
from PIL import Image

from ..cache.store import CacheEntry, CacheStore
from ..data.images import side_by_side
from ..utils.atomic import atomic_save
from .validation_decode import PanelDecoder
from .validation_metrics import SCORES_FILE, output_metrics, summarize, write_scores
from .tracking import VALIDATION_DIR
# (entry_seed and the job builders are imported from here by the preflight and the tests)
from .validation_sampling import Render, entry_seed, flow_match_jobs, lbm_jobs, sample_jobs  # noqa: F401

log = logging.getLogger(__name__)


def output_name(k: int, entry_id: str) -> str:
    """File stem of the k-th held-out entry's strip: ``<k>-<entry id, file-name safe>``."""
    return f"{k}-{_safe(entry_id)}"


class Validator:
    """Renders held-out entries every ``validate_every`` steps (see the module docstring)."""

    def __init__(self, store: CacheStore, indices: Sequence[int], output_dir: str, preset, model_dir: Optional[str],
                 num_steps: int, cfg_scale: float, zero_cond_t: bool, accelerator, dtype: torch.dtype):
        self.store = store
        self.indices = list(indices)
        self.output_dir = Path(output_dir) / VALIDATION_DIR
        self.preset = preset
        self.model_dir = model_dir
        self.num_steps = num_steps
        self.cfg_scale = cfg_scale
        self.zero_cond_t = zero_cond_t
        self.accelerator = accelerator
        self.dtype = dtype
        self.decoder = PanelDecoder(preset, model_dir, accelerator, dtype)  # the VAE, loaded on first use
        self._lpips = None  # loaded on the first validation; False when it cannot be
        self._judge = None  # --val_judge, built on the first validation; False without one
        self._teacher = None  # --loss dmd: the teacher's renders, made at the first validation
        self.metrics, self.row_scores = {}, {}  # of the last run (main process): means, and per output name

    def _objective(self, wrapped_module):
        """(a bridge loss: the LBM sampler, LBMConfig) of the loss the module trains (its resolved ``RunConfig``)."""
        from .losses.lbm import lbm_config_of
        from .losses.registry import loss_spec

        config = getattr(self.accelerator.unwrap_model(wrapped_module), "config", None)
        name = getattr(getattr(config, "loss", None), "loss", None)
        return name is not None and loss_spec(name).bridge, lbm_config_of(config)

    def schedule(self, wrapped_module) -> tuple[int, float, Optional[tuple]]:
        """(steps, cfg, sigmas) of the validation sampler: the frozen LoRA's declared schedule when the module
        trains on top of one (said once), else ``--validation_steps`` / ``--validation_cfg_scale``."""
        declared = getattr(self.accelerator.unwrap_model(wrapped_module), "frozen_schedule", None)
        if declared is None:
            return self.num_steps, self.cfg_scale, None
        if not getattr(self, "_said", False):
            self._said = True
            log.info("validation samples with the frozen LoRA's declared schedule (%s), not --validation_steps / "
                     "--validation_cfg_scale", declared.describe())
        grid = declared.grid()
        return len(grid), declared.cfg, grid

    @torch.no_grad()
    def render(self, wrapped_module, device, dtype, entries: Optional[Sequence[CacheEntry]] = None,
               teacher_cfg: Optional[float] = None) -> list[Render]:
        """Latents of every validation output; all ranks call this (the DiT runs collectively). With
        ``teacher_cfg``: the loss's frozen teacher instead (every trained adapter off), at ``--validation_steps``
        and that CFG."""
        from .losses.dmd_state import active_adapter

        if entries is None:
            entries = [self.store.load(i) for i in self.indices]
        names = [output_name(k, e.entry_id) for k, e in enumerate(entries)]
        is_lbm, lbm = self._objective(wrapped_module)
        jobs = lbm_jobs(entries, names, lbm.lbm_sub_target) if is_lbm else flow_match_jobs(entries, names, dtype)

        def teacher(fn):
            def off(dit):
                with active_adapter(dit, None):
                    return fn(dit)
            return off

        def run_dit(fn):
            return wrapped_module(predict=fn if teacher_cfg is None else teacher(fn))

        if teacher_cfg is None:
            steps, cfg, sigmas = self.schedule(wrapped_module)
        else:
            steps, cfg, sigmas = self.num_steps, teacher_cfg, None
        was_training = wrapped_module.training
        wrapped_module.eval()  # already so under the trainer; a no-op then
        try:
            return sample_jobs(run_dit, entries, jobs, lbm=is_lbm, steps=steps, cfg=cfg, zero_cond_t=self.zero_cond_t,
                               bridge_noise=lbm.lbm_bridge_noise, device=device, dtype=dtype, preset=self.preset,
                               sigmas=sigmas)
        finally:
            wrapped_module.train(was_training)

    @torch.no_grad()
    def run(self, step: int, wrapped_module, device, dtype, tag: str = "") -> dict:
        """Render, decode and save; all ranks call this. Returns {name: strip image} on the main process."""
        started = time.perf_counter()
        entries = [self.store.load(i) for i in self.indices]
        renders = self.render(wrapped_module, device, dtype, entries)
        teacher = self._teacher_renders(wrapped_module, device, dtype, entries)
        images, decoder = {}, self.decoder
        if self.accelerator.is_main_process or decoder.zero3():
            scores, self.row_scores, judged = [], {}, []
            with decoder.gathered():
                for r in renders:
                    entry = entries[r.entry]
                    which = "target" if r.target is entry.target_latents else "ref_gt"
                    panels = [decoder.panel((r.entry, which), r.target), decoder.decode(r.latents)]
                    beside = [decoder.panel((r.entry, "teacher"), teacher[r.name].latents)] if teacher else []
                    # every reference of the row, in order (a text-to-image row has none)
                    refs = [decoder.panel((r.entry, f"reference{k}"), z) for k, z in enumerate(entry.edit_latents)]
                    if self.accelerator.is_main_process:
                        mask = entry.back_mask if which == "target" else None
                        source = refs[0] if refs and which == "target" else None
                        values = output_metrics(panels[1], panels[0], mask, self._lpips_model(), source)
                        judged.append((values, self._judged(wrapped_module, self.indices[r.entry], source, panels[1],
                                                            r.name)))
                        scores.append((r.stream, values))
                        self.row_scores[r.name] = values
                    images[r.name] = side_by_side(refs + panels[:1] + beside + panels[1:])
            self._gather_judged(judged, step)
            self.metrics = summarize(scores)
        if self.accelerator.is_main_process:
            seconds = time.perf_counter() - started
            log.info("validation at step %d took %.1f s (%d output(s), %.2f s each); metrics: %s", step, seconds,
                     len(renders), seconds / max(1, len(renders)),
                     ", ".join(f"{k} {v:.4f}" for k, v in self.metrics.items()))
            folder = self.output_dir / f"step-{step}{tag}"
            for name, img in images.items():
                atomic_save(folder / f"{name}.png", lambda p, img=img: img.save(p))
            write_scores(folder / SCORES_FILE, self.row_scores)
            log.info("validation: %d image(s) [references | target | %soutput] in %s", len(images),
                     "teacher | " if teacher else "", folder)
            return images
        return {}

    def _teacher_renders(self, wrapped_module, device, dtype, entries) -> dict:
        """{name: render} of the loss's frozen teacher (``--loss dmd``), rendered at the first validation and kept
        (it does not train); {} for a loss without a teacher. All ranks call this."""
        cfg = getattr(self.accelerator.unwrap_model(wrapped_module), "teacher_cfg", None)
        if cfg is None:
            return {}
        if self._teacher is None:
            self._teacher = {r.name: r for r in self.render(wrapped_module, device, dtype, entries, teacher_cfg=cfg)}
            if self.accelerator.is_main_process:
                log.info("validation strips show the teacher (%d steps, CFG %g) beside the trained model",
                         self.num_steps, cfg)
        return self._teacher

    def _judged(self, wrapped_module, index: int, source: Optional[Image.Image], output: Image.Image, name: str):
        """The pending ``--val_judge`` verdict of an output with a source (the judge built on first use, from the
        module's ``RunConfig``; its rows are scored while the next are decoded), or None without a judge."""
        if self._judge is None:
            from ..metrics.judge_spec import build_judge

            config = getattr(self.accelerator.unwrap_model(wrapped_module), "config", None)
            spec = getattr(getattr(config, "train", None), "val_judge", None)
            self._judge = build_judge(spec, "--val_judge", getattr(config, "judge", None)) or False
        if not self._judge or source is None:
            return None
        return self._judge.submit(source, self.store.meta(index).prompts[0], output, name)

    def _gather_judged(self, judged: list, step: int) -> None:
        """Each output's judge scores into its metrics ({} where the judge gave none: metrics/judge.py never
        invents one), and one line naming the outputs it could not score."""
        pending = [(values, verdict) for values, verdict in judged if verdict is not None]
        for values, verdict in pending:
            values.update(verdict.result().scores)
        missed = self._judge.take_unscored() if self._judge else []
        if missed:
            from ..metrics.judge import unscored_line

            log.warning("validation at step %d: %s", step, unscored_line("--val_judge", missed, len(pending)))

    def _lpips_model(self):
        if self._lpips is None:
            from ..metrics.lpips import load_lpips

            self._lpips = load_lpips() or False
        return self._lpips or None


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:64]


def validate_step(run, step: int) -> None:
    """The training loop's validation at ``step`` (``run``: a ``run_setup.Run``): render with the weights users
    would get (schedule-free: the average x; ``--validate_with``: the raw weights, their EMA, or both), then
    train on."""
    from .optim import schedule_free_eval

    device, dtype = run.module.compute_device_dtype()
    which = run.cfg.train.validate_with if run.ema is not None else "raw"
    run.wrapped.eval()
    for tag in {"raw": ("",), "ema": ("-ema",), "both": ("", "-ema")}[which]:
        with schedule_free_eval(run.optimizer, run.engine), \
                (run.ema.applied(run.module) if tag else contextlib.nullcontext()):
            images = run.validator.run(step, run.wrapped, device, dtype, tag=tag)
        run.tracker.log_validation(step, {f"{k}{tag.replace('-', '_')}": v for k, v in run.validator.metrics.items()})
        run.tracker.log_images(step, images)
    run.wrapped.train()
