"""``qie check-dataset``'s duplicate pass: pairs whose source and target hashes (64-bit difference hashes) are
within ``k`` bits of an earlier pair's, confirmed by their thumbnails, found through a multi-index instead of
comparing every pair.

The hash is cut into ``k + 1`` bands of contiguous bits. Two hashes that differ in at most ``k`` bits differ in
at most ``k`` bands, so (pigeonhole) at least one of the ``k + 1`` bands is equal in both: looking a hash up in
each band's table finds every hash within ``k`` bits, and only a few others, which the exact popcount drops, at
about ``(k + 1)`` dict look-ups per row. Flat images (plain backgrounds, drawings) make many hashes a few bits
apart, and the tables' lists then grow with the rows; such a look-up takes instead the window of rows whose target
thumbnail's sum is within ``THUMB_MEAN_DIFF`` per pixel of this one's (the rows are kept in the order of their
sums; the difference of two sums bounds the summed pixel differences from below, so this cut is exact; it leaves
about a quarter of the demo's flat images) and popcounts that window. The pairs left are confirmed all at once: the
sums of the target thumbnails' 4x4 blocks (the same bound per block), then the thumbnails. Rows are checked a
batch at a time (:class:`DuplicatePass`, fed as ``qie check-dataset`` measures them), each against the rows before
it only.
Either way the answer is exactly the one of the pairwise scan (the earliest matching row;
``pairwise_pairs`` in benchmarks/check_dataset_scale.py). Identical hashes keep at most ``per_hash`` pairs, so a
dataset of many copies stays linear.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .check_align import THUMB_MAX_DIFF, THUMB_MEAN_DIFF, THUMB_SIDE, thumbs_match_many

BITS = 64
#: two target thumbnails whose sums differ by more than this cannot match (``thumbs_match``: their pixels' summed
#: difference, at least the sums' difference, is at most THUMB_MEAN_DIFF per pixel)
SUM_GAP = int(THUMB_MEAN_DIFF * THUMB_SIDE ** 2)


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
    target's thumbnail, its source's (or None) and an instruction; :meth:`matches_many` answers, earliest first, the
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
        self.thumbs = np.zeros((0, 2, THUMB_SIDE ** 2), np.uint8)
        self.blocks = np.zeros((0, 16), np.int32)  # each target thumbnail's sums over its 4x4 blocks
        self.sums = np.zeros(0, np.int32)          # and its whole sum
        self.sorted_sums = np.zeros(0, np.int32)   # every row's sum, ascending, and the rows in that order
        self.by_sum = np.zeros(0, np.int64)
        self.sorted_words = np.zeros((parts, 0), np.uint64)  # their hashes, in that order
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
            for name in ("thumbs", "blocks", "sums", "has_source"):
                old = getattr(self, name)
                setattr(self, name, np.concatenate([old, np.zeros((cap - len(old), *old.shape[1:]), old.dtype)]))
        rows = slice(self.synced, self.size)
        added = _Queries([(self.hashes[i], *self.pictures[i]) for i in new], self.parts)
        self.thumbs[rows], self.blocks[rows], self.sums[rows] = added.thumbs, added.blocks, added.sums
        self.has_source[rows] = added.has_source
        order = np.argsort(added.sums, kind="stable")  # (inserted in order: equal places keep it)
        at = np.searchsorted(self.sorted_sums, added.sums[order], side="right")
        self.sorted_sums = np.insert(self.sorted_sums, at, added.sums[order])
        self.by_sum = np.insert(self.by_sum, at, np.arange(self.synced, self.size)[order])
        self.sorted_words = np.insert(self.sorted_words, at, added.words[:, order], axis=1)
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
        """The rows of pairs whose hash may be within ``k`` bits of ``h``: those of the bands' lists, or None (every
        row) when the lists are long (or ``k`` leaves no band to be sure of)."""
        buckets = [table.get((h >> shift) & mask, ()) for table, (shift, mask) in zip(self.tables, self.bands)]
        if self.k >= len(self.bands) or sum(map(len, buckets)) > max(64, self.size // 32):
            return None
        return sorted({i for bucket in buckets for other in bucket for i in self.rows_of[other]})

    def _near(self, h: int, rows: list[int]) -> list[int]:
        """Of a few ``rows``, those whose hash is within ``k`` bits of ``h`` (and its first word within
        ``first_k``): one popcount each."""
        top = BITS * (self.parts - 1)
        return [i for i in rows if (h ^ self.hashes[i]).bit_count() <= self.k and
                (self.first_k is None or ((h ^ self.hashes[i]) >> top).bit_count() <= self.first_k)]

    def matches_many(self, queries: list, before: list[int]) -> list[np.ndarray]:
        """The rows (ascending: earliest added first) of the pairs that are the same as each ``(hash, target
        thumbnail, source thumbnail or None)`` of ``queries``, among the rows added before ``before[q]``, all
        compared at once (a few dozen array operations for a whole batch instead of as many per query)."""
        self._sync()
        q = _Queries(queries, self.parts)
        limit = np.asarray(before, np.int64)
        pairs_q, pairs_j, wide = [], [], []
        for n, (h, _, _) in enumerate(queries):
            rows = self._candidates(h)
            if rows is None:
                wide.append(n)
            else:
                near = [i for i in self._near(h, rows) if i < before[n]]
                pairs_q += [n] * len(near)
                pairs_j += near
        wide_q, wide_j = self._near_many(q, wide, limit)
        qi = np.concatenate([np.asarray(pairs_q, np.int64), wide_q])
        j = np.concatenate([np.asarray(pairs_j, np.int64), wide_j])
        # (a block's sum differs by at most the block's summed difference: an exact first cut)
        gap = np.abs(self.blocks[j] - q.blocks[qi])
        side = q.thumbs.shape[-1]
        cut = (gap.max(1, initial=0) <= THUMB_MAX_DIFF * (side // gap.shape[1])) & (
            gap.sum(1) <= THUMB_MEAN_DIFF * side)
        qi, j = qi[cut], j[cut]
        ok = thumbs_match_many(self.thumbs[j, 0], q.thumbs[qi, 0])
        ok &= ~(self.has_source[j] & q.has_source[qi]) | thumbs_match_many(self.thumbs[j, 1], q.thumbs[qi, 1])
        qi, j = qi[ok], j[ok]
        order = np.lexsort((j, qi))
        qi, j = qi[order], j[order]
        return np.split(j, np.searchsorted(qi, np.arange(1, len(queries))))

    def _near_many(self, q: "_Queries", wide: list[int], limit: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(query, row)`` pairs of the queries ``wide`` and their near rows: of the rows whose target thumbnail's
        sum is within :data:`SUM_GAP` of the query's (a window of the rows in sum order), those added before the
        query's limit whose hash is within ``k`` bits (one window's popcounts at a time: cache-sized slices)."""
        wide = np.asarray(wide, np.int64)
        lo = np.searchsorted(self.sorted_sums, q.sums[wide] - SUM_GAP, side="left")
        hi = np.searchsorted(self.sorted_sums, q.sums[wide] + SUM_GAP, side="right")
        qs, at = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        for n, a, b in zip(wide.tolist(), lo.tolist(), hi.tolist()):
            diff = _popcount(self.sorted_words[:, a:b] ^ q.words[:, n:n + 1])
            near = diff.sum(0, dtype=np.int32) <= self.k
            if self.first_k is not None:
                near &= diff[0] <= self.first_k
            found = np.flatnonzero(near) + a
            at.append(found)
            qs.append(np.full(len(found), n))
        qi, j = np.concatenate(qs), self.by_sum[np.concatenate(at)]
        before = j < limit[qi]
        return qi[before], j[before]


class _Queries:
    """``(hash, target thumbnail, source thumbnail or None)`` items as arrays: the queries of
    :meth:`PairIndex.matches_many`, and the rows the index adds to its own arrays."""

    def __init__(self, queries: list, parts: int):
        side = THUMB_SIDE ** 2
        blank = bytes(side)
        self.words = np.array([_words(h, parts) for h, _, _ in queries], np.uint64).reshape(len(queries), parts).T
        self.thumbs = np.frombuffer(b"".join(t + (s or blank) for _, t, s in queries), np.uint8).reshape(
            len(queries), 2, side)
        self.has_source = np.array([s is not None for _, _, s in queries], bool)
        self.blocks = _block_sums(self.thumbs[:, 0])
        self.sums = self.blocks.sum(1)


def _block_sums(thumbs: np.ndarray) -> np.ndarray:
    """``[n, 16]`` int32 sums of each ``[n, side²]`` thumbnail's 4x4 grid of blocks."""
    q = THUMB_SIDE // 4
    return thumbs.reshape(len(thumbs), 4, q, 4, q).sum((2, 4), dtype=np.int32).reshape(len(thumbs), 16)


def _words(h: int, parts: int) -> list[int]:
    """``h``'s 64-bit words, most significant first (the source's hash, then the target's)."""
    return [(h >> (BITS * (parts - 1 - j))) & ((1 << BITS) - 1) for j in range(parts)]


class DuplicatePass:
    """The duplicate flags of rows given in order (:meth:`add`, as they are measured), checked a batch at a time
    (:meth:`finish` checks the last); ``held``: the held-out rows' checks. Each row is compared with the earlier
    rows only, so the flags are those of one pass over the finished list."""

    def __init__(self, held, k: int, progress=None, batch: int = 256):
        self.progress, self.batch = progress, batch
        self.held = PairIndex(k)
        for c in held:
            if "target_hash" in c.measures:
                self.held.add(c.measures["target_hash"], c.row_id, c.measures["_target_thumb"], None)
        self.rows = PairIndex(2 * k, parts=2, first_k=k)
        self.waiting: list = []

    def add(self, check) -> None:
        self.waiting.append(check)
        if len(self.waiting) >= self.batch:
            self.finish()

    def finish(self) -> None:
        from .check_rules import flag

        todo = [c for c in self.waiting if "target_hash" in c.measures]
        queries, before = [], []
        for c in todo:  # (added in order: each row is compared with the rows added before it)
            m = c.measures
            key = (m.get("source_hash", 0) << BITS) | m["target_hash"]
            queries.append((key, m["_target_thumb"], m.get("_source_thumb")))
            before.append(self.rows.size)
            self.rows.add(key, c.row_id, m["_target_thumb"], m.get("_source_thumb"), m["_instruction"])
        same_rows = self.rows.matches_many(queries, before) if todo else []
        held = self.held.matches_many([(c.measures["target_hash"], c.measures["_target_thumb"], None) for c in todo],
                                      [self.held.size] * len(todo)) if todo and self.held.count else [()] * len(todo)
        for c, same, held_same in zip(todo, same_rows, held):
            mine = self.rows.instructions.get(c.measures["_instruction"])  # (None: no kept row has it)
            told = [i for i in same if self.rows.instruction[i] == mine]
            if told:
                near = self.rows.keys[told[0]]
                flag(c, "duplicate", near, f"the same source, target and instruction as row {near}")
            elif len(same):
                near = self.rows.keys[same[0]]
                flag(c, "duplicate_pair", near, f"the same source and target as row {near}, another instruction")
            if len(held_same):
                near = self.held.keys[held_same[0]]
                flag(c, "holdout_duplicate", near, f"its target is the held-out row {near}'s")
        if self.progress is not None:
            self.progress(len(self.waiting))
        self.waiting = []


def flag_pair_duplicates(checks, held, k: int, progress=None) -> None:
    """Flag, in place, each row (a ``RowCheck`` with ``source_hash`` / ``target_hash`` / ``_target_thumb`` /
    ``_instruction`` measures) whose source and target are an earlier row's (within ``k`` bits of each hash and
    the target's thumbnail matching: a re-encoded copy counts): ``duplicate`` with the same instruction,
    ``duplicate_pair`` with another; and ``holdout_duplicate`` when its target is a held-out row's. Two edits of
    one source differ in their targets and are not duplicates."""
    found = DuplicatePass(held, k, progress)
    for c in checks:
        found.add(c)
    found.finish()
