"""``qie train --export FORMATS``: each runtime's export of the trained LoRA, checked when the run starts and
written beside ``lora.safetensors`` when it ends.

Before anything loads, :func:`check_exports` asks the export check itself (``lora/export_check.plan_export``, the
rules of ``lora/export_targets.py``) about the LoRA this run will write: the modules its targets name in one block
of the family's DiT (built on the meta device) and its fully trained weights. A format whose runtime would leave
some of them out stops the run there, naming them and the ways out (``--lora_targets serving``, another
``--export``, or ``--drop_unsupported``, which writes the format without them); training to the end and failing
then would leave the later formats unwritten. :func:`write_exports` writes them after the last step.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

log = logging.getLogger(__name__)

_BLOCK = re.compile(r"^transformer_blocks\.(\d+)(?=\.|$)")


def planned_lora(cfg, preset):
    """A stand-in of the LoRA ``cfg`` (a resolved ``RunConfig``) trains on ``preset``: its modules in one block
    (rank 1, zeros: the export check reads names and shapes) and its full weights, under the same names."""
    import inspect

    import torch

    from ..lora.state import LoraModule, LoraState
    from ..models.family import get_family

    cls = get_family(preset.family).component_type("dit")
    kwargs = {"use_additional_t_cond": True} if "use_additional_t_cond" in inspect.signature(cls).parameters else {}
    with torch.device("meta"):
        dit = cls(num_layers=1, **kwargs)
    lo = cfg.lora
    targets = list(lo.lora_target_modules or []) if lo.lora_rank > 0 else []
    modules = {n: LoraModule(A=torch.zeros(1, m.in_features), B=torch.zeros(m.out_features, 1))
               for n, m in dit.named_modules() if isinstance(m, torch.nn.Linear) and _target_of(n, targets)}
    full = {}
    for prefix in lo.full_finetune_modules or []:
        block = _BLOCK.match(prefix)
        probe = _BLOCK.sub("transformer_blocks.0", prefix) if block else prefix
        for name, _ in dit.named_parameters():
            if name == probe or name.startswith(probe + "."):
                full[_BLOCK.sub(f"transformer_blocks.{block.group(1)}", name) if block else name] = torch.zeros(1)
    return LoraState(modules=modules, full=full, source="of this run", metadata={"preset": preset.name})


def _target_of(module: str, targets: list[str]) -> str | None:
    """The target suffix that names ``module`` (PEFT's matching: the whole name or a dotted suffix), or None."""
    return next((t for t in targets if module == t or module.endswith("." + t)), None)


def check_exports(cfg, preset) -> None:
    """Every ``--export`` format against what this run trains, before anything loads (ValueError: the modules its
    runtime would leave out and the fixes; with ``--drop_unsupported`` logged instead)."""
    from ..lora.export_check import plan_export
    from ..lora.export_targets import export_names, export_target

    lo = cfg.lora
    formats = export_names(lo.export)
    if not formats:
        if lo.drop_unsupported:
            log.warning("--drop_unsupported only means something with --export; ignored")
        return
    state = planned_lora(cfg, preset)
    targets = list(lo.lora_target_modules or [])
    for fmt in formats:
        try:
            plan = plan_export(state, fmt)
        except ValueError as exc:  # (the check's words are `qie export-lora`'s: its --format is our --export)
            said = str(exc).removeprefix(f"--format {fmt}: ").replace("--format", "--export")
            raise ValueError(f"--export {fmt} cannot be written for this run: {said}") from None
        if not plan.dropped:
            continue
        left = sorted({_target_of(n, targets) for n in plan.dropped if n in state.modules})
        serving = "train with --lora_targets serving (the modules every runtime loads), " if left else ""
        if any(n in state.full for n in plan.dropped):
            left.append(f"the full weights of {', '.join(lo.full_finetune_modules)}")
        what = f"{export_target(fmt).runtime} would not load {', '.join(left)}, which this run trains"
        if lo.drop_unsupported:
            log.info("--export %s --drop_unsupported: %s; its export will leave them out", fmt, what)
            continue
        raise ValueError(f"--export {fmt}: {what}; {serving}drop {fmt} from --export, or pass --drop_unsupported "
                         "to write it without them")


def write_exports(cfg, lora_path: str | Path) -> list[Path]:
    """After the last step: each ``--export`` format beside ``lora_path`` (the main process only)."""
    from ..lora.export import export_beside

    return export_beside(lora_path, cfg.lora.export, drop_unsupported=cfg.lora.drop_unsupported)
