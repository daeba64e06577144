"""What a LoRA file holds, and where it loads: as-is, after ``qie export-lora --format X``, or not (and why).

The rows come from the rules table ``export_targets`` through the same check as the export (``export_check``).
"""
from __future__ import annotations

import os
import re
from collections import Counter
from typing import Any

from .export_check import plan_export
from .export_targets import EXPORT_TARGETS
from .state import LoraState

_SCHEDULE_KEYS = ("step", "steps", "weights", "schedule", "sigma", "shift", "timestep", "loss", "lbm")


def module_kind(name: str) -> str:
    """``transformer_blocks.7.attn.to_q`` -> ``attn.to_q`` (the block index dropped)."""
    return re.sub(r"^transformer_blocks\.\d+\.", "", name)


def runtime_row(state: LoraState, fmt: str) -> dict[str, Any]:
    """One runtime's verdict: ``status`` "as-is" / "export" / "cannot", and why."""
    target = EXPORT_TARGETS[fmt]
    try:
        plan = plan_export(state, fmt)
    except ValueError as e:
        return {"runtime": target.runtime, "format": fmt, "status": "cannot", "why": str(e)}
    if plan.dropped:
        return {"runtime": target.runtime, "format": fmt, "status": "cannot",
                "why": f"{len(plan.dropped)} module(s), {plan.dropped_share:.1%} of the delta, not loaded: "
                       f"{plan.dropped_listing()} (qie export-lora --format {fmt} --drop_unsupported writes the rest)"}
    rules = [target.rule(f) for f in plan.families if target.rule(f) is not None]
    alphas_ok = not target.alpha_folded or all(m.alpha is None or m.alpha == m.rank for m in state.modules.values())
    if alphas_ok and all(state.format in r.as_is for r in rules):
        return {"runtime": target.runtime, "format": fmt, "status": "as-is", "why": ""}
    why = "alpha must be folded" if not alphas_ok else f"{target.runtime} does not read {state.format} keys"
    return {"runtime": target.runtime, "format": fmt, "status": "export",
            "why": f"{why}: qie export-lora --format {fmt}"}


def describe(path: str | os.PathLike) -> dict[str, Any]:
    """``qie inspect-lora``'s facts about one LoRA file, JSON-able."""
    from .resolve import resolved
    from .export_check import families_of
    from .formats import load_lora_state

    state = resolved(load_lora_state(path))
    families = families_of(state)
    ranks = sorted(state.ranks)
    alphas = sorted({m.alpha for m in state.modules.values() if m.alpha is not None})
    meta = state.metadata
    return {
        "file": str(path), "format": state.format, "families": families, "preset": meta.get("preset"),
        "ranks": ranks, "alphas": alphas or None, "modules": len(state.modules),
        "modules_by_kind": dict(sorted(Counter(module_kind(n) for n in state.modules).items())),
        "full_weights": sorted(state.full),
        "schedule": {k: v for k, v in meta.items() if any(s in k.lower() for s in _SCHEDULE_KEYS)} or None,
        "runtimes": [runtime_row(state, fmt) for fmt in EXPORT_TARGETS],
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
