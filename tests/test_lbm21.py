"""Latent Bridge Matching on Qwen-Image-2.1 (the tiny 2.1: DiffSynth's real 2.1 classes at small sizes).

The bridge's noisy target is 2.1's image stream at σ while the references stay in its prefix at t=0: the loss
and the sampler reach the DiT through the family's ops, as flow matching does. Checked here: the cache writes the
main stream's source, both streams train, the DiT sees 1000·σ for the target and the references as its prefix,
a 1-step edit gives the main and the sub-stream image (Editor and `qie edit`), and the UI offers the sampler.
"""
from __future__ import annotations

import pytest
import torch


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")
CACHE21_SEED = 3  # the conftest fixture cache21 caches the 2.1 demo of this seed


def _config(cache, out, model_dir, **lbm):
    from diffsynth_qie.training import config as tc
    from diffsynth_qie.training.losses.lbm import LBMConfig

    return tc.RunConfig(
        train=tc.TrainConfig(cache_dir=str(cache), output_dir=str(out), model="tiny-2.1", model_dir=str(model_dir),
                             batch_size=2, max_steps=4, mixed_precision="no", gradient_checkpointing=False,
                             save_every=0, seed=0, device="cpu"),
        lora=tc.LoRAConfig(lora_rank=4), loss=tc.LossConfig(loss="lbm"), lbm=LBMConfig(**lbm))


def test_the_21_cache_holds_the_main_streams_source_and_the_white_latents(cache21):
    from diffsynth_qie.cache.store import CacheStore

    store = CacheStore.open(cache21)
    entries = [store.load(i) for i in range(len(store))]
    with_refs = [e for e in entries if e.edit_latents]
    assert with_refs, "the demo has rows with references"
    for e in with_refs:
        assert e.lbm_source_latents is not None and e.lbm_source_latents.shape == e.target_latents.shape
    for e in entries:
        assert e.sub_noise.shape == e.target_latents.shape and e.sub_noise.shape[0] == 64


def test_lbm_trains_both_streams_on_21(cache21, tiny21_dir, tmp_path):
    from diffsynth_qie.lora import load_lora_state
    from diffsynth_qie.training.loop import train

    result = train(_config(cache21, tmp_path / "run", tiny21_dir))
    assert all(torch.isfinite(torch.tensor(result.losses)))
    assert len(set(result.losses)) > 1
    state = load_lora_state(result.lora_path)
    assert state.metadata.get("loss") == "lbm" and state.modules
    assert str(state.metadata.get("preset")) == "tiny-2.1"


def test_the_bridge_reaches_the_21_dit_with_the_target_at_sigma_and_the_references_in_its_prefix(
        cache21, tiny21_dir, monkeypatch):
    """One call of DiffSynth's 2.1 model_fn per sample: the noisy target at 1000·σ, the cached references as
    ``edit_latents`` (its t=0 prefix) and the row's slot mask; the regression target is prior − target."""
    import diffsynth.pipelines.qwen_image_21 as p21

    from diffsynth_qie.cache.store import CacheStore
    from diffsynth_qie.models.load.loading import load_pipeline
    from diffsynth_qie.training.data import collate
    from diffsynth_qie.training.losses.lbm import LBMConfig, lbm_loss, make_bridge_batch

    store = CacheStore.open(cache21)
    entry = next(e for e in (store.load(i) for i in range(len(store))) if e.edit_latents)
    batch = collate([{"entry_id": entry.entry_id, "prompt_emb": entry.prompt_embs[0],
                      "prompt_extras": entry.extras_of(0), "target_latents": entry.target_latents,
                      "edit_latents": list(entry.edit_latents), "back_mask": entry.back_mask,
                      "sub_noise": entry.sub_noise, "lbm_source_latents": entry.lbm_source_latents}])
    cfg = _config(cache21, "-", tiny21_dir, lbm_p_sub=0.0, lbm_sigma_grid=[0.75])
    calls = []
    real = p21.model_fn_qwen_image_21

    def spy(dit, latents, timestep, edit_latents=None, **kw):
        calls.append((latents.clone(), timestep.clone(), [z.clone() for z in edit_latents or []]))
        return real(dit, latents=latents, timestep=timestep, edit_latents=edit_latents, **kw)

    monkeypatch.setattr(p21, "model_fn_qwen_image_21", spy)
    dit = load_pipeline("tiny-2.1", model_dir=tiny21_dir, device="cpu", torch_dtype=torch.float32,
                        components=("dit",)).dit
    loss, metrics = lbm_loss(dit, batch, cfg, torch.Generator().manual_seed(0))
    bridge = make_bridge_batch(batch, LBMConfig(lbm_p_sub=0.0, lbm_sigma_grid=[0.75]),
                               torch.Generator().manual_seed(0))
    assert len(calls) == 1 and torch.isfinite(loss) and "mse_main" in metrics
    latents, timestep, refs = calls[0]
    assert torch.allclose(latents[0], bridge.noisy[0]) and float(timestep) == pytest.approx(750.0)
    assert len(refs) == len(entry.edit_latents)
    assert all(torch.equal(a[0], b) for a, b in zip(refs, entry.edit_latents))
    assert torch.allclose(bridge.velocity[0], entry.lbm_source_latents.float() - entry.target_latents.float())


def test_a_one_step_lbm_edit_gives_the_main_and_sub_stream_images(tiny21_dir):
    from PIL import Image

    from diffsynth_qie.inference import EditRequest, Editor
    from diffsynth_qie.models.load.loading import load_pipeline

    pipe = load_pipeline("tiny-2.1", model_dir=tiny21_dir, device="cpu", torch_dtype=torch.float32)
    editor = Editor(pipe)
    source = Image.new("RGB", (64, 64), (200, 40, 40))
    out = editor.edit(EditRequest(images=[source], prompt="make it blue", lbm_steps=1, seed=1))
    assert out.image.size == out.sub_image.size == (64, 64)
    assert out.latents.shape == (2, 64, 4, 4)  # main stream, sub-stream
    again = editor.edit(EditRequest(images=[source], prompt="make it blue", lbm_steps=2, seed=1))
    assert again.latents.shape == out.latents.shape and not torch.equal(again.latents, out.latents)


def test_qie_edit_lbm_steps_on_21(tiny21_dir, tmp_path):
    from PIL import Image

    from diffsynth_qie.cli import main

    Image.new("RGB", (64, 64), (40, 200, 40)).save(tmp_path / "src.png")
    rc = main(["edit", "--model", "tiny-2.1", "--model_dir", str(tiny21_dir), "--image", str(tmp_path / "src.png"),
               "--prompt", "make it blue", "--lbm_steps", "1", "--out", str(tmp_path / "out.png")])
    assert rc in (0, None)
    assert Image.open(tmp_path / "out.png").size == (64, 64) and (tmp_path / "out_sub.png").is_file()


def test_the_ui_offers_lbm_where_the_family_has_it(tiny21_dir, monkeypatch):
    from diffsynth_qie.models.family_ops import ops_for
    from diffsynth_qie.models.family import QWEN21
    from diffsynth_qie.ui.handlers import MODE_FLOW, MODE_LBM, UIHandlers
    from diffsynth_qie.ui.config import UIConfig

    h = UIHandlers(UIConfig(model="tiny-2.1", model_dir=str(tiny21_dir), lora_dir=str(tiny21_dir), examples=""))
    assert [m for _, m in h.mode_choices()] == [MODE_FLOW, MODE_LBM]
    monkeypatch.setattr(type(ops_for(QWEN21)), "supports_lbm", False)
    assert [m for _, m in h.mode_choices()] == [MODE_FLOW]


def test_a_family_without_a_bridge_refuses_lbm_by_name(cache21, tiny21_dir, tmp_path, monkeypatch):
    from diffsynth_qie.models.family import QWEN21
    from diffsynth_qie.models.family_ops import ops_for
    from diffsynth_qie.models.presets import get_preset

    cfg = _config(cache21, tmp_path, tiny21_dir)
    cfg.resolved(get_preset("tiny-2.1"))  # 2.1 has the bridge
    monkeypatch.setattr(type(ops_for(QWEN21)), "supports_lbm", False)
    with pytest.raises(ValueError, match="--loss lbm .* which has no bridge"):
        cfg.resolved(get_preset("tiny-2.1"))


def test_the_repeated_conditioning_shares_its_prefix_caches_exactly(tiny21_dir):
    """The LBM sampler's two streams read one prefix cache per prompt: the velocities equal uncached ones."""
    from PIL import Image

    from diffsynth_qie.models.family import QWEN21
    from diffsynth_qie.models.family_ops import ops_for
    from diffsynth_qie.models.load.loading import load_pipeline

    pipe = load_pipeline("tiny-2.1", model_dir=tiny21_dir, device="cpu", torch_dtype=torch.float32)
    ops = ops_for(QWEN21)
    image = Image.new("RGB", (64, 64), (30, 90, 200))
    z = ops.encode_image(pipe, image)
    prompt = ops.encode_prompt(pipe, "make it red", [image], [z], True, None)
    cond = ops.conditioning([prompt], None, [[z]], False, lambda t: t).repeat(2)
    x = torch.randn(2, 64, 4, 4, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([1000.0, 1000.0])
    velocity = ops.velocity(pipe.dit, cond, 1.0)
    first, second = velocity(x, t), velocity(x, t)  # fills the shared cache, then reads it
    assert len(cond._caches) == 1
    plain = ops.conditioning([prompt] * 2, None, [[z]] * 2, False, lambda t: t)
    plain.kv_cache = False
    reference = ops.velocity(pipe.dit, plain, 1.0)(x, t)
    torch.testing.assert_close(first, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second, reference, rtol=1e-5, atol=1e-5)


def test_the_pixel_loss_decodes_21_latents_at_16x(cache21, tiny21_dir, tmp_path, fake_lpips_home):
    """``--lbm_pixel_loss lpips`` on 2.1: crops measured at the family's 16 px per latent, RGB of the RGBA decode."""
    from diffsynth_qie.training.loop import train
    from diffsynth_qie.training.losses.lbm import LBMConfig
    from diffsynth_qie.training.losses.lbm_pixel import build_pixel_critic
    from diffsynth_qie.training.tracking import read_loss_log

    lbm = LBMConfig(lbm_pixel_loss="lpips", lbm_pixel_crop=64)
    critic = build_pixel_critic(lbm, "tiny-2.1", str(tiny21_dir), "cpu", torch.float32)
    assert critic.scale == 16 and critic.crop_box((64, 8, 8), torch.Generator().manual_seed(0))[2:] == (4, 4)
    assert critic._decode(torch.zeros(64, 4, 4)).shape == (1, 3, 64, 64)
    cfg = _config(cache21, tmp_path / "run", tiny21_dir, lbm_pixel_loss="lpips", lbm_pixel_crop=64)
    train(cfg)
    records = read_loss_log(tmp_path / "run" / "loss.jsonl")
    assert records and all(r["lpips"] > 0 for r in records)


def test_an_editor_of_a_family_without_a_bridge_refuses_lbm_steps(tiny21_dir, monkeypatch):
    from PIL import Image

    from diffsynth_qie.inference import EditRequest, Editor
    from diffsynth_qie.models.family import QWEN21
    from diffsynth_qie.models.family_ops import ops_for
    from diffsynth_qie.models.load.loading import load_pipeline

    monkeypatch.setattr(type(ops_for(QWEN21)), "supports_lbm", False)
    editor = Editor(load_pipeline("tiny-2.1", model_dir=tiny21_dir, device="cpu", torch_dtype=torch.float32))
    with pytest.raises(ValueError, match="has no LBM sampler"):
        editor.edit(EditRequest(images=[Image.new("RGB", (64, 64))], prompt="x", lbm_steps=1))
