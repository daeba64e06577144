"""Few-step distillation of a task LoRA (``--loss dmd``): DMD2 (Yin et al. 2024), ``docs/DISTILL.md``.

The teacher is the base with the user's task LoRA (``--teacher_lora``, attached frozen and unmerged as
``--frozen_lora`` is) sampled at ``--teacher_cfg``; the student a new LoRA on top of both, sampling in
``--student_steps`` steps at CFG 1 on the fixed grid it declares (``dmd_math.student_sigmas``); the fake score a
second adapter on the same DiT (``dmd_state.py``). Per sample of a batch, the loss

1. draws noise and one of the student's steps ``i`` (DMD2's backward simulation: the student runs its first
   ``i`` steps without a graph, then the step ``i`` with one), and takes the student's clean prediction ``x``;
2. fits the fake score to ``x`` by flow matching, ``--dmd_fake_updates`` optimizer steps of its own;
3. noises ``x`` to a σ drawn uniformly in [0.02, 0.98], runs the teacher with CFG and the fake score there
   (no graph), and returns ``½‖x − sg(x − ∇)‖²`` with DMD's normalised gradient ``∇`` (``dmd_math.py``);
4. with ``--dmd_regression_weight``: adds the squared error of the student's sample of a fixed noise per row to
   the teacher's sample of it (computed once per row, full steps at its CFG).

The student sees the cache's references, prompt and (``--mask_loss_weights``) mask, as an edit does; 2511 keeps
``zero_cond_t``, and 2.1's sampler reuses the references' prefix KV cache. Torch-free at import.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from ...utils.config_cli import cli_help
from .spec import LossSpec

DMD_SIGMA_RANGE = (0.02, 0.98)  # the σ the student's output is noised to (DMD2's t in [20, 980] of 1000)


@dataclass
class DMDConfig:
    """Few-step distillation (used with --loss dmd)."""

    teacher_lora: Optional[str] = field(default=None, metadata=cli_help(
        "--loss dmd: the task LoRA to distil (the teacher: base + this LoRA, attached frozen and unmerged); the "
        "student is trained on top of it and records it", metavar="FILE"))
    teacher_cfg: Optional[float] = field(default=None, metadata=cli_help(
        "--loss dmd: the teacher's CFG scale; default: the family's (4 for Qwen-Image-Edit, 1 for 2.1)",
        min=0.0, max=100.0))
    student_steps: int = field(default=4, metadata=cli_help(
        "--loss dmd: the student's sampling steps at CFG 1, on a fixed σ grid it declares (1-8)", min=1, max=8))
    dmd_fake_updates: int = field(default=5, metadata=cli_help(
        "--loss dmd: optimizer steps of the fake score per sample of each step (DMD2's two time-scale rule)",
        min=1, max=100))
    dmd_fake_lr: Optional[float] = field(default=None, metadata=cli_help(
        "--loss dmd: the fake score's learning rate (AdamW); default: --learning_rate with adamw, else 1e-4",
        min=0.0))
    dmd_regression_weight: float = field(default=0.0, metadata=cli_help(
        "--loss dmd: weight of a regression of the student's sample of a fixed noise per row to the teacher's "
        "(the teacher's sample made once per row); 0 = off", min=0.0, max=1e6))
    merge_teacher: bool = field(default=False, metadata=cli_help(
        "--loss dmd: also write lora_merged.safetensors, one LoRA holding the teacher's and the student's deltas "
        "(load one file, get the few-step edit)"))

    def __post_init__(self):
        if not 1 <= int(self.student_steps) <= 8:
            raise ValueError(f"--student_steps {self.student_steps}: the student samples in 1 to 8 steps")


def dmd_config_of(config) -> DMDConfig:
    return SPEC.config_of(config)


def teacher_cfg_of(c: DMDConfig, family) -> float:
    return float(family.default_cfg if c.teacher_cfg is None else c.teacher_cfg)


def validation_teacher_cfg(cfg, family) -> float:
    """The teacher's CFG (``--teacher_cfg``, else the family's), for validation's teacher panel."""
    return teacher_cfg_of(dmd_config_of(cfg), family)


def check_dmd(cfg) -> None:
    """``--loss dmd``'s flags, before anything loads: a teacher LoRA that is there, of this family, not a few-step
    LoRA itself, and not given twice."""
    from pathlib import Path

    from ...lora.frozen import check_frozen_family
    from ...models.presets import PRESETS, family_of
    from ...models.samplers.declared import declared_schedule, read_metadata

    c = dmd_config_of(cfg)
    if not c.teacher_lora:
        raise ValueError("--loss dmd needs --teacher_lora FILE: the task LoRA to distil (trained with qie train)")
    if not Path(c.teacher_lora).is_file():
        raise ValueError(f"--teacher_lora {c.teacher_lora} is not a file; give the path of a .safetensors LoRA")
    if cfg.lora.frozen_lora and Path(cfg.lora.frozen_lora).resolve() != Path(c.teacher_lora).resolve():
        raise ValueError("--loss dmd attaches --teacher_lora as the frozen LoRA; drop --frozen_lora")
    metadata = read_metadata(c.teacher_lora)
    family = family_of(cfg.train.model).name if cfg.train.model in PRESETS else None
    check_frozen_family(c.teacher_lora, metadata, family)
    schedule, where = declared_schedule(c.teacher_lora, metadata)
    if schedule is not None:
        raise ValueError(f"--teacher_lora {c.teacher_lora} is already a few-step LoRA ({where}: "
                         f"{schedule.describe()}); distil the task LoRA trained at the model's own schedule")


def resolve_dmd(cfg):
    """The teacher as the run's frozen LoRA (scale 1): attached, recorded and checked on resume as one."""
    c = dmd_config_of(cfg)
    return dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, frozen_lora=c.teacher_lora,
                                                             frozen_lora_scale=1.0))


def check_launch(cfg, ds_config) -> None:
    from .common import refuse_zero3

    refuse_zero3(ds_config, "--loss dmd", "its two adapters are switched on the whole LoRA layers of every rank")


def student_schedule(cfg, family):
    """The schedule the student declares: its steps, CFG 1 and its σ grid."""
    from ...models.samplers.declared import DeclaredSchedule
    from .dmd_math import student_sigmas

    steps = dmd_config_of(cfg).student_steps
    return DeclaredSchedule(steps, 1.0, student_sigmas(steps), family=family, line="dmd student")


def teacher_stand_in(cfg, preset, blocks, folder: str):
    """``qie plan --verify``'s teacher: a LoRA of zeros at the run's rank on its targets in the first ``blocks``
    blocks of ``preset``'s DiT (None: all; the step attaches those), written to ``folder``."""
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    from ...memory.census import build_dit

    with torch.device("meta"):
        dit = build_dit(preset, blocks)
    targets, rank = list(cfg.lora.lora_target_modules or preset.lora_target_modules), max(1, cfg.lora.lora_rank)
    tensors = {}
    for name, m in dit.named_modules():
        if isinstance(m, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            tensors[f"{name}.lora_A.weight"] = torch.zeros(rank, m.in_features, dtype=torch.bfloat16)
            tensors[f"{name}.lora_B.weight"] = torch.zeros(m.out_features, rank, dtype=torch.bfloat16)
    path = str(Path(folder) / "teacher-stand-in.safetensors")
    save_file(tensors, path, metadata={"preset": preset.name})
    return dataclasses.replace(cfg, dmd=dataclasses.replace(dmd_config_of(cfg), teacher_lora=path))


def write_merged(cfg, lora_path) -> None:
    """``--merge_teacher``: ``lora_merged.safetensors`` beside the student, the teacher's and its deltas in one."""
    import logging
    from pathlib import Path

    from ...lora.stack import stack_files

    c = dmd_config_of(cfg)
    if c.merge_teacher:
        out = stack_files(c.teacher_lora, lora_path, Path(lora_path).with_name("lora_merged.safetensors"))
        logging.getLogger(__name__).info("--merge_teacher: teacher and student in one LoRA: %s", out)


def attach_fake_score(module, cfg, preset, device, dtype, ds_config) -> None:
    """Run set-up: the fake score's adapter on the module's DiT and its optimizer."""
    from .dmd_state import DMDState, add_fake_adapter

    check_launch(cfg, ds_config)
    c, lo = dmd_config_of(cfg), cfg.lora
    fake = add_fake_adapter(module.dit, lo.lora_rank, lo.lora_alpha, lo.lora_target_modules)
    own = cfg.optim.learning_rate if cfg.optim.optimizer == "adamw" else None  # (prodigy_sf's lr is a multiplier)
    lr = c.dmd_fake_lr if c.dmd_fake_lr is not None else (own or 1e-4)
    module.loss_extras["dmd"] = DMDState(module.dit, fake, c.dmd_fake_updates, lr, module.declared_schedule())


def dmd_loss_fn(dit, batch: dict, config, generator=None, dmd=None):
    """DMD2's loss of a batch (the module docstring); ``dmd``: the run's :class:`~.dmd_state.DMDState`."""
    import torch

    from ...models.family_ops import ops_for
    from ...models.presets import family_of
    from .common import pixel_weights
    from .dmd_sample import Roles

    if dmd is None:
        raise ValueError("--loss dmd needs its fake score; the loss's set-up (attach_fake_score) did not run")
    c = dmd_config_of(config)
    ops = ops_for(family_of(config.train.model))
    roles = Roles(dit, ops, batch, config, dmd, generator, student_steps=c.student_steps,
                  teacher_cfg=teacher_cfg_of(c, ops.family), sigma_range=DMD_SIGMA_RANGE)
    n = len(batch["target_latents"])
    pixel_w = pixel_weights(config.loss.mask_loss_weights, batch.get("back_mask"), n)
    losses, dmd_losses, fake_losses, regressions = [], [], [], []
    for b in range(n):
        _, dmd_b, fake_b = roles.distribution_matching(b, pixel_w[b])
        dmd_losses.append(dmd_b.detach())
        loss_b = dmd_b
        if c.dmd_regression_weight > 0:
            reg = roles.regression(b)
            regressions.append(reg.detach())
            loss_b = loss_b + c.dmd_regression_weight * reg
        losses.append(loss_b)
        fake_losses.append(fake_b)
    metrics = {"dmd_loss": torch.stack(dmd_losses).mean(), "fake_loss": torch.stack(fake_losses).mean()}
    if regressions:
        metrics["regression"] = torch.stack(regressions).mean()
    return torch.stack(losses).mean(), metrics


SPEC = LossSpec(
    name="dmd", summary="DMD2 few-step distillation of --teacher_lora into a student LoRA (--student_steps, CFG 1)",
    fn=dmd_loss_fn, config=DMDConfig, sigma_note="draws the student's steps on its own grid and DMD's σ uniformly",
    cfg_pass=True, distills=True, stand_in=teacher_stand_in, check=check_dmd, setup=attach_fake_score, setup_loads_nothing=True, resolve=resolve_dmd,
    check_launch=check_launch, schedule=student_schedule, finish=write_merged,
    teacher_cfg=validation_teacher_cfg)
