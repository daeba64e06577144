"""`qie plan --verify`: a memory verdict, not a number. The fake-device run of the planned configuration (2
full-width blocks here, as the preflights run) is compared with the plan of the same depth and the GPU, and a
failure is one line (exit code 2) naming the phase, the largest holders by our frame, and the fix."""
from __future__ import annotations

import inspect

import torch

from diffsynth_qie.cli import main

FAST = ["--resolution", "512", "--verify", "--verify_blocks", "2"]
NO_TIME = ["--no_time"]  # the time prediction (two more counted runs) where the verdict is what is checked


def _run(capfd, *argv) -> tuple[int, str]:
    rc = main(["plan", *argv])
    out, err = capfd.readouterr()
    return rc, out + err


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if " ERROR " in line]


def test_the_verdict_passes_for_a_plan_that_agrees(capfd):
    """(Also the phases printed beside the plan, which `qie plan --verify` shows for the same run.)"""
    rc, text = _run(capfd, "--model", "2511", *FAST, *NO_TIME)
    assert rc == 0, text
    assert "memory verdict: training step (steady state): fake-device peak" in text and "plan" in text
    assert "fake CUDA device, one training step (sft, loss float32), 2 blocks" in text
    assert "steady-state peak" in text and "the plan counts every block" in text


def test_a_peak_over_the_gpu_fails_naming_the_phase_the_holders_and_the_fix(capfd):
    rc, text = _run(capfd, "--model", "2511", *FAST, "--gpu_memory_gb", "20")
    assert rc == 2
    (line,) = _error_lines(text)
    assert "training step (steady state) on the GPU" in line and "exceeds the GPU's 20.00 GiB" in line
    assert "largest holders: diffsynth_qie/memory/census.py:" in line  # the DiT's weights, built there
    assert "fix: `qie plan --gpu_memory_gb 20`" in line and "Traceback" not in text


def test_a_planted_memory_blowup_fails_naming_the_holders_line(capfd, monkeypatch):
    from diffsynth_qie.training.module import QIETrainingModule

    kept, real = [], QIETrainingModule.forward

    def forward(self, *args, **kwargs):
        kept.append([p.float() for p in self.dit.parameters()])  # planted: an fp32 copy of the DiT kept
        return real(self, *args, **kwargs)

    planted = inspect.getsourcelines(forward)[1] + 1
    monkeypatch.setattr(QIETrainingModule, "forward", forward)
    rc, text = _run(capfd, "--model", "2511", *FAST)
    assert rc == 2, text
    (line,) = _error_lines(text)
    assert "qie plan predicts" in line and "more than ±10% off" in line
    holders = line.split("largest holders: ")[1]
    assert holders.startswith(f"tests/memory/test_plan_verify.py:{planted} ("), line


def test_a_fake_device_error_is_one_line_not_a_traceback(capfd, monkeypatch):
    from diffsynth_qie.training.module import QIETrainingModule

    real = QIETrainingModule.forward

    def forward(self, batch, *args, **kwargs):
        loss, extra = real(self, batch, *args, **kwargs)
        if loss > 0:  # planted: a host read of the device loss
            pass
        return loss, extra

    monkeypatch.setattr(QIETrainingModule, "forward", forward)
    rc, text = _run(capfd, "--model", "2511", *FAST)
    assert rc == 2 and "Traceback" not in text
    (line,) = _error_lines(text)
    assert "qie plan --verify (train on a fake CUDA device): host read of a device tensor" in line
    assert "at diffsynth_qie/preflight/train_step.py:" in line  # the package's frame that called the planted code


def test_qwen_image_21_training_and_editing_are_verified(capfd, monkeypatch):
    from diffsynth_qie.preflight import edit_step

    rc, text = _run(capfd, "--model", "2.1", *FAST, *NO_TIME)  # (its counted steps: test_speed_guard.py)
    assert rc == 0, text
    assert "memory verdict: training step (steady state)" in text
    runs, verify_edit = [], edit_step.verify_edit

    def counted(*args, **kwargs):
        runs.append((kwargs.get("num_layers"), bool(kwargs.get("costs")), kwargs.get("prompt_pass", True)))
        return verify_edit(*args, **kwargs)

    monkeypatch.setattr(edit_step, "verify_edit", counted)
    rc, text = _run(capfd, "--model", "2.1", "--task", "edit", "--ref_images", "3", *FAST)
    assert rc == 0, text
    assert "prefix KV caches" in text and "encode peak" in text and "decode peak" in text  # the whole edit
    assert "memory verdict: edit: " in text
    assert "predicted edit (" in text and "), per image: " in text  # the time beside the verified edit
    # the verified 2-block edit is the time prediction's deeper run: counted there, not run again; the 1-block
    # run skips the prompt's language model pass (the encode is the same at both depths)
    assert runs == [(2, True, True), (1, True, False)]


def test_the_21_kv_cache_is_what_breaks_the_plan_without_its_term(capfd, monkeypatch):
    """The verdict catches a plan without the prefix KV cache term (the planner's old gap)."""
    from diffsynth_qie.memory import plan

    monkeypatch.setattr(plan, "kv_cache_bytes", lambda c, o: 0)
    # at 1024² ten references make a prefix of about 41k tokens: its caches outweigh the text encoder even in 2 blocks
    rc, text = _run(capfd, "--model", "2.1", "--task", "edit", "--ref_images", "10", *FAST, "--resolution", "1024")
    assert rc == 2
    (line,) = _error_lines(text)
    assert "edit: denoise" in line and "qie plan predicts" in line


def test_lbm_ema_and_on_the_fly_are_verified_as_planned(capfd):
    rc, text = _run(capfd, "--model", "2511", "--loss", "lbm", "--ema_decay", "0.99", "--on_the_fly", *FAST)
    assert rc == 0, text
    assert "predicted training step: " in text  # the time of the counted lbm step with its EMA update
    assert "one training step (lbm, loss" in text and "optimizer prodigy_sf, as qie train runs --loss lbm" in text
    assert "+33" not in text  # the encoders are either built or left out of both sides, and said so
    assert "--on_the_fly" in text


def test_attribution_names_the_allocating_frame():
    from diffsynth_qie.fakegpu.device import FakeCuda

    with FakeCuda() as fc:
        kept = torch.empty(1 << 20, device="cuda:0")  # 4 MiB
        line = inspect.currentframe().f_lineno - 1
        holders = dict(fc.memory.top_holders())
        assert holders[f"tests/memory/test_plan_verify.py:{line} (test_attribution_names_the_allocating_frame)"] \
            == 4 << 20
        del kept
        assert fc.memory.by_where == {}
