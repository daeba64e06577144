"""The batch of a fake-device training step (``train_step.py``): shaped like a collated cache batch of any family.

Per sample: a target latent ``[C, H/f, W/f]`` (the family's latent channels and VAE factor), reference latents, a
prompt embedding ``[L, D]``, the family's prompt tensors (Qwen-Image-2.1: the references' slot mask ``pad``
``[L]`` on the host, as the cache gives it), the edit mask ``back_mask [1, H/f, W/f]`` when
``--mask_loss_weights`` weighs the loss with it, the bridge loss's extra latents (LBM) and a preference loss's
rejected latents (DPO). Values do not
exist; only shapes, dtypes and devices, as ``TrainingModule.to_compute`` leaves them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

DEVICE = "cuda:0"


@dataclass(frozen=True)
class SampleShape:
    """One sample: target size in pixels, the reference images' sizes, prompt tokens."""

    height: int
    width: int
    refs: tuple[tuple[int, int], ...] = ((1024, 1024),)
    prompt_tokens: int = 300

    @property
    def tokens(self) -> int:
        return sum((h // 16) * (w // 16) for h, w in ((self.height, self.width), *self.refs)) + self.prompt_tokens


def batch_shapes(resolution: int, ref_images: int, prompt_tokens: int, batch_size: int,
                 mixed: bool = False, multiple: int = 16) -> tuple[SampleShape, ...]:
    """``batch_size`` samples at ``resolution``²; ``mixed``: every other sample is 4:3 landscape at about
    the same pixel count (sides in multiples of ``multiple``: the family's ``size_divisor``) with a prompt 30 %
    shorter (a mixed-shape, mixed-length batch)."""
    out = []
    for b in range(batch_size):
        if mixed and b % 2:
            h, w = _snap(resolution * 0.866, multiple), _snap(resolution * 1.155, multiple)
            out.append(SampleShape(h, w, ((h, w),) * ref_images, max(1, int(prompt_tokens * 0.7))))
        else:
            out.append(SampleShape(resolution, resolution, ((resolution, resolution),) * ref_images, prompt_tokens))
    return tuple(out)


def step_rows(shapes: Sequence[SampleShape], step: int, multiple: int = 16) -> tuple[SampleShape, ...]:
    """The samples of step ``step`` (0 is the first: ``shapes``): other rows of the data. On odd steps each sample
    is turned 4:3 the other way (about its pixel count, sides in multiples of ``multiple``) with a prompt 30 %
    shorter; even steps take ``shapes``' sizes again, so every size a later step takes an earlier one took (a
    cache per size fills once; one per sample grows)."""
    if step % 2 == 0:
        return tuple(shapes)

    def turned(h: int, w: int) -> tuple[int, int]:
        return _snap(h * 0.866, multiple), _snap(w * 1.155, multiple)

    return tuple(SampleShape(*turned(s.height, s.width), tuple(turned(h, w) for h, w in s.refs),
                             max(1, int(s.prompt_tokens * 0.7))) for s in shapes)


def _snap(x: float, multiple: int = 16) -> int:
    return max(multiple, int(round(x / multiple)) * multiple)


def text_dim(dit: torch.nn.Module) -> int:
    """The width of the prompt embedding the DiT takes: the input of the first linear of its ``txt_in``."""
    return next(m for m in dit.txt_in.modules() if isinstance(m, torch.nn.Linear)).in_features


def fake_batch(shapes: Sequence[SampleShape], family, dim: int, *, lbm: bool, masks: bool,
               dtype: torch.dtype, pairs: bool = False, negatives: bool = False) -> dict:
    """A collated batch on the fake device for ``family`` (a ``models.family.Family``); ``negatives``: with the
    empty prompt's embedding (and its extras) a CFG pass reads (``LossSpec.cfg_pass``)."""
    from ..fakegpu.standin21 import slot_mask21

    def lat(h: int, w: int, channels: int = family.latent_channels) -> torch.Tensor:
        return torch.empty(channels, *family.latent_size(h, w), device=DEVICE, dtype=dtype)

    if "pad" in family.prompt_tensors:  # the references' slots in the prompt, on the host as the cache holds them
        extras = [{"pad": slot_mask21([family.latent_size(h, w) for h, w in s.refs], s.prompt_tokens)}
                  for s in shapes]
        lengths = [len(e["pad"]) for e in extras]
    else:
        extras, lengths = None, [s.prompt_tokens for s in shapes]
    batch = {
        "target_latents": [lat(s.height, s.width) for s in shapes],
        "edit_latents": [[lat(h, w) for h, w in s.refs] for s in shapes],
        "prompt_emb": [torch.empty(n, dim, device=DEVICE, dtype=dtype) for n in lengths],
        "back_mask": [lat(s.height, s.width, 1) if masks else None for s in shapes],
        "index": list(range(len(shapes))),
    }
    if extras is not None:
        batch["prompt_extras"] = extras
    if lbm:
        batch["lbm_source_latents"] = [lat(s.height, s.width) for s in shapes]
        batch["sub_noise"] = [lat(s.height, s.width) for s in shapes]
    if pairs:  # a preference row's rejected output, at its target's size
        batch["rejected_latents"] = [lat(s.height, s.width) for s in shapes]
    if negatives:  # the cached empty prompt: the template's tokens around no instruction
        empty = [max(1, s.prompt_tokens // 2) for s in shapes]
        if extras is not None:
            batch["empty_prompt_extras"] = [{"pad": slot_mask21([family.latent_size(h, w) for h, w in s.refs], n)}
                                            for s, n in zip(shapes, empty)]
            empty = [len(e["pad"]) for e in batch["empty_prompt_extras"]]
        batch["empty_prompt_emb"] = [torch.empty(n, dim, device=DEVICE, dtype=dtype) for n in empty]
    return batch
