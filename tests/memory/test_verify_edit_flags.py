"""`qie edit`'s preflight runs every option on the fake CUDA device, as a GPU run would take it.

A bug reachable only behind an edit flag (the strength's start, the Lightning schedule, the mask's blend, a second
LoRA) is planted in a copy of our code at its real file:line: the preflight passes without the flag and names
the planted line with it. The memory verdict scales the two blocks run to the whole DiT and says so.
"""
from __future__ import annotations

import re

import pytest
import torch
from PIL import Image

from edit_planting import line_of, plant

GiB = 1024 ** 3


def request(**fields):
    from diffsynth_qie.inference.editor import EditRequest

    base = dict(images=[Image.new("RGB", (640, 512), (90, 120, 200))], prompt="make the sky pink", steps=40, cfg=4.0)
    return EditRequest(**{**base, **fields})


def mask():
    m = Image.new("L", (640, 512), 0)
    m.paste(255, (100, 100, 400, 300))
    return m


def run(req, **load):
    from diffsynth_qie.preflight.edit_step import EditLoad
    from diffsynth_qie.preflight.edit import preflight

    return preflight("2511", req, EditLoad(**load), gpu_memory_gb=1000)


def plant_all(monkeypatch):
    """One bug behind each edit flag; returns {flag: (the request and load options reaching it, where)}."""
    import diffsynth_qie.inference.editor as editor
    import diffsynth_qie.lora.branch as branch
    import diffsynth_qie.models.samplers.lightning as lightning
    import diffsynth_qie.models.samplers.sampling as sampling
    from diffsynth_qie.inference import masking

    planted = {}
    # the SDEdit start mixes fresh host noise into the source latents
    planted["strength"] = (dict(strength=0.6), {}, plant(
        monkeypatch, sampling, "sample_flow_match", "sigmas[0] * noise.float()", "sigmas[0] * torch.randn(noise.shape)",
        also=(editor,)))
    # the Lightning schedule's timesteps moved to the GPU: DiffSynth's step indexes its host sigmas with them
    plant(monkeypatch, lightning, "lightning_scheduler", "    return scheduler",
          "    scheduler.timesteps = scheduler.timesteps.to('cuda'); return scheduler")
    planted["lightning"] = (dict(scheduler="lightning", steps=4, cfg=1.0), {},
                            line_of(sampling.sample_flow_match, "x = scheduler.step("))
    # the mask's latent weight left on the host
    plant(monkeypatch, editor.Editor, "_latent_blend", "weight=weight.to(device=prior.device, dtype=prior.dtype)",
          "weight=weight.to(dtype=prior.dtype)")
    planted["mask"] = (dict(mask=mask(), mask_blend=0.8, mask_feather=4.0), {},
                       line_of(masking.keep_source, "return"))
    # every LoRA after the first computed with its down-projection on the host
    plant(monkeypatch, branch, "_branch_hook", 'a = getattr(module, f"{adapter.key}_A").to(x.device)',
          'a = getattr(module, f"{adapter.key}_A").to(x.device if adapter is _adapters(module)[0] else "cpu")')
    # (a device weight copied to the host mid-step: the host copy itself is the first thing a GPU run pays for)
    planted["second LoRA"] = ({}, dict(lora_ranks=(32, 16), lora_scales=(1.0, 0.5)),
                              line_of(branch._branch_hook, 'a = getattr(module, f"{adapter.key}_A")'))
    return planted


def test_the_preflight_catches_a_bug_behind_each_edit_flag_at_its_line(monkeypatch):
    planted = plant_all(monkeypatch)
    run(request(), lora_ranks=(32,))  # every bug planted, none reached: no false alarm
    for flag, (fields, load, where) in planted.items():
        with pytest.raises(ValueError, match=r"preflight .* at " + re.escape(where) + r" ") as caught:
            run(request(**fields), **load)
        assert "--no_preflight" in str(caught.value), flag


def test_every_edit_option_runs_and_each_lora_is_counted():
    """Strength, mask blend and feather, true CFG as one batch (prompts of one length), two references, two
    LoRAs, FP8 weights multiplied in FP8, block swapping and --compile in one edit; LBM part-way with a mask in
    another."""
    from diffsynth_qie.memory.census import preset_census

    census = preset_census("2511", with_encoders=False)
    stacked = run(request(strength=0.5, mask=mask(), mask_blend=0.7, mask_feather=3.0, negative_prompt="blurry",
                          images=[Image.new("RGB", (640, 512))] * 2),
                  lora_ranks=(32, 16), lora_scales=(1.0, -0.5), fp8_base=True, fp8_compute=True, blocks_to_swap=30,
                  compile=True)
    targets = _targets_in_two_blocks()
    assert stacked.lora_branches == 2 * targets  # one branch per LoRA on every target
    lora_per_block = (census.lora_params(32) + census.lora_params(16)) * 2 // census.num_layers
    fp8_block = stacked.block_bytes - lora_per_block
    assert 0.95 * census.block_params < fp8_block < 1.1 * census.block_params  # about one byte a weight, not two
    assert stacked.compiled_blocks == 2 and stacked.encode_peak > stacked.weights
    # one graph for both blocks, CFG's two prompts and every step (the count qie edit --compile logs)
    assert stacked.compile_counts == {"graphs": 1, "recompiles": 0}
    assert stacked.decode_peak > stacked.weights and stacked.denoise_peak > stacked.weights
    lbm = run(request(lbm_steps=2, strength=0.5, mask=mask()), lora_ranks=(32,))
    assert lbm.denoise_peak > lbm.weights and lbm.lora_branches == targets


def _targets_in_two_blocks() -> int:
    from diffsynth_qie.lora.branch import matches_target
    from diffsynth_qie.memory.census import build_dit
    from diffsynth_qie.models.presets import get_preset

    preset = get_preset("2511")
    with torch.device("meta"):
        dit = build_dit(preset, 2)
    return sum(1 for n, m in dit.named_modules() if hasattr(m, "in_features")
               and matches_target(n, preset.lora_target_modules))


def test_the_verdict_scales_the_blocks_run_to_the_whole_dit():
    """Every block holds the same: two blocks scaled to three give the three-block run's peak."""
    from diffsynth_qie.preflight.edit_step import EditLoad, verify_edit
    from diffsynth_qie.preflight.edit import edit_verdict
    from diffsynth_qie.models.presets import get_preset

    req, load = request(steps=1, mask=mask()), EditLoad(lora_ranks=(32,))
    two, three = (verify_edit(get_preset("2511"), num_layers=n, request=req, load=load) for n in (2, 3))
    verdict = edit_verdict(two, 3, 0, 0, None)
    assert abs(verdict.peak_bytes - three.peak) < 0.02 * three.peak, (verdict.peak_bytes / GiB, three.peak / GiB)
    assert verdict.scaled == "2 of 3 blocks run, scaled to 3"


def test_qie_edit_exits_with_the_one_line_verdict_when_the_edit_does_not_fit(tmp_path, capfd):
    from diffsynth_qie.cli import main

    image = tmp_path / "in.png"
    Image.new("RGB", (512, 512)).save(image)
    code = main(["edit", "--model", "2511", "--image", str(image), "--prompt", "make the sky pink",
                 "--out", str(tmp_path / "out.png"), "--gpu_memory_gb", "24"])
    text = "".join(capfd.readouterr())
    assert code != 0
    assert re.search(r"edit \(\w+\): fake-device peak [\d.]+ GiB \(2 of 60 blocks run, scaled to 60\): the peak "
                     r"[\d.]+ GiB exceeds the GPU's 24.00 GiB; largest holders: DiT blocks \(resident\)", text), text
    assert not (tmp_path / "out.png").exists()
