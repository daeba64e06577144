"""``cache.encode.placed`` from two threads at once (``--on_the_fly``: the encode thread and validation both
encode through one pipe): no call sees the other component's device, and ``pipe.device`` ends as it began."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch

from diffsynth_qie.cache.encode import placed


def _pipe():
    text_encoder = torch.nn.Linear(2, 2, device="meta")
    vae = torch.nn.Linear(2, 2, device="cpu")
    return SimpleNamespace(text_encoder=text_encoder, vae=vae, device="cuda:0")


def test_two_threads_never_see_each_others_device():
    pipe = _pipe()
    wrong: list = []
    calls = 2000
    start = threading.Barrier(2)

    def run(component: str, expected: torch.device) -> None:
        start.wait()
        for _ in range(calls):
            with placed(pipe, component):
                seen = [pipe.device]
                time.sleep(0)  # hand the GIL over inside the block, as a real encode does
                seen.append(pipe.device)
            wrong.extend(d for d in seen if d != expected)

    threads = [threading.Thread(target=run, args=("text_encoder", torch.device("meta"))),
               threading.Thread(target=run, args=("vae", torch.device("cpu")))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == [], f"{len(wrong)} of {4 * calls} reads saw the other component's device"
    assert pipe.device == "cuda:0"


def test_placed_restores_the_device_after_an_error():
    pipe = _pipe()
    try:
        with placed(pipe, "vae"):
            assert pipe.device == torch.device("cpu")
            raise RuntimeError("encode failed")
    except RuntimeError:
        pass
    assert pipe.device == "cuda:0"
