"""How ``qie check-dataset`` scales (CPU).

    python -m benchmarks.check_dataset_scale [--rows 100000] [--flat 20000] [--pairwise 3000] [--e2e 400]
                                             [--demo 20000 | --demo_data METADATA] [--workers 2]

1. The duplicate pass alone (``data/check_dups.flag_pair_duplicates``) over ``--rows`` synthetic rows with random
   64-bit source and target hashes and 16x16 thumbnails (one row in ten a re-encoded copy of an earlier one, some
   with another instruction, some of a held-out row's target), and over ``--flat`` rows whose hashes have few
   bits set, as flat images give (plain backgrounds: every hash a few bits from many others): rows/s and the
   pass's peak Python memory (tracemalloc, a second run). With ``--pairwise N`` the pairwise scan
   (:func:`pairwise_pairs`, O(N²)) runs on the first N rows of each too, and must give the same answer.
2. End to end: ``--e2e`` rows of 96x96 PNG pairs (written to a temporary folder) through ``check_rows`` with
   ``--workers`` processes: rows/s and the peak resident memory of this process and of its workers.
3. ``--demo N``: ``qie make-demo-data --num_pairs N``, then ``qie check-dataset --write_clean`` on it as a user
   runs it (its own process, default workers): the seconds of each and the check's CPU seconds. ``--demo_data``
   checks a demo dataset made before instead (making 20,000 rows takes longer than checking them).
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from pathlib import Path

PROMPTS = ("make it blue", "remove the cup", "add a hat")
THUMB = 256  # bytes of a 16x16 grey thumbnail


def _thumb(rng: random.Random, like: bytes | None = None, flat: bool = False) -> bytes:
    if like is not None:  # a re-encoded copy: every pixel within 2 grey levels
        noise = rng.randbytes(THUMB)
        return bytes(min(255, max(0, b + n % 5 - 2)) for b, n in zip(like, noise))
    if not flat:
        return rng.randbytes(THUMB)
    back, fore, y, x = rng.randrange(200, 250), rng.randrange(256), rng.randrange(12), rng.randrange(12)
    block = bytes([fore]) * 4  # a plain background and a 4x4 block of another grey
    rows = [bytes([back]) * 16 if not y <= r < y + 4 else bytes([back]) * x + block + bytes([back]) * (12 - x)
            for r in range(16)]
    return b"".join(rows)


def _hash(rng: random.Random, flat: bool) -> int:
    return sum(1 << b for b in rng.sample(range(64), rng.randint(2, 8))) if flat else rng.getrandbits(64)


def _near(rng: random.Random, h: int, bits: int | None = None) -> int:
    for bit in rng.sample(range(64), rng.randint(0, 2) if bits is None else bits):
        h ^= 1 << bit
    return h


def synthetic_checks(n: int, seed: int = 0, flat: bool = False, held: int = 50, copies: int = 0, k: int = 4):
    """``(rows, held_rows)`` of ``RowCheck`` with the measures the duplicate pass reads (see the module's doc).
    Some copies keep the target and move the source by ``k + 1`` bits (within ``2k`` in all, but not the same
    source). ``copies``: that many more rows with one row's hashes but pictures of their own (flat images hash
    alike), then a re-encoded copy of each: those past the index's ``per_hash`` are not found, by design."""
    from diffsynth_qie.data.check import RowCheck

    rng = random.Random(seed)

    def row(i, prefix, source=True, copy_of=None, far_source=False, same_hashes=None):
        m = {}
        if copy_of is None:
            m["target_hash"], m["_target_thumb"] = _hash(rng, flat), _thumb(rng, flat=flat)
            if source:
                m["source_hash"], m["_source_thumb"] = _hash(rng, flat), _thumb(rng, flat=flat)
            if same_hashes is not None:
                m.update({h: same_hashes.measures[h] for h in ("target_hash", "source_hash")})
        else:
            o = copy_of.measures
            m["target_hash"], m["_target_thumb"] = _near(rng, o["target_hash"]), _thumb(rng, o["_target_thumb"])
            if "source_hash" in o:
                m["source_hash"] = _near(rng, o["source_hash"], min(k + 1, 64) if far_source else None)
                m["_source_thumb"] = _thumb(rng, o["_source_thumb"])
            if far_source:
                m["target_hash"] = o["target_hash"]
        m["_instruction"] = rng.choice(PROMPTS)
        return RowCheck(i, f"{prefix}{i}", {}, measures=m)

    held_rows = [row(i, "h") for i in range(held)]
    rows = []
    for i in range(n):
        pick = rng.random()
        if rows and pick < 0.1:
            rows.append(row(i, "r", copy_of=rows[rng.randrange(len(rows))], far_source=pick < 0.02))
        elif held_rows and pick < 0.12:
            rows.append(row(i, "r", copy_of=held_rows[rng.randrange(len(held_rows))]))
        else:
            rows.append(row(i, "r", source=i == 0 or rng.random() > 0.05))
    if copies and rows:
        alike = [row(n + i, "r", same_hashes=rows[0]) for i in range(copies)]
        rows += alike + [row(n + copies + i, "r", copy_of=a) for i, a in enumerate(alike)]
    return rows, held_rows


def pairwise_pairs(rows, held, k: int, per_hash: int = 32) -> dict[int, dict[str, str]]:
    """The duplicate pass written out as the scan the index replaced: every row against every earlier kept one
    (O(N²)); the flags by position."""
    from diffsynth_qie.data.check_align import thumbs_match

    def same(a, b, bits):  # a, b: (source hash, target hash, target thumb, source thumb)
        return ((a[0] ^ b[0]).bit_count() + (a[1] ^ b[1]).bit_count() <= bits and (a[0] ^ b[0]).bit_count() <= k
                and thumbs_match(a[2], b[2]) and (a[3] is None or b[3] is None or thumbs_match(a[3], b[3])))

    def pair(m, source=True):
        return (m.get("source_hash", 0) if source else 0, m["target_hash"], m["_target_thumb"],
                m.get("_source_thumb") if source else None)

    kept_held, per = [], Counter()
    for c in held:
        if per[c.measures["target_hash"]] < per_hash:
            kept_held.append((pair(c.measures, False), c.row_id))
        per[c.measures["target_hash"]] += 1
    kept, per, out = [], Counter(), {}
    for i, c in enumerate(rows):
        m, flags = c.measures, {}
        mine = pair(m)
        found = [(rid, instruction) for p, rid, instruction in kept if same(mine, p, 2 * k)]
        told = [rid for rid, instruction in found if instruction == m["_instruction"]]
        if told:
            flags["duplicate"] = told[0]
        elif found:
            flags["duplicate_pair"] = found[0][0]
        key = (mine[0], mine[1])
        if per[key] < per_hash:
            kept.append((mine, c.row_id, m["_instruction"]))
        per[key] += 1
        near = [rid for p, rid in kept_held if same(pair(m, False), p, k)]
        if near:
            flags["holdout_duplicate"] = near[0]
        if flags:
            out[i] = flags
    return out


def duplicate_pass(rows: int, k: int, pairwise_rows: int, flat: bool) -> None:
    import copy

    from diffsynth_qie.data.check_dups import flag_pair_duplicates

    items, held = synthetic_checks(rows, flat=flat)
    kind = "flat" if flat else "random"
    fresh = copy.deepcopy(items)
    start = time.perf_counter()
    flag_pair_duplicates(fresh, held, k)
    seconds = time.perf_counter() - start
    tracemalloc.start()
    flag_pair_duplicates(copy.deepcopy(items), held, k)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"duplicate pass, {kind} hashes: {rows} rows in {seconds:.2f} s = {rows / seconds:,.0f} rows/s, "
          f"{sum(1 for c in fresh if c.flags)} rows flagged, peak {peak / 2**20:.1f} MiB", flush=True)
    if pairwise_rows:
        start = time.perf_counter()
        expected = pairwise_pairs(items[:pairwise_rows], held, k)
        seconds = time.perf_counter() - start
        got = {i: c.flags for i, c in enumerate(fresh[:pairwise_rows]) if c.flags}
        print(f"duplicate pass, pairwise, {kind} hashes: {pairwise_rows} rows in {seconds:.2f} s; same answer: "
              f"{got == expected}", flush=True)
        if got != expected:
            raise SystemExit("the index and the pairwise scan disagree")


def end_to_end(rows: int, workers: int) -> None:
    import numpy as np
    from PIL import Image

    from diffsynth_qie.data.check import CheckConfig, check_rows

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        tasks = []
        for i in range(rows):
            low = rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)
            src = Image.fromarray(low).resize((96, 96), Image.BILINEAR)
            tgt = np.asarray(src).copy()
            tgt[32:64, 32:64] = (30, 30, 200)
            s, t = Path(tmp) / f"{i}_s.png", Path(tmp) / f"{i}_t.png"
            src.save(s)
            Image.fromarray(tgt).save(t)
            tasks.append({"row_id": f"r{i}", "target": str(t), "source": str(s), "mask": None})
        start = time.perf_counter()
        checks, _ = check_rows(tasks, CheckConfig(workers=workers), show_progress=False)
        seconds = time.perf_counter() - start
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(f"end to end: {rows} rows of 96x96 pairs, {workers} worker(s): {seconds:.2f} s = {rows / seconds:,.1f} "
          f"rows/s, {sum(1 for c in checks if c.flags)} flagged; peak RSS {own:.0f} MiB (largest worker "
          f"{children:.0f} MiB)")


def demo(rows: int, metadata: str | None = None) -> None:
    """``qie make-demo-data`` (unless ``metadata`` names a dataset already made) then ``qie check-dataset
    --write_clean``, each in its own process as a user runs it."""
    with tempfile.TemporaryDirectory() as tmp:
        qie = [sys.executable, "-m", "diffsynth_qie.cli"]
        made = ""
        if metadata is None:
            start = time.perf_counter()
            subprocess.run([*qie, "make-demo-data", "--out", f"{tmp}/demo", "--num_pairs", str(rows)], check=True,
                           capture_output=True)
            made, metadata = f"make-demo-data {rows} rows {time.perf_counter() - start:.1f} s; ", f"{tmp}/demo/metadata.json"
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run([*qie, "check-dataset", metadata, "--out", f"{tmp}/check", "--write_clean", f"{tmp}/clean.json"],
                       check=True, capture_output=True)
        seconds = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        checked = len(json.loads(Path(metadata).read_text()))
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    print(f"demo: {made}check-dataset --write_clean {checked} rows {seconds:.1f} s = {checked / seconds:,.0f} rows/s "
          f"({cpu:.0f} CPU s in all its processes)", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--flat", type=int, default=20_000, help="rows of the flat-hash duplicate pass (0: none)")
    parser.add_argument("--distance", type=int, default=4, help="--dup_distance")
    parser.add_argument("--pairwise", type=int, default=0, help="also run the pairwise scan on this many rows")
    parser.add_argument("--e2e", type=int, default=400, help="rows of the end-to-end run (0: none)")
    parser.add_argument("--demo", type=int, default=0, help="demo rows through qie check-dataset (0: none)")
    parser.add_argument("--demo_data", default=None, help="check this metadata file instead of making --demo rows")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    if args.rows:
        duplicate_pass(args.rows, args.distance, args.pairwise, flat=False)
    if args.flat:
        duplicate_pass(args.flat, args.distance, args.pairwise, flat=True)
    if args.e2e:
        end_to_end(args.e2e, args.workers)
    if args.demo or args.demo_data:
        demo(args.demo, args.demo_data)


if __name__ == "__main__":
    main()
