"""Turning one dataset row into cache tensors: decode and resize its images (threads,
ahead of the encoders), then VAE-encode them and run the prompt embedder.

Image sizing (all sides multiples of ``divisor``, never enlarged):

- target and ``ref_gt``: each fit to ``max_pixels`` on its own;
- every reference image: fit to ``edit_max_pixels`` (default ``max_pixels``) on its own;
- ``back_mask``: resized to the target's size (binary), then averaged over 8x8
  blocks to latent resolution, so partly covered latent pixels are fractional;
- LBM source: the first reference image resized to the target's pixel size.

Prompts are encoded together with the (resized) reference images by DiffSynth's
own ``QwenImageUnit_PromptEmbedder`` (``models/qwen_image_edit/encoding.py``), with the single- or
multi-image template chosen by the preset.

Where Qwen-Image-2.1 differs (``models/family_ops.py``): sides are multiples of 32, each reference is sized as
2.1's pipeline sizes it at inference (the target's area at the reference's aspect ratio), images enter the VAE
as RGBA (16x, 64 channels), the mask is averaged over 16x16 blocks, prompts hold their references' slot mask,
and LBM's source is stored for rows with references.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from ..data.images import fit_image, load_mask, load_rgb, resize_to
from ..data.rows import EditRow
from ..utils.text import is_empty_prompt
from . import store
from .config import CacheConfig
from .shards import ShardWriter
from .store import CacheEntry, EntryMeta


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
    mask_derived: bool = False  # back_mask came from --auto_mask, not from the row
    rejected: Any = None  # a preference row's rejected output (PIL.Image at the target's size) or None


def _fit(img, max_pixels: int, divisor: int, path):
    return resize_to(img, fit_image(img.size, max_pixels, divisor, f"image {path}"))


def prepare_row(row: EditRow, config: CacheConfig, ops, augment=None) -> _Prepared:
    """Decode and resize a row's images as documented in the module docstring (``ops``: the model family's,
    ``models.family_ops.ops_for``). ``augment(image)``, when given, transforms every
    image of the row the same way (``live.augmenter``), the mask before it is pooled to latent resolution."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    divisor = max(config.divisor, ops.family.size_divisor)
    same = augment or (lambda im: im)
    target = same(_fit(load_rgb(row.target), config.max_pixels, divisor, row.target))
    originals = [load_rgb(p) for p in row.edit_images]
    edits = [same(resize_to(im, ops.cache_reference_size(im.size, target.size, config.resolved_edit_max_pixels(),
                                                         divisor, f"image {p}")))
             for im, p in zip(originals, row.edit_images)]
    lbm = None
    if originals and ops.supports_lbm:
        lbm = edits[0] if edits[0].size == target.size else same(resize_to(originals[0], target.size))
    mask, m, auto = None, None, config.auto_mask_params()
    if row.back_mask is not None:
        m = same(resize_to(load_mask(row.back_mask), target.size))
    elif auto is not None and originals:  # the pair's own difference (data/automask.py)
        from ..data.automask import diff_mask

        m = diff_mask(target, lbm if lbm is not None else same(resize_to(originals[0], target.size)), auto)
    if m is not None:
        t = torch.from_numpy(np.asarray(m, dtype=np.float32) / 255.0)[None, None]
        mask = F.avg_pool2d(t, ops.family.vae_factor)[0]
    ref_gt = None
    if row.ref_gt is not None:
        ref_gt = same(_fit(load_rgb(row.ref_gt), config.max_pixels, divisor, row.ref_gt))
    rejected = None  # at the target's size: one noise and one σ serve both outputs of the pair (losses/dpo.py)
    if row.rejected is not None:
        rejected = same(resize_to(load_rgb(row.rejected), target.size))
    return _Prepared(row, target, edits, lbm, mask, ref_gt, mask_derived=row.back_mask is None and mask is not None,
                     rejected=rejected)


def prefetch(fn: Callable, items: Iterable, num_workers: int) -> Iterator:
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


def vae_encode_many(pipe, images: list, ops) -> list:
    """VAE latents ``[C, h, w]`` per PIL image; images of equal size go through the VAE together."""
    import torch

    pipe.load_models_to_device(["vae"])  # no-op unless DiffSynth's VRAM management is on
    out: list = [None] * len(images)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, im in enumerate(images):
        groups.setdefault(im.size, []).append(i)
    for idx in groups.values():
        pixels = torch.cat([ops.vae_pixels(pipe, images[i]) for i in idx])
        with torch.no_grad():
            lat = pipe.vae.encode(pixels)
        for k, i in enumerate(idx):
            out[i] = lat[k]
    return out


def encode_prepared(pipe, prep: _Prepared, multi_image: bool, ops) -> CacheEntry:
    """The tensors of one row (``sub_noise`` left to the caller: it is shared per size); the VAE and the text
    encoder each run where their weights are (:func:`placed`). The prompts' tensors follow the family's
    ``Family.prompt_tensors`` (``ops.split_prompt``)."""
    import torch

    row = prep.row
    images = [prep.target, *prep.edits]
    own_lbm = prep.lbm_source is not None and (not prep.edits or prep.lbm_source is not prep.edits[0])
    if own_lbm:
        images.append(prep.lbm_source)
    if prep.ref_gt is not None:
        images.append(prep.ref_gt)
    if prep.rejected is not None:
        images.append(prep.rejected)
    with placed(pipe, "vae"):
        lat = vae_encode_many(pipe, images, ops)
    target, edits = lat[0], lat[1:1 + len(prep.edits)]
    rest = lat[1 + len(prep.edits):]
    lbm = rest.pop(0) if own_lbm else (edits[0] if prep.lbm_source is not None else None)
    ref_gt = rest.pop(0) if prep.ref_gt is not None else None
    rejected = rest.pop(0) if prep.rejected is not None else None

    prompts = [p for p in row.prompts if not is_empty_prompt(p)]
    with placed(pipe, "text_encoder"):
        encoded = [ops.split_prompt(ops.encode_prompt(pipe, p, prep.edits, edits, multi_image, None)) for p in prompts]
        empty, empty_extras = ops.split_prompt(ops.encode_prompt(pipe, "", prep.edits, edits, multi_image, None))
    embs = [e for e, _ in encoded]

    def host(extras: dict) -> dict:
        return {name: extras[name].cpu() for name in ops.family.prompt_tensors}

    def ones(emb):
        return torch.ones(emb.shape[0], dtype=torch.long)

    return CacheEntry(
        entry_id=row.row_id, row_id=row.row_id, dataset=row.dataset, inverse=row.inverse,
        prompt_embs=embs, prompt_masks=[ones(e) for e in embs],
        empty_prompt_emb=empty, empty_prompt_mask=ones(empty),
        target_latents=target, edit_latents=list(edits), sub_noise=None,  # type: ignore[arg-type]
        back_mask=prep.back_mask, ref_gt_latents=ref_gt, lbm_source_latents=lbm,
        prompt_extras=[host(x) for _, x in encoded], empty_prompt_extras=host(empty_extras),
        rejected_latents=rejected,
    )


_PLACEMENT = threading.RLock()  # held while a component runs with ``pipe.device`` pointing at it (see placed)


@contextlib.contextmanager
def placed(pipe, component: str):
    """While ``component`` (``text_encoder`` or ``vae``) runs, the pipeline's device is the one that component's
    weights are on, so DiffSynth's units send their inputs there (the encoders may sit on two devices).

    ``pipe.device`` is one attribute that DiffSynth's units read, so it cannot be passed per call; with
    ``--on_the_fly`` the encode thread and validation (the main thread) both encode through the same pipe. A
    process-wide lock makes each ``placed`` block exclusive: no encode sees the other component's device, and
    ``pipe.device`` is restored to what it was. The encodes are serialised (they share the device anyway)."""
    module = getattr(pipe, component, None)
    param = next(iter(module.parameters()), None) if module is not None else None
    with _PLACEMENT:
        saved = pipe.device
        if param is not None:
            pipe.device = param.device
        try:
            yield
        finally:
            pipe.device = saved


def white_key(pipe, writer: ShardWriter, size: tuple[int, int], ops) -> str:
    """Key of the white latents for a (W, H) pixel size, computing them once per cache."""
    key = store.sub_noise_key(size[1], size[0])
    if not writer.has_shared(key):
        with placed(pipe, "vae"):
            writer.add_shared(key, ops.white(pipe, size[0], size[1]))
    return key


def entry_meta(prep: _Prepared, entry: CacheEntry, content_hash: str, sub_key: str, sub_ref_key: str | None,
               base: Path, patch: int) -> EntryMeta:
    def rel(p) -> str:
        try:
            return str(Path(p).relative_to(base))
        except ValueError:
            return str(p)

    row = prep.row
    return EntryMeta(
        entry_id=entry.entry_id, row_id=row.row_id, dataset=row.dataset, inverse=row.inverse,
        content_hash=content_hash, prompts=[p for p in row.prompts if not is_empty_prompt(p)],
        prompt_lengths=[int(e.shape[0]) for e in entry.prompt_embs],
        empty_prompt_length=int(entry.empty_prompt_emb.shape[0]),
        prompt_dim=int(entry.empty_prompt_emb.shape[1]),
        target_size=(prep.target.height, prep.target.width),
        target_shape=tuple(entry.target_latents.shape),
        edit_shapes=[tuple(e.shape) for e in entry.edit_latents],
        has_back_mask=entry.back_mask is not None, mask_derived=prep.mask_derived,
        ref_gt_shape=tuple(entry.ref_gt_latents.shape) if entry.ref_gt_latents is not None else None,
        rejected_shape=tuple(entry.rejected_latents.shape) if entry.rejected_latents is not None else None,
        lbm_source=store.lbm_source_mode(entry),
        sub_noise_key=sub_key, sub_noise_ref_gt_key=sub_ref_key,
        dtype=str(entry.target_latents.dtype).replace("torch.", ""),
        sources={name: rel(p) for name, p in row.image_paths().items()},
        patch=patch,
        prompt_tensors=list(entry.empty_prompt_extras),
    )
