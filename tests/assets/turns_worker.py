"""One process of ``tests/test_load_turns_ddp.py``: ``in_turns`` over gloo, the process named by argv[1] raising
in its turn. Prints what it raised as ``RAISED <type>: <message>``."""
import sys

import torch.distributed as dist

from diffsynth_qie.training.placement import gathered, in_turns, process_group_timeout

dist.init_process_group("gloo", timeout=process_group_timeout())
rank, failing = dist.get_rank(), int(sys.argv[1])


def load():
    if rank == failing:
        raise ValueError(f"--model_dir /nowhere (process {rank}): no such directory")
    return rank


try:
    in_turns(load, rank, dist.get_world_size(), gathered)
    print("LOADED", flush=True)
except Exception as e:  # noqa: BLE001
    print(f"RAISED {type(e).__name__}: {e}", flush=True)
    sys.exit(1)
finally:
    dist.destroy_process_group()
