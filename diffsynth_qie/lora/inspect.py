"""What a LoRA file holds, and where it loads: as-is, after ``qie export-lora --format X``, or not (and why).

"As-is" comes from the file's own keys and metadata, read as each runtime's loader reads them
(``runtime_reads``): every module applied at the file's scale, every full weight applied, nothing refused. What
the export would write, or why it cannot, comes from the same check as the export (``export_check``).
"""
from __future__ import annotations

import math
import os
import re
from collections import Counter
from typing import Any

from .export_check import plan_export
from .export_targets import EXPORT_TARGETS
from .runtime_reads import READERS, FileKeys
from .state import LoraState, listing

_SCHEDULE_KEYS = ("step", "steps", "weights", "schedule", "sigma", "shift", "timestep", "loss", "lbm")


def module_kind(name: str) -> str:
    """``transformer_blocks.7.attn.to_q`` -> ``attn.to_q`` (the block index dropped)."""
    return re.sub(r"^transformer_blocks\.\d+\.", "", name)


def reading_problems(state: LoraState, keys: FileKeys, fmt: str, family: str) -> list[str]:
    """What runtime ``fmt``'s loader does not apply of the file as the LoRA means it, on ``family``'s model."""
    from .adapter_metadata import ADAPTER_METADATA_KEY
    from .resolve import linear_names

    runtime, out = EXPORT_TARGETS[fmt].runtime, []
    for label, reading in READERS[fmt](keys, linear_names(state, family), family):
        where = f" on {label}" if label else ""
        if reading.refused:
            out.append(f"{runtime} refuses the whole file{where}: {reading.refused}")
            continue
        missing = sorted(n for n in state.modules if n not in reading.loaded)
        if missing:
            out.append(f"{len(missing)} of its {len(state.modules)} modules not loaded{where}: {listing(missing)}")
        lost = sorted(n for n in state.full if n not in reading.full)
        if lost:
            out.append(f"{len(lost)} full weight(s) not applied{where}: {listing(lost)}")
        wrong = sorted(n for n, m in state.modules.items()
                       if n in reading.loaded and not math.isclose(reading.loaded[n], m.scale, rel_tol=1e-6))
        if wrong:
            n = wrong[0]
            why = (f"; the alpha is only in the file's metadata ({ADAPTER_METADATA_KEY}), which {runtime} does not "
                   "read" if not keys.alphas and ADAPTER_METADATA_KEY in keys.metadata else "")
            out.append(f"{len(wrong)} module(s) applied at another scale{where} ({n}: {reading.loaded[n]:.4g} × B·A "
                       f"instead of {state.modules[n].scale:.4g}{why})")
    return out


def runtime_row(state: LoraState, fmt: str, keys: FileKeys) -> dict[str, Any]:
    """One runtime's verdict on a file (``keys``: as written; ``state``: as our reader reads it, resolved):
    ``status`` "as-is" / "export" / "cannot", and why."""
    target = EXPORT_TARGETS[fmt]
    row = {"runtime": target.runtime, "format": fmt}
    try:
        plan = plan_export(state, fmt)
    except ValueError as e:
        return {**row, "status": "cannot", "why": str(e)}
    if plan.dropped or plan.dropped_full:
        return {**row, "status": "cannot", "why": f"would not load {plan.dropped_clause()} (qie export-lora --format "
                                                  f"{fmt} --drop_unsupported writes the rest)"}
    problems = [p for family in plan.families for p in reading_problems(state, keys, fmt, family)]
    if not problems:
        return {**row, "status": "as-is", "why": ""}
    return {**row, "status": "export", "why": f"{'; '.join(problems)}: qie export-lora --format {fmt}"}


def describe(path: str | os.PathLike) -> dict[str, Any]:
    """``qie inspect-lora``'s facts about one LoRA file, JSON-able."""
    from .export_check import families_of
    from .formats import parse_lora_state_dict, read_lora_file
    from .resolve import resolved

    tensors, metadata = read_lora_file(path)
    state = resolved(parse_lora_state_dict(tensors, metadata, source=str(path)))
    keys = FileKeys.of(tensors, metadata)
    families = families_of(state)
    ranks = sorted(state.ranks)
    alphas = sorted({m.alpha for m in state.modules.values() if m.alpha is not None})
    meta = state.metadata
    return {
        "file": str(path), "format": state.format, "families": families, "preset": meta.get("preset"),
        "ranks": ranks, "alphas": alphas or None, "modules": len(state.modules),
        "modules_by_kind": dict(sorted(Counter(module_kind(n) for n in state.modules).items())),
        "full_weights": sorted(state.full),
        "schedule": {k: v for k, v in meta.items() if k != "full_weights"
                     and any(s in k.lower() for s in _SCHEDULE_KEYS)} or None,
        "runtimes": [runtime_row(state, fmt, keys) for fmt in EXPORT_TARGETS],
    }


def describe_text(info: dict[str, Any]) -> str:
    lines = [f"{info['file']}: {info['format']} LoRA for {' / '.join(info['families'])}"
             + (f" (preset {info['preset']})" if info["preset"] else ""),
             f"rank {', '.join(map(str, info['ranks'])) or '-'}; alpha "
             f"{', '.join(f'{a:g}' for a in info['alphas']) if info['alphas'] else '= rank (scale 1)'}; "
             f"{info['modules']} module(s), {len(info['full_weights'])} full weight(s)"]
    lines += [f"  {kind}: {n}" for kind, n in info["modules_by_kind"].items()]
    if info["schedule"]:
        lines.append("schedule: " + ", ".join(f"{k}={v}" for k, v in info["schedule"].items()))
    words = {"as-is": "loads as-is", "export": "loads after", "cannot": "cannot"}
    for row in info["runtimes"]:
        lines.append(f"{row['runtime']:<13} {words[row['status']]}" + (f" — {row['why']}" if row["why"] else ""))
    return "\n".join(lines)
