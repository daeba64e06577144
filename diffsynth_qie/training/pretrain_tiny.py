"""The pretrained tiny bases: a tiny Qwen-Image-Edit and a tiny Qwen-Image-2.1 that can draw flat shapes.

A random tiny model decodes noise, so a LoRA trained on it shows nothing. This
recipe turns the instant tiny model (``tiny/build.py``) into a base a LoRA can
visibly teach, in a few minutes of one CPU thread:

1. the VAE becomes :class:`~diffsynth_qie.tiny.vae.TinyConvQwenImageVAE`,
   trained as an autoencoder on procedurally generated shape images
   (``data/demo.random_shapes_image``);
2. the DiT is fully fine-tuned with our flow-matching loss
   (``training.losses.flow_match_sft_loss``) on a base skill: "reproduce the source
   image", with ``zero_cond_t`` on for half the batches so both the 2509 and the 2511
   paths work. It calls the loss directly on in-memory batches instead of running
   ``training.loop.train`` on a cache: the latents come from the VAE trained a
   minute earlier in the same process, and a cache plus a LoRA/checkpoint loop
   would only add disk round trips to a one-off, full-weight, single-process job.
   The text encoder stays random (it still carries the prompt: the edit a LoRA
   learns later is asked for in words).

The tiny Qwen-Image-2.1 (``tiny/qwen21.py``: DiffSynth's real 2.1 DiT and text encoder at small sizes) takes
the same recipe through its family's ops (:data:`RECIPE21`): its VAE becomes
:class:`~diffsynth_qie.tiny.vae21.TinyConvQwenImage21VAE` (RGBA, 16x, 64 channels; the alpha it learns is
opaque), and its DiT learns to reproduce the reference it reads in its t=0 prefix (it has no ``zero_cond_t``).

Everything is deterministic from ``seed``. The result is written in the real repo
layout by :func:`pretrain_tiny`; ``tiny/pretrained.py`` installs it (from
the weights shipped with the package when their recipe fingerprint matches) and
DiffSynth's own loader reads it.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import time
from pathlib import Path

import torch

from ..tiny import pretrained as tiny_pretrained
from .config import RunConfig
from .losses.sft import flow_match_sft_loss

log = logging.getLogger(__name__)

#: Everything that decides the weights. Changing any value changes the fingerprint.
RECIPE = dict(
    version=1,
    image_size=[64, 64],
    vae_steps=800, vae_batch=8, vae_lr=3e-3, vae_latent_reg=1e-2, vae_shape_weight=4.0,
    dit_steps=1600, dit_batch=8, dit_lr=1e-3, dit_pool=256,
    prompts=["keep the image as it is", "reproduce the picture", "make the red circle blue", ""],
)
#: The tiny 2.1's recipe: the same skills, budgeted for its per-sample DiT calls.
RECIPE21 = dict(RECIPE, version=1, family="qwen-image-2.1", vae_steps=800, vae_lr=3e-4, dit_steps=1200)
#: The recipe of each tiny preset with a pretrained base, by the name of its module constant.
RECIPES = {"tiny": "RECIPE", "tiny-2.1": "RECIPE21"}


def _recipe(model: str) -> dict:
    tiny_pretrained.base_for(model)  # a ValueError naming the presets with a base
    return globals()[RECIPES[model]]


def recipe_fingerprint(seed: int = 0, model: str = "tiny") -> str:
    """Fingerprint of the recipe, the model sizes and the seed (see ``tiny/pretrained.py``)."""
    return tiny_pretrained.fingerprint({"recipe": _recipe(model), "seed": seed}, tiny_pretrained.base_for(model))


def _to_tensor(images, channels: int = 3) -> torch.Tensor:
    """Images as [B, C, H, W] in [-1, 1]; a fourth channel is an opaque alpha (the 2.1 VAE's RGBA)."""
    import numpy as np

    arr = np.stack([np.asarray(im, dtype=np.float32) for im in images]) / 127.5 - 1.0
    x = torch.from_numpy(arr).permute(0, 3, 1, 2).contiguous()
    return torch.cat([x, torch.ones_like(x[:, :1])], dim=1) if channels == 4 else x


def train_vae(vae, seed: int, log_every: int = 100, recipe: dict = RECIPE, channels: int = 3) -> float:
    """Autoencoder training of the conv VAE on random shape images; returns the final PSNR (dB)."""
    from ..data.demo import random_shapes_image

    r = recipe
    rng = random.Random(f"{seed}:vae")
    vae.train().requires_grad_(True)
    opt = torch.optim.AdamW(vae.parameters(), lr=r["vae_lr"], weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, r["vae_steps"], eta_min=r["vae_lr"] * 0.05)
    size = tuple(r["image_size"])
    mse = torch.tensor(1.0)
    for step in range(r["vae_steps"]):
        x = _to_tensor([random_shapes_image(rng, size) for _ in range(r["vae_batch"])], channels)
        z = vae.encode(x)
        y = vae.decode(z)
        mse = torch.mean((y - x) ** 2)
        # Keep the normalised latents near zero mean / unit variance per channel: the DiT's noise scale.
        reg = (z.mean(dim=(0, 2, 3)) ** 2).mean() + ((z.std(dim=(0, 2, 3)) - 1) ** 2).mean()
        # Shapes cover a small part of each image: weight the pixels that differ from the background
        # (the image's median colour) more, or the colours of the shapes come out washed.
        bg = x.flatten(2).median(dim=2).values[:, :, None, None]
        w = 1.0 + r["vae_shape_weight"] * ((x - bg)[:, :3].abs().amax(dim=1, keepdim=True) > 0.1).float()
        err = y - x
        loss = (w * (err.abs() + err ** 2)).mean() / w.mean() + r["vae_latent_reg"] * reg
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % log_every == 0:
            log.info("VAE step %d/%d: mse %.4f", step, r["vae_steps"], mse.item())
    vae.eval().requires_grad_(False)
    return float(10 * torch.log10(4.0 / mse.detach()))


def train_dit(pipe, seed: int, log_every: int = 100, model: str = "tiny") -> float:
    """Full fine-tune of the DiT to reproduce the source; returns the last 50 steps' mean loss."""
    from ..data.demo import random_shapes_image
    from ..models.family_ops import ops_for
    from ..models.presets import DEFAULT_MAX_PROMPT_TOKENS, family_of

    r = _recipe(model)
    ops = ops_for(family_of(model))
    rng = random.Random(f"{seed}:dit")
    pool = []
    for i in range(r["dit_pool"]):
        image = random_shapes_image(rng, tuple(r["image_size"]))
        prompt = r["prompts"][i % len(r["prompts"])]
        z = ops.encode_image(pipe, image)
        emb, extras = ops.split_prompt(ops.encode_prompt(pipe, prompt, [image], [z], True, DEFAULT_MAX_PROMPT_TOKENS))
        pool.append((z, emb, extras))
    dit = pipe.dit
    dit.train().requires_grad_(True)
    opt = torch.optim.AdamW(dit.parameters(), lr=r["dit_lr"], weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, r["dit_steps"], eta_min=r["dit_lr"] * 0.05)
    gen = torch.Generator().manual_seed(seed)
    base = RunConfig()
    losses = []
    for step in range(r["dit_steps"]):
        items = [pool[rng.randrange(len(pool))] for _ in range(r["dit_batch"])]
        batch = {"target_latents": [z for z, _, _ in items], "edit_latents": [[z] for z, _, _ in items],
                 "prompt_emb": [e for _, e, _ in items], "prompt_extras": [x for _, _, x in items],
                 "back_mask": [None] * len(items)}
        config = dataclasses.replace(base, train=dataclasses.replace(
            base.train, model=model, zero_cond_t=ops.supports_zero_cond_t and bool(step % 2),
            gradient_checkpointing=False))
        loss, _ = flow_match_sft_loss(dit, batch, config, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(dit.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % log_every == 0:
            log.info("DiT step %d/%d: loss %.4f", step, r["dit_steps"], loss.item())
    dit.eval().requires_grad_(False)
    tail = losses[-50:]
    return sum(tail) / len(tail)


def pretrain_tiny(out_dir: str | Path, seed: int = 0, model: str = "tiny") -> Path:
    """Build the random tiny model in ``out_dir``, then train its VAE and DiT in place (minutes)."""
    from safetensors.torch import save_file

    from ..models.load.loading import load_pipeline
    from ..utils.atomic import atomic_path

    base, recipe = tiny_pretrained.base_for(model), _recipe(model)
    out_dir = Path(out_dir)
    t0 = time.perf_counter()
    base.build(out_dir, seed=seed)
    pipe = load_pipeline(model, model_dir=out_dir, device="cpu", torch_dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = base.conv_vae()
        vae_psnr = train_vae(vae, seed, recipe=recipe, channels=base.vae_channels)
        t_vae = time.perf_counter() - t0
        pipe.vae = vae
        dit_loss = train_dit(pipe, seed, model=model)
    seconds = time.perf_counter() - t0
    for rel, module in ((base.files["vae"][0], vae), (base.files["dit"][0], pipe.dit)):
        sd = {k: v.detach().float().contiguous() for k, v in module.state_dict().items()}
        with atomic_path(out_dir / rel) as tmp:
            save_file(sd, str(tmp), metadata={"format": "pt"})
    stats = {"vae_psnr_db": round(vae_psnr, 2), "dit_final_loss": round(dit_loss, 4),
             "vae_seconds": round(t_vae, 1), "seconds": round(seconds, 1)}
    tiny_pretrained.mark_pretrained(out_dir, recipe_fingerprint(seed, model), recipe, seed, stats, base)
    log.info("pretrained tiny base in %s: VAE %.1f dB, DiT loss %.3f, %.0f s", out_dir, vae_psnr, dit_loss, seconds)
    return out_dir


def ensure_pretrained_tiny(out_dir: str | Path | None = None, seed: int = 0, rebuild: bool = False,
                           model: str = "tiny") -> Path:
    """Return a directory holding the pretrained tiny base, building it only when needed.

    Order: an existing build with this recipe's fingerprint; else the weights shipped
    with the package (when their fingerprint matches); else train (a few minutes).
    ``rebuild`` always trains. Builds go to a temporary sibling renamed into place.
    """
    base = tiny_pretrained.base_for(model)
    out_dir = Path(out_dir) if out_dir is not None else tiny_pretrained.default_dir(base)
    fp = recipe_fingerprint(seed, model)
    if not rebuild and tiny_pretrained.is_pretrained(out_dir, fp, base):
        base.register()
        return out_dir
    if not rebuild and seed == 0 and tiny_pretrained.install_shipped(out_dir, fp, base):
        return out_dir
    return tiny_pretrained.build_atomically(out_dir, lambda tmp: pretrain_tiny(tmp, seed=seed, model=model), base)
