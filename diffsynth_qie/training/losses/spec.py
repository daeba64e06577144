"""What a loss is: one registered object carrying its function, its own config and its capabilities.

Torchtitan's ``BaseLoss.Config`` pattern: everything the rest of the trainer needs to know about a
loss is declared once, next to the loss, as a :class:`LossSpec` (``SPEC`` at the end of ``sft.py`` and
``lbm.py``), and ``registry.py`` lists the specs. The ``--loss`` choices (``qie train``, ``qie plan``), the
config checks, the default optimizer, the validation sampler and the fake-device verify all read the
spec; nothing outside the registry compares loss names.

This module imports no torch (``qie --help`` builds the flags from the registry).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class LossSpec:
    """One loss: its name (``--loss NAME``), function, config and capabilities.

    ``fn(dit, batch, config, generator=None) -> (loss, metrics)`` (see ``sft.py``), importing torch only
    when called. ``config`` is the loss's own config dataclass: its fields become the flags of the group
    ``--loss NAME`` and it is held by ``RunConfig.<name>`` (a loss without knobs leaves it ``None``).
    """

    name: str
    summary: str                          # one line, shown in ``--loss``'s help
    fn: Callable[..., Any]
    config: Optional[type] = None         # the loss's own config dataclass (its flags), RunConfig.<name>
    bridge: bool = False                  # a bridge from a prior image (LBM: its sampler, cache fields, families
    #                                       with ``supports_lbm``); False: flow matching from noise
    stratified_sigma: bool = False        # accepts ``--timestep_sampling stratified`` (σ's drawn by timesteps.py)
    sigma_note: str = ""                  # how it draws its σ's otherwise (for the error naming the fix)
    default_optimizer: str = "adamw"      # when --optimizer is not given (training/config.py's OPTIMIZER_DEFAULTS)
    needs_rollouts: bool = False          # trains on samples the model generates during training
    preference: bool = False              # trains on chosen/rejected pairs (the cache's rejected_latents): two
    #                                       samples' activations per row and a reference pass (qie plan, verify)
    check: Optional[Callable[..., None]] = None  # check(run_config) from config_checks.validate: ValueError before any load
    check_data: Optional[Callable[..., None]] = None  # check_data(dataset) once the training rows are known, before
    #                                                   the DiT loads: ValueError naming the rows and the fix
    setup: Optional[Callable[..., None]] = None  # setup(module, cfg, preset, device, dtype, ds_config) after the
    #                                              module is built (e.g. LBM's pixel critic); None: nothing
    cfg_pass: bool = False                # runs a CFG pass with the cached empty prompt (dmd's teacher): qie plan
    #                                       counts it, the fake-device batch carries the negative
    distills: bool = False                # distils a frozen teacher LoRA with a second adapter (the fake score) and
    #                                       its own optimizer: qie plan counts them (memory/plan_distill.py)
    stand_in: Optional[Callable[..., Any]] = None  # stand_in(run_config, preset, blocks, folder) -> run_config:
    #                                                what qie plan --verify gives the loss in place of its files
    setup_loads_nothing: bool = False     # its setup reads no file: the fake-device verify runs it as is
    resolve: Optional[Callable[..., Any]] = None  # resolve(run_config) -> run_config: values the loss decides for
    #                                               the other areas (--loss dmd: its teacher as the frozen LoRA)
    check_launch: Optional[Callable[..., None]] = None  # check_launch(run_config, ds_config) before the DiT loads
    finish: Optional[Callable[..., None]] = None  # finish(run_config, lora_path) on the main process once the final
    #                                              LoRA is written (--loss dmd --merge_teacher: the stacked file)
    schedule: Optional[Callable[..., Any]] = None  # schedule(run_config, family) -> the DeclaredSchedule the
    #                                                trained LoRA declares (--loss dmd: the student's), or None
    teacher_cfg: Optional[Callable[..., float]] = None  # teacher_cfg(run_config, family) -> the CFG its frozen
    #                                                    teacher samples at: validation renders the teacher (every
    #                                                    trained adapter off) beside the trained model

    def __post_init__(self):
        if not self.name or not self.name.replace("_", "").isalnum():
            raise ValueError(f"a loss name is a flag value of letters, digits and _, got {self.name!r}")
        if self.config is not None and not dataclasses.is_dataclass(self.config):
            raise ValueError(f"loss {self.name!r}: config must be a dataclass, got {self.config!r}")

    def config_of(self, run_config) -> Any:
        """This loss's config from a run config (``RunConfig.<name>``; its defaults when absent)."""
        if self.config is None:
            return None
        value = getattr(run_config, self.name, None)
        if value is None:
            return self.config()
        if isinstance(value, dict):  # a RunConfig read back from JSON
            names = {f.name for f in dataclasses.fields(self.config)}
            return self.config(**{k: v for k, v in value.items() if k in names})
        return value

    @property
    def has_flags(self) -> bool:
        return self.config is not None and bool(dataclasses.fields(self.config))
