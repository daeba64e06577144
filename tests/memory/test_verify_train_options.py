"""`qie train`'s options under the fake-device check: each runs the code a GPU run takes, a bug behind a flag is
caught at its line, the launch scripts' training configurations pass, and the memory verdict judges the whole DiT.

One full-width block (two for the preflight's pair) at 512² keeps each case to seconds.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from diffsynth_qie.models.presets import get_preset

ROOT = Path(__file__).resolve().parents[2]
GiB = 1024 ** 3


def run_config(model="2511", loss="sft", mask=None, optimizer=None, **train):
    from diffsynth_qie.training.config import RunConfig

    cfg = RunConfig()
    cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, model=model, cache_dir="-", output_dir="-", **train),
        loss=dataclasses.replace(cfg.loss, loss=loss, mask_loss_weights=mask),
        optim=dataclasses.replace(cfg.optim, optimizer=optimizer))
    return cfg.resolved(get_preset(model))


def step(cfg, model="2511", layers=1, batch=1):
    from diffsynth_qie.preflight.train_step import batch_shapes, verify_train_step

    family_divisor = 32 if model.startswith("2.1") else 16
    return verify_train_step(cfg, get_preset(model), batch_shapes(512, 1, 40, batch, mixed=batch > 1,
                                                                  multiple=family_divisor), num_layers=layers)


def test_the_ema_is_built_on_the_device_updated_and_swapped_in_for_validation():
    plain = step(run_config())
    ema = step(run_config(ema_decay=0.999, validate_every=5, validate_with="both"))
    from diffsynth_qie.memory.census import build_dit
    from diffsynth_qie.training.module import QIETrainingModule

    with torch.device("meta"):
        trainable = sum(p.numel() for _, p in QIETrainingModule(build_dit(get_preset("2511"), 1), run_config(),
                                                                 "2511").trainable_named_parameters())
    assert abs(ema.weights - plain.weights - 4 * trainable) <= 64  # the fp32 average beside the weights
    assert ema.validation_peak > ema.after_step  # the render's working set and the EMA swap's saved weights


@pytest.mark.parametrize("model", ["2511", "2.1"])
def test_validation_renders_through_the_real_sampler_on_the_device(model):
    r = step(run_config(model=model, validate_every=1, validation_cfg_scale=4.0), model=model)
    assert r.validation_peak > r.after_step
    assert r.peak >= r.validation_peak


@pytest.mark.parametrize("model", ["2511", "2.1"])
def test_lbm_runs_its_real_default_optimizer_step(model):
    """ProdigyPlusScheduleFree's step runs (its own host reads answered); its state is measured, not assumed.
    On 2.1 the bridge goes through the family's DiT call (its stand-in, the references in the prefix)."""
    cfg = run_config(model=model, loss="lbm", mask=(1.0, 0.5))
    assert cfg.optim.optimizer == "prodigy_sf"
    r = step(cfg, model=model)
    assert r.notes == [] and r.optimizer_state > 0 and r.optimizer_peak >= r.after_step


def test_a_host_read_of_ours_is_still_caught_beside_the_optimizers_own(monkeypatch):
    from diffsynth_qie.fakegpu.device import FakeRunError
    from diffsynth_qie.training import optim

    real = optim.build_optimizer

    def syncing(params, config):
        built = real(params, config)
        step_fn = built.step

        def step_and_read(*a, **k):
            out = step_fn(*a, **k)
            float(next(iter(built.param_groups[0]["params"])).sum())  # ours: a host read after the step
            return out
        built.step = step_and_read
        return built

    monkeypatch.setattr(optim, "build_optimizer", syncing)
    with pytest.raises(FakeRunError, match=r"host read .* at diffsynth_qie/preflight/train_step\.py:\d+ \(_verify_train_step\)"):
        step(run_config(loss="lbm"))  # (the caller of the planted code: the innermost frame of the package)


def test_a_21_run_with_every_option_runs_through_its_family():
    r = step(run_config(model="2.1", ema_decay=0.9, validate_every=2, validate_with="both", mask=(1.0, 0.0),
                        batch_size=2), model="2.1", batch=2)
    assert r.loss_dtype == "float32" and r.validation_peak > 0


def test_compile_runs_compile_blocks_on_the_checked_dit(monkeypatch):
    from diffsynth_qie.models.load import compile as compile_mod

    calls = []
    real = compile_mod.compile_blocks
    monkeypatch.setattr(compile_mod, "compile_blocks", lambda dit, **kw: calls.append(kw) or real(dit, **kw))
    step(run_config(compile=True))
    assert calls == [{"backend": "eager"}]


# --- bugs reachable only behind a flag ------------------------------------------------------------------------
def test_a_device_mismatch_in_the_ema_update_is_caught_only_with_ema_decay(monkeypatch):
    from diffsynth_qie.training import ema as ema_mod
    from diffsynth_qie.preflight import train_extras as verify_extras

    real = verify_extras.build_ema

    def planted(cfg, module):
        built = real(cfg, module)
        if built is not None:  # the update reads a host copy of each weight
            built._local = lambda p: torch.zeros(p.shape)
        return built

    monkeypatch.setattr(verify_extras, "build_ema", planted)
    monkeypatch.setattr("diffsynth_qie.preflight.train_step.build_ema", planted)
    step(run_config())  # without --ema_decay the bug is not reached
    with pytest.raises(ValueError, match=r"preflight.*device mismatch.*training/ema\.py:\d+ \(update\).*--no_preflight"):
        from diffsynth_qie.preflight.train import preflight

        preflight(run_config(ema_decay=0.99), get_preset("2511"))
    assert ema_mod.LoraEMA.update  # (the class itself is untouched)


def _old_mask_weights(back_mask, inside, outside):
    m = back_mask.float().clamp(0, 1)
    w = inside * m + outside * (1 - m)
    mean = w.mean()
    return w / mean if mean > 0 else w  # the host read the check must catch


def test_a_host_read_in_the_mask_weights_is_caught_only_with_mask_loss_weights(monkeypatch):
    from diffsynth_qie.fakegpu.device import FakeRunError
    from diffsynth_qie.training.losses import common

    monkeypatch.setattr(common, "mask_weights", _old_mask_weights)
    step(run_config())  # no --mask_loss_weights: the masks are not read
    with pytest.raises(FakeRunError, match=r"host read .*(test_verify_train_options|losses/(sft|common))\.py:\d+"):
        step(run_config(mask=(1.0, 0.2)))


def test_mask_weights_stay_on_the_device_with_the_same_numbers():
    from diffsynth_qie.fakegpu.device import FakeCuda
    from diffsynth_qie.training.losses.common import mask_weights

    g = torch.Generator().manual_seed(0)
    for mask, (inside, outside) in [(torch.rand(1, 6, 5, generator=g), (1.0, 0.3)), (torch.zeros(1, 4, 4), (1.0, 0.0)),
                                    (torch.ones(1, 3, 3), (0.0, 2.0)), (torch.rand(1, 2, 7, generator=g), (2.0, 1.0))]:
        assert torch.equal(mask_weights(mask, inside, outside), _old_mask_weights(mask, inside, outside))
    with FakeCuda():
        w = mask_weights(torch.empty(1, 8, 8, device="cuda", dtype=torch.bfloat16), 1.0, 0.1)  # no host read
    assert w.shape == (1, 8, 8)


# --- no false alarms: the launch scripts' training configurations ---------------------------------------------
def _train_flags(script: str) -> list[str]:
    text = (ROOT / script).read_text()
    return re.search(r"^TRAIN_FLAGS=\((.*)\)$", text, re.M).group(1).split()


def _parsed(model: str, flags: list[str]):
    from diffsynth_qie.commands import train

    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    args = parser.parse_args(["--model", model, "--cache_dir", "c", "--output_dir", "o", *flags])
    return train.config_from_args(args).resolved(get_preset(model))


@pytest.mark.parametrize("script,model", [("Qwen-Image-Edit-2511.sh", "2511"), ("Qwen-Image-Edit-2509.sh", "2509"),
                                          ("Qwen-Image-Edit-LBM.sh", "2511"), ("Qwen-Image-2.1.sh", "2.1"),
                                          ("Qwen-Image-2.1-LBM.sh", "2.1")])
def test_the_launch_scripts_training_configurations_pass_the_preflight_on_an_80_gb_gpu(script, model):
    from diffsynth_qie.preflight.train import preflight

    report = preflight(_parsed(model, _train_flags(script)), get_preset(model), gpu_memory_gb=80)
    assert 0 < report.verdict.peak_bytes < 80 * GiB and "scaled to" in report.verdict.scaled


# --- the memory verdict ---------------------------------------------------------------------------------------
def test_the_preflight_refuses_a_step_that_does_not_fit_the_gpu_in_one_line():
    from diffsynth_qie.fakegpu.verdict import MemoryVerdictError
    from diffsynth_qie.preflight.train import preflight

    with pytest.raises(MemoryVerdictError) as caught:
        preflight(run_config(gradient_checkpointing=False), get_preset("2511"), gpu_memory_gb=24)
    line = str(caught.value)
    assert "\n" not in line and "exceeds the GPU's 24.00 GiB" in line and "scaled to 60" in line
    assert "largest holders" in line and "--blocks_to_swap" in line


def test_the_scaled_peak_matches_a_deeper_run():
    """Two depths scaled to four blocks give the four-block run's peak: the per-block share is linear."""
    from diffsynth_qie.preflight.train import scaled_verdict

    cfg = run_config()
    one, two, four = (step(cfg, layers=n) for n in (1, 2, 4))
    verdict = scaled_verdict(one, two, (1, 2), 4, 0, None)
    assert abs(verdict.peak_bytes - four.peak) / four.peak < 0.02, (verdict.peak_bytes / GiB, four.peak / GiB)


def test_every_qie_train_flag_is_in_the_verify_table():
    """docs/VERIFY.md's `qie train` table says how the check covers each flag; a new flag must be added there."""
    from diffsynth_qie.commands import train

    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    flags = {s for a in parser._actions for s in a.option_strings if s.startswith("--") and a.dest != "help"}
    section = (ROOT / "docs" / "VERIFY.md").read_text().split("## qie train", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `(--[a-z0-9_]+)` \| \S", section, re.M))
    # --no-<flag> spellings of boolean flags are the same flag
    missing = {f for f in flags if f not in rows and not (f.startswith("--no-") and "--" + f[5:] in rows)}
    assert not missing, f"add these qie train flags to docs/VERIFY.md's '## qie train' table: {sorted(missing)}"
