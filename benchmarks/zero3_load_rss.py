"""Peak host memory per rank of loading a DiT under ZeRO-3: DiffSynth's loader vs the streamed one.

Uses the real ``QwenImageDiT`` with ``--num_layers`` blocks (random weights; one block is
≈0.34 B parameters, ≈0.7 GB in bf16) so the numbers are big enough to see on a CPU machine::

    python benchmarks/zero3_load_rss.py --write /tmp/dit.safetensors --num_layers 1
    torchrun --nproc_per_node 2 benchmarks/zero3_load_rss.py --weights /tmp/dit.safetensors --mode stream
    torchrun --nproc_per_node 2 benchmarks/zero3_load_rss.py --weights /tmp/dit.safetensors --mode diffsynth

Each rank reports its peak resident memory (``VmHWM``) before and after loading, the
difference, and (``--check``) whether every gathered parameter equals the file's.
Both modes build the model through DiffSynth's ``load_model`` under ``deepspeed.zero.Init``
exactly as its ``ModelPool`` does; ``stream`` hands it an empty state dict and then fills the
partitions with ``diffsynth_qie.memory.zero3_load.stream_into``.
"""
from __future__ import annotations

import argparse
import json
import logging

log = logging.getLogger("zero3_load_rss")


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def write(path: str, num_layers: int) -> None:
    import torch
    from diffsynth.models.qwen_image_dit import QwenImageDiT
    from safetensors.torch import save_file

    torch.manual_seed(0)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in QwenImageDiT(num_layers=num_layers).state_dict().items()}
    state = {k: (torch.randn(s) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
    save_file(state, path)
    log.info("wrote %s: %d tensors, %.1f MB", path, len(state), sum(v.numel() * 2 for v in state.values()) / 1e6)


def load(path: str, num_layers: int, mode: str, check: bool, reopen_mb: int = 256) -> dict:
    import deepspeed
    import torch
    import torch.distributed as dist
    from diffsynth.core.loader import load_model
    from diffsynth.models.qwen_image_dit import QwenImageDiT
    from transformers.integrations import HfDeepSpeedConfig

    from diffsynth_qie.memory.zero3_load import SafetensorsStream, stream_into

    deepspeed.init_distributed(dist_backend="gloo")
    ds = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},  # noqa: F841 (kept alive)
                            "train_micro_batch_size_per_gpu": 1})
    config = {"num_layers": num_layers}
    dist.barrier()
    before = status_kb("VmHWM")
    if mode == "diffsynth":
        model = load_model(QwenImageDiT, path, config, torch.bfloat16, "cpu", None, use_disk_map=True)
    else:
        model = load_model(QwenImageDiT, path, config, torch.bfloat16, "cpu", None, use_disk_map=True, state_dict={})
        stream_into(model, SafetensorsStream(path, reopen_bytes=reopen_mb << 20))
    dist.barrier()
    after = status_kb("VmHWM")
    out = {"mode": mode, "rank": dist.get_rank(), "world_size": dist.get_world_size(),
           "hwm_before_mb": before / 1024, "hwm_after_mb": after / 1024, "load_peak_extra_mb": (after - before) / 1024,
           "partition_mb": sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters()) / 2**20}
    if check:
        from safetensors import safe_open

        equal = True
        with safe_open(path, framework="pt", device="cpu") as f:
            for name, p in model.named_parameters():
                with deepspeed.zero.GatheredParameters([p]):
                    equal &= torch.equal(p.data, f.get_tensor(name))
        out["equal_to_file"] = bool(equal)
    return out


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", help="the DiT safetensors file to load")
    parser.add_argument("--write", help="write a random-weight DiT safetensors file here and exit")
    parser.add_argument("--num_layers", type=int, default=1)
    parser.add_argument("--mode", choices=("stream", "diffsynth"), default="stream")
    parser.add_argument("--reopen_mb", type=int, default=256, help="stream: reopen the memory map after this many MiB")
    parser.add_argument("--check", action="store_true", help="compare every gathered parameter with the file")
    args = parser.parse_args()
    if args.write:
        write(args.write, args.num_layers)
        return
    if not args.weights:
        parser.error("--weights (or --write) is required")
    log.info("%s", json.dumps(load(args.weights, args.num_layers, args.mode, args.check, args.reopen_mb)))


if __name__ == "__main__":
    main()
