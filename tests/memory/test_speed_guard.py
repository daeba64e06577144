"""The speed guard: one block of the default training steps (2511, 2.1) and of a 2511 edit step, at full width on
the fake device, holds to a budget of bytes moved and kernels launched (docs/SPEED.md).

Budgets, not exact numbers: a speed-up passes, a change that adds casts or copies fails with the operators and
the lines of our code whose bytes grew. The budgets sit about 5 % above today's counts. The last test plants a
regression of the kind the guard is for: PEFT's fp32 copy of every adapted input left on (as the benchmarks had
it), which moves about 4.7 GB more per block.
"""
from __future__ import annotations

import dataclasses

import pytest

from diffsynth_qie.fakegpu.costs import CostCounter, Profile, top_frames
from diffsynth_qie.models.presets import get_preset

GB = 1e9
# per block, one step (forward, backward, optimizer) or one denoising step (CFG batch of 2)
BUDGETS = {
    "2511 train": {"bytes": 41.0 * GB, "kernels": 785},       # counted: 39.1 GB, 746 kernels (autocast: 46.8, 808)
    "2.1 train": {"bytes": 55.0 * GB, "kernels": 430},        # counted: 52.4 GB, 408 kernels (autocast: 63.4, 444)
    "2511 edit step": {"bytes": 6.0 * GB, "kernels": 225},    # counted: 5.7 GB, 214 kernels (512², CFG batch 2)
}


def run_config(model: str, **train):
    from diffsynth_qie.training.config import RunConfig

    cfg = RunConfig()
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, model=model, cache_dir="-", output_dir="-",
                                                             **train))
    return cfg.resolved(get_preset(model))


def train_block(model: str, cfg=None) -> Profile:
    """One block's counted kernels of ``model``'s default training step (1024² + one reference, 300 tokens)."""
    from diffsynth_qie.preflight.train_step import STEP_SECTIONS, batch_shapes, verify_train_step

    cfg = cfg or run_config(model)
    shapes = batch_shapes(1024, 1, 300, 1, multiple=32 if model.startswith("2.1") else 16)
    one, two = (verify_train_step(cfg, get_preset(model), shapes, num_layers=n, costs=CostCounter(frames=True)).costs
                for n in (1, 2))
    return _only(two.combine(one, -1.0), STEP_SECTIONS)


def edit_block() -> Profile:
    """One block's counted kernels of one later denoising step of a 512² 2511 edit (CFG 4)."""
    from diffsynth_qie.preflight.edit_step import verify_edit

    one, two = (verify_edit(get_preset("2511"), resolution=512, steps=2, cfg=4.0, num_layers=n,
                            costs=CostCounter(frames=True), prompt_pass=False).costs  # (the encode is not judged)
                for n in (1, 2))
    return _only(two.combine(one, -1.0), ("denoise_next",))


def _only(profile: Profile, sections) -> Profile:
    return Profile({k: g for k, g in profile.groups.items() if k[0] in sections}, profile.frames)


def check(name: str, block: Profile) -> None:
    """Raise naming what grew when ``block`` moves more bytes or launches more kernels than its budget."""
    moved, kernels = block.total(), block.kernels()
    budget = BUDGETS[name]
    if moved <= budget["bytes"] and kernels <= budget["kernels"]:
        return
    top = "\n".join(f"  {op} at {line}: {b / GB:.2f} GB" for (op, line), b in top_frames(block, 8))
    raise AssertionError(f"{name}: one block moves {moved / GB:.2f} GB in {kernels:.0f} kernels, over its budget of "
                         f"{budget['bytes'] / GB:.1f} GB and {budget['kernels']} kernels; the elementwise kernels "
                         f"moving the most bytes (op, our line):\n{top}")


def test_a_2_1_training_step_holds_its_budget():
    check("2.1 train", train_block("2.1"))


def test_an_edit_step_holds_its_budget_of_bytes_and_kernels():
    check("2511 edit step", edit_block())


@pytest.fixture(scope="module")
def block_2511():
    return train_block("2511")


def test_a_2511_training_step_holds_its_budget(block_2511):
    check("2511 train", block_2511)


def test_the_guard_names_the_casts_of_a_planted_regression(monkeypatch):
    from diffsynth_qie.training.module import QIETrainingModule

    monkeypatch.setattr(QIETrainingModule, "disable_lora_input_casting", lambda self: None)  # PEFT's fp32 copies on
    with pytest.raises(AssertionError, match=r"(?s)2511 train: one block moves .* over its budget.*_to_copy at "
                                             r"\S+\.py:\d+"):
        check("2511 train", train_block("2511"))


def test_the_guard_fails_when_autocast_over_fp32_adapters_comes_back():
    """The step before pure bf16 (autocast: fp32 norms and modulation, cast again for every consumer) is over the
    budget, naming the casts."""
    with pytest.raises(AssertionError, match=r"(?s)2511 train: one block moves .* over its budget.*_to_copy at "
                                             r"\S+\.py:\d+"):
        check("2511 train", train_block("2511", run_config("2511", compute_precision="autocast")))
