"""Qwen-Image-2.1 through the cache and the trainer: the family's cache layout, family checks, real mixed-shape
batches (equal to single samples), exact resume, and a LoRA refused by a model of the other family."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import fresh_accelerate  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")
CACHE21_SEED = 2  # the conftest fixture cache21 caches the 2.1 demo of this seed


def _config(cache, out, model_dir, loss=None, **train):
    from diffsynth_qie.training import config as tc

    t = dict(model="tiny-2.1", model_dir=str(model_dir), batch_size=2, max_steps=4, mixed_precision="no",
             gradient_checkpointing=False, save_every=0, seed=0, device="cpu")
    t.update(train)
    return tc.RunConfig(train=tc.TrainConfig(cache_dir=None if cache is None else str(cache), output_dir=str(out), **t),
                        lora=tc.LoRAConfig(lora_rank=4), optim=tc.OptimConfig(learning_rate=1e-2),
                        loss=tc.LossConfig(**(loss or {})))


def test_the_21_cache_holds_the_familys_tensors(cache21):
    from diffsynth_qie.cache.store import CacheStore

    store = CacheStore.open(cache21)
    assert store.family == "qwen-image-2.1" and store.manifest["resize"]["divisor"] == 32 and len(store) == 4
    assert any(store.meta(i).n_edit == 2 for i in range(len(store)))
    for i in range(len(store)):
        meta, entry = store.meta(i), store.load(i)
        h, w = meta.target_size
        assert h % 32 == 0 and w % 32 == 0 and entry.target_latents.shape == (64, h // 16, w // 16)
        assert meta.patch == 1 and meta.image_tokens == sum(s[1] * s[2] for s in [meta.target_shape, *meta.edit_shapes])
        # LBM's main stream: the first reference at the target's size (none for a row without references)
        assert (entry.lbm_source_latents is None) == (not entry.edit_latents)
        assert entry.lbm_source_latents is None or entry.lbm_source_latents.shape == entry.target_latents.shape
        # each reference slot of the prompt takes a 2x2 block of the reference's latents (Qwen3-VL merges 2x2)
        ref_tokens = sum(z.shape[1] * z.shape[2] for z in entry.edit_latents)
        assert meta.prompt_tensors == ["pad"]  # the family's prompt-tensor schema (Family.prompt_tensors)
        pads = [x["pad"] for x in entry.prompt_extras + [entry.empty_prompt_extras]]
        for emb, pad in zip(entry.prompt_embs + [entry.empty_prompt_emb], pads):
            assert pad.dtype == torch.bool and pad.shape == emb.shape[:1] and 4 * int(pad.sum()) == ref_tokens
        if entry.back_mask is not None:
            assert entry.back_mask.shape == (1, *entry.target_latents.shape[1:])


def test_a_cache_of_one_family_is_refused_for_the_other(cache21, cache_dir):
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.training.data import open_cache

    with pytest.raises(ValueError, match="encoded for qwen-image-2.1 .* --model tiny is qwen-image-edit"):
        open_cache(str(cache21), get_preset("tiny"))
    with pytest.raises(ValueError, match="encoded for qwen-image-edit .* --model tiny-2.1 is qwen-image-2.1"):
        open_cache(str(cache_dir), get_preset("tiny-2.1"))


def test_a_mixed_batch_equals_its_samples_one_by_one(cache21, tiny21_dir, tmp_path):
    """Different target and reference shapes in one batch: the same loss and gradients as single samples."""
    from diffsynth_qie.cache.store import CacheStore
    from diffsynth_qie.models.load.loading import load_pipeline
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.training.data import CacheDataset, SampleKey, collate
    from diffsynth_qie.training.module import QIETrainingModule

    cfg = _config(cache21, tmp_path, tiny21_dir, loss={"mask_loss_weights": (2.0, 0.5)}).resolved(get_preset("tiny-2.1"))
    dit = load_pipeline("tiny-2.1", model_dir=tiny21_dir, components=("dit",), device="cpu",
                        torch_dtype=torch.float32).dit
    module = QIETrainingModule(dit, cfg, "tiny-2.1")
    with torch.no_grad():
        for n, p in module.trainable_named_parameters():
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    ds = CacheDataset(CacheStore.open(cache21))
    samples = [ds[SampleKey(i, 0)] for i in range(len(ds))]
    assert len({(tuple(s["target_latents"].shape), len(s["edit_latents"])) for s in samples}) >= 3

    def grads():
        return {n: p.grad.detach().clone() for n, p in module.trainable_named_parameters() if p.grad is not None}

    module.zero_grad()
    loss_all, _ = module(collate(samples), torch.Generator().manual_seed(5))
    loss_all.backward()
    g_all = grads()
    module.zero_grad()
    gen, singles = torch.Generator().manual_seed(5), []
    for s in samples:
        one, _ = module(collate([s]), gen)
        (one / len(samples)).backward()
        singles.append(float(one.detach()))
    g_one = grads()
    assert float(loss_all.detach()) == pytest.approx(sum(singles) / len(samples), rel=1e-5)
    assert set(g_all) == set(g_one) and len(g_all) == 2 * 7 * 2  # A and B of 7 targets in 2 blocks
    for n in g_all:
        assert torch.allclose(g_all[n], g_one[n], rtol=1e-4, atol=1e-7), n


def test_21_training_resumes_exactly(cache21, tiny21_dir, tmp_path):
    from safetensors.torch import load_file

    from diffsynth_qie.training.loop import Hooks, train

    ref = train(_config(cache21, tmp_path / "ref", tiny21_dir))
    out = tmp_path / "run"

    class Crash(Exception):
        pass

    def crash_at_3(step, record):
        if step == 3:
            raise Crash

    with pytest.raises(Crash):
        train(_config(cache21, out, tiny21_dir, save_every=2), Hooks(on_step_end=crash_at_3))
    with fresh_accelerate():
        resumed = train(_config(cache21, out, tiny21_dir, save_every=2, resume="latest"))
    assert resumed.losses == pytest.approx(ref.losses[2:], rel=1e-6)
    a, b = load_file(str(out / "lora.safetensors")), load_file(str(ref.lora_path))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-8) for k in a)
    assert min(ref.losses) < ref.losses[0] or len(set(ref.losses)) > 1  # it trains (the losses move)


@pytest.mark.parametrize("flags, message", [
    ({"zero_cond_t": True}, "--zero_cond_t is a Qwen-Image-Edit-2511 flag"),
])
def test_what_21_training_cannot_do_is_refused_by_name(cache21, tiny21_dir, tmp_path, flags, message):
    from diffsynth_qie.models.presets import get_preset

    flags = dict(flags)
    cfg = _config(cache21, tmp_path, tiny21_dir, loss=flags.pop("loss", None), **flags)
    with pytest.raises(ValueError, match=message):
        cfg.resolved(get_preset("tiny-2.1"))


def test_a_lora_of_the_other_family_is_refused_naming_it(cache21, tiny21_dir, tiny_pipe, tmp_path):
    from diffsynth_qie.inference import Editor
    from diffsynth_qie.training.loop import train

    lora = train(_config(cache21, tmp_path / "run", tiny21_dir, max_steps=1)).lora_path
    with pytest.raises(ValueError, match=r"was trained for qwen-image-2.1 \(preset tiny-2.1\), but this model is "
                                         r"qwen-image-edit"):
        Editor(tiny_pipe).set_loras([(str(lora), 1.0)])
    assert Path(lora).is_file()


def test_the_web_uis_lora_picker_lists_only_the_models_family(cache21, tiny21_dir, cache_dir, tiny_model_dir, tmp_path):
    from diffsynth_qie.training.loop import train
    from diffsynth_qie.training.config import LoRAConfig, RunConfig, TrainConfig
    from diffsynth_qie.ui.config import UIConfig
    from diffsynth_qie.ui.handlers import UIHandlers

    train(_config(cache21, tmp_path / "loras" / "q21", tiny21_dir, max_steps=1))
    with fresh_accelerate():
        train(RunConfig(train=TrainConfig(cache_dir=str(cache_dir), output_dir=str(tmp_path / "loras" / "edit"),
                                          model="tiny", model_dir=str(tiny_model_dir), device="cpu", max_steps=1),
                        lora=LoRAConfig(lora_rank=4)))
    pick = {m: UIHandlers(UIConfig(model=m, lora_dir=str(tmp_path / "loras"))).lora_choices()
            for m in ("tiny", "tiny-2.1")}
    assert "edit/lora.safetensors" in pick["tiny"] and "q21/lora.safetensors" not in pick["tiny"]
    assert "q21/lora.safetensors" in pick["tiny-2.1"] and "edit/lora.safetensors" not in pick["tiny-2.1"]


def test_the_cached_slot_mask_reaches_the_dit_on_the_latents_device(monkeypatch):
    """The cache keeps the mask on the host; on a GPU DiffSynth concatenates it with a mask on the latents'
    device, so it must move there (the meta device stands in for the GPU)."""
    import diffsynth.pipelines.qwen_image_21 as pipeline21

    from diffsynth_qie.models.qwen_image_21.qwen21 import Prompt21, forward21

    seen = {}

    def model_fn(dit, latents, edit_image_pad_mask, **kwargs):
        seen["devices"] = (latents.device, edit_image_pad_mask.device)
        return latents

    monkeypatch.setattr(pipeline21, "model_fn_qwen_image_21", model_fn)
    dit = torch.nn.Linear(2, 2).to("meta")
    x = torch.empty(64, 2, 2, device="meta")
    prompt = Prompt21(emb=torch.empty(5, 32, device="meta"), pad_mask=torch.tensor([0, 1, 1, 0, 0], dtype=torch.bool))
    forward21(dit, [x], torch.zeros(1, device="meta"), [prompt], [[]])
    assert seen["devices"] == (torch.device("meta"), torch.device("meta"))


def test_the_samplers_host_timesteps_reach_the_dit_on_the_latents_device(monkeypatch):
    """A sampler hands ``velocity21`` the scheduler's timesteps, which live on the host; DiffSynth's 2.1 DiT feeds
    them to its timestep embedder's linear layers, so on a GPU they must move to the latents' device (the meta
    device stands in for the GPU). A CPU-only test of the whole edit cannot see this."""
    import diffsynth.pipelines.qwen_image_21 as pipeline21

    from diffsynth_qie.models.qwen_image_21.qwen21 import Cond21, Prompt21, velocity21

    seen = []

    def model_fn(dit, latents, timestep, edit_image_pad_mask, **kwargs):
        seen.append((latents.device, timestep.device, edit_image_pad_mask.device))
        return latents

    monkeypatch.setattr(pipeline21, "model_fn_qwen_image_21", model_fn)
    dit = torch.nn.Linear(2, 2).to("meta")
    prompt = Prompt21(emb=torch.empty(5, 32, device="meta"), pad_mask=torch.zeros(5, dtype=torch.bool))
    cond = Cond21(prompts=[prompt, prompt], ref_latents=[[], []], negatives=[prompt, prompt], kv_cache=False)
    x = torch.empty(2, 64, 2, 2, device="meta")
    for cfg in (1.0, 4.0):
        velocity21(dit, cond, cfg=cfg)(x, torch.tensor([1000.0, 500.0]))  # host timesteps, as a scheduler gives
    meta = torch.device("meta")
    assert len(seen) == 2 + 4 and all(devices == (meta, meta, meta) for devices in seen), seen


def test_an_edit_moves_each_prompts_slot_mask_to_the_device_once(monkeypatch):
    """DiffSynth's 2.1 forward needs the slot mask on the latents' device (``model_fn_qwen_image_21`` concatenates
    it with a target mask it makes there); an edit moves it once per prompt, with the conditioning, and every
    denoising step and CFG pass then hands the DiT that same device tensor: no copy per DiT call."""
    import diffsynth.pipelines.qwen_image_21 as pipeline21

    from diffsynth_qie.models.family_ops import ops_for
    from diffsynth_qie.models.qwen_image_21.qwen21 import Prompt21

    seen = []

    def model_fn(dit, latents, edit_image_pad_mask, **kwargs):
        seen.append(edit_image_pad_mask)
        return latents

    monkeypatch.setattr(pipeline21, "model_fn_qwen_image_21", model_fn)
    ops = ops_for("qwen-image-2.1")
    host = [Prompt21(emb=torch.zeros(5, 32), pad_mask=torch.tensor([0, 1, 1, 0, 0], dtype=torch.bool))
            for _ in range(2)]
    cond = ops.conditioning(host[:1], host[1:], [[]], False, lambda t: t.to("meta"))
    cond.kv_cache = False  # (the stand-in DiT has no blocks to cache)
    masks = [p.pad_mask for p in (*cond.prompts, *cond.negatives)]
    assert all(m.device.type == "meta" for m in masks)
    velocity = ops.velocity(torch.nn.Linear(2, 2).to("meta"), cond, 4.0)
    for t in (1000.0, 600.0, 200.0):
        velocity(torch.empty(1, 64, 2, 2, device="meta"), torch.tensor([t]))
    assert len(seen) == 3 * 2
    assert all(m._base is masks[k % 2] for k, m in enumerate(seen))  # views of the two masks moved once


def test_21_on_the_fly_gives_the_cached_runs_losses(cache21, tiny21_dir, tmp_path):
    from diffsynth_qie.cache.store import CacheStore
    from diffsynth_qie.data.formats import DatasetConfig
    from diffsynth_qie.training.config import OnTheFlyConfig
    from diffsynth_qie.training.loop import train

    cached = train(_config(cache21, tmp_path / "cached", tiny21_dir, max_steps=6, cfg_dropout=0.3))
    cfg = _config(None, tmp_path / "live", tiny21_dir, max_steps=6, cfg_dropout=0.3)
    cfg.onthefly = OnTheFlyConfig(on_the_fly=True, max_pixels=128 * 128)
    cfg.dataset = DatasetConfig(dataset_metadata=CacheStore.open(cache21).manifest["metadata"])
    with fresh_accelerate():
        live = train(cfg)
    assert live.losses == pytest.approx(cached.losses, rel=1e-5)
