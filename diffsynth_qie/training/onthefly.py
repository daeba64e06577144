"""``qie train --on_the_fly``: the encoders loaded on their devices, the :class:`~..cache.live.LiveStore` over the
dataset, and batches encoded ahead in a background thread while the DiT trains.

Why a thread, not DataLoader worker processes: the encoders are large models on a device; a worker process
would need its own copy. PyTorch releases the GIL in its kernels, so an encoder on the CPU (or on another GPU)
runs beside the DiT's step in the same process; with both on one GPU the thread still overlaps the image
decoding and the host work. Under DeepSpeed ZeRO-3 on-the-fly training is refused: DiffSynth's loader builds
every model partitioned there, and each rank would need whole encoders of its own outside the engine.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
from typing import Iterator, Optional

log = logging.getLogger(__name__)


def check_on_the_fly(cfg, ds_config: Optional[dict]) -> None:
    if cfg.onthefly.on_the_fly and ds_config and ds_config.get("zero_optimization", {}).get("stage") == 3:
        raise ValueError("--on_the_fly is refused under DeepSpeed ZeRO-3: the encoders would be built partitioned; "
                         "use ZeRO-2 or DDP (each rank then encodes its own share), or cache first with `qie cache`")


def live_store(cfg, preset, accelerator):
    """The text encoder and VAE loaded on ``--text_encoder_device`` / ``--vae_device`` (default: the training
    device), wrapped in a :class:`~..cache.live.LiveStore` over ``--dataset_metadata``."""
    from ..cache.config import CacheConfig
    from ..cache.live import LiveStore
    from ..cache.settings import load_encoder_pipeline
    from ..models.load.loading import default_dtype

    o, t = cfg.onthefly, cfg.train
    here = "cpu" if accelerator.device.type == "cpu" else str(accelerator.device)
    dtype = default_dtype(o.text_encoder_device or here)
    pipe = load_encoder_pipeline(preset, t.model_dir, dtype, here, o.text_encoder_device, o.vae_device)
    config = CacheConfig(model=preset.name, model_dir=t.model_dir, max_pixels=o.max_pixels,
                         edit_max_pixels=o.edit_max_pixels, dataset=cfg.dataset, fields=cfg.fields)
    log.info("on the fly: text encoder on %s, VAE encoder on %s (%s, decoder not kept); batches encoded %d ahead",
             o.text_encoder_device or here, o.vae_device or here, str(dtype).replace("torch.", ""), o.prefetch)
    return LiveStore(config, pipe, preset, t.output_dir, seed=t.seed, augment=o.augment,
                     write_skipped=accelerator.is_main_process)


def prefetched(stream: Iterator, depth: int) -> Iterator:
    """``stream`` computed up to ``depth`` items ahead in a daemon thread (0: as it is). An error in the
    thread is raised here, at the item it would have produced."""
    if depth <= 0:
        yield from stream
        return
    items: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in stream:
                while not stop.is_set():
                    try:
                        items.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            items.put((done, e))
            return
        items.put((done, None))

    thread = threading.Thread(target=produce, name="qie-on-the-fly-encode", daemon=True)
    thread.start()
    try:
        while True:
            item, error = items.get()
            if error is not None:
                raise error
            if item is done:
                return
            yield item
    finally:  # (closed when training ends): let the thread finish the batch it is on, then stop, before the
        stop.set()  # interpreter exits; a thread killed inside a torch kernel aborts the process
        while thread.is_alive():
            with contextlib.suppress(queue.Empty):
                items.get(timeout=0.1)  # room for a put it is blocked on
