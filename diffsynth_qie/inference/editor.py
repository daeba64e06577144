"""``Editor``: the one inference API (CLI, training validation, UI, benchmarks).

It drives DiffSynth's components itself instead of calling
``QwenImagePipeline.__call__``: the text encoder and VAE through our thin
``models/qwen_image_edit/encoding.py`` wrappers (DiffSynth's own units), the DiT through our batched
``dit_forward``. That buys three things DiffSynth's pipeline lacks:

- true CFG as one batch of 2 (positive + negative); LBM bridge sampling with a main and a white-prior
  sub-stream in one batch;
- per-component devices (``device_map``) and model-level CPU offload at component boundaries.

With no mask, no LoRA and no LBM the result equals ``QwenImagePipeline.__call__`` (``edit_image_auto_resize=False``,
same seed) up to float rounding of the batched forward (tests/test_inference.py pins the latents).

Devices
-------
- Default: every component on one device (CUDA when available), bf16 on GPU, fp32 on CPU.
- ``device_map={"text_encoder": "cuda:1", "dit": "cuda:0", "vae": "cuda:0"}``: each
  component lives on its own device (weights are loaded on the CPU, then moved).
- ``cpu_offload=True``: components stay on the CPU and each is moved to its device
  only while it runs (model-level offload; peak GPU memory = the largest component,
  the DiT: ≈40 GB bf16 for the real model). For GPUs smaller than the DiT use
  ``blocks_to_swap=N`` (the last N DiT blocks stream from pinned CPU memory, prefetched on a
  side stream; ≈0.68 GB bf16 saved per block, docs/MEMORY.md), or DiffSynth's layer-level
  VRAM management: build the pipe with ``load_pipeline(..., model_config_kwargs={c: {"offload_device": "cpu",
  ...}}, vram_limit=...)`` and wrap it with ``Editor(pipe)``; the editor calls ``pipe.load_models_to_device``
  like DiffSynth's pipeline does (untested on GPU here).

Not thread-safe: one editor per worker (the UI runs generations on one thread).
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Mapping, Sequence

import torch
from PIL import Image

from ..data.images import resize_to, to_rgb
from ..models.prompts import check_prompt_length
from ..models.family import EDIT, family_of_pipe
from ..models.qwen_image_edit.edit_ops import reference_size  # noqa: F401 (public here)
from ..models.family_ops import ops_for
from ..models.qwen_image_edit.forward import bound_rope_cache
from ..models.samplers.cached_blocks import step_cache_for
from ..models.samplers.sampling import sample_bridge, sample_flow_match, seeded_noise, uses_cfg
from ..models.samplers.step_cache import cache_settings
from ..models.samplers.schedules import ScheduleSpec
from .checks import check_request
from .request import DEFAULT_MAX_PIXELS, EditRequest, EditResult, output_size  # noqa: F401 (public here too)
from .devices import COMPONENTS, _module_device, device_map_with, parse_device_map, parse_dtype  # noqa: F401
from .masking import LatentMaskBlend, blend_pixels, latent_keep_weight

log = logging.getLogger(__name__)

Tensor = torch.Tensor
PREVIEW_MAX_PIXELS = 192 * 192  # a live preview's size at most: latents larger than this are area-averaged first


def preview_latents(latents: Tensor, vae_factor: int, max_pixels: int = PREVIEW_MAX_PIXELS) -> Tensor:
    """``[C, h, w]`` latents averaged down so that they decode to at most ``max_pixels`` (a preview: a VAE decode
    costs about its pixels); as they are when already small enough."""
    h, w = latents.shape[-2:]
    scale = (max_pixels / (h * w * vae_factor ** 2)) ** 0.5
    if scale >= 1:
        return latents
    size = (max(1, int(h * scale)), max(1, int(w * scale)))
    return torch.nn.functional.interpolate(latents[None].float(), size=size, mode="area")[0].to(latents.dtype)


# --- the editor ---------------------------------------------------------------------
class Editor:
    """Edit images with a loaded pipeline (text encoder + DiT + VAE) of either family; what differs between
    the families is behind ``models/family_ops.py`` (``FamilyOps``)."""

    def __init__(self, pipe, device_map: Mapping[str, str] | str | None = None, cpu_offload: bool = False,
                 zero_cond_t: bool | None = None, offload_device: str = "cpu", lora_merge: bool = False,
                 blocks_to_swap: int = 0):
        self.pipe = pipe
        self.lora_merge = bool(lora_merge)
        self.preset = getattr(pipe, "qie_preset", None)
        self.zero_cond_t = bool(self.preset.zero_cond_t if zero_cond_t is None and self.preset else zero_cond_t)
        self.multi_image_prompt = self.preset.multi_image_prompt if self.preset is not None else True
        self.family = family_of_pipe(pipe) or EDIT  # (a stand-in pipeline without a preset: the Edit family)
        self.ops = ops_for(self.family)
        self.cpu_offload = bool(cpu_offload)
        self.offload_device = torch.device(offload_device)
        self.dtype = pipe.torch_dtype
        mapping = parse_device_map(device_map)
        self.devices: dict[str, torch.device] = {}
        for name in COMPONENTS:
            if name in mapping:
                device = torch.device(mapping[name])
            elif getattr(pipe, "vram_management_enabled", False) or self.cpu_offload:
                device = torch.device(pipe.device)
            else:
                device = _module_device(getattr(pipe, name, None)) or torch.device(pipe.device)
            self.devices[name] = device
        for name in COMPONENTS:
            module = getattr(pipe, name, None)
            if module is None:
                continue
            target = self.offload_device if self.cpu_offload else self.devices[name]
            if name == "dit" and blocks_to_swap:
                continue  # the block swapper places the DiT
            if _module_device(module) != target and not getattr(pipe, "vram_management_enabled", False):
                module.to(device=target)
        self.block_swapper = self._swap_blocks(blocks_to_swap)
        self._loras = None
        log.debug("editor devices %s, dtype %s, zero_cond_t %s, cpu_offload %s",
                  {k: str(v) for k, v in self.devices.items()}, self.dtype, self.zero_cond_t, self.cpu_offload)

    @classmethod
    def from_preset(cls, model: str = "tiny", model_dir=None, device: str | None = None,
                    torch_dtype: str | torch.dtype | None = None, device_map: Mapping[str, str] | str | None = None,
                    cpu_offload: bool = False, zero_cond_t: bool | None = None,
                    lora_merge: bool = False, fp8_base: bool = False, blocks_to_swap: int = 0) -> "Editor":
        """Load ``model`` (edit, 2509, 2511, tiny; tiny is built on first use) and wrap it.

        dtype ``None``/"auto": bf16 when any component runs on a GPU, fp32 on CPU.
        With a ``device_map``, ``cpu_offload``, ``fp8_base`` or ``blocks_to_swap`` the weights are loaded on the
        CPU first. ``fp8_base``: the DiT's block linears are stored as FP8 (``memory/fp8.py``), quantised
        from a host copy straight onto the DiT's device; LoRAs are then applied unmerged.
        """
        from ..models.load.loading import default_device, load_pipeline

        device = str(torch.device(device)) if device else default_device()
        mapping = parse_device_map(device_map)
        devices = {name: mapping.get(name, device) for name in COMPONENTS}
        dtype = parse_dtype(torch_dtype)
        if dtype is None:
            on_gpu = any(not d.startswith("cpu") for d in devices.values())
            dtype = torch.bfloat16 if on_gpu else torch.float32
        split = len(set(devices.values())) > 1
        load_device = "cpu" if (cpu_offload or split or fp8_base or blocks_to_swap) else device
        pipe = load_pipeline(model, model_dir=model_dir, device=load_device, torch_dtype=dtype, zero_cond_t=zero_cond_t,
                             map_weights=any(d.startswith("cuda") for d in devices.values()))  # host staging
        if fp8_base:
            from ..memory.block_swap import swapped_blocks
            from ..memory.fp8 import quantize_linears

            quantize_linears(pipe.dit.requires_grad_(False), device="cpu" if cpu_offload else devices["dit"],
                             host=swapped_blocks(pipe.dit, blocks_to_swap))  # (swapped blocks: back to the host)
        pipe.device = devices["dit"]  # where the pipeline's own intermediate tensors live
        return cls(pipe, device_map=devices, cpu_offload=cpu_offload, lora_merge=lora_merge,
                   blocks_to_swap=blocks_to_swap)

    def _swap_blocks(self, blocks_to_swap: int):
        """``blocks_to_swap`` > 0: stream the DiT's last blocks from the CPU (``memory/block_swap.py``)."""
        if not blocks_to_swap:
            return None
        if self.cpu_offload or getattr(self.pipe, "vram_management_enabled", False):
            raise ValueError(f"blocks_to_swap={blocks_to_swap} cannot be combined with cpu_offload or DiffSynth's "
                             "VRAM management (both move the whole DiT); use one of them")
        from ..memory.block_swap import BlockSwapper

        self.pipe.dit.requires_grad_(False)  # inference: every weight is frozen, so every block weight swaps
        return BlockSwapper(self.pipe.dit, blocks_to_swap, self.devices["dit"], self.offload_device).install()

    # --- LoRA ---------------------------------------------------------------------
    def set_loras(self, loras: Sequence[tuple[str, float]]):
        """Make exactly ``loras`` [(path, scale), ...] active on the DiT (``[]`` = base model).

        Unmerged by default: an adapter branch on each targeted linear, so a LoRA costs
        its own size and a scale change writes no weight. With ``lora_merge=True`` the
        deltas are merged into the weights (no per-step cost, a CPU backup of every
        touched weight). Either way, switching restores the base weights bit-exactly,
        without reloading the model. Returns the load reports.
        """
        from ..memory.fp8 import fp8_layers

        if loras and self.lora_merge and fp8_layers(self.pipe.dit):  # would add an unscaled delta to FP8 bits
            raise ValueError("LoRAs cannot be merged into FP8 base weights: drop --lora_merge (LoRAs then run as "
                             "unmerged branches beside the FP8 weights) or load the model without --fp8_base")
        if self._loras is None:
            from ..lora.manager import LoraManager

            self._loras = LoraManager(self.pipe.dit, merge=self.lora_merge, family=self.family.name)
        return self._loras.set_loras([(str(p), float(s)) for p, s in loras])

    @property
    def active_loras(self) -> list:
        return [] if self._loras is None else self._loras.active

    # --- devices ------------------------------------------------------------------
    @contextlib.contextmanager
    def _running(self, name: str):
        """While ``name`` runs: it is on its device (offload) and ``pipe.device`` points there."""
        device = self.devices[name]
        if self.cpu_offload:
            for other in COMPONENTS:
                module = getattr(self.pipe, other, None)
                if module is not None:
                    module.to(device=device if other == name else self.offload_device)
        saved = self.pipe.device
        self.pipe.device = device
        try:
            yield device
        finally:
            self.pipe.device = saved

    def _encode_images(self, images: Sequence[Image.Image]) -> list[Tensor]:
        with self._running("vae"):
            return [self.ops.encode_image(self.pipe, im) for im in images]

    def _encode_prompt(self, prompt: str, refs: Sequence[Image.Image], ref_latents: Sequence[Tensor],
                       max_tokens: int | None):
        with self._running("text_encoder"):
            return self.ops.encode_prompt(self.pipe, prompt, refs, ref_latents, self.multi_image_prompt, max_tokens)

    def _white(self, width: int, height: int) -> Tensor:
        """LBM's sub-stream prior: VAE latents of a pure white image at the output size."""
        with self._running("vae"):
            return self.ops.white(self.pipe, width, height)

    def _decode(self, latents: Tensor) -> Image.Image:
        with self._running("vae"):
            return self.ops.decode(self.pipe, latents)

    # --- editing ------------------------------------------------------------------
    @torch.no_grad()
    def edit(self, request: EditRequest) -> EditResult:
        """Run one edit: flow matching (``lbm_steps=None``) or LBM bridge sampling."""
        start = time.perf_counter()
        check_request(request)
        if len(request.images) > self.family.max_references:  # (DiffSynth fails later, or truncates)
            raise ValueError(f"{len(request.images)} reference images: {self.family.label} takes at most "
                             f"{self.family.max_references}; pass {self.family.max_references} or fewer")
        bound_rope_cache(self.pipe.dit)
        for prompt in (request.prompt, request.negative_prompt):  # before any encoder runs
            check_prompt_length(self.pipe, prompt, request.max_prompt_tokens)
        images = [to_rgb(im) for im in request.images]
        width, height = output_size(request, images[0], self.family.size_divisor)
        refs = [resize_to(im, size) for im, size in
                zip(images, self.ops.reference_sizes(self.pipe, images, width, height, request.ref_max_pixels))]
        lbm = request.lbm_steps is not None
        if lbm and not self.ops.supports_lbm:
            raise ValueError(f"{self.family.label} has no LBM sampler "
                             "(drop lbm_steps / --lbm_steps)")
        cfg = request.lbm_cfg if lbm else (self.family.default_cfg if request.cfg is None else request.cfg)
        if lbm and request.cache != "off":
            log.info("LBM's 1-4 steps are each a large jump with no earlier step to reuse: no step cache")
        step_cache = None if lbm else step_cache_for(
            cache_settings(request.cache, request.cache_method, request.cache_threshold), self.pipe.dit, self.family,
            getattr(self.preset, "name", None))
        if not lbm and request.scheduler == "lightning" and uses_cfg(cfg):
            log.info("Lightning LoRAs were distilled for CFG 1: using cfg 1 instead of %g", cfg)
            cfg = 1.0

        edit_latents = self._encode_images(refs)
        prompt_emb = self._encode_prompt(request.prompt, refs, edit_latents, request.max_prompt_tokens)
        negative_emb = (self._encode_prompt(request.negative_prompt, refs, edit_latents, request.max_prompt_tokens)
                        if uses_cfg(cfg) else None)
        need_source = lbm or (request.mask is not None and request.mask_blend > 0) or request.strength < 1.0
        z_src = None
        if need_source:  # the first reference at the output size
            z_src = edit_latents[0] if refs[0].size == (width, height) else \
                self._encode_images([resize_to(images[0], (width, height))])[0]
        z_white = self._white(width, height) if lbm else None

        dit_device = self.devices["dit"]
        to_dit = lambda t: t.to(device=dit_device, dtype=self.dtype)  # noqa: E731
        cond = self.ops.conditioning([prompt_emb], None if negative_emb is None else [negative_emb], [edit_latents],
                                     self.zero_cond_t, to_dit)
        if hasattr(cond, "kv_cache"):  # a family whose prefix keys/values can be cached across steps
            cond.kv_cache = request.kv_cache
        latents = self._sample(request, cond, cfg, z_src, z_white, self.family.latent_size(height, width),
                               step_cache=step_cache)
        # the conditioning holds 2.1's prefix KV caches (GiBs at full size): free them before the VAE decodes
        del cond, prompt_emb, negative_emb, edit_latents, z_src, z_white
        decoded = [self._decode(x) for x in latents]
        self.pipe.load_models_to_device([])
        if request.mask is not None and request.mask_blend > 0:
            decoded = [blend_pixels(im, images[0], request.mask, request.mask_blend, request.mask_feather)
                       for im in decoded]
        seconds = time.perf_counter() - start
        stats = None if step_cache is None else step_cache.stats
        log.debug("edited %dx%d (%s) in %.2f s%s", width, height,
                  f"LBM {request.lbm_steps} step(s)" if lbm else f"{request.steps} steps, cfg {cfg:g}", seconds,
                  "" if stats is None else f"; the step cache reused {stats.skipped} of {stats.calls} DiT calls")
        return EditResult(image=decoded[0], sub_image=decoded[1] if lbm else None,
                          latents=latents.detach().float().cpu(), width=width, height=height, seconds=seconds,
                          cache=stats)

    def _sample(self, request: EditRequest, cond, cfg: float, z_src: Tensor | None,
                z_white: Tensor | None, latent_hw: tuple[int, int], step_cache=None) -> Tensor:
        """Run the DiT sampler: flow matching from seeded noise (with ``step_cache``), or LBM from [z_S, z_W]."""
        dit_device = self.devices["dit"]
        to_dit = lambda t: t.to(device=dit_device, dtype=self.dtype)  # noqa: E731
        with self._running("dit"):
            self.pipe.load_models_to_device(["dit"])  # DiffSynth VRAM management, else no-op
            if request.lbm_steps is not None:
                prior = torch.stack([to_dit(z_src), to_dit(z_white)])  # main stream, sub-stream
                velocity = self.ops.velocity(self.pipe.dit, cond.repeat(2), cfg)
                keep = self._latent_blend(request, z_src=to_dit(z_src).expand_as(prior), prior=prior)
                generator = torch.Generator("cpu").manual_seed(int(request.seed))
                return sample_bridge(velocity, prior, int(request.lbm_steps), request.lbm_noise, generator, keep,
                                     request.progress, strength=request.strength, preview=self._previews(request))
            noise = seeded_noise((1, self.family.latent_channels, *latent_hw), request.seed, self.dtype, dit_device)
            velocity = self.ops.velocity(self.pipe.dit, cond, cfg)
            keep = self._latent_blend(request, z_src=None if z_src is None else to_dit(z_src)[None], prior=noise)
            steps = (len(request.sigmas) if request.sigmas else self.default_steps()) if request.steps is None \
                else int(request.steps)
            spec = ScheduleSpec.for_preset(self.preset, steps, latent_hw, request.scheduler, request.strength,
                                           request.sigmas)
            return sample_flow_match(velocity, noise, spec, self.ops.schedule, keep, request.progress,
                                     source=None if z_src is None else to_dit(z_src)[None],
                                     preview=self._previews(request), step_cache=step_cache)

    def _previews(self, request: EditRequest):
        """The sampler's preview hook for ``request.preview``: every ``preview_every`` steps (not the last), the
        first stream's predicted clean latents decoded by the VAE, at most :data:`PREVIEW_MAX_PIXELS` (the decode's
        cost grows with the pixels). None when not asked for, and with CPU offload or
        DiffSynth's VRAM management (a decode there would move the DiT off its device between steps)."""
        every, show = request.preview_every, request.preview
        if show is None or every <= 0:
            return None
        if self.cpu_offload or getattr(self.pipe, "vram_management_enabled", False):
            log.info("no live previews with CPU offload or VRAM management (each would move the DiT off its device)")
            return None

        def preview(step: int, total: int, x0: Tensor) -> None:
            if step % every == 0 and step < total:
                show(step, total, self._decode(preview_latents(x0[0], self.family.vae_factor)))
        return preview

    def default_steps(self) -> int:
        """The model's own step count: a fixed grid's length (2.1-turbo), else the family's default (40)."""
        return len(getattr(self.preset, "sigmas", None) or ()) or self.family.default_steps

    def _latent_blend(self, request: EditRequest, z_src: Tensor | None, prior: Tensor) -> LatentMaskBlend | None:
        if request.mask is None or request.mask_blend <= 0:
            return None
        assert z_src is not None
        weight = latent_keep_weight(request.mask, tuple(prior.shape[-2:]), request.mask_blend,
                                    factor=self.family.vae_factor)
        return LatentMaskBlend(z_src=z_src, prior=prior, weight=weight.to(device=prior.device, dtype=prior.dtype))

