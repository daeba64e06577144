"""How ``qie check-dataset`` scales (CPU).

    python -m benchmarks.check_dataset_scale [--rows 100000] [--pairwise 10000] [--e2e 400] [--workers 2]

1. The duplicate pass alone over ``--rows`` synthetic 64-bit hashes (random, with one row in ten a near copy,
   1-4 bits flipped, of an earlier one, and a held-out set of 1000): rows/s and the pass's peak Python memory
   (tracemalloc, a second run). With ``--pairwise N`` the pairwise scan the index replaced runs on the first N
   rows too, its rows/s printed and its answer compared with the index's (they must agree).
2. End to end: ``--e2e`` rows of 96x96 PNG pairs (written to a temporary folder) through ``check_rows`` with
   ``--workers`` processes: rows/s and the peak resident memory of this process and of its workers.
"""
from __future__ import annotations

import argparse
import random
import resource
import tempfile
import time
import tracemalloc
from pathlib import Path


def synthetic_hashes(n: int, seed: int = 0) -> list[tuple[int, str]]:
    rng = random.Random(seed)
    out: list[tuple[int, str]] = []
    for i in range(n):
        if out and rng.random() < 0.1:
            h = out[rng.randrange(len(out))][0]
            for bit in rng.sample(range(64), rng.randint(1, 4)):
                h ^= 1 << bit
        else:
            h = rng.getrandbits(64)
        out.append((h, f"r{i}"))
    return out


def pairwise(items, held, k: int) -> dict[int, dict[str, str]]:
    """The scan the index replaced: every row against every earlier row (O(N²))."""
    seen: list[tuple[int, str]] = []
    out: dict[int, dict[str, str]] = {}
    for i, (h, rid) in enumerate(items):
        flags = {}
        near = [r for other, r in seen if bin(h ^ other).count("1") <= k]
        if near:
            flags["duplicate"] = near[0]
        near = [r for other, r in held if bin(h ^ other).count("1") <= k]
        if near:
            flags["holdout_duplicate"] = near[0]
        if flags:
            out[i] = flags
        seen.append((h, rid))
    return out


def duplicate_pass(rows: int, k: int, pairwise_rows: int) -> None:
    from diffsynth_qie.data.check_dups import flag_duplicates

    items, held = synthetic_hashes(rows), synthetic_hashes(1000, seed=1)
    start = time.perf_counter()
    found = flag_duplicates(items, held, k)
    seconds = time.perf_counter() - start
    tracemalloc.start()
    flag_duplicates(items, held, k)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"duplicate pass, index: {rows} rows in {seconds:.2f} s = {rows / seconds:,.0f} rows/s, "
          f"{len(found)} rows flagged, peak {peak / 2**20:.1f} MiB")
    if pairwise_rows:
        start = time.perf_counter()
        expected = pairwise(items[:pairwise_rows], held, k)
        seconds = time.perf_counter() - start
        got = flag_duplicates(items[:pairwise_rows], held, k)
        print(f"duplicate pass, pairwise: {pairwise_rows} rows in {seconds:.2f} s = "
              f"{pairwise_rows / seconds:,.0f} rows/s (O(N²): {rows} rows would take about "
              f"{seconds * (rows / pairwise_rows) ** 2 / 60:.0f} min); same answer: {got == expected}")
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--distance", type=int, default=4, help="--dup_distance")
    parser.add_argument("--pairwise", type=int, default=0, help="also run the pairwise scan on this many rows")
    parser.add_argument("--e2e", type=int, default=400, help="rows of the end-to-end run (0: none)")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    duplicate_pass(args.rows, args.distance, args.pairwise)
    if args.e2e:
        end_to_end(args.e2e, args.workers)


if __name__ == "__main__":
    main()
