"""Training without a cache (``qie train --on_the_fly``): a dataset's rows encoded when training asks for them.

:class:`LiveStore` reads like a :class:`~.store.CacheStore` (``len``, ``meta(i)``, ``load(i)``, ``manifest``,
``family``), so the trainer's dataset, bucket sampler, resume and validation use it unchanged. Why a store
and not a second data pipeline: the rows go through exactly what ``qie cache`` runs for them
(``encode.prepare_row`` -> ``encode_prepared`` -> the white latents), so with the same seed a run on the fly
gives the numbers of a run from the cache.

- **Rows** are read and validated as ``qie cache`` does (``skipped.jsonl`` in the output directory, the
  ``--max_bad_fraction`` rule, long prompts skipped).
- **Metas** (what the bucket sampler needs) come from the image headers and the sizing rules alone: no
  encoder runs before training starts.
- **Placement**: the text encoder and the VAE each run where their weights are (``--text_encoder_device`` /
  ``--vae_device``; ``encode.placed``). The encode thread and validation (the main thread) may load at once;
  ``placed`` holds a lock while it points ``pipe.device`` at a component, so their encodes take turns.
- **Augmentation** (``augment``): per (seed, epoch, entry) a crop box of 80-100 % of each side at a random
  place and a horizontal flip with probability 0.5, applied to the target, every reference and the mask
  alike (as fractions of each image's size, resized back to it; the mask before it is pooled), so they stay
  aligned. Validation renders the rows unaugmented.
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
from pathlib import Path
from typing import Optional

from PIL import Image

from ..data.images import image_size, resize_to
from ..data.rows import SkippedRow, check_bad_fraction, validate_rows
from ..data.rows import write_skipped as write_skipped_file
from ..utils.sizes import fit_image
from . import store as store_mod
from .config import CacheConfig
from .encode import encode_prepared, placed, prepare_row
from .store import CacheEntry, EntryMeta

log = logging.getLogger(__name__)

CROP_MIN = 0.8  # the smallest crop side, as a fraction of the image's side


class LiveStore:
    """The rows of ``config.dataset`` as cache entries, encoded by ``pipe`` (text encoder + VAE) on demand."""

    def __init__(self, config: CacheConfig, pipe, preset, output_dir: str | Path, seed: int = 0,
                 augment: bool = False, write_skipped: bool = True):
        from ..data.formats import read_rows
        from ..models.family_ops import ops_for
        from .fingerprint import encoder_fingerprint
        from .settings import skip_long_prompts

        self.config, self.pipe, self.preset = config, pipe, preset
        self.ops, self.seed, self.augment = ops_for(preset.family), seed, augment
        self._whites: dict = {}  # (W, H) -> white latents
        ds = config.dataset
        unparsed: list[SkippedRow] = []
        rows = read_rows(ds.dataset_metadata, ds.dataset_base, dataset_name=ds.dataset_name, fields=config.fields,
                         disable_inverse=ds.disable_inverse, t2i_mode=ds.t2i_mode, skipped=unparsed)
        good, bad = validate_rows(rows, check_images=config.check_images)
        good, long_prompts = skip_long_prompts(good, pipe, config.max_prompt_tokens)
        skipped = unparsed + bad + long_prompts
        path = Path(output_dir) / store_mod.SKIPPED_NAME
        if write_skipped:  # (one rank writes it; every rank reads the same rows)
            write_skipped_file(path, skipped)
        check_bad_fraction(len(rows) + len(unparsed), skipped, ds.max_bad_fraction, ds.dataset_metadata, path)
        self.rows = good
        self._metas = [self._meta(row) for row in good]
        self.manifest = {"preset": preset.name, "family": preset.family,
                         "multi_image_prompt": preset.multi_image_prompt, "encoder_fingerprint": encoder_fingerprint(pipe),
                         "entries": [{"id": m.entry_id} for m in self._metas]}
        log.info("on the fly: %d rows of %s (%d skipped, listed in %s)", len(good), ds.dataset_metadata,
                 len(skipped), path)

    # --- the CacheStore interface ------------------------------------------------------------------------
    family = property(lambda self: self.preset.family)
    entry_ids = property(lambda self: [m.entry_id for m in self._metas])

    def __len__(self) -> int:
        return len(self._metas)

    def meta(self, i: int) -> EntryMeta:
        return self._metas[i]

    def identity(self) -> str:
        """What identifies the training data for ``--resume``: the metadata file's bytes and the sizing."""
        c = self.config
        payload = {"metadata": hashlib.sha256(Path(c.dataset.dataset_metadata).read_bytes()).hexdigest(),
                   "max_pixels": c.max_pixels, "edit_max_pixels": c.resolved_edit_max_pixels(), "augment": self.augment,
                   "preset": self.preset.name, "rows": len(self)}
        return "live:" + hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def load(self, i: int, epoch: Optional[int] = None) -> CacheEntry:
        """Row ``i`` encoded as ``qie cache`` would have stored it; augmented for ``epoch`` when the store augments
        (``epoch=None``, as validation asks: never)."""
        import torch

        augment = None
        if self.augment and epoch is not None:
            augment = augmenter(random.Random(f"{self.seed}:{epoch}:{self.rows[i].row_id}:augment"))
        prep = prepare_row(self.rows[i], self.config, self.ops, augment)
        with torch.no_grad():
            entry = self._encode(prep)
        return entry

    # --- helpers --------------------------------------------------------------------------------------------
    def _encode(self, prep) -> CacheEntry:
        entry = encode_prepared(self.pipe, prep, self.preset.multi_image_prompt, self.ops)
        entry.sub_noise = self._white(prep.target.size)
        if prep.ref_gt is not None:
            entry.sub_noise_ref_gt = self._white(prep.ref_gt.size)
        return entry

    def _white(self, size: tuple[int, int]):
        """The white image's latents at ``size``, encoded once per size (as the cache shares them)."""
        if size not in self._whites:
            with placed(self.pipe, "vae"):
                self._whites[size] = self.ops.white(self.pipe, *size)
        return self._whites[size]

    def _meta(self, row) -> EntryMeta:
        """The entry's shapes from the image headers and the sizing rules (what the bucket sampler needs)."""
        c, family = self.config, self.ops.family
        divisor = max(c.divisor, family.size_divisor)
        target = fit_image(image_size(row.target), c.max_pixels, divisor, f"image {row.target}")
        edits = [self.ops.cache_reference_size(image_size(p), target, c.resolved_edit_max_pixels(), divisor,
                                               f"image {p}") for p in row.edit_images]
        ref_gt = fit_image(image_size(row.ref_gt), c.max_pixels, divisor) if row.ref_gt is not None else None

        def shape(wh):
            return (family.latent_channels, wh[1] // family.vae_factor, wh[0] // family.vae_factor)

        return EntryMeta(
            entry_id=row.row_id, row_id=row.row_id, dataset=row.dataset, inverse=row.inverse, content_hash="",
            prompts=list(row.prompts), prompt_lengths=[], empty_prompt_length=0, prompt_dim=0,  # (known once encoded)
            target_size=(target[1], target[0]), target_shape=shape(target), edit_shapes=[shape(e) for e in edits],
            has_back_mask=row.back_mask is not None, ref_gt_shape=shape(ref_gt) if ref_gt else None,
            lbm_source=store_mod.LBM_NONE, sub_noise_key="", sub_noise_ref_gt_key=None, dtype="", patch=family.patch,
            prompt_tensors=list(family.prompt_tensors), rejected_shape=shape(target) if row.rejected else None)


def augmenter(rng: random.Random):
    """One crop box (80-100 % of each side, as fractions of the image) and one horizontal flip (probability
    0.5), drawn from ``rng``: a function applying them to any image of the row, resized back to its own size.
    A mask ("L") is cropped and resized as a mask (binary), so target, references and mask stay aligned."""
    side = rng.uniform(CROP_MIN, 1.0)
    left, top = rng.uniform(0.0, 1.0 - side), rng.uniform(0.0, 1.0 - side)
    flip = rng.random() < 0.5

    def apply(im):
        w, h = im.size
        box = (round(left * w), round(top * h), round((left + side) * w), round((top + side) * h))
        out = resize_to(im.crop(box), (w, h))
        return out.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else out

    return apply
