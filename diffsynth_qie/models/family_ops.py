"""What the cache, the training loss and the :class:`~diffsynth_qie.inference.editor.Editor` do differently per
model family, behind one abstract interface.

The flows are the same for every family: the cache sizes the images, VAE-encodes them and encodes the
prompts with the references; the loss runs the DiT on noisy latents; the editor samples from seeded noise
and decodes. A family's :class:`FamilyOps` supplies its steps; :func:`ops_for` finds it through
``Family.ops`` (``family.py``), so nothing else asks which family it serves. Implementations:
``edit_ops.EditOps`` (Qwen-Image-Edit) and ``qwen21_ops.Qwen21Ops`` (Qwen-Image-2.1).

A prompt encoding is family-specific (a tensor [L, D] for Qwen-Image-Edit, a :class:`~.qwen21.Prompt21` with
the references' slot mask for 2.1). :meth:`FamilyOps.split_prompt` / :meth:`FamilyOps.join_prompt` turn it into
the tensors the cache stores and back: the embedding [L, D] plus one tensor per name of the family's
``Family.prompt_tensors``.
"""
from __future__ import annotations

import abc
import functools
import importlib
from typing import Callable, Mapping, Optional, Sequence

import torch
from PIL import Image

from .family import Family, get_family
from .samplers.schedules import ScheduleSpec

Tensor = torch.Tensor


class FamilyOps(abc.ABC):
    """A model family's behaviour. A new family implements every method (and sets :attr:`family`)."""

    family: Family
    supports_lbm: bool = False          # Latent Bridge Matching training and sampling
    supports_zero_cond_t: bool = False  # zero-timestep modulation of the reference tokens (2511)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        complete = not any(getattr(getattr(cls, name), "__isabstractmethod__", False)
                           for name in FamilyOps.__abstractmethods__)
        if complete and not isinstance(getattr(cls, "family", None), Family):
            raise TypeError(f"{cls.__name__} must set `family` to its models.family.Family")

    # --- sizes -----------------------------------------------------------------------------------------
    @abc.abstractmethod
    def reference_sizes(self, pipe, images: Sequence[Image.Image], width: int, height: int,
                        ref_max_pixels: Optional[int]) -> list[tuple[int, int]]:
        """The editor's (width, height) of each reference for an output of ``width`` x ``height``."""

    @abc.abstractmethod
    def cache_reference_size(self, size: tuple[int, int], target_size: tuple[int, int], max_pixels: int,
                             divisor: int, source: str) -> tuple[int, int]:
        """A cached reference's (width, height) (``source`` names the image in errors)."""

    # --- encoding --------------------------------------------------------------------------------------
    @abc.abstractmethod
    def encode_image(self, pipe, image: Image.Image) -> Tensor:
        """VAE latents ``[C, h, w]`` of one image."""

    @abc.abstractmethod
    def vae_pixels(self, pipe, image: Image.Image) -> Tensor:
        """One image as the VAE takes it (``[1, C, H, W]`` on the pipeline's device and dtype)."""

    @abc.abstractmethod
    def white(self, pipe, width: int, height: int) -> Tensor:
        """Latents of a white image (LBM's sub-stream prior; the cache's shared ``sub_noise``)."""

    @abc.abstractmethod
    def encode_prompt(self, pipe, prompt: str, refs: Sequence[Image.Image], ref_latents: Sequence[Tensor],
                      multi_image: bool, max_tokens: Optional[int]):
        """The prompt encoded with its reference images (the family's own encoding type)."""

    @abc.abstractmethod
    def split_prompt(self, encoded) -> tuple[Tensor, dict[str, Tensor]]:
        """An encoded prompt as cache tensors: (embedding [L, D], {name: tensor} for ``family.prompt_tensors``)."""

    @abc.abstractmethod
    def join_prompt(self, emb: Tensor, extras: Mapping[str, Tensor]):
        """The inverse of :meth:`split_prompt`."""

    # --- the DiT ---------------------------------------------------------------------------------------
    @abc.abstractmethod
    def forward(self, dit, latents: Sequence[Tensor], timesteps: Tensor, prompts: Sequence, ref_latents,
                zero_cond_t: bool = False, use_gradient_checkpointing: bool = False) -> list[Tensor]:
        """The training loss's DiT call: one velocity per sample (``prompts`` as :meth:`join_prompt` gives)."""

    @abc.abstractmethod
    def conditioning(self, prompts: Sequence, negatives: Optional[Sequence], ref_latents: Sequence[Sequence[Tensor]],
                     zero_cond_t: bool, to_dit: Callable[[Tensor], Tensor]):
        """The sampler's per-sample conditioning (``prompts[b]`` as :meth:`encode_prompt` / :meth:`join_prompt`
        give them; ``negatives`` only for CFG), moved with ``to_dit``."""

    @abc.abstractmethod
    def velocity(self, dit, cond, cfg: float):
        """The sampler's velocity function ``(x [B, C, h, w], timesteps [B]) -> v`` with true CFG."""

    @abc.abstractmethod
    def schedule(self, spec: ScheduleSpec):
        """The ready DiffSynth ``FlowMatchScheduler`` for ``spec`` (default, Lightning or a fixed grid), or a
        ValueError naming what the family cannot sample."""

    @abc.abstractmethod
    def decode(self, pipe, latents: Tensor) -> Image.Image:
        """The RGB image of ``[C, h, w]`` latents."""


@functools.lru_cache(maxsize=None)
def _ops(dotted: str) -> FamilyOps:
    module, _, name = dotted.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    return cls()


def ops_for(family: Family | str) -> FamilyOps:
    """The ops of a family (or of a family name): ``Family.ops``, resolved once."""
    family = get_family(family) if isinstance(family, str) else family
    ops = _ops(family.ops)
    if ops.family.name != family.name:
        raise ValueError(f"{family.ops} serves {ops.family.name}, not {family.name}; fix Family.ops")
    return ops
