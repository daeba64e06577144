"""Multi-node runs check at start that CACHE_DIR / OUTPUT_DIR are shared: two "nodes" as
threads, with one directory each or one shared directory."""
from __future__ import annotations

import threading


from diffsynth_qie.utils.shared_dir import check_shared_dir


def run_ranks(dirs):
    barrier = threading.Barrier(len(dirs))
    errors = [None] * len(dirs)

    def rank(i):
        try:
            check_shared_dir(dirs[i], i == 0, barrier.wait, what="--output_dir", name=".qie-shared-check-test")
        except ValueError as e:
            errors[i] = str(e)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(dirs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return errors


def test_a_shared_directory_passes_and_is_left_clean(tmp_path):
    assert run_ranks([tmp_path, tmp_path]) == [None, None]
    assert list(tmp_path.iterdir()) == []


def test_a_node_local_directory_stops_the_other_rank_naming_it(tmp_path):
    a, b = tmp_path / "node0", tmp_path / "node1"
    b.mkdir()
    errors = run_ranks([a, b])
    assert errors[0] is None
    assert errors[1] is not None and f"--output_dir {b} is not shared with rank 0" in errors[1]
