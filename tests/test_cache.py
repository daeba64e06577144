"""Phase-1 cache: round trip, resume, invalidation, stale rows, white latents, bad rows,
format version, ranks. Tiny model, fp32 CPU; a 4-row subset of the demo data keeps it fast."""
from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from diffsynth_qie.cache import store as store_mod
from diffsynth_qie.cache.shards import ShardWriter, scan_shards
from diffsynth_qie.cache.store import CacheEntry, CacheStore, EntryMeta
from diffsynth_qie.cache.writer import CacheConfig, finalize_cache, write_cache
from diffsynth_qie.data import DatasetConfig, fit_to_budget, load_mask, load_rgb, resize_to
from diffsynth_qie.data.demo import make_demo_jsonl
from diffsynth_qie.models.qwen_image_edit.encoding import encode_image, encode_prompt, white_latents

MAX_PIXELS = 128 * 128
SUBSET = [0, 1, 3, 5]  # 64x64, a portrait, 128x128 with two sources, 64x64 again (shared white size)
ATOL = 1e-5


# ---------------------------------------------------------------- helpers

def _copy_subset(src: Path, dst: Path, indices=SUBSET) -> Path:
    shutil.copytree(src / "images", dst / "images")
    rows = json.loads((src / "metadata.json").read_text())
    for i, r in enumerate(rows):
        r.setdefault("id", f"row{i}")
    (dst / "metadata.json").write_text(json.dumps([rows[i] for i in indices], indent=1))
    return dst


def _config(cache_dir: Path, data_dir: Path, tiny_model_dir, metadata="metadata.json", **kw) -> CacheConfig:
    ds = {k: kw.pop(k) for k in list(kw) if k in {f.name for f in dataclasses.fields(DatasetConfig)}}
    kw.setdefault("shard_size", 2)
    return CacheConfig(cache_dir=str(cache_dir), model="tiny", model_dir=str(tiny_model_dir), max_pixels=MAX_PIXELS,
                       device="cpu", dtype="float32", num_workers=2,
                       dataset=DatasetConfig(dataset_metadata=str(data_dir / metadata), **ds), **kw)


class EncoderCalls:
    """Counts text-encoder forwards (one per prompt alternative + one for the empty prompt per row)."""

    def __init__(self, pipe, monkeypatch):
        self.n = 0
        inner = pipe.text_encoder.forward

        def counted(*a, **k):
            self.n += 1
            return inner(*a, **k)

        monkeypatch.setattr(pipe.text_encoder, "forward", counted)


def _entries(store: CacheStore) -> dict[str, CacheEntry]:
    return {store.meta(i).entry_id: store.load(i) for i in range(len(store))}


def _tensors(e: CacheEntry) -> dict[str, torch.Tensor]:
    out = e.own_tensors()
    out["sub_noise"] = e.sub_noise
    if e.lbm_source_latents is not None:
        out["lbm_source_latents"] = e.lbm_source_latents
    return out


def _assert_same(a: CacheEntry, b: CacheEntry, exact=True):
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        if exact:
            assert torch.equal(ta[k], tb[k]), k
        else:
            torch.testing.assert_close(ta[k], tb[k], atol=ATOL, rtol=1e-4, msg=k)


@pytest.fixture(scope="module")
def subset_dir(demo_data_dir, tmp_path_factory):
    return _copy_subset(Path(demo_data_dir), tmp_path_factory.mktemp("subset"))


@pytest.fixture(scope="module")
def base_cache(subset_dir, tiny_pipe, tiny_model_dir, tmp_path_factory):
    """The subset cached once in one rank; the reference for the other tests."""
    cache_dir = tmp_path_factory.mktemp("base-cache")
    summary = write_cache(_config(cache_dir, subset_dir, tiny_model_dir), pipe=tiny_pipe)
    assert summary.computed == len(SUBSET) and summary.manifest is not None
    return cache_dir


# ---------------------------------------------------------------- tests

def test_round_trip_matches_direct_encoding(base_cache, subset_dir, tiny_pipe):
    from diffsynth.pipelines.qwen_image import QwenImageUnit_PromptEmbedder

    store = CacheStore.open(base_cache)
    assert store.entry_ids == [f"row{i}" for i in SUBSET]  # metadata order
    assert store.preset == "tiny" and len(store) == len(SUBSET)
    assert {p.suffix for p in base_cache.rglob("*") if p.is_file()} <= {".json", ".jsonl", ".safetensors"}

    rows = json.loads((subset_dir / "metadata.json").read_text())
    for i, rec in enumerate(rows):
        meta, e = store.meta(i), store.load(i)
        # recompute from the files, independently of the writer's code path
        tgt = load_rgb(subset_dir / rec["image"])
        tgt = resize_to(tgt, fit_to_budget(tgt.width, tgt.height, MAX_PIXELS))
        srcs = [load_rgb(subset_dir / p) for p in rec["edit_image"]]
        edits = [resize_to(s, fit_to_budget(s.width, s.height, MAX_PIXELS)) for s in srcs]
        torch.testing.assert_close(e.target_latents, encode_image(tiny_pipe, tgt), atol=ATOL, rtol=1e-4)
        assert len(e.edit_latents) == meta.n_edit == len(edits)
        for lat, im in zip(e.edit_latents, edits):
            torch.testing.assert_close(lat, encode_image(tiny_pipe, im), atol=ATOL, rtol=1e-4)
        # DiffSynth's own unit with the multi-image template (the tiny preset behaves like 2509)
        ref = QwenImageUnit_PromptEmbedder().process(tiny_pipe, rec["prompt"], edits)
        torch.testing.assert_close(e.prompt_embs[0], ref["prompt_emb"][0], atol=ATOL, rtol=1e-4)
        assert torch.equal(e.prompt_masks[0], torch.ones(meta.prompt_lengths[0], dtype=torch.long))
        torch.testing.assert_close(e.empty_prompt_emb, encode_prompt(tiny_pipe, "", edits), atol=ATOL, rtol=1e-4)
        assert e.empty_prompt_mask.shape == (meta.empty_prompt_length,)
        # mask: binary at target size, then the mean of each 8x8 block
        m = np.asarray(resize_to(load_mask(subset_dir / rec["back_mask"]), tgt.size), dtype=np.float32) / 255
        h, w = m.shape[0] // 8, m.shape[1] // 8
        expect = m.reshape(h, 8, w, 8).mean(axis=(1, 3))[None]
        torch.testing.assert_close(e.back_mask, torch.from_numpy(expect))
        assert ((e.back_mask > 0) & (e.back_mask < 1)).any()  # partial coverage is fractional
        ref_gt = load_rgb(subset_dir / rec["ref_gt"])
        ref_gt = resize_to(ref_gt, fit_to_budget(ref_gt.width, ref_gt.height, MAX_PIXELS))
        torch.testing.assert_close(e.ref_gt_latents, encode_image(tiny_pipe, ref_gt), atol=ATOL, rtol=1e-4)
        # LBM source: first source at the target's size (same pixels as edit 0 here, stored once)
        lbm = encode_image(tiny_pipe, resize_to(srcs[0], tgt.size))
        torch.testing.assert_close(e.lbm_source_latents, lbm, atol=ATOL, rtol=1e-4)
        # metadata agrees with the tensors
        assert meta.target_size == (tgt.height, tgt.width)
        assert meta.target_shape == tuple(e.target_latents.shape) == (16, tgt.height // 8, tgt.width // 8)
        assert meta.edit_shapes == [tuple(t.shape) for t in e.edit_latents]
        assert meta.prompt_lengths == [t.shape[0] for t in e.prompt_embs]
        assert meta.prompt_dim == e.prompt_embs[0].shape[1]
        assert meta.has_back_mask and meta.has_ref_gt and meta.lbm_source == store_mod.LBM_EDIT0
        assert meta.image_tokens == sum(s[1] * s[2] // 4 for s in [meta.target_shape, *meta.edit_shapes])
        assert meta.prompts == [rec["prompt"]] and meta.dataset == subset_dir.name and not meta.inverse
    assert [store.meta(i).n_edit for i in range(len(store))] == [1, 1, 2, 1]


def test_sub_noise_is_white_latents_stored_once(base_cache, tiny_pipe):
    store = CacheStore.open(base_cache)
    sizes = {store.meta(i).target_size for i in range(len(store))}
    with safe_open(str(base_cache / store_mod.shared_name(store.manifest)), "pt") as f:
        keys = set(f.keys())
        assert keys == {f"sub_noise/{h}x{w}" for h, w in sizes}  # 3 sizes for 4 rows
        for key in keys:
            h, w = map(int, key.split("/")[1].split("x"))
            torch.testing.assert_close(f.get_tensor(key), white_latents(tiny_pipe, w, h), atol=ATOL, rtol=1e-4)
    for shard in store.manifest["shards"]:
        with safe_open(str(base_cache / "shards" / shard), "pt") as f:
            assert not [k for k in f.keys() if "sub_noise" in k]
    e0, e3 = store.load(0), store.load(3)
    assert store.meta(0).target_size == store.meta(3).target_size
    assert torch.equal(e0.sub_noise, e3.sub_noise)
    h, w = store.meta(0).target_size
    torch.testing.assert_close(e0.sub_noise, white_latents(tiny_pipe, w, h), atol=ATOL, rtol=1e-4)
    assert torch.equal(e0.sub_noise_ref_gt, e0.sub_noise)  # ref_gt has the target's size here


def test_interrupted_run_resumes(subset_dir, tiny_pipe, tiny_model_dir, base_cache, tmp_path, monkeypatch):
    cfg = _config(tmp_path / "cache", subset_dir, tiny_model_dir, shard_size=2)

    def crash_after_three(meta, seen=[]):
        seen.append(meta.entry_id)
        if len(seen) == 3:
            raise KeyboardInterrupt("simulated kill")

    with pytest.raises(KeyboardInterrupt):
        write_cache(cfg, pipe=tiny_pipe, on_entry=crash_after_three)
    with pytest.raises(ValueError, match="manifest.json missing"):
        CacheStore.open(cfg.cache_dir)
    done = {m.entry_id for m in scan_shards(cfg.cache_dir)}
    assert done == {"row0", "row1", "row3"}  # finished entries survive the interruption

    calls = EncoderCalls(tiny_pipe, monkeypatch)
    summary = write_cache(cfg, pipe=tiny_pipe)
    assert (summary.computed, summary.reused) == (1, 3)
    assert calls.n == 2  # one prompt + the empty prompt, for row5 only
    got, ref = _entries(CacheStore.open(cfg.cache_dir)), _entries(CacheStore.open(base_cache))
    assert list(got) == list(ref)
    for k in ref:
        _assert_same(got[k], ref[k], exact=False)


def test_changed_image_or_prompt_recomputes_only_that_row(subset_dir, tiny_pipe, tiny_model_dir, tmp_path,
                                                          monkeypatch):
    data = _copy_subset(subset_dir, tmp_path / "data", indices=range(len(SUBSET)))
    cfg = _config(tmp_path / "cache", data, tiny_model_dir, shard_size=3)
    write_cache(cfg, pipe=tiny_pipe)
    before = _entries(CacheStore.open(cfg.cache_dir))

    rows = json.loads((data / "metadata.json").read_text())
    rows[1]["prompt"] = "turn everything upside down"
    (data / "metadata.json").write_text(json.dumps(rows))
    tgt = data / rows[2]["image"]
    Image.open(tgt).convert("RGB").transpose(Image.FLIP_LEFT_RIGHT).save(tgt)

    calls = EncoderCalls(tiny_pipe, monkeypatch)
    summary = write_cache(cfg, pipe=tiny_pipe)
    assert (summary.computed, summary.reused) == (2, 2) and calls.n == 4
    store = CacheStore.open(cfg.cache_dir)
    after = _entries(store)
    ids = [r["id"] for r in rows]
    assert list(after) == ids
    _assert_same(after[ids[0]], before[ids[0]])
    _assert_same(after[ids[3]], before[ids[3]])
    assert not torch.allclose(after[ids[1]].prompt_embs[0][-8:], before[ids[1]].prompt_embs[0][-8:])
    assert torch.equal(after[ids[1]].target_latents, before[ids[1]].target_latents)
    assert not torch.allclose(after[ids[2]].target_latents, before[ids[2]].target_latents)
    assert store.meta(1).prompts == ["turn everything upside down"]
    # the superseded entries are gone from disk, not just from the manifest
    assert sorted(m.entry_id for m in scan_shards(cfg.cache_dir)) == sorted(ids)


def test_stale_rows_dropped(subset_dir, tiny_pipe, tiny_model_dir, tmp_path, monkeypatch):
    data = _copy_subset(subset_dir, tmp_path / "data", indices=range(len(SUBSET)))
    cfg = _config(tmp_path / "cache", data, tiny_model_dir, shard_size=2)
    write_cache(cfg, pipe=tiny_pipe)
    rows = json.loads((data / "metadata.json").read_text())
    kept = [rows[0], rows[2], rows[3]]
    (data / "metadata.json").write_text(json.dumps(kept))
    calls = EncoderCalls(tiny_pipe, monkeypatch)
    summary = write_cache(cfg, pipe=tiny_pipe)
    assert summary.computed == 0 and calls.n == 0
    store = CacheStore.open(cfg.cache_dir)
    assert store.entry_ids == [r["id"] for r in kept]
    assert sorted(m.entry_id for m in scan_shards(cfg.cache_dir)) == sorted(r["id"] for r in kept)
    on_disk = {p.name for p in (Path(cfg.cache_dir) / "shards").iterdir()}
    assert on_disk == set(store.manifest["shards"]) | {s.replace(".safetensors", ".json") for s in store.manifest["shards"]}


def test_bad_rows_reported(subset_dir, tiny_pipe, tiny_model_dir, tmp_path):
    data = _copy_subset(subset_dir, tmp_path / "data", indices=range(len(SUBSET)))
    rows = json.loads((data / "metadata.json").read_text())
    good = rows[0]
    (data / "images" / "trunc.png").write_bytes((data / good["image"]).read_bytes()[:60])
    Image.new("L", (8, 8), 255).save(data / "images" / "small_mask.png")
    bad = [
        dict(good, id="missing", image="images/nope.png"),
        dict(good, id="empty", prompt="  "),
        dict(good, id="truncated", image="images/trunc.png"),
        dict(good, id="mask_size", back_mask="images/small_mask.png"),
    ]
    (data / "metadata.json").write_text(json.dumps(rows + bad))
    cfg = _config(tmp_path / "cache", data, tiny_model_dir)
    with pytest.raises(ValueError, match="max_bad_fraction"):  # 4 of 8 bad > 5 %
        write_cache(cfg, pipe=tiny_pipe)
    skipped = [json.loads(line) for line in (Path(cfg.cache_dir) / "skipped.jsonl").read_text().splitlines()]
    assert {(s["row_id"], s["field"]) for s in skipped} == {
        ("missing", "target"), ("empty", "prompts"), ("truncated", "target"), ("mask_size", "back_mask")}

    cfg.dataset.max_bad_fraction = 0.5
    summary = write_cache(cfg, pipe=tiny_pipe)
    assert summary.skipped == 4 and summary.manifest["num_skipped"] == 4
    assert CacheStore.open(cfg.cache_dir).entry_ids == [r["id"] for r in rows]


def test_single_image_preset_uses_single_template_and_skips_multi_source_rows(subset_dir, tiny_pipe,
                                                                              tiny_model_dir, tmp_path):
    from diffsynth.pipelines.qwen_image import QwenImageUnit_PromptEmbedder

    pipe = copy.copy(tiny_pipe)  # shallow: same modules, own preset
    pipe.qie_preset = dataclasses.replace(tiny_pipe.qie_preset, multi_image_prompt=False)
    cfg = _config(tmp_path / "cache", subset_dir, tiny_model_dir, max_bad_fraction=0.5)
    summary = write_cache(cfg, pipe=pipe)
    skipped = [json.loads(line) for line in (Path(cfg.cache_dir) / "skipped.jsonl").read_text().splitlines()]
    assert [(s["row_id"], s["field"]) for s in skipped] == [("row3", "edit_images")]
    store = CacheStore.open(cfg.cache_dir)
    assert store.entry_ids == ["row0", "row1", "row5"] and summary.computed == 3
    assert not store.manifest["multi_image_prompt"]
    rec = json.loads((subset_dir / "metadata.json").read_text())[0]
    src = load_rgb(subset_dir / rec["edit_image"][0])
    ref = QwenImageUnit_PromptEmbedder().process(tiny_pipe, rec["prompt"], src)  # a single Image: single template
    e = store.load(0)
    torch.testing.assert_close(e.prompt_embs[0], ref["prompt_emb"][0], atol=ATOL, rtol=1e-4)
    multi = encode_prompt(tiny_pipe, rec["prompt"], [src], multi_image=True)  # what 2509/2511 would cache
    assert multi.shape != e.prompt_embs[0].shape or not torch.allclose(multi, e.prompt_embs[0])


def test_format_version_mismatch_is_a_clear_error_and_a_rerun_repairs(subset_dir, tiny_pipe, tiny_model_dir,
                                                                      tmp_path, monkeypatch):
    cfg = _config(tmp_path / "cache", subset_dir, tiny_model_dir)
    write_cache(cfg, pipe=tiny_pipe)
    cache_dir = Path(cfg.cache_dir)
    for path in [cache_dir / "manifest.json", *(cache_dir / "shards").glob("*.json")]:
        d = json.loads(path.read_text())
        d["format_version"] = 0
        path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"format_version 0.*re-run `qie cache`"):
        CacheStore.open(cache_dir)
    calls = EncoderCalls(tiny_pipe, monkeypatch)
    summary = write_cache(cfg, pipe=tiny_pipe)
    assert summary.computed == len(SUBSET) and calls.n == 2 * len(SUBSET)
    assert CacheStore.open(cache_dir).manifest["format_version"] == store_mod.FORMAT_VERSION


def test_two_ranks_cover_rows_disjointly(subset_dir, tiny_pipe, tiny_model_dir, base_cache, tmp_path):
    cfg = _config(tmp_path / "cache", subset_dir, tiny_model_dir, shard_size=1)
    seen: dict[int, list[str]] = {0: [], 1: []}
    s0 = write_cache(cfg, pipe=tiny_pipe, rank=0, world_size=2, finalize=False,
                     on_entry=lambda m: seen[0].append(m.entry_id))
    assert s0.manifest is None
    with pytest.raises(ValueError, match="rank 1 of 2 has not finished"):
        finalize_cache(cfg.cache_dir, world_size=2)
    s1 = write_cache(cfg, pipe=tiny_pipe, rank=1, world_size=2, on_entry=lambda m: seen[1].append(m.entry_id))
    assert s1.manifest is None  # only rank 0 finalises by default
    assert seen == {0: ["row0", "row3"], 1: ["row1", "row5"]}  # row i -> rank i % 2
    manifest = finalize_cache(cfg.cache_dir, world_size=2)
    assert [e["id"] for e in manifest["entries"]] == ["row0", "row1", "row3", "row5"]
    assert not list((Path(cfg.cache_dir) / "parts").iterdir())
    got, ref = _entries(CacheStore.open(cfg.cache_dir)), _entries(CacheStore.open(base_cache))
    assert list(got) == list(ref)
    for k in ref:
        _assert_same(got[k], ref[k], exact=False)


def test_jsonl_rows_of_every_kind(tiny_pipe, tiny_model_dir, tmp_path):
    data = make_demo_jsonl(tmp_path / "data", num_pairs=2, seed=1, num_t2i=1)
    cfg = _config(tmp_path / "cache", data, tiny_model_dir, metadata="metadata.jsonl", t2i_mode=True)
    write_cache(cfg, pipe=tiny_pipe)
    store = CacheStore.open(cfg.cache_dir)
    recs = [json.loads(line) for line in (data / "metadata.jsonl").read_text().splitlines()]
    metas = [store.meta(i) for i in range(len(store))]
    kinds = {(m.n_edit, m.inverse, m.lbm_source) for m in metas}
    assert (0, False, "none") in kinds and any(m.inverse for m in metas)
    for i, m in enumerate(metas):
        e = store.load(i)
        assert len(e.prompt_embs) == m.n_prompts == len(m.prompts)
        if m.n_edit == 0:  # text-to-image: no sources, no LBM prior, t2i template
            assert e.edit_latents == [] and e.lbm_source_latents is None
            torch.testing.assert_close(e.prompt_embs[0], encode_prompt(tiny_pipe, m.prompts[0]), atol=ATOL, rtol=1e-4)
        else:
            edits = [load_rgb(data / m.sources[f"edit_images[{j}]"]) for j in range(m.n_edit)]
            edits = [resize_to(im, fit_to_budget(im.width, im.height, MAX_PIXELS)) for im in edits]
            for emb, text in zip(e.prompt_embs, m.prompts):
                torch.testing.assert_close(emb, encode_prompt(tiny_pipe, text, edits), atol=ATOL, rtol=1e-4)
    fwd = next(r for r in recs if r.get("inverse_instruction") and isinstance(r["source_image"], str))
    inv = next(m for m in metas if m.inverse and m.prompts[0] == fwd["inverse_instruction"])
    assert inv.prompts == [fwd["inverse_instruction"], fwd["inverse_instruction_cn"]]
    assert inv.sources["target"] == fwd["source_image"] and inv.sources["edit_images[0]"] == fwd["target_image"]


def test_nan_is_refused_naming_the_row(tmp_path):
    z = torch.zeros(16, 2, 2)
    emb, mask = torch.zeros(3, 4), torch.ones(3, dtype=torch.long)
    entry = CacheEntry("r", "r", "d", False, [emb], [mask], emb, mask, z.clone().fill_(float("nan")), [z], z)
    meta = EntryMeta("r", "r", "d", False, "h", ["p"], [3], 3, 4, (16, 16), (16, 2, 2), [(16, 2, 2)], False, None,
                     "edit0", "sub_noise/16x16", None, "float32")
    writer = ShardWriter(tmp_path, rank=0, shard_size=4)
    writer.add_shared("sub_noise/16x16", z)
    with pytest.raises(ValueError, match="row 'r'.*target_latents.*NaN"):
        writer.add(entry, meta)


# ---------------------------------------------------------------- crash states

def _finished_cache(subset_dir, tiny_pipe, tiny_model_dir, tmp_path, base_cache, **kw):
    """A finished copy of ``base_cache`` plus the config that wrote it (shard_size=2 there)."""
    cache = tmp_path / "cache"
    shutil.copytree(base_cache, cache)
    return cache, _config(cache, subset_dir, tiny_model_dir, **kw)


def _shard_files(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "shards").iterdir())


def test_temp_files_of_killed_writes_are_never_counted(subset_dir, tiny_pipe, tiny_model_dir, base_cache, tmp_path,
                                                       monkeypatch):
    """A run killed between writing a sidecar and renaming it leaves a complete temp sidecar; other
    kills leave partial temp shards, white-latent parts, manifest, report and skipped list."""
    cache, cfg = _finished_cache(subset_dir, tiny_pipe, tiny_model_dir, tmp_path, base_cache)
    manifest = json.loads((cache / "manifest.json").read_text())
    victim = manifest["shards"][0]
    n_victim = sum(e["shard"] == victim for e in manifest["entries"])
    sidecar = cache / "shards" / victim.replace(".safetensors", ".json")
    sidecar.rename(cache / "shards" / f".{sidecar.stem}.k2j_x9a.tmp.json")  # complete, never renamed
    (cache / "shards" / f".{Path(victim).stem}.zz9_q1w.tmp.safetensors").write_bytes(b"\x10\x00partial")
    (cache / "shards" / ".r0000-20990101000000-abcdef-00007.q1w2e3.tmp.json").write_text("{\"format_ver")
    (cache / "parts").mkdir(exist_ok=True)
    (cache / "parts" / ".shared-r0000-20990101000000-abcdef-00000.a1b2c3.tmp.safetensors").write_bytes(b"xx")
    (cache / "parts" / ".rank-0000-of-0001.d4e5f6.tmp.json").write_text("{}")
    (cache / ".manifest.g7h8i9.tmp.json").write_text("{}")
    (cache / ".skipped.j1k2l3.tmp.jsonl").write_text("")
    (cache / "manifest.json").unlink()  # the run was killed before finalising

    assert {m.entry_id for m in scan_shards(cache)} == {e["id"] for e in manifest["entries"] if e["shard"] != victim}
    calls = EncoderCalls(tiny_pipe, monkeypatch)
    summary = write_cache(cfg, pipe=tiny_pipe)
    assert (summary.computed, summary.reused) == (n_victim, len(SUBSET) - n_victim)
    assert calls.n == 2 * n_victim
    store = CacheStore.open(cache)  # "cache ready" means the trainer can read it
    got, ref = _entries(store), _entries(CacheStore.open(base_cache))
    assert list(got) == list(ref)
    for k in ref:
        _assert_same(got[k], ref[k], exact=False)
    names = [p.name for p in cache.rglob("*")]
    assert not [n for n in names if ".tmp" in n], names  # every leftover removed
    assert _shard_files(cache) == sorted(store.manifest["shards"] + [s.replace(".safetensors", ".json")
                                                                      for s in store.manifest["shards"]])


def _fail_manifest_write(monkeypatch):
    """Kill finalisation just before manifest.json is written."""
    from diffsynth_qie.cache import shards as mod

    inner = mod.atomic_write_json

    def write(path, obj):
        if Path(path).name == "manifest.json":
            raise KeyboardInterrupt("killed before the manifest")
        inner(path, obj)

    monkeypatch.setattr(mod, "atomic_write_json", write)


def test_white_latent_update_killed_before_the_manifest_keeps_the_old_cache(
        subset_dir, tiny_pipe, tiny_model_dir, base_cache, tmp_path, monkeypatch):
    """Dropping the only portrait row shrinks the white latents; the old manifest still needs them."""
    data = _copy_subset(subset_dir, tmp_path / "data", indices=range(len(SUBSET)))
    cache = tmp_path / "cache"
    shutil.copytree(base_cache, cache)
    cfg = _config(cache, data, tiny_model_dir)
    rows = json.loads((data / "metadata.json").read_text())
    (data / "metadata.json").write_text(json.dumps([rows[0], rows[2], rows[3]]))  # row1: the only portrait size
    with monkeypatch.context() as m:
        _fail_manifest_write(m)
        with pytest.raises(KeyboardInterrupt):
            write_cache(cfg, pipe=tiny_pipe)
    old = CacheStore.open(cache)  # the old manifest with every file it reads
    assert old.entry_ids == [f"row{i}" for i in SUBSET]
    got, ref = _entries(old), _entries(CacheStore.open(base_cache))
    for k in ref:
        _assert_same(got[k], ref[k])  # the portrait row's white latents included

    summary = write_cache(cfg, pipe=tiny_pipe)  # the next run finishes the job
    assert summary.computed == 0
    new = CacheStore.open(cache)
    assert new.entry_ids == ["row0", "row3", "row5"]
    for k, e in _entries(new).items():
        _assert_same(e, ref[k])
    shared = sorted(p.name for p in cache.glob("shared*.safetensors"))
    assert shared == [new.manifest["shared"]] and shared != [old.manifest["shared"]]  # old version removed
    with safe_open(str(cache / shared[0]), "pt") as f:
        assert len(list(f.keys())) == 2


def test_white_latent_update_killed_after_the_manifest(subset_dir, tiny_pipe, tiny_model_dir, base_cache, tmp_path):
    """Killed after the manifest, before the old version was deleted: the new manifest reads its own
    file, and the next run removes the old one."""
    cache, cfg = _finished_cache(subset_dir, tiny_pipe, tiny_model_dir, tmp_path, base_cache)
    current = CacheStore.open(cache).manifest["shared"]
    stale = cache / "shared-0123456789abcdef.safetensors"
    shutil.copy(cache / current, stale)
    (cache / "shared.safetensors").write_bytes((cache / current).read_bytes())  # older name scheme too
    assert len(CacheStore.open(cache)) == len(SUBSET)
    assert write_cache(cfg, pipe=tiny_pipe).computed == 0
    assert sorted(p.name for p in cache.glob("shared*")) == [current]
    got, ref = _entries(CacheStore.open(cache)), _entries(CacheStore.open(base_cache))
    for k in ref:
        _assert_same(got[k], ref[k])


@pytest.mark.parametrize("lost", ["shard", "sidecar", "shared"])
def test_missing_file_message_names_the_missing_file(subset_dir, tiny_pipe, tiny_model_dir, base_cache, tmp_path,
                                                     lost):
    cache, _ = _finished_cache(subset_dir, tiny_pipe, tiny_model_dir, tmp_path, base_cache)
    manifest = json.loads((cache / "manifest.json").read_text())
    shard = manifest["shards"][-1]
    path = {"shard": cache / "shards" / shard, "sidecar": cache / "shards" / shard.replace(".safetensors", ".json"),
            "shared": cache / store_mod.shared_name(manifest)}[lost]
    path.unlink()
    with pytest.raises(ValueError) as info:
        CacheStore.open(cache)
    msg = str(info.value)
    assert str(path.relative_to(cache)) in msg and "is missing" in msg and "re-run `qie cache`" in msg


# ---------------------------------------------------------------- one run per directory

def _hold_lock_in_subprocess(cache: Path, seconds: float):
    """Another process holding the directory's lock (it prints 'locked' once it has it)."""
    import subprocess
    import sys

    code = ("import sys, time; from diffsynth_qie.utils.dir_lock import CacheLock; "
            f"l = CacheLock({str(cache)!r}); l.acquire(); print('locked', flush=True); time.sleep({seconds})")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_run_on_the_same_directory_exits_naming_the_holder(subset_dir, tiny_pipe, tiny_model_dir, base_cache,
                                                                  tmp_path, monkeypatch):
    import socket

    cache, cfg = _finished_cache(subset_dir, tiny_pipe, tiny_model_dir, tmp_path, base_cache)
    before = sorted(p.name for p in cache.rglob("*"))
    holder = _hold_lock_in_subprocess(cache, 60)
    try:
        calls = EncoderCalls(tiny_pipe, monkeypatch)
        with pytest.raises(ValueError) as info:
            write_cache(cfg, pipe=tiny_pipe)
        msg = str(info.value)
        assert str(cache) in msg and f"pid {holder.pid} on {socket.gethostname()}" in msg
        assert "--lock_timeout" in msg and calls.n == 0
        with pytest.raises(ValueError, match=f"pid {holder.pid}"):
            finalize_cache(cache, world_size=1)
        assert sorted(p.name for p in cache.rglob("*")) == before  # nothing written, nothing deleted
    finally:
        holder.kill()  # a killed holder's lock is released by the OS
        holder.wait()
    summary = write_cache(cfg, pipe=tiny_pipe)
    assert summary.computed == 0 and len(CacheStore.open(cache)) == len(SUBSET)


def test_second_run_waits_for_the_first_with_lock_timeout(subset_dir, tiny_pipe, tiny_model_dir, base_cache,
                                                          tmp_path):
    import time

    cache, cfg = _finished_cache(subset_dir, tiny_pipe, tiny_model_dir, tmp_path, base_cache, lock_timeout=30)
    holder = _hold_lock_in_subprocess(cache, 1.5)
    t0 = time.monotonic()
    summary = write_cache(cfg, pipe=tiny_pipe)
    assert time.monotonic() - t0 >= 1.0 and holder.wait(5) == 0
    assert summary.manifest is not None and len(CacheStore.open(cache)) == len(SUBSET)


def test_lock_is_exclusive_between_file_descriptors(tmp_path):
    from diffsynth_qie.utils.dir_lock import CacheLock

    a, b = CacheLock(tmp_path), CacheLock(tmp_path)
    a.acquire()
    with pytest.raises(ValueError, match=f"pid {__import__('os').getpid()}"):
        b.acquire(timeout=0.2, poll=0.05)
    a.release()
    b.acquire()
    b.release()


def test_relaunch_reads_no_unchanged_image_and_rehashes_a_touched_one(tiny_model_dir, demo_data_dir, tmp_path,
                                                                      monkeypatch):
    """An unchanged dataset is not re-read for hashing on relaunch (size + mtime), and no encoder loads."""
    import os

    from diffsynth_qie.cache import fingerprint

    data = tmp_path / "data"
    shutil.copytree(demo_data_dir, data)
    config = _config(tmp_path / "c", data, tiny_model_dir)
    write_cache(config)
    read = []
    real = fingerprint.image_bytes_hash
    monkeypatch.setattr(fingerprint, "image_bytes_hash", lambda p: read.append(Path(p).name) or real(p))

    def no_encoders(*args, **kwargs):
        raise AssertionError("nothing changed: the encoders must not load")

    monkeypatch.setattr("diffsynth_qie.cache.writer.load_encoders", no_encoders)
    second = write_cache(config)
    assert read == [] and second.computed == 0 and second.reused == second.rows
    touched = sorted(p for p in data.rglob("*.png"))[0]
    st = touched.stat()
    os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    third = write_cache(config)
    assert read == [touched.name] and third.computed == 0  # same bytes: re-hashed, still the same entry


def _read_only(monkeypatch):
    """The cache directory as on a read-only mount: its lock file cannot be created."""
    import errno

    from diffsynth_qie.utils import dir_lock

    real = dir_lock.os.open

    def refuse(path, *args, **kwargs):
        if str(path).endswith(dir_lock.CacheLock.name):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(dir_lock.os, "open", refuse)


def test_a_finished_cache_on_a_read_only_mount_is_checked_not_written(base_cache, subset_dir, demo_data_dir,
                                                                    tiny_model_dir, tmp_path, monkeypatch):
    """Phase 1 rerun over a finished cache that now sits on a read-only mount: complete, so exit cleanly having
    written nothing and loaded no encoder; a dataset it does not cover is one line naming the directory."""
    from diffsynth_qie.cache import writer as writer_mod
    from diffsynth_qie.utils.dir_lock import UnwritableDirectory

    cache = tmp_path / "ro-cache"
    shutil.copytree(base_cache, cache)
    before = {p: p.stat().st_mtime_ns for p in cache.rglob("*")}
    _read_only(monkeypatch)
    monkeypatch.setattr(writer_mod, "load_encoders", lambda *a, **k: pytest.fail("no encoder may load"))
    summary = write_cache(_config(cache, subset_dir, tiny_model_dir))
    assert (summary.computed, summary.reused) == (0, len(SUBSET))
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*")} == before

    data = tmp_path / "more"
    _copy_subset(Path(demo_data_dir), data, indices=[0, 1, 3, 2])  # a row the cache lacks, and one it has no more
    with pytest.raises(UnwritableDirectory, match=rf"cannot write into {cache} \(it is on a read-only file system\)"
                                                  r".*not up to date .*1 row\(s\) to encode, 2 entries differ"):
        write_cache(_config(cache, data, tiny_model_dir, dataset_name=Path(subset_dir).name))
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*")} == before


def test_folders_inside_shards_do_not_stop_finalisation(base_cache, subset_dir, tiny_pipe, tiny_model_dir, tmp_path):
    """A killed write's temp folder is removed; a folder that is not ours is left alone with a warning."""
    cache = tmp_path / "cache"
    shutil.copytree(base_cache, cache)
    ours, theirs = cache / "shards" / ".r0-00009.4242424-ab.tmp", cache / "shards" / "notes"
    for folder in (ours, theirs):
        folder.mkdir()
        (folder / "x.safetensors").write_bytes(b"x")
    summary = write_cache(_config(cache, subset_dir, tiny_model_dir), pipe=tiny_pipe)
    assert summary.manifest is not None and len(CacheStore.open(cache)) == len(SUBSET)
    assert not ours.exists() and (theirs / "x.safetensors").is_file()
