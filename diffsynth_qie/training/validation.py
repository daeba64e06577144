"""Validation renders during training: a few held-out cache entries edited by the current model.

Phase 2 has no text encoder, so validation reuses what the cache holds: each held-out
entry's prompt embedding (its first prompt alternative), its reference latents, and its
target size. A short flow-matching Euler sampler on DiffSynth's Qwen-Image schedule
(``FlowMatchScheduler("Qwen-Image")`` with the pipeline's ``dynamic_shift_len``) runs
all entries as one batch through the *wrapped* training module (its ``predict``
path), so DDP/DeepSpeed hooks fire and under ZeRO-3 every rank takes part. The VAE is
loaded alone (``components=("vae",)``), once, and only when validation is on.

Images go to ``<output_dir>/validation/step-<n>/<k>-<entry>.png`` (atomically) and to
WandB when it is on. The initial noise is the same at every validation, so images of
different steps are comparable.
"""
from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..cache.store import CacheStore
from ..utils.atomic import atomic_save

log = logging.getLogger(__name__)

VALIDATION_DIR = "validation"
NOISE_SEED = 1234


def sampler_sigmas(num_steps: int, height: int, width: int) -> torch.Tensor:
    """σ_0 > ... > σ_{N-1} of DiffSynth's Qwen-Image inference schedule, then 0 (``[N+1]``).

    ``height``/``width`` are latent sizes; the shift depends on the token count
    (h/2)·(w/2) exactly as ``QwenImagePipeline.__call__`` sets it.
    """
    from diffsynth.diffusion.flow_match import FlowMatchScheduler

    scheduler = FlowMatchScheduler("Qwen-Image")
    scheduler.set_timesteps(num_steps, dynamic_shift_len=(height // 2) * (width // 2))
    return torch.cat([scheduler.sigmas.float(), torch.zeros(1)])


@torch.no_grad()
def sample_edits(predict, prompt_embs: Sequence[torch.Tensor], edit_latents: Sequence[Sequence[torch.Tensor]],
                 shapes: Sequence[tuple[int, int]], num_steps: int, zero_cond_t: bool, cfg_scale: float = 1.0,
                 negative_embs: Optional[Sequence[torch.Tensor]] = None, seed: int = NOISE_SEED,
                 device=None, dtype=torch.float32) -> list[torch.Tensor]:
    """Euler flow-matching sampling of a batch of edits; returns ``[16, h, w]`` latents per sample.

    ``predict(**dit_forward_kwargs) -> list`` runs the DiT. With ``cfg_scale > 1`` the
    negative (empty-prompt) predictions come from the same batched forward.
    """
    gen = torch.Generator().manual_seed(seed)
    x = [torch.randn((16, h, w), generator=gen).to(device=device, dtype=torch.float32) for h, w in shapes]
    sigmas = [sampler_sigmas(num_steps, h, w) for h, w in shapes]
    use_cfg = cfg_scale != 1.0 and negative_embs is not None
    n = len(x)
    for k in range(num_steps):
        t = torch.stack([s[k] for s in sigmas]) * 1000
        lat = [xi.to(dtype) for xi in x]
        embs, edits = list(prompt_embs), list(edit_latents)
        if use_cfg:
            lat, t, embs, edits = lat + lat, torch.cat([t, t]), embs + list(negative_embs), edits + edits
        v = predict(latents=lat, timesteps=t.to(device), prompt_embs=embs, edit_latents=edits,
                    zero_cond_t=zero_cond_t)
        v = [vi.float() for vi in v]
        if use_cfg:
            v = [neg + cfg_scale * (pos - neg) for pos, neg in zip(v[:n], v[n:])]
        x = [xi + vi * float(s[k + 1] - s[k]) for xi, vi, s in zip(x, v, sigmas)]
    return x


class Validator:
    """Renders held-out entries every ``validate_every`` steps (see the module docstring)."""

    def __init__(self, store: CacheStore, indices: Sequence[int], output_dir: str, preset, model_dir: Optional[str],
                 num_steps: int, cfg_scale: float, zero_cond_t: bool, accelerator, dtype: torch.dtype):
        self.store = store
        self.indices = list(indices)
        self.output_dir = Path(output_dir) / VALIDATION_DIR
        self.preset = preset
        self.model_dir = model_dir
        self.num_steps = num_steps
        self.cfg_scale = cfg_scale
        self.zero_cond_t = zero_cond_t
        self.accelerator = accelerator
        self.dtype = dtype
        self._vae_pipe = None

    def _zero3(self) -> bool:
        from transformers.integrations import is_deepspeed_zero3_enabled

        return is_deepspeed_zero3_enabled()

    def _pipe(self):
        """VAE-only pipeline, loaded on first use: on the main process, or on every rank under
        ZeRO-3 (DiffSynth then builds it partitioned, and decoding gathers it collectively)."""
        if self._vae_pipe is None:
            from ..models.loading import load_pipeline

            device = self.accelerator.device
            device = "cpu" if device.type == "cpu" else str(device)
            self._vae_pipe = load_pipeline(self.preset, model_dir=self.model_dir, components=("vae",),
                                           device=device, torch_dtype=self.dtype)
        return self._vae_pipe

    @torch.no_grad()
    def run(self, step: int, wrapped_module, device, dtype) -> dict:
        """Render, decode and save; all ranks call this. Returns {name: PIL image} on the main process."""
        entries = [self.store.load(i) for i in self.indices]
        shapes = [tuple(e.target_latents.shape[1:]) for e in entries]

        def to(t):
            return t.to(device=device, dtype=dtype)

        def predict(**kw):
            return wrapped_module(predict=kw)

        latents = sample_edits(
            predict, [to(e.prompt_embs[0]) for e in entries], [[to(x) for x in e.edit_latents] for e in entries],
            shapes, self.num_steps, self.zero_cond_t, self.cfg_scale,
            negative_embs=[to(e.empty_prompt_emb) for e in entries], device=device, dtype=dtype)
        images = {}
        zero3 = self._zero3()
        if self.accelerator.is_main_process or zero3:
            from ..models.encoding import decode_latents

            pipe = self._pipe()
            ctx = _gathered(pipe.vae) if zero3 else contextlib.nullcontext()
            with ctx:
                for k, (entry, lat) in enumerate(zip(entries, latents)):
                    images[f"{k}-{_safe(entry.entry_id)}"] = decode_latents(pipe, lat)
        if self.accelerator.is_main_process:
            folder = self.output_dir / f"step-{step}"
            for name, img in images.items():
                atomic_save(folder / f"{name}.png", lambda p, img=img: img.save(p))
            log.info("validation: %d image(s) in %s", len(images), folder)
            return images
        return {}


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:64]


def _gathered(module):
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
