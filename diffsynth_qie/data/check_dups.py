"""``qie check-dataset``'s duplicate pass: 64-bit difference hashes within ``k`` bits of each other, found
through a multi-index instead of comparing every pair.

The hash is cut into ``k + 1`` bands of contiguous bits. Two hashes that differ in at most ``k`` bits differ in
at most ``k`` bands, so (pigeonhole) at least one of the ``k + 1`` bands is equal in both: looking a hash up in
each band's table finds every hash within ``k`` bits, and only a few others, which the exact popcount drops.
The answer is exactly the one of the pairwise scan (the earliest matching row), at about ``(k + 1)`` dict
look-ups per row. Identical hashes share one entry, so a dataset of many copies stays linear. Only with a
large ``k`` (narrow bands, > ~16 bits) do the candidate lists grow towards the pairwise cost again.
"""
from __future__ import annotations

from typing import Iterable, Optional

BITS = 64


def bands(k: int) -> list[tuple[int, int]]:
    """``(shift, mask)`` of ``min(k + 1, 64)`` contiguous bands covering the 64 bits."""
    n = max(1, min(k + 1, BITS))
    edges = [round(i * BITS / n) for i in range(n + 1)]
    return [(lo, (1 << (hi - lo)) - 1) for lo, hi in zip(edges, edges[1:])]


class HashIndex:
    """Hashes added in order; :meth:`first_within` answers the earliest added one within ``k`` bits."""

    def __init__(self, k: int):
        self.k = k
        self.bands = bands(k)
        self.tables: list[dict[int, list[int]]] = [{} for _ in self.bands]
        self.order: dict[int, int] = {}      # distinct hash -> its position among the distinct hashes
        self.keys: list = []                 # by position: the first key added with that hash

    def add(self, h: int, key: object) -> None:
        if h in self.order:
            return
        self.order[h] = len(self.keys)
        self.keys.append(key)
        for table, (shift, mask) in zip(self.tables, self.bands):
            table.setdefault((h >> shift) & mask, []).append(h)

    def first_within(self, h: int) -> Optional[object]:
        """The key of the earliest added hash within ``k`` bits of ``h`` (None: none)."""
        best = self.order.get(h)  # (an exact copy; an earlier near one may still come first)
        if self.k >= BITS:  # every hash is within 64 bits
            return self.keys[0] if self.keys else None
        for table, (shift, mask) in zip(self.tables, self.bands):
            for other in table.get((h >> shift) & mask, ()):
                pos = self.order[other]
                if (best is None or pos < best) and (h ^ other).bit_count() <= self.k:
                    best = pos
        return None if best is None else self.keys[best]


def flag_duplicates(items: Iterable[tuple[int, str]], held: Iterable[tuple[int, str]], k: int,
                    progress=None) -> dict[int, dict[str, str]]:
    """``items``: ``(hash, row_id)`` in row order; ``held``: the held-out rows' ones. Returns, by position in
    ``items``, the flags ``duplicate`` (the earliest earlier row within ``k`` bits) and ``holdout_duplicate``
    (the earliest held-out row within ``k`` bits). ``progress(n)`` is called as rows are done."""
    held_index = HashIndex(k)
    for h, rid in held:
        held_index.add(h, rid)
    seen = HashIndex(k)
    out: dict[int, dict[str, str]] = {}
    for i, (h, rid) in enumerate(items):
        flags = {}
        near = seen.first_within(h)
        if near is not None:
            flags["duplicate"] = near
        near = held_index.first_within(h) if held_index.keys else None
        if near is not None:
            flags["holdout_duplicate"] = near
        if flags:
            out[i] = flags
        seen.add(h, rid)
        if progress is not None:
            progress(1)
    return out


class PairIndex:
    """Pairs added in order, found again by their hashes within ``k`` bits and then confirmed by ``same``
    (e.g. thumbnails that match): :meth:`first_match` answers the earliest confirmed one. Each distinct hash
    keeps at most ``per_hash`` entries (the earliest ones), so many pairs with one hash (flat images) stay
    linear."""

    def __init__(self, k: int, bits: int = BITS, per_hash: int = 32):
        self.k, self.per_hash = k, per_hash
        n = max(1, min(k + 1, bits))
        edges = [round(i * bits / n) for i in range(n + 1)]
        self.bands = [(lo, (1 << (hi - lo)) - 1) for lo, hi in zip(edges, edges[1:])]
        self.tables: list[dict[int, list[int]]] = [{} for _ in self.bands]
        self.entries: dict[int, list[tuple[int, object, object]]] = {}
        self.count = 0

    def add(self, h: int, key: object, payload: object) -> None:
        entries = self.entries.get(h)
        if entries is None:
            entries = self.entries[h] = []
            for table, (shift, mask) in zip(self.tables, self.bands):
                table.setdefault((h >> shift) & mask, []).append(h)
        if len(entries) < self.per_hash:
            entries.append((self.count, key, payload))
        self.count += 1

    def first_match(self, h: int, payload: object, same) -> Optional[object]:
        """The key of the earliest added pair within ``k`` bits of ``h`` that ``same(payload, its payload)``
        confirms (None: none)."""
        seen: set[int] = set()
        best: Optional[tuple[int, object]] = None
        for table, (shift, mask) in zip(self.tables, self.bands):
            for other in table.get((h >> shift) & mask, ()):
                if other in seen or (h ^ other).bit_count() > self.k:
                    continue
                seen.add(other)
                for pos, key, theirs in self.entries[other]:
                    if best is not None and pos >= best[0]:
                        break
                    if same(payload, theirs):
                        best = (pos, key)
                        break
        return None if best is None else best[1]


def flag_pair_duplicates(checks, held, k: int, progress=None) -> None:
    """Flag, in place, each row (a ``RowCheck`` with ``source_hash`` / ``target_hash`` / ``_target_thumb`` /
    ``_instruction`` measures) whose source and target are an earlier row's (within ``k`` bits of each hash and
    the target's thumbnail matching: a re-encoded copy counts): ``duplicate`` with the same instruction,
    ``duplicate_pair`` with another; and ``holdout_duplicate`` when its target is a held-out row's. Two edits of
    one source differ in their targets and are not duplicates."""
    from .check_align import thumbs_match
    from .check_rules import flag

    def same(a, b):
        return ((a[0] ^ b[0]).bit_count() <= k and thumbs_match(a[1], b[1])
                and (a[3] is None or b[3] is None or thumbs_match(a[3], b[3])))

    held_index = PairIndex(k)
    for c in held:
        if "target_hash" in c.measures:
            held_index.add(c.measures["target_hash"], c.row_id, (0, c.measures["_target_thumb"], "", None))
    rows = PairIndex(2 * k, bits=2 * BITS)
    for c in checks:
        m = c.measures
        if "target_hash" in m:
            key = (m.get("source_hash", 0) << BITS) | m["target_hash"]
            mine = (m.get("source_hash", 0), m["_target_thumb"], m["_instruction"], m.get("_source_thumb"))
            near = rows.first_match(key, mine, lambda a, b: same(a, b) and b[2] == a[2])
            if near is not None:
                flag(c, "duplicate", near, f"the same source, target and instruction as row {near}")
            else:
                near = rows.first_match(key, mine, same)
                if near is not None:
                    flag(c, "duplicate_pair", near, f"the same source and target as row {near}, another instruction")
            rows.add(key, c.row_id, mine)
            near = held_index.first_match(m["target_hash"], (0, m["_target_thumb"], "", None), same) if held_index.count else None
            if near is not None:
                flag(c, "holdout_duplicate", near, f"its target is the held-out row {near}'s")
        if progress is not None:
            progress(1)
