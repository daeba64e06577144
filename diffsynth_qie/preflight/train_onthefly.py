"""``--on_the_fly`` in the fake-device training step (``train_step.py``): the encoders on the device beside the DiT,
and one sample encoded through the real on-the-fly path.

The family's real text encoder and VAE (its decoder freed, as ``cache.settings.load_encoder_pipeline`` frees
it) are built on the fake device in the training dtype, and one row of the step's first sample's shape is
encoded by :meth:`~..cache.live.LiveStore.load`: ``prepare_row`` (the images decoded, resized, ``--augment``ed
and masked on the host), ``encode_prepared`` (the VAE encode of target and references and the prompt, each
inside ``placed``, where its weights are) and the white latents. The one stand-in is the Qwen-VL prompt
encoder's host bookkeeping (``fakegpu/standin_vl.py``: the language model runs over the same tokens). The row's
images are grey PNGs in a temporary folder (values do not matter; sizes do).

What the encode holds above what was live before it is the encode transient; the background encode thread
runs it beside the DiT's step on a GPU, so the step's peak counts it on top (``StepReport.peak``). The encode
phase allows host copies: the cache's prompt tensors are copied to the host by design, in the encode thread.
Encoders placed elsewhere (``--text_encoder_device`` / ``--vae_device`` naming the CPU or another GPU) are not
built: their memory is not the training GPU's, and the encode is then left out (a note says so).
"""
from __future__ import annotations

import tempfile
from pathlib import Path
import torch
from PIL import Image

from .train_batch import DEVICE, SampleShape


def elsewhere(cfg) -> list[str]:
    """The on-the-fly encoders that ``cfg`` places on another device than the training GPU."""
    o = cfg.onthefly
    out = []
    for flag, dev in (("--text_encoder_device", o.text_encoder_device), ("--vae_device", o.vae_device)):
        if dev is not None and torch.device(dev) not in (torch.device("cuda"), torch.device(DEVICE)):
            out.append(f"{flag} {dev}")
    return out


def _row(folder: Path, shape: SampleShape, masked: bool, row_id: str = "check"):
    """One dataset row of ``shape``: grey target and references, a mask when the loss weighs with it."""
    from ..data.rows import EditRow

    def png(name: str, size: tuple[int, int], mode: str = "RGB") -> Path:
        path = folder / name
        Image.new(mode, size, 128).save(path)
        return path

    target = png("target.png", (shape.width, shape.height))
    refs = [png(f"ref{i}.png", (w, h)) for i, (h, w) in enumerate(shape.refs)]
    mask = png("mask.png", (shape.width, shape.height), "L") if masked else None
    return EditRow(row_id=row_id, prompts=["edit"], target=target, edit_images=refs, back_mask=mask)


def _store(cfg, preset, pipe, row):
    """A :class:`~..cache.live.LiveStore` over ``row`` alone, with the prompt stand-in in the family's ops (the
    dataset's reading and validation, host-only, are left out)."""
    from ..cache.config import CacheConfig
    from ..cache.live import LiveStore
    from ..fakegpu.standin_vl import StandinOps
    from ..models.family_ops import ops_for

    class CheckStore(LiveStore):
        def __init__(self):  # (LiveStore.load, _encode and _white are what run)
            o = cfg.onthefly
            self.config = CacheConfig(model=preset.name, model_dir=None, max_pixels=o.max_pixels,
                                      edit_max_pixels=o.edit_max_pixels, dataset=cfg.dataset, fields=cfg.fields)
            self.pipe, self.preset, self.seed, self.augment = pipe, preset, cfg.train.seed, o.augment
            self.ops, self._whites, self.rows = StandinOps(ops_for(preset.family)), {}, [row]

    return CheckStore()


class Encoders:
    """The on-the-fly encoders on the device and the store that encodes through them, kept beside the steps."""

    def __init__(self, cfg, preset, pipe):
        self.cfg, self.preset, self.pipe = cfg, preset, pipe
        self.store = None

    def encode(self, fc, shape: SampleShape) -> None:
        """Encode the store's next row, of ``shape``, in the phase "on-the-fly encode" (the entry is then dropped,
        as the loop drops a batch after its step)."""
        with tempfile.TemporaryDirectory(prefix="qie-check-") as folder:
            masked = self.cfg.loss.mask_loss_weights is not None
            row = _row(Path(folder), shape, masked, row_id=f"check{0 if self.store is None else len(self.store.rows)}")
            if self.store is None:
                self.store = _store(self.cfg, self.preset, self.pipe, row)
            else:
                self.store.rows.append(row)
            with fc.phase("on-the-fly encode", host_syncs=True):
                entry = self.store.load(len(self.store.rows) - 1, epoch=0)
            del entry


def encode_once(fc, cfg, preset, family, shape: SampleShape, prompt_tokens: int, dtype: torch.dtype):
    """Build the encoders on the fake device and encode one row of ``shape`` in the phase "on-the-fly encode";
    returns (the :class:`Encoders`, kept alive beside the step, its weights' bytes), or (None, 0) when an
    encoder is placed elsewhere."""
    from ..fakegpu.standin_vl import FakeTokenizer, build_encoders

    if elsewhere(cfg):
        return None, 0
    before = fc.current_bytes
    te, vae = build_encoders(fc, family, dtype, DEVICE, preset)
    vae.decoder = None  # (an encoder-only pipeline, as qie train loads it)
    fc.register(te), fc.register(vae)
    pipe = family.pipeline_type()(device=DEVICE, torch_dtype=dtype)
    pipe.text_encoder, pipe.vae, pipe.tokenizer = te, vae, FakeTokenizer(prompt_tokens)
    weights = fc.current_bytes - before
    encoders = Encoders(cfg, preset, pipe)
    encoders.encode(fc, shape)
    return encoders, weights


def on_the_fly(fc, cfg, preset, family, shape: SampleShape, report, encode: bool,
               dtype: torch.dtype = torch.bfloat16):
    """``--on_the_fly``'s encoders and one encode (with ``encode``), recorded in ``report`` (``encoder_weights``,
    ``encode_transient``, notes); returns the :class:`Encoders` for the caller to keep until the steps are done
    (and to encode a later step's sample with), None without."""
    if not (cfg.onthefly.on_the_fly and encode):
        return None
    if elsewhere(cfg):
        report.notes.append(f"--on_the_fly: {', '.join(elsewhere(cfg))}: those encoders are not on the training "
                            "GPU; the encode is not run here")
        return None
    encoders, report.encoder_weights = encode_once(fc, cfg, preset, family, shape, shape.prompt_tokens, dtype)
    phase = fc.phases[-1]
    report.encode_transient = max(0, phase.peak_bytes - phase.start_bytes)
    return encoders
