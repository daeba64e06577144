"""Training-time validation: it runs the inference samplers, not a sampler of its own.

- flow matching: validation latents equal the ``Editor``'s own sampling (``Editor._sample``,
  i.e. ``models.sampling`` as the CLI drives them) with the same cached conditioning,
  seed, cfg and ``zero_cond_t``, and they come from the module's trained weights;
- LBM: both streams start at the loss's priors (``lbm_source_latents``, ``sub_noise``), match
  the Editor's LBM sampling, and a row without a source renders the sub-stream only;
- the strips [reference | target | output] are written with the expected names;
- validation leaves training mode, weights, gradients and the global RNG as they were;
- end to end: ``train(--loss lbm --validate_every 1)`` (schedule-free) writes the LBM strips.
"""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from conftest import fresh_accelerate
from diffsynth_qie.models.samplers.sampling import Conditioning
from diffsynth_qie.training.config import LoRAConfig, LossConfig, RunConfig, TrainConfig
from diffsynth_qie.training.losses.lbm import LBMConfig
from diffsynth_qie.training.validation import Validator, entry_seed, output_name, side_by_side

CACHE_MAX_PIXELS = 64 * 64
ACCELERATOR = SimpleNamespace(device=torch.device("cpu"), is_main_process=True, unwrap_model=lambda m: m)
# Batched (shape-grouped, CFG as 2B) vs the Editor's batch of one: fp32 rounding only
# (measured ≤ 1e-6 on latents of magnitude ≈ 1; exactly 0 for a batch of one).
ATOL = 1e-5


@pytest.fixture(scope="module")
def cache_dir(tiny_pipe, demo_data_dir, tmp_path_factory):
    from diffsynth_qie.cache.writer import CacheConfig, write_cache
    from diffsynth_qie.data.formats import DatasetConfig

    out = tmp_path_factory.mktemp("validation-cache")
    write_cache(CacheConfig(cache_dir=str(out), model="tiny", max_pixels=CACHE_MAX_PIXELS, num_workers=1,
                            dataset=DatasetConfig(dataset_metadata=str(Path(demo_data_dir) / "metadata.json"))),
                pipe=tiny_pipe, rank=0, world_size=1)
    return out


@pytest.fixture(scope="module")
def store(cache_dir):
    from diffsynth_qie.cache.store import CacheStore

    return CacheStore.open(cache_dir)


def run_config(loss: str = "sft", zero_cond_t: bool = True, lbm: LBMConfig | None = None) -> RunConfig:
    from diffsynth_qie.models.presets import get_preset

    cfg = RunConfig(train=TrainConfig(cache_dir="unused", output_dir="unused", model="tiny", zero_cond_t=zero_cond_t,
                                      gradient_checkpointing=False),
                    lora=LoRAConfig(lora_rank=4, lora_alpha=4.0), loss=LossConfig(loss=loss), lbm=lbm)
    return cfg.resolved(get_preset("tiny"))


def training_module(dit, config: RunConfig, seed: int = 0, perturb: bool = True):
    """The trainer's module around a copy of ``dit``; ``perturb`` gives the LoRA a non-zero delta
    (a fresh LoRA's B is 0) so outputs depend on the trained weights."""
    from diffsynth_qie.training.module import QIETrainingModule

    module = QIETrainingModule(copy.deepcopy(dit), config, "tiny")
    if perturb:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in module.trainable_named_parameters():
                if "lora_B" in name:
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return module.train()


def editor_for(dit, zero_cond_t: bool):
    """An ``Editor`` whose DiT is ``dit`` (no text encoder or VAE: sampling only)."""
    from diffsynth_qie.inference import Editor

    pipe = SimpleNamespace(dit=dit, text_encoder=None, vae=None, torch_dtype=torch.float32, device="cpu",
                           load_models_to_device=lambda names: None)
    return Editor(pipe, zero_cond_t=zero_cond_t)


def cached_conditioning(entry, cfg: float, zero_cond_t: bool) -> Conditioning:
    return Conditioning([entry.prompt_embs[0]], [list(entry.edit_latents)],
                        [entry.empty_prompt_emb] if cfg != 1 else None, zero_cond_t)


def editor_flow_match(editor, entry, k: int, steps: int, cfg: float) -> torch.Tensor:
    """The Editor's flow-matching sampling of one cached entry with validation's seed."""
    from diffsynth_qie.inference import EditRequest

    request = EditRequest([Image.new("RGB", (16, 16))], "", steps=steps, cfg=cfg, seed=entry_seed(k))
    cond = cached_conditioning(entry, cfg, editor.zero_cond_t)
    return editor._sample(request, cond, cfg, None, None, tuple(entry.target_latents.shape[-2:]))[0]


def editor_lbm(editor, entry, k: int) -> torch.Tensor:
    """The Editor's 1-step LBM sampling: [main, sub] from [lbm_source_latents, sub_noise]."""
    from diffsynth_qie.inference import EditRequest

    request = EditRequest([Image.new("RGB", (16, 16))], "", lbm_steps=1, seed=entry_seed(k))
    cond = cached_conditioning(entry, 1.0, editor.zero_cond_t)
    return editor._sample(request, cond, 1.0, entry.lbm_source_latents, entry.sub_noise,
                          tuple(entry.target_latents.shape[-2:]))


def validator(store, indices, out, model_dir, steps=3, cfg=2.0, zero_cond_t=True) -> Validator:
    return Validator(store, indices, str(out), "tiny", str(model_dir), steps, cfg, zero_cond_t, ACCELERATOR,
                     torch.float32)


def state_snapshot(module) -> dict:
    return {n: p.detach().clone() for n, p in module.state_dict().items()}


class SourcelessRows:
    """A store whose rows ``drop`` have no LBM source (text-to-image rows)."""

    def __init__(self, store, drop):
        self.store, self.drop = store, set(drop)

    def load(self, i):
        e = self.store.load(i)
        return dataclasses.replace(e, lbm_source_latents=None) if i in self.drop else e


# --- flow matching ----------------------------------------------------------------------
def test_flow_match_validation_is_the_editors_sampling(store, tiny_pipe, tmp_path):
    """Entries 0 and 5 share a shape (one batch), 2 has its own; cfg 2 runs the negative pass."""
    indices = [0, 5, 2]
    entries = [store.load(i) for i in indices]
    assert entries[0].target_latents.shape == entries[1].target_latents.shape != entries[2].target_latents.shape
    module = training_module(tiny_pipe.dit, run_config("sft", zero_cond_t=True))
    renders = validator(store, indices, tmp_path, None).render(module, torch.device("cpu"), torch.float32)
    assert [(r.name, r.entry, r.stream) for r in renders] == [
        (output_name(k, store.meta(i).entry_id), k, None) for k, i in enumerate(indices)]

    editor = editor_for(module.dit, zero_cond_t=True)
    base_editor = editor_for(tiny_pipe.dit, zero_cond_t=True)
    other_zct = editor_for(module.dit, zero_cond_t=False)
    for k, (entry, r) in enumerate(zip(entries, renders)):
        expected = editor_flow_match(editor, entry, k, steps=3, cfg=2.0)
        assert r.latents.shape == entry.target_latents.shape
        assert torch.allclose(r.latents, expected, atol=ATOL, rtol=0), float((r.latents - expected).abs().max())
        assert torch.equal(r.target, entry.target_latents)
        # the comparison can fail: the base weights, zero_cond_t off, another seed all move the latents
        for wrong in (editor_flow_match(base_editor, entry, k, 3, 2.0),
                      editor_flow_match(other_zct, entry, k, 3, 2.0),
                      editor_flow_match(editor, entry, k + 1, 3, 2.0)):
            assert float((r.latents - wrong).abs().max()) > 20 * ATOL  # measured >= 8.9e-4


def test_validation_writes_strips_and_leaves_training_state_alone(store, tiny_pipe, tiny_model_dir, tmp_path):
    from diffsynth_qie.models.qwen_image_edit.encoding import decode_latents

    module = training_module(tiny_pipe.dit, run_config("sft"))
    module.train()
    before, grads = state_snapshot(module), [p.grad for p in module.parameters()]
    flags = {n: p.requires_grad for n, p in module.named_parameters()}
    rng = torch.get_rng_state()
    v = validator(store, [0, 2], tmp_path, tiny_model_dir, steps=2, cfg=1.0)
    images = v.run(7, module, torch.device("cpu"), torch.float32)

    assert module.training and all(m.training for m in module.modules())
    after = state_snapshot(module)
    assert set(after) == set(before) and all(torch.equal(after[n], before[n]) for n in before)
    assert [p.grad for p in module.parameters()] == grads
    assert {n: p.requires_grad for n, p in module.named_parameters()} == flags
    assert torch.equal(torch.get_rng_state(), rng)

    folder = tmp_path / "validation" / "step-7"
    stems = [output_name(k, store.meta(i).entry_id) for k, i in enumerate([0, 2])]
    # the strips and every output's scorecard, no temp files left
    assert {p.name for p in folder.iterdir()} == {f"{s}.png" for s in stems} | {"scores.jsonl"}
    from diffsynth_qie.training.validation_metrics import read_scores

    rows = read_scores(folder / "scores.jsonl")
    assert set(rows) == set(stems) and all({"psnr", "edit_psnr", "shift_px"} <= set(r) for r in rows.values())
    assert list(images) == stems
    renders = v.render(module, torch.device("cpu"), torch.float32)  # deterministic: same latents again
    for k, (i, r) in enumerate(zip([0, 2], renders)):
        entry, meta = store.load(i), store.meta(i)
        height, width = meta.target_size
        ref_h, ref_w = (8 * s for s in meta.edit_shapes[0][1:])
        saved = Image.open(folder / f"{r.name}.png").convert("RGB")
        assert saved.size == (round(ref_w * height / ref_h) + 2 * width, height)
        assert images[r.name].tobytes() == saved.tobytes()
        # panels: [reference | target | output], each the VAE decode of the cached/sampled latents
        pipe = v.decoder.pipe()
        output = decode_latents(pipe, r.latents)
        target = decode_latents(pipe, entry.target_latents)
        x0 = saved.width - 2 * width
        assert saved.crop((x0, 0, x0 + width, height)).tobytes() == target.tobytes()
        assert saved.crop((x0 + width, 0, saved.width, height)).tobytes() == output.tobytes()
    assert tuple(v.decoder.vae_pipe.qie_model_paths) == ("vae",)  # the VAE alone


def test_side_by_side_scales_panels_to_the_output_height():
    a = Image.new("RGB", (10, 20), (255, 0, 0))
    b = Image.new("RGB", (8, 10), (0, 255, 0))
    c = Image.new("RGB", (6, 10), (0, 0, 255))
    strip = side_by_side([a, b, c])
    assert strip.size == (5 + 8 + 6, 10)
    assert strip.getpixel((2, 5)) == (255, 0, 0)
    assert strip.getpixel((5, 5)) == (0, 255, 0) and strip.getpixel((12, 9)) == (0, 255, 0)
    assert strip.getpixel((13, 0)) == (0, 0, 255) and strip.getpixel((18, 9)) == (0, 0, 255)
    with pytest.raises(ValueError, match="at least one"):
        side_by_side([])


# --- LBM --------------------------------------------------------------------------------
def test_lbm_validation_starts_at_the_priors_and_skips_main_without_source(store, tiny_pipe, tiny_model_dir,
                                                                           tmp_path):
    """A zero-velocity DiT: one bridge step returns the prior, so main = lbm_source_latents and
    sub = sub_noise exactly. Row 1 has no source: sub only."""
    dit = copy.deepcopy(tiny_pipe.dit)
    with torch.no_grad():
        dit.proj_out.weight.zero_()
        dit.proj_out.bias.zero_()
    module = training_module(dit, run_config("lbm", lbm=LBMConfig(lbm_bridge_noise=0.3)), perturb=False)
    rows = SourcelessRows(store, drop={1})
    v = validator(rows, [0, 1], tmp_path, tiny_model_dir, steps=8, cfg=1.0)
    renders = v.render(module, torch.device("cpu"), torch.float32)
    s0, s1 = output_name(0, store.meta(0).entry_id), output_name(1, store.meta(1).entry_id)
    assert [(r.name, r.entry, r.stream) for r in renders] == [
        (f"{s0}_main", 0, "main"), (f"{s0}_sub", 0, "sub"), (f"{s1}_sub", 1, "sub")]
    e0, e1 = store.load(0), store.load(1)
    assert torch.equal(renders[0].latents, e0.lbm_source_latents)
    assert torch.equal(renders[1].latents, e0.sub_noise)
    assert torch.equal(renders[2].latents, e1.sub_noise)
    assert not torch.equal(e0.sub_noise, e0.lbm_source_latents)
    assert all(torch.equal(r.target, e.target_latents) for r, e in zip(renders, (e0, e0, e1)))

    images = v.run(3, module, torch.device("cpu"), torch.float32)
    folder = tmp_path / "validation" / "step-3"
    assert {p.name for p in folder.iterdir()} == {f"{s0}_main.png", f"{s0}_sub.png", f"{s1}_sub.png", "scores.jsonl"}
    assert list(images) == [f"{s0}_main", f"{s0}_sub", f"{s1}_sub"]


def test_lbm_validation_is_the_editors_lbm_sampling(store, tiny_pipe, tmp_path):
    indices = [0, 5, 1]  # 0 and 5 share a shape: main+sub of both in one batch of 4
    module = training_module(tiny_pipe.dit, run_config("lbm", zero_cond_t=True), seed=1)
    renders = validator(store, indices, tmp_path, None, cfg=1.0).render(module, torch.device("cpu"), torch.float32)
    assert [r.stream for r in renders] == ["main", "sub"] * 3
    editor = editor_for(module.dit, zero_cond_t=True)
    for k, i in enumerate(indices):
        entry = store.load(i)
        expected = editor_lbm(editor, entry, k)
        got = torch.stack([renders[2 * k].latents, renders[2 * k + 1].latents])
        assert torch.allclose(got, expected, atol=ATOL, rtol=0), float((got - expected).abs().max())
        # a real step: the outputs left the priors
        assert float((got[0] - entry.lbm_source_latents).abs().max()) > 100 * ATOL
        assert float((got[1] - entry.sub_noise).abs().max()) > 100 * ATOL


# --- end to end -------------------------------------------------------------------------
def test_train_lbm_renders_lbm_validation(cache_dir, store, tiny_model_dir, tmp_path):
    """`--loss lbm` (prodigy_sf, the trainer's eval()/train() around validation) writes main
    and sub strips for every held-out entry at each validation step."""

    from diffsynth_qie.training.loop import train

    cfg = RunConfig(train=TrainConfig(cache_dir=str(cache_dir), output_dir=str(tmp_path / "run"), model="tiny",
                                      model_dir=str(tiny_model_dir), batch_size=2, max_steps=2, save_every=0,
                                      gradient_checkpointing=False, validate_every=2, num_validation=2,
                                      validation_steps=2, device="cpu", mixed_precision="no", seed=0),
                    lora=LoRAConfig(lora_rank=4), loss=LossConfig(loss="lbm"), lbm=LBMConfig())
    with fresh_accelerate():
        train(cfg)
    files = [p.name for p in (tmp_path / "run" / "validation" / "step-2").glob("*.png")]
    streams: dict[str, set] = {}
    for name in files:
        stem, stream = name[:-len(".png")].rsplit("_", 1)
        streams.setdefault(stem, set()).add(stream)
    candidates = {output_name(k, store.meta(i).entry_id) for k in range(2) for i in range(len(store))}
    assert len(files) == 4 and set(streams) <= candidates
    assert sorted(stem.split("-", 1)[0] for stem in streams) == ["0", "1"]
    assert all(s == {"main", "sub"} for s in streams.values())
