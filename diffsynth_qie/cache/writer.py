"""Phase 1 of split training: run the text encoder and the VAE once per row into the cache.

Why not DiffSynth's ``sft:data_process``: it pickles whole input dicts, freezes
training flags into them and has no resume. Here each rank encodes its share of
rows (row ``i`` goes to rank ``i % world_size``) into safetensors shards
(``store.ShardWriter``), skipping rows whose content hash is already cached, and
rank 0 finalises (``store.finalize_store``): stale entries dropped, shards
compacted, ``manifest.json`` written last.

Image sizing (all sides multiples of ``divisor``, never enlarged):

- target and ``ref_gt``: each fit to ``max_pixels`` on its own;
- every reference image: fit to ``edit_max_pixels`` (default ``max_pixels``) on its own;
- ``back_mask``: resized to the target's size (binary), then averaged over 8x8
  blocks to latent resolution, so partly covered latent pixels are fractional;
- LBM source: the first reference image resized to the target's pixel size.

Prompts are encoded together with the (resized) reference images by DiffSynth's
own ``QwenImageUnit_PromptEmbedder`` (``models/encoding.py``), with the single- or
multi-image template chosen by the preset.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal, Optional

from ..data.formats import DatasetConfig, FieldNames, read_rows
from ..data.images import fit_image, load_mask, load_rgb, resize_to
from ..data.rows import EditRow, SkippedRow, check_bad_fraction, log_skip, validate_rows, write_skipped
from ..models.presets import DEFAULT_MAX_PROMPT_TOKENS
from ..utils.atomic import atomic_write_json
from . import store
from .fingerprint import FileHasher, encoder_fingerprint, row_content_hash
from .store import CacheEntry, EntryMeta, ShardWriter

log = logging.getLogger(__name__)

VAE_DOWNSCALE = 8


@dataclass
class CacheConfig:
    """Phase-1 cache: where it goes, which model encodes, how images are sized."""

    cache_dir: Optional[str] = field(default=None, metadata={
        "help": "output directory (a rerun into the same directory resumes and updates it)", "metavar": "DIR"})
    model: str = field(default="2511", metadata={"help": "model preset: edit, 2509, 2511 or tiny"})
    model_dir: Optional[str] = field(default=None, metadata={
        "help": "local model directory (the preset's repo layout); default: DiffSynth's download folders",
        "metavar": "DIR"})
    max_pixels: int = field(default=1024 * 1024, metadata={
        "help": "pixel budget of target and ref_gt images (sides rounded down to --divisor, never enlarged)"})
    edit_max_pixels: Optional[int] = field(default=None, metadata={
        "help": "pixel budget of each reference image (default: --max_pixels)"})
    divisor: int = field(default=16, metadata={"help": "image sides are multiples of this"})
    shard_size: int = field(default=64, metadata={
        "help": "entries per shard file; an interrupted run loses at most this many entries per rank"})
    device: Optional[str] = field(default=None, metadata={
        "help": "encoding device (default: this rank's GPU, else CPU)"})
    dtype: Optional[Literal["bfloat16", "float16", "float32"]] = field(default=None, metadata={
        "help": "encoder and storage dtype (default: bfloat16 on GPU, float32 on CPU)"})
    num_workers: int = field(default=4, metadata={"help": "threads decoding and resizing images ahead of the encoders"})
    check_images: bool = field(default=True, metadata={
        "help": "fully decode every image while validating rows (catches truncated files before encoding)"})
    max_prompt_tokens: int = field(default=DEFAULT_MAX_PROMPT_TOKENS, metadata={
        "help": "rows with a longer prompt (in tokens) are skipped and listed in skipped.jsonl"})
    # Filled from their own flag groups by commands/cache.py (shared with `qie train`).
    dataset: DatasetConfig = field(default_factory=DatasetConfig, metadata={"cli": False})
    fields: FieldNames = field(default_factory=FieldNames, metadata={"cli": False})

    def resolved_edit_max_pixels(self) -> int:
        return self.edit_max_pixels or self.max_pixels


@dataclass
class CacheSummary:
    """What one ``write_cache`` call did (this rank's share)."""

    rank: int
    world_size: int
    rows: int  # rows assigned to this rank that passed validation
    computed: int
    reused: int
    skipped: int
    seconds: float  # the whole call, model loading included
    encode_seconds: float  # decoding + encoding + writing the computed rows
    manifest: Optional[dict] = None  # set on the rank that finalised

    @property
    def rows_per_second(self) -> float:
        """Encoding throughput of this rank (what the progress bar shows)."""
        return self.computed / self.encode_seconds if self.encode_seconds > 0 else 0.0


# ----------------------------------------------------------------------------- distribution


def _dist_context(rank: int | None, world_size: int | None) -> tuple[int, int, Callable[[], None], Any]:
    """(rank, world_size, barrier, device) for this process.

    Launched distributed (``WORLD_SIZE`` > 1, as ``accelerate launch``/torchrun set it):
    accelerate's state when it is distributed, else a gloo process group from the
    launcher's environment (accelerate reports no distribution on a CPU-only machine).
    Otherwise rank 0 of 1 and no barrier. Explicit ``rank``/``world_size`` win.
    """
    import torch

    device = None
    barrier: Callable[[], None] = lambda: None  # noqa: E731
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist
        from accelerate import PartialState

        state = PartialState()
        if state.num_processes > 1:
            env_rank, env_world, device = state.process_index, state.num_processes, state.device
        else:
            if not dist.is_initialized():
                dist.init_process_group("gloo")
            env_rank, env_world = dist.get_rank(), dist.get_world_size()
            local = int(os.environ.get("LOCAL_RANK", "0"))
            device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
        if rank is None and world_size is None:
            rank, world_size = env_rank, env_world
        if world_size == env_world and dist.is_initialized():
            barrier = dist.barrier
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    return rank, world_size, barrier, device


def _report_path(cache_dir: Path, rank: int, world_size: int) -> Path:
    return cache_dir / store.PARTS_DIR / f"rank-{rank:04d}-of-{world_size:04d}.json"


# ----------------------------------------------------------------------------- images


@dataclass
class _Prepared:
    """One row's decoded, resized inputs (built in a worker thread)."""

    row: EditRow
    target: Any  # PIL.Image at the target's cache size
    edits: list  # PIL.Images, each at its own size
    lbm_source: Any  # PIL.Image at the target's size, or None (t2i) ; edits[0] itself when sizes match
    back_mask: Any  # float32 tensor [1, h, w] or None
    ref_gt: Any  # PIL.Image or None


def _fit(img, max_pixels: int, divisor: int, path):
    return resize_to(img, fit_image(img.size, max_pixels, divisor, f"image {path}"))


def prepare_row(row: EditRow, config: CacheConfig) -> _Prepared:
    """Decode and resize a row's images as documented in the module docstring."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    target = _fit(load_rgb(row.target), config.max_pixels, config.divisor, row.target)
    originals = [load_rgb(p) for p in row.edit_images]
    edits = [_fit(im, config.resolved_edit_max_pixels(), config.divisor, p) for im, p in zip(originals, row.edit_images)]
    lbm = None
    if originals:
        lbm = edits[0] if edits[0].size == target.size else resize_to(originals[0], target.size)
    mask = None
    if row.back_mask is not None:
        m = resize_to(load_mask(row.back_mask), target.size)
        t = torch.from_numpy(np.asarray(m, dtype=np.float32) / 255.0)[None, None]
        mask = F.avg_pool2d(t, VAE_DOWNSCALE)[0]
    ref_gt = _fit(load_rgb(row.ref_gt), config.max_pixels, config.divisor, row.ref_gt) if row.ref_gt is not None else None
    return _Prepared(row, target, edits, lbm, mask, ref_gt)


def _prefetch(fn: Callable, items: Iterable, num_workers: int) -> Iterator:
    """``map(fn, items)`` in order, computed up to ``2 * num_workers`` items ahead in threads
    (PIL decoding and resizing release the GIL)."""
    if num_workers <= 0:
        yield from map(fn, items)
        return
    from concurrent.futures import ThreadPoolExecutor

    it = iter(items)
    with ThreadPoolExecutor(num_workers, thread_name_prefix="qie-cache-io") as ex:
        pending = collections.deque(ex.submit(fn, x) for x in itertools.islice(it, 2 * num_workers))
        try:
            while pending:
                fut = pending.popleft()
                for x in itertools.islice(it, 1):
                    pending.append(ex.submit(fn, x))
                yield fut.result()
        finally:
            for fut in pending:
                fut.cancel()


# ----------------------------------------------------------------------------- encoding


def vae_encode_many(pipe, images: list) -> list:
    """VAE latents ``[16, h, w]`` per PIL image; images of equal size go through the VAE together."""
    import torch

    pipe.load_models_to_device(["vae"])  # no-op unless DiffSynth's VRAM management is on
    out: list = [None] * len(images)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, im in enumerate(images):
        groups.setdefault(im.size, []).append(i)
    for idx in groups.values():
        pixels = torch.cat([pipe.preprocess_image(images[i]).to(device=pipe.device, dtype=pipe.torch_dtype)
                            for i in idx])
        with torch.no_grad():
            lat = pipe.vae.encode(pixels)
        for k, i in enumerate(idx):
            out[i] = lat[k]
    return out


def encode_prepared(pipe, prep: _Prepared, multi_image: bool) -> CacheEntry:
    """The tensors of one row (``sub_noise`` left to the caller: it is shared per size)."""
    import torch

    from ..models.encoding import encode_prompt

    row = prep.row
    images = [prep.target, *prep.edits]
    own_lbm = prep.lbm_source is not None and (not prep.edits or prep.lbm_source is not prep.edits[0])
    if own_lbm:
        images.append(prep.lbm_source)
    if prep.ref_gt is not None:
        images.append(prep.ref_gt)
    lat = vae_encode_many(pipe, images)
    target, edits = lat[0], lat[1:1 + len(prep.edits)]
    rest = lat[1 + len(prep.edits):]
    lbm = rest.pop(0) if own_lbm else (edits[0] if prep.lbm_source is not None else None)
    ref_gt = rest.pop(0) if prep.ref_gt is not None else None

    prompts = [p for p in row.prompts if p.strip()]
    embs = [encode_prompt(pipe, p, prep.edits, multi_image=multi_image, max_tokens=None) for p in prompts]
    empty = encode_prompt(pipe, "", prep.edits, multi_image=multi_image)

    def ones(emb):
        return torch.ones(emb.shape[0], dtype=torch.long)

    return CacheEntry(
        entry_id=row.row_id, row_id=row.row_id, dataset=row.dataset, inverse=row.inverse,
        prompt_embs=embs, prompt_masks=[ones(e) for e in embs],
        empty_prompt_emb=empty, empty_prompt_mask=ones(empty),
        target_latents=target, edit_latents=list(edits), sub_noise=None,  # type: ignore[arg-type]
        back_mask=prep.back_mask, ref_gt_latents=ref_gt, lbm_source_latents=lbm,
    )


def _white(pipe, writer: ShardWriter, size: tuple[int, int]) -> str:
    """Key of the white latents for a (W, H) pixel size, computing them once per cache."""
    from ..models.encoding import white_latents

    key = store.sub_noise_key(size[1], size[0])
    if not writer.has_shared(key):
        writer.add_shared(key, white_latents(pipe, size[0], size[1]))
    return key


def _meta(prep: _Prepared, entry: CacheEntry, content_hash: str, sub_key: str, sub_ref_key: str | None,
          base: Path) -> EntryMeta:
    def rel(p) -> str:
        try:
            return str(Path(p).relative_to(base))
        except ValueError:
            return str(p)

    row = prep.row
    return EntryMeta(
        entry_id=entry.entry_id, row_id=row.row_id, dataset=row.dataset, inverse=row.inverse,
        content_hash=content_hash, prompts=[p for p in row.prompts if p.strip()],
        prompt_lengths=[int(e.shape[0]) for e in entry.prompt_embs],
        empty_prompt_length=int(entry.empty_prompt_emb.shape[0]),
        prompt_dim=int(entry.empty_prompt_emb.shape[1]),
        target_size=(prep.target.height, prep.target.width),
        target_shape=tuple(entry.target_latents.shape),
        edit_shapes=[tuple(e.shape) for e in entry.edit_latents],
        has_back_mask=entry.back_mask is not None,
        ref_gt_shape=tuple(entry.ref_gt_latents.shape) if entry.ref_gt_latents is not None else None,
        lbm_source=store.lbm_source_mode(entry),
        sub_noise_key=sub_key, sub_noise_ref_gt_key=sub_ref_key,
        dtype=str(entry.target_latents.dtype).replace("torch.", ""),
        sources={name: rel(p) for name, p in row.image_paths().items()},
    )


# ----------------------------------------------------------------------------- the run


def _load_pipe(config: CacheConfig, device):
    import torch

    from ..models.loading import default_device, default_dtype, load_pipeline

    device = config.device or (str(device) if device is not None else default_device())
    dtype = getattr(torch, config.dtype) if config.dtype else default_dtype(device)
    return load_pipeline(config.model, model_dir=config.model_dir, components=("text_encoder", "vae"),
                         device=device, torch_dtype=dtype)


def cache_settings(config: CacheConfig, preset, pipe) -> dict:
    """Everything besides a row's own inputs that its cached tensors depend on (hashed per row)."""
    return {
        "format_version": store.FORMAT_VERSION,
        "preset": preset.name,
        "multi_image_prompt": preset.multi_image_prompt,
        "encoder_fingerprint": encoder_fingerprint(pipe),
        "max_pixels": config.max_pixels,
        "edit_max_pixels": config.resolved_edit_max_pixels(),
        "divisor": config.divisor,
        "dtype": str(pipe.torch_dtype).replace("torch.", ""),
    }


@dataclass
class _RankRows:
    """This rank's share of the metadata after validation."""

    good: list[EditRow]
    skipped: list[SkippedRow]
    index_of: dict[str, int]  # row id -> position in the metadata (manifest order)
    n_total: int  # rows this rank accounts for in the bad-row fraction


def _rank_rows(config: CacheConfig, preset, rank: int, world_size: int) -> _RankRows:
    """Read the metadata, take rows ``i % world_size == rank`` and validate them. Rows that
    fail to parse are reported by rank 0 only (every rank parses the same file)."""
    ds = config.dataset
    parse_skipped: list[SkippedRow] = []
    rows = read_rows(ds.dataset_metadata, ds.dataset_base, dataset_name=ds.dataset_name, fields=config.fields,
                     disable_inverse=ds.disable_inverse, t2i_mode=ds.t2i_mode, skipped=parse_skipped)
    mine = [(i, r) for i, r in enumerate(rows) if i % world_size == rank]
    good, skipped = validate_rows([r for _, r in mine], check_images=config.check_images)
    if not preset.multi_image_prompt:
        for r in [r for r in good if r.num_sources > 1]:
            s = SkippedRow(r.row_id, "edit_images", None,
                           f"preset {preset.name} takes one reference image, the row has {r.num_sources}; "
                           "use the 2509 or 2511 preset for several")
            log_skip(s)
            skipped.append(s)
        good = [r for r in good if r.num_sources <= 1]
    if rank != 0:
        parse_skipped = []
    return _RankRows(good=good, skipped=parse_skipped + skipped, index_of={r.row_id: i for i, r in mine},
                     n_total=len(mine) + len(parse_skipped))


def _skip_long_prompts(share: _RankRows, pipe, max_tokens: int) -> None:
    """Move rows with a prompt over ``max_tokens`` tokens from ``share.good`` to ``share.skipped``."""
    from ..models.encoding import prompt_token_count

    good = []
    for row in share.good:
        longest = max(prompt_token_count(pipe, p) for p in row.prompts)
        if longest > max_tokens:
            s = SkippedRow(row.row_id, "prompts", None,
                           f"prompt of {longest} tokens, more than --max_prompt_tokens {max_tokens}")
            log_skip(s)
            share.skipped.append(s)
        else:
            good.append(row)
    share.good = good


def _encode_rows(pipe, config: CacheConfig, preset, todo: list[tuple[EditRow, str]], writer: ShardWriter,
                 show_progress: bool, on_entry: Callable[[EntryMeta], None] | None) -> None:
    """Decode (threads, ahead) and encode (this thread) each row, queueing entries into ``writer``."""
    from tqdm import tqdm

    ds = config.dataset
    base = Path(ds.dataset_base) if ds.dataset_base else Path(ds.dataset_metadata).parent
    hash_of = {r.row_id: h for r, h in todo}
    bar = tqdm(total=len(todo), unit="row", desc="qie cache", disable=not show_progress or not todo,
               dynamic_ncols=True)
    try:
        for prep in _prefetch(lambda rh: prepare_row(rh[0], config), todo, config.num_workers):
            entry = encode_prepared(pipe, prep, preset.multi_image_prompt)
            sub_key = _white(pipe, writer, prep.target.size)
            sub_ref = _white(pipe, writer, prep.ref_gt.size) if prep.ref_gt is not None else None
            meta = _meta(prep, entry, hash_of[prep.row.row_id], sub_key, sub_ref, base)
            writer.add(entry, meta)
            bar.update(1)
            if on_entry is not None:
                on_entry(meta)
    finally:
        bar.close()
        writer.flush()  # keep every finished entry, also when interrupted


def write_cache(config: CacheConfig, pipe=None, rank: int | None = None, world_size: int | None = None, *,
                finalize: bool | None = None, on_entry: Callable[[EntryMeta], None] | None = None) -> CacheSummary:
    """Cache this rank's share of the dataset into ``config.cache_dir``; rank 0 then finalises.

    ``rank``/``world_size`` default to the launcher's (``accelerate launch``; 0/1 when
    not launched distributed). ``pipe`` (text encoder + VAE) is loaded from the preset
    if not given. ``finalize`` defaults to ``rank == 0``; it runs after a barrier and
    needs every rank's report (``parts/rank-*.json``), so when ranks run one after
    another without a process group, run rank 0 last or call :func:`finalize_cache`.
    ``on_entry(meta)`` runs after each computed entry is queued for writing.
    """
    from ..models.presets import get_preset

    t0 = time.perf_counter()
    rank, world_size, barrier, dist_device = _dist_context(rank, world_size)
    if not config.cache_dir:
        raise ValueError("no cache directory given; pass --cache_dir DIR")
    if not config.dataset.dataset_metadata:
        raise ValueError("no dataset given; pass --dataset_metadata FILE (e.g. from `qie make-demo-data`)")
    if config.shard_size < 1:
        raise ValueError(f"--shard_size must be >= 1, got {config.shard_size}")
    cache_dir = Path(config.cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    preset = get_preset(getattr(pipe, "qie_preset", None) or config.model)
    ds = config.dataset
    report_path = _report_path(cache_dir, rank, world_size)
    report_path.unlink(missing_ok=True)  # a stale report must not vouch for this run

    share = _rank_rows(config, preset, rank, world_size)
    if world_size == 1:  # fail before encoding anything; with several ranks rank 0 checks the total
        write_skipped(cache_dir / store.SKIPPED_NAME, share.skipped)
        check_bad_fraction(share.n_total, share.skipped, ds.max_bad_fraction, ds.dataset_metadata,
                           cache_dir / store.SKIPPED_NAME)

    if pipe is None:
        pipe = _load_pipe(config, dist_device)
    _skip_long_prompts(share, pipe, config.max_prompt_tokens)
    settings = cache_settings(config, preset, pipe)
    hasher = FileHasher()
    hashes = list(_prefetch(lambda r: row_content_hash(r, settings, hasher), share.good, config.num_workers))
    have = {(m.entry_id, m.content_hash) for m in store.scan_shards(cache_dir)}
    todo = [(r, h) for r, h in zip(share.good, hashes) if (r.row_id, h) not in have]
    log.info("rank %d/%d: %d rows, %d already cached, %d to encode, %d skipped",
             rank, world_size, len(share.good), len(share.good) - len(todo), len(todo), len(share.skipped))

    writer = ShardWriter(cache_dir, rank, config.shard_size, known_shared=store.known_shared_keys(cache_dir))
    t_enc = time.perf_counter()
    _encode_rows(pipe, config, preset, todo, writer, show_progress=rank == 0, on_entry=on_entry)
    enc_s = time.perf_counter() - t_enc
    if todo:
        log.info("rank %d: encoded %d rows in %.1f s (%.2f rows/s)", rank, len(todo), enc_s, len(todo) / max(enc_s, 1e-9))

    atomic_write_json(report_path, {
        "format_version": store.FORMAT_VERSION,
        "run_key": _run_key(config, settings),
        "rank": rank, "world_size": world_size, "num_rows": share.n_total,
        "entries": [[share.index_of[r.row_id], r.row_id, h] for r, h in zip(share.good, hashes)],
        "skipped": [s.to_json() for s in share.skipped],
        "metadata": str(ds.dataset_metadata),
        "max_bad_fraction": ds.max_bad_fraction,
        "manifest_fields": _manifest_fields(config, settings),
    })
    barrier()  # every rank's shards and report are on disk
    manifest = None
    if finalize if finalize is not None else rank == 0:
        manifest = finalize_cache(cache_dir, world_size)
    barrier()  # nobody returns before the manifest exists
    return CacheSummary(rank=rank, world_size=world_size, rows=len(share.good), computed=len(todo),
                        reused=len(share.good) - len(todo), skipped=len(share.skipped),
                        seconds=time.perf_counter() - t0, encode_seconds=enc_s, manifest=manifest)


def _run_key(config: CacheConfig, settings: dict) -> str:
    """Identifies one logical cache run across ranks: same metadata file, dataset options and settings."""
    import hashlib

    from ..data.images import image_bytes_hash

    payload = {"settings": settings, "metadata": image_bytes_hash(config.dataset.dataset_metadata),
               "dataset": dataclasses.asdict(config.dataset), "fields": dataclasses.asdict(config.fields)}
    payload["dataset"].pop("max_bad_fraction", None)
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _manifest_fields(config: CacheConfig, settings: dict) -> dict:
    return {
        "preset": settings["preset"],
        "encoder_fingerprint": settings["encoder_fingerprint"],
        "resize": {"max_pixels": settings["max_pixels"], "edit_max_pixels": settings["edit_max_pixels"],
                   "divisor": settings["divisor"]},
        "dtype": settings["dtype"],
        "multi_image_prompt": settings["multi_image_prompt"],
        "metadata": str(config.dataset.dataset_metadata),
        "dataset_base": config.dataset.dataset_base,
    }


def finalize_cache(cache_dir: str | os.PathLike, world_size: int) -> dict:
    """Merge every rank's report into ``skipped.jsonl`` and ``manifest.json`` (rank 0, after all ranks).

    Raises ValueError if a rank's report is missing or belongs to another run (a
    different metadata file, model or settings), or if too many rows are bad.
    """
    cache_dir = Path(cache_dir)
    reports = []
    for r in range(world_size):
        path = _report_path(cache_dir, r, world_size)
        if not path.is_file():
            raise ValueError(f"rank {r} of {world_size} has not finished caching into {cache_dir} ({path} missing); "
                             "run every rank (accelerate launch does), then finalise")
        reports.append(json.loads(path.read_text()))
    if len({rep["run_key"] for rep in reports}) != 1:
        raise ValueError(f"the rank reports in {cache_dir / store.PARTS_DIR} come from different runs (metadata, "
                         "model or resize settings differ); re-run `qie cache` with the same arguments on every rank")
    skipped = [SkippedRow(**s) for rep in reports for s in rep["skipped"]]
    skipped_path = write_skipped(cache_dir / store.SKIPPED_NAME, skipped)
    n_total = sum(rep["num_rows"] for rep in reports)
    check_bad_fraction(n_total, skipped, reports[0]["max_bad_fraction"], reports[0]["metadata"], skipped_path)
    wanted = sorted((tuple(e) for rep in reports for e in rep["entries"]), key=lambda e: e[0])
    manifest = store.finalize_store(cache_dir, [(e[1], e[2]) for e in wanted],
                                    {**reports[0]["manifest_fields"], "num_rows": n_total, "num_skipped": len(skipped)})
    for r in range(world_size):
        _report_path(cache_dir, r, world_size).unlink(missing_ok=True)
    log.info("cache %s: %d entries in %d shards, %d rows skipped", cache_dir, len(manifest["entries"]),
             len(manifest["shards"]), len(skipped))
    return manifest
