"""The step cache (``models/samplers/step_cache.py``, ``cached_blocks.py``) on the pretrained tiny bases of both
families: a cache that reuses nothing changes no bit, a cache that reuses really skips block calls (counted on the
real blocks) and more with a higher threshold, each level repeats itself for a seed, true CFG's branches decide
on their own, and it runs with masks, strength, stacked LoRAs, 2.1's prefix KV cache and (as a no-op) LBM; on
the fake device, its one designed host read is the only one let through.
"""
from __future__ import annotations

import math

import pytest
import torch
from PIL import Image, ImageDraw

from diffsynth_qie.inference import EditRequest, Editor
from diffsynth_qie.models.samplers.cached_blocks import StepCache
from diffsynth_qie.models.samplers.step_cache import (CacheSettings, MagnitudeCurve, cache_settings,
                                                      curve_from_samples, skip_plan)

STEPS = 20


@pytest.fixture(scope="module", params=["tiny", "tiny-2.1"])
def editor(request, tmp_path_factory):
    from diffsynth_qie.models.load.loading import load_pipeline
    from diffsynth_qie.training.pretrain_tiny import ensure_pretrained_tiny

    base = ensure_pretrained_tiny(tmp_path_factory.mktemp("base") / request.param, model=request.param)
    return Editor(load_pipeline(request.param, model_dir=base, device="cpu", torch_dtype=torch.float32))


def source() -> Image.Image:
    image = Image.new("RGB", (64, 64), (230, 230, 210))
    ImageDraw.Draw(image).ellipse((16, 20, 40, 44), fill=(220, 30, 30))
    return image


def edit(editor, **fields):
    base = dict(images=[source()], prompt="make the red circle blue", steps=STEPS, cfg=4.0, seed=0)
    return editor.edit(EditRequest(**{**base, **fields}))


class BlockCounter:
    """Calls of each real DiT block (forward hooks on the blocks themselves, under the cache's stand-ins)."""

    def __init__(self, dit):
        self.counts = [0] * len(dit.transformer_blocks)
        self.handles = [b.register_forward_hook(self._hook(i)) for i, b in enumerate(dit.transformer_blocks)]

    def _hook(self, i):
        def hook(module, args, output):
            self.counts[i] += 1
        return hook

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("method", ["first_block", "schedule"])
def test_a_cache_that_reuses_nothing_changes_no_bit(editor, method):
    exact = edit(editor)
    assert exact.cache is None
    with BlockCounter(editor.pipe.dit) as counter:
        attached = edit(editor, cache=CacheSettings(method, threshold=0.0))
    assert attached.cache.calls > 0 and attached.cache.skipped == 0  # the stand-ins ran every call, reusing nothing
    assert counter.counts == [attached.cache.calls] * len(counter.counts)
    assert torch.equal(attached.latents, exact.latents)


def test_the_cache_skips_block_calls_and_more_with_a_higher_threshold(editor):
    skipped, last_block = [], []
    for threshold in (0.02, 0.12, 0.4):
        with BlockCounter(editor.pipe.dit) as counter:
            result = edit(editor, cache="balanced", cache_threshold=threshold)
        stats = result.cache
        # the first block runs at every call; the others only where nothing was reused
        assert counter.counts[0] == stats.calls
        assert counter.counts[-1] == stats.calls - stats.skipped
        assert stats.blocks_run == sum(counter.counts)
        skipped.append(stats.skipped)
        last_block.append(counter.counts[-1])
    assert skipped[0] < skipped[1] < skipped[2], skipped
    assert last_block[0] > last_block[1] > last_block[2]
    assert skipped[2] <= 0.8 * stats.calls  # nothing is reused in the warm-up (20 % of the steps)


@pytest.mark.parametrize("level", ["balanced", "fast"])
def test_each_level_repeats_itself_for_a_seed(editor, level):
    one, two = edit(editor, cache=level), edit(editor, cache=level)
    assert one.cache.skipped > 0 and (one.cache.calls, one.cache.skipped) == (two.cache.calls, two.cache.skipped)
    assert torch.equal(one.latents, two.latents)
    exact = edit(editor)
    change = float((one.latents - exact.latents).norm() / exact.latents.norm())
    # close to the exact edit, not it (measured: balanced 0.009 / 0.050, fast 0.036 / 0.078 on Edit / 2.1)
    assert 0 < change < {"balanced": 0.075, "fast": 0.12}[level], change


def test_masks_strength_and_stacked_loras_run_with_the_cache(editor, tmp_path):
    from diffsynth_qie.lora import save_lora
    from diffsynth_qie.lora.branch import matches_target

    dit = editor.pipe.dit
    gen = torch.Generator().manual_seed(0)
    paths = []
    for k in range(2):
        tensors = {}
        for name, module in dit.named_modules():
            if matches_target(name, editor.family.lora_targets) and getattr(module, "weight", None) is not None \
                    and module.weight.ndim == 2:
                tensors[f"{name}.lora_A.weight"] = torch.randn(2, module.weight.shape[1], generator=gen) * 0.3
                tensors[f"{name}.lora_B.weight"] = torch.randn(module.weight.shape[0], 2, generator=gen) * 0.3
        paths.append(save_lora(tmp_path / f"l{k}.safetensors", tensors))
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (12, 12, 48, 48))
    fields = dict(mask=mask, strength=0.6, cache="fast")
    try:
        editor.set_loras([(str(paths[0]), 1.0), (str(paths[1]), 0.7)])
        stacked = edit(editor, **fields)
        editor.set_loras([])
        plain = edit(editor, **fields)
    finally:
        editor.set_loras([])
    for result in (stacked, plain):
        assert 0 < result.cache.skipped
    outside = [(x, y) for x in (0, 5, 60) for y in (0, 6, 63)]
    src = source()
    for result in (stacked, plain):  # the mask keeps the outside the source's
        assert all(result.image.getpixel(p) == src.getpixel(p) for p in outside)
    assert not torch.equal(stacked.latents, plain.latents)  # the LoRAs act under the cache


def test_lbm_takes_no_step_cache(editor):
    if not editor.ops.supports_lbm:
        pytest.skip("no LBM sampler")
    lbm = edit(editor, lbm_steps=2, cache="fast")
    assert lbm.cache is None and torch.equal(lbm.latents, edit(editor, lbm_steps=2).latents)


def test_the_prefix_kv_cache_and_the_step_cache_together(editor):
    if editor.family.name != "qwen-image-2.1":
        pytest.skip("Qwen-Image-2.1's prefix KV cache")
    exact = edit(editor)
    with_kv, without_kv = edit(editor, cache="balanced"), edit(editor, cache="balanced", kv_cache=False)
    for result in (with_kv, without_kv):  # one call per prompt and step: positive and negative
        assert result.cache.calls == 2 * STEPS and result.cache.skipped > 0
    # the steps after the first send only the target's tokens: they reuse the first step's residual by its tail
    change = float((with_kv.latents - exact.latents).norm() / exact.latents.norm())
    assert change < 0.1, change


# --- the decisions, without a model -------------------------------------------------------------------------
class _Residual(torch.nn.Module):
    """A block in 2.1's shape (``hidden_states`` in and out)."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, hidden_states):
        return hidden_states + self.scale * hidden_states.tanh()


class ToyDiT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer_blocks = torch.nn.ModuleList(_Residual(s) for s in (0.5, 0.2, 0.3))

    def forward(self, x):
        for block in self.transformer_blocks:
            x = block(hidden_states=x)
        return x


def toy_run(branches, steps: int = 10, threshold: float = 0.05):
    """Skips per branch of a first-block cache over ``steps``; ``branches`` maps a name to its input at step k."""
    dit = ToyDiT()
    cache = StepCache(CacheSettings("first_block", threshold, warmup=0.1, max_skips=9), dit, (("hidden_states",),) * 2)
    runs = {name: 0 for name in branches}
    outputs = {name: [] for name in branches}
    with cache.run([1 - k / steps for k in range(steps)]):
        for k in range(steps):
            cache.step(k)
            for name, make in branches.items():
                before = cache.stats.skipped
                outputs[name].append(dit(make(k)))
                runs[name] += cache.stats.skipped - before
    toy_run.outputs = outputs
    return runs


def test_each_branch_has_its_own_decision():
    still = lambda k: torch.ones(1, 5, 4)  # noqa: E731  (the same input at every step: always reusable)
    moving = lambda k: torch.full((1, 5, 4), (-1.0) ** k * (1 + k))  # noqa: E731  (changes a lot)
    alone = toy_run({"still": still})["still"]
    exact = ToyDiT()(still(0))
    for out in toy_run.outputs["still"]:  # a reused call adds the cached residual: the computed call's output
        torch.testing.assert_close(out, exact)
    assert alone == 9 and toy_run({"moving": moving})["moving"] == 0
    assert toy_run({"still": still, "moving": moving}) == {"still": alone, "moving": 0}
    assert toy_run({"moving": moving, "still": still}) == {"moving": 0, "still": alone}


def test_the_schedule_plan_follows_warmup_run_length_and_threshold():
    sigmas = [1 - k / 40 for k in range(40)]
    flat = MagnitudeCurve((0.0, 1.0), (0.0, 0.0))
    plan = skip_plan(CacheSettings("schedule", 0.1, warmup=0.25, max_skips=3), sigmas, flat)
    assert plan[:10] == [False] * 10  # warm-up
    assert plan[10:18] == [True, True, True, False] * 2  # a flat curve reuses as long as allowed in a row
    sloped = curve_from_samples([(s, math.exp(2 * s)) for s in sigmas])  # magnitude changes 5 % a step
    counts = [sum(skip_plan(CacheSettings("schedule", t, 0.2, 4), sigmas, sloped)) for t in (0.01, 0.1, 0.3, 1.0)]
    assert counts[0] == 0 and counts[0] < counts[1] < counts[2] <= counts[3], counts
    assert skip_plan(CacheSettings("first_block", 0.1, 0.2), sigmas[:5]) == [False, True, True, True, True]


def test_cache_settings_refuse_what_does_not_exist():
    assert cache_settings("off") is None
    assert cache_settings("balanced", "schedule", 0.3) == CacheSettings("schedule", 0.3, 0.2, 4)
    for bad in (dict(level="faster"), dict(level="fast", method="taylor"), dict(level="fast", threshold=-1),
                dict(level="off", threshold=0.1), dict(level="off", method="schedule")):
        with pytest.raises(ValueError):
            cache_settings(**bad)


# --- on the fake device -------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["tiny", "tiny-2.1"])
def test_the_fake_device_runs_the_reusing_path_and_lets_only_the_designed_read_through(model, monkeypatch):
    import contextlib

    from diffsynth_qie.fakegpu import device
    from diffsynth_qie.fakegpu.device import FakeRunError
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.preflight.edit_step import verify_edit

    def run(method):
        return verify_edit(get_preset(model), resolution=64, steps=2, cfg=4.0, prompt_tokens=20, cache="balanced",
                           cache_method=method)

    report = run("first_block")
    assert report.cache_calls == 4 and report.cache_skipped == 2  # each branch: step 1 computes, step 2 reuses
    monkeypatch.setattr(device, "step_cache_answers", contextlib.nullcontext)  # the read no longer answered
    where = r"host read .* at diffsynth_qie/models/samplers/cached_blocks\.py:\d+ \(read\)"
    with pytest.raises(FakeRunError, match=where):
        run("first_block")
    if model == "tiny":
        run("schedule")  # the schedule reads nothing on the host: it runs unanswered
