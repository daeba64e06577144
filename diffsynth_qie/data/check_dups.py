"""``qie check-dataset``'s duplicate pass: pairs whose source and target hashes (64-bit difference hashes) are
within ``k`` bits of an earlier pair's, confirmed by their thumbnails, found through a multi-index instead of
comparing every pair.

The hash is cut into ``k + 1`` bands of contiguous bits. Two hashes that differ in at most ``k`` bits differ in
at most ``k`` bands, so (pigeonhole) at least one of the ``k + 1`` bands is equal in both: looking a hash up in
each band's table finds every hash within ``k`` bits, and only a few others, which the exact popcount drops, at
about ``(k + 1)`` dict look-ups per row. Flat images (plain backgrounds, drawings) make many hashes a few bits
apart, and the tables' lists then grow with the rows; such a look-up compares every kept pair at once in numpy
instead (popcounts, then the sums of the target thumbnails' 4x4 blocks, whose differences bound the thumbnails'
from below: an exact first cut, then the thumbnails).
Either way the answer is exactly the one of the pairwise scan (the earliest matching row;
``pairwise_pairs`` in benchmarks/check_dataset_scale.py). Identical hashes keep at most ``per_hash`` pairs, so a
dataset of many copies stays linear.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .check_align import THUMB_MAX_DIFF, THUMB_MEAN_DIFF, THUMB_SIDE, thumbs_match_many

BITS = 64


def bands(k: int, bits: int = BITS) -> list[tuple[int, int]]:
    """``(shift, mask)`` of ``min(k + 1, bits)`` contiguous bands covering the ``bits`` bits."""
    n = max(1, min(k + 1, bits))
    edges = [round(i * bits / n) for i in range(n + 1)]
    return [(lo, (1 << (hi - lo)) - 1) for lo, hi in zip(edges, edges[1:])]


def _popcount(x: np.ndarray) -> np.ndarray:
    """Set bits of each element of a uint64 array (uint8)."""
    if hasattr(np, "bitwise_count"):  # numpy >= 2
        return np.bitwise_count(x)
    return _BYTE_BITS[x.view(np.uint8).reshape(*x.shape, 8)].sum(-1, dtype=np.uint8)


_BYTE_BITS = np.array([bin(i).count("1") for i in range(256)], np.uint8)


class PairIndex:
    """Pairs added in order, each a hash of ``parts`` 64-bit words (source and target, or the target alone), its
    target's thumbnail, its source's (or None) and an instruction; :meth:`matches` answers, earliest first, the
    added pairs that are the same as a new one: the hashes within ``k`` bits in all (and the first word within
    ``first_k``, when given) and the thumbnails matching (``check_align.thumbs_match``; the sources' only when
    both have one). Each distinct hash keeps at most ``per_hash`` pairs (the earliest ones).

    Candidates come from the banded tables while their lists stay short; when they do not, every pair is compared
    at once (the module's doc). Both find exactly the hashes within ``k`` bits."""

    def __init__(self, k: int, parts: int = 1, first_k: Optional[int] = None, per_hash: int = 32):
        self.k, self.parts, self.first_k, self.per_hash = k, parts, first_k, per_hash
        self.bands = bands(k, parts * BITS)
        self.tables: list[dict[int, list[int]]] = [{} for _ in self.bands]
        self.rows_of: dict[int, list[int]] = {}  # distinct hash -> its pairs' rows
        self.count = 0                            # pairs added (kept or not)
        self.keys: list = []                      # by row: the key added, its hash, thumbnails, instruction
        self.hashes: list[int] = []
        self.pictures: list[tuple[bytes, Optional[bytes]]] = []
        self.instructions: dict[str, int] = {}
        self.instruction: list[int] = []
        # the rows as arrays, for comparing many at once (filled up to ``synced`` when needed)
        self.synced = 0
        self.words = np.zeros((parts, 0), np.uint64)  # each row's hash, by 64-bit word
        self.thumbs = np.zeros((0, 2, THUMB_SIDE ** 2), np.uint8)
        self.blocks = np.zeros((0, 16), np.int32)  # each target thumbnail's sums over its 4x4 blocks
        self.has_source = np.zeros(0, bool)

    @property
    def size(self) -> int:
        return len(self.keys)

    def _sync(self) -> None:
        """The arrays hold every row (capacity doubled as they grow)."""
        new = range(self.synced, self.size)
        if not new:
            return
        if self.size > len(self.blocks):
            cap = max(64, 2 * self.size)
            self.words = np.concatenate([self.words, np.zeros((self.parts, cap - len(self.blocks)), np.uint64)], 1)
            for name in ("thumbs", "blocks", "has_source"):
                old = getattr(self, name)
                setattr(self, name, np.concatenate([old, np.zeros((cap - len(old), *old.shape[1:]), old.dtype)]))
        rows = slice(self.synced, self.size)
        self.words[:, rows] = np.array([_words(self.hashes[i], self.parts) for i in new], np.uint64).T
        side = self.thumbs.shape[-1]
        blank = bytes(side)
        self.thumbs[rows] = np.frombuffer(b"".join(t + (s or blank) for t, s in (self.pictures[i] for i in new)),
                                          np.uint8).reshape(len(new), 2, side)
        self.blocks[rows] = _block_sums(self.thumbs[rows, 0])
        self.has_source[rows] = [self.pictures[i][1] is not None for i in new]
        self.synced = self.size

    def add(self, h: int, key: object, target_thumb: bytes, source_thumb: Optional[bytes], instruction: str = ""
            ) -> None:
        rows = self.rows_of.get(h)
        if rows is None:
            rows = self.rows_of[h] = []
            for table, (shift, mask) in zip(self.tables, self.bands):
                table.setdefault((h >> shift) & mask, []).append(h)
        if len(rows) < self.per_hash:
            rows.append(self.size)
            self.keys.append(key)
            self.hashes.append(h)
            self.pictures.append((target_thumb, source_thumb))
            self.instruction.append(self.instructions.setdefault(instruction, len(self.instructions)))
        self.count += 1

    def _candidates(self, h: int):
        """The rows of pairs whose hash may be within ``k`` bits of ``h``: those of the bands' lists, or a slice
        of every row when the lists are long (or ``k`` leaves no band to be sure of)."""
        buckets = [table.get((h >> shift) & mask, ()) for table, (shift, mask) in zip(self.tables, self.bands)]
        if self.k >= len(self.bands) or sum(map(len, buckets)) > max(64, self.size // 32):
            return slice(0, self.size)
        return sorted({i for bucket in buckets for other in bucket for i in self.rows_of[other]})

    def _near(self, h: int, rows) -> np.ndarray:
        """Of ``rows``, those whose hash is within ``k`` bits of ``h`` (and its first word within ``first_k``)."""
        top = BITS * (self.parts - 1)
        if not isinstance(rows, slice):  # a few: one popcount each
            return np.array([i for i in rows if (h ^ self.hashes[i]).bit_count() <= self.k and
                             (self.first_k is None or ((h ^ self.hashes[i]) >> top).bit_count() <= self.first_k)],
                            np.int64)
        self._sync()
        diff = _popcount(self.words[:, rows] ^ np.array(_words(h, self.parts), np.uint64)[:, None])
        near = diff.sum(0, dtype=np.int32) <= self.k
        if self.first_k is not None:
            near &= diff[0] <= self.first_k
        return np.flatnonzero(near)

    def matches(self, h: int, target_thumb: bytes, source_thumb: Optional[bytes]) -> np.ndarray:
        """Rows (ascending: earliest added first) of the added pairs that are the same as this one."""
        rows = self._near(h, self._candidates(h))
        if not len(rows):
            return rows
        self._sync()
        mine = [None if t is None else np.frombuffer(t, np.uint8) for t in (target_thumb, source_thumb)]
        # (a block's sum differs by at most the block's summed difference: an exact first cut)
        gap = np.abs(self.blocks[rows] - _block_sums(mine[0][None])[0])
        block_pixels = len(mine[0]) // gap.shape[1]
        rows = rows[(gap.max(1) <= THUMB_MAX_DIFF * block_pixels) & (gap.sum(1) <= THUMB_MEAN_DIFF * len(mine[0]))]
        ok = thumbs_match_many(self.thumbs[rows, 0], mine[0])
        if mine[1] is not None:
            ok &= ~self.has_source[rows] | thumbs_match_many(self.thumbs[rows, 1], mine[1])
        return rows[ok]


def _block_sums(thumbs: np.ndarray) -> np.ndarray:
    """``[n, 16]`` int32 sums of each ``[n, side²]`` thumbnail's 4x4 grid of blocks."""
    q = THUMB_SIDE // 4
    return thumbs.reshape(len(thumbs), 4, q, 4, q).sum((2, 4), dtype=np.int32).reshape(len(thumbs), 16)


def _words(h: int, parts: int) -> list[int]:
    """``h``'s 64-bit words, most significant first (the source's hash, then the target's)."""
    return [(h >> (BITS * (parts - 1 - j))) & ((1 << BITS) - 1) for j in range(parts)]


def flag_pair_duplicates(checks, held, k: int, progress=None) -> None:
    """Flag, in place, each row (a ``RowCheck`` with ``source_hash`` / ``target_hash`` / ``_target_thumb`` /
    ``_instruction`` measures) whose source and target are an earlier row's (within ``k`` bits of each hash and
    the target's thumbnail matching: a re-encoded copy counts): ``duplicate`` with the same instruction,
    ``duplicate_pair`` with another; and ``holdout_duplicate`` when its target is a held-out row's. Two edits of
    one source differ in their targets and are not duplicates."""
    from .check_rules import flag

    held_index = PairIndex(k)
    for c in held:
        if "target_hash" in c.measures:
            held_index.add(c.measures["target_hash"], c.row_id, c.measures["_target_thumb"], None)
    rows = PairIndex(2 * k, parts=2, first_k=k)
    for c in checks:
        m = c.measures
        if "target_hash" in m:
            key = (m.get("source_hash", 0) << BITS) | m["target_hash"]
            same = rows.matches(key, m["_target_thumb"], m.get("_source_thumb"))
            mine = rows.instructions.get(m["_instruction"])
            told = [i for i in same if rows.instruction[i] == mine]
            if told:
                near = rows.keys[told[0]]
                flag(c, "duplicate", near, f"the same source, target and instruction as row {near}")
            elif len(same):
                near = rows.keys[same[0]]
                flag(c, "duplicate_pair", near, f"the same source and target as row {near}, another instruction")
            rows.add(key, c.row_id, m["_target_thumb"], m.get("_source_thumb"), m["_instruction"])
            held_same = held_index.matches(m["target_hash"], m["_target_thumb"], None) if held_index.count else ()
            if len(held_same):
                near = held_index.keys[held_same[0]]
                flag(c, "holdout_duplicate", near, f"its target is the held-out row {near}'s")
        if progress is not None:
            progress(1)
