"""DiffusionNFT (``--loss nft``): online reward tuning on the forward process (``docs/REWARD.md``).

Each training sample is a *source*: its references, prompt and (for the reward) target and mask from the
cache. Per source, the loss

1. lets the old policy follow the trained one (``θ_old ← η θ_old + (1 − η) θ``, once per optimizer step);
2. samples ``K`` edits with the old policy at ``--nft_rollout_steps`` steps, through the family's own sampler
   (2511 keeps ``zero_cond_t``; 2.1 reuses each rollout's prefix KV cache), from noise drawn on the loss's
   generator;
3. decodes them with the VAE and scores them with ``--reward`` (``metrics/rewards.py``) against the decoded
   source, target and mask; turns the rewards into optimality probabilities, group by group;
4. trains on the clean rollouts: one flow-matching point each, the current and the old policy's velocity there,
   and ``nft_math.nft_loss`` (the implicit positive / negative policy contrast).

The old policy is a copy of the trainable weights kept by :class:`NFTState`, saved in every checkpoint
(accelerate's custom objects), so a resume is exact. Rollouts need the whole trainable weights on each rank:
not under DeepSpeed ZeRO-3. Torch-free at import (the registry builds the flags from it).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

from ...utils.config_cli import cli_help
from .spec import LossSpec


@dataclass
class NFTConfig:
    """DiffusionNFT (used with --loss nft)."""

    reward: str = field(default="", metadata=cli_help(
        "--loss nft: what rollouts are scored by, a weighted sum of terms (docs/REWARD.md): preserve, fidelity, "
        "drift, colour, judge, module:function, jsonl:PATH; e.g. 'preserve:0.5,mypkg.rewards:blue:1'"))
    reward_judge: Optional[str] = field(default=None, metadata=cli_help(
        "--reward judge's judge: an OpenAI-compatible URL#MODEL[#FORMAT] or a local EditScore directory "
        "(docs/SCORECARD.md; how it is asked: the --judge_* flags)"))
    reward_judge_max_failed: float = field(default=0.25, metadata=cli_help(
        "--reward judge: the share of a group's rollouts the judge may fail to score (they count as the group's "
        "mean); past it the run stops with one line instead of training on partial rewards", min=0.0, max=1.0))
    reward_timeout: float = field(default=900.0, metadata=cli_help(
        "--loss nft: seconds one reward call (one group of rollouts, every term) may take before the run stops "
        "with one line", min=0.01, max=1e6))
    nft_group_size: int = field(default=4, metadata=cli_help(
        "--loss nft: rollouts per source, compared with each other (K >= 2)", min=2, max=256))
    nft_rollout_steps: int = field(default=8, metadata=cli_help(
        "--loss nft: sampling steps of each rollout", min=1, max=1000))
    nft_beta: float = field(default=1.0, metadata=cli_help(
        "--loss nft: β of the implicit policies v± = v_old ± β (v_θ − v_old)", min=1e-6, max=100.0))
    nft_old_decay: float = field(default=0.5, metadata=cli_help(
        "--loss nft: η of the old policy's update θ_old ← η θ_old + (1 − η) θ, once per optimizer step", min=0.0,
        max=0.999999))
    nft_adv_clip: float = field(default=5.0, metadata=cli_help(
        "--loss nft: the group-normalised advantage is clipped to ± this before it becomes a probability",
        min=1e-6, max=1000.0))

    def __post_init__(self):
        if not 0.0 <= float(self.nft_old_decay) < 1.0:
            raise ValueError(f"--nft_old_decay must be in [0, 1), got {self.nft_old_decay}")
        if int(self.nft_group_size) < 2:
            raise ValueError(f"--nft_group_size {self.nft_group_size}: DiffusionNFT compares the rollouts of one "
                             "source, so it needs at least 2")


def nft_config_of(config) -> NFTConfig:
    return SPEC.config_of(config)


class NFTState:
    """The old policy (a copy of the trainable weights, by name), the VAE that decodes rollouts and the reward.
    ``state_dict``/``load_state_dict``: accelerate's checkpointing protocol (the old policy travels with every
    checkpoint)."""

    def __init__(self, dit, vae, reward, decay: float, schedule=None, reward_timeout: Optional[float] = None):
        import torch

        self.vae, self.reward, self.decay, self.schedule = vae, reward, float(decay), schedule
        self.reward_timeout = reward_timeout
        self.names = [n for n, p in dit.named_parameters() if p.requires_grad]
        with torch.no_grad():
            self.old = {n: p.detach().clone() for n, p in zip(self.names, self._params(dit))}
        self.stepped = False  # an optimizer step ended since the old policy last followed (the loop says so)

    def _params(self, dit) -> list:
        params = dict(dit.named_parameters())
        return [params[n] for n in self.names]

    def after_step(self) -> None:
        """The training loop's word that an optimizer step is complete (whatever wrote the weights: DeepSpeed's
        flat buffers and fused optimizers do not show as in-place writes)."""
        self.stepped = True

    def follow(self, dit) -> bool:
        """One soft update toward the current weights if an optimizer step ended since the last; True if it did.
        The micro-batches of one step see one update."""
        from .nft_math import soft_update_

        if not self.stepped:
            return False
        soft_update_([self.old[n] for n in self.names], self._params(dit), self.decay)
        self.stepped = False
        return True

    @contextlib.contextmanager
    def old_policy(self, dit):
        """The DiT with the old policy's weights in (copied in and back: views of a flat buffer stay views)."""
        import torch

        current = self._params(dit)
        with torch.no_grad():
            saved = [p.detach().clone() for p in current]
            for n, p in zip(self.names, current):
                p.copy_(self.old[n])
        try:
            yield dit
        finally:
            with torch.no_grad():
                for p, s in zip(current, saved):
                    p.copy_(s)

    def decode(self, latents):
        """``[C, h, w]`` latents -> ``[3, H, W]`` in [0, 1]; an RGBA decode (Qwen-Image-2.1's VAE) over white, as
        the editor shows it."""
        dtype = next(self.vae.parameters()).dtype
        image = ((self.vae.decode(latents[None].to(dtype))[0].float() + 1) / 2).clamp(0, 1)
        if image.shape[0] == 4:
            return image[:3] * image[3:] + (1 - image[3:])
        return image[:3]

    def score(self, samples, batch: dict):
        """Rewards ``[B·K]`` on the host (see :func:`score`)."""
        return score(self, samples, batch)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "old": {n: t.cpu() for n, t in self.old.items()}, "stepped": self.stepped}

    def load_state_dict(self, state: dict) -> None:
        if set(state["old"]) != set(self.old):
            raise ValueError("the checkpoint's DiffusionNFT old policy holds other tensors than this run trains; "
                             "resume with the checkpoint's LoRA settings")
        for n in self.names:
            self.old[n].copy_(state["old"][n])
        self.stepped = bool(state.get("stepped", True))  # a checkpoint is written after a step: follow it first


def build_reward(nft: NFTConfig, judge_config=None):
    """The ``--reward`` of ``nft`` (``ValueError`` naming what is missing, before any rollout); its judge is asked
    as ``judge_config`` (the ``--judge_*`` flags) says."""
    from ...metrics.rewards import parse_reward

    if not nft.reward:
        raise ValueError("--loss nft needs --reward SPEC: what to reward, e.g. 'preserve:0.5,mypkg.rewards:blue' "
                         "(docs/REWARD.md)")
    judge = None
    if nft.reward_judge:
        from ...metrics.judge_spec import build_judge

        judge = build_judge(nft.reward_judge, "--reward_judge", judge_config)
        if judge is None:  # (a local judge that is not there, or an endpoint that does not answer: said above)
            raise ValueError(f"--reward_judge {nft.reward_judge}: the judge is not there (see the line above), and "
                             "--reward judge cannot be left out; start it or give another --reward")
    return parse_reward(nft.reward, judge=judge, max_failed=nft.reward_judge_max_failed)


def check_nft(cfg) -> None:
    """``config_checks.validate``'s check of ``--loss nft``: the reward resolves (a module imports, a file reads), before
    anything is loaded; the judge itself loads in the set-up."""
    from ...metrics.rewards import parse_reward, probe

    nft = nft_config_of(cfg)
    if not nft.reward:
        raise ValueError("--loss nft needs --reward SPEC: what to reward, e.g. 'preserve:0.5,mypkg.rewards:blue' "
                         "(docs/REWARD.md)")
    if nft.reward_judge:
        from ...metrics.judge_spec import parse_spec

        parse_spec(nft.reward_judge, "--reward_judge")  # (the spec alone: the judge is asked in the set-up)
    reward = parse_reward(nft.reward, judge=object() if nft.reward_judge else None)
    if any(name.startswith("jsonl:") for name, _, _ in reward.terms):
        raise ValueError("--reward jsonl:... scores rows, and every rollout of a row would get the same score: no "
                         "signal for --loss nft; use it with qie eval-edits, or give a reward that looks at the "
                         "rollouts")
    probe(reward)  # a term that returns NaN or the wrong shape, before any rollout


def attach_rollouts(module, cfg, preset, device, dtype, ds_config) -> None:
    """Run set-up: the reward (checked now), the VAE (alone), and the old policy as a copy of the LoRA."""
    from .common import load_frozen_vae, refuse_zero3

    nft = nft_config_of(cfg)
    refuse_zero3(ds_config, "--loss nft", "rollouts need the whole LoRA on every rank")
    reward = build_reward(nft, getattr(cfg, "judge", None))  # (its terms were resolved by check_nft; a judge loads now)
    vae = load_frozen_vae(preset, cfg.train.model_dir, device, dtype)
    module.loss_extras["nft"] = NFTState(module.dit, vae, reward, nft.nft_old_decay, module.declared_schedule(),
                                         reward_timeout=nft.reward_timeout)


def rollouts(dit, ops, nft: NFTConfig, prompts, refs, targets, zero_cond_t: bool, generator, schedule=None):
    """``K`` clean samples per source ``[K, C, h, w]`` from noise of ``generator`` (no graph), on the run's declared
    schedule where it has one (a turbo preset's grid, a frozen LoRA's line), else the model's own."""
    import torch

    from ...models.samplers.sampling import sample_flow_match
    from ...models.samplers.schedules import ScheduleSpec

    k, out = nft.nft_group_size, []
    for prompt, ref, target in zip(prompts, refs, targets):
        cond = ops.conditioning([prompt] * k, None, [list(ref)] * k, zero_cond_t, lambda t: t)
        noise = torch.randn((k, *target.shape), generator=generator).to(target.device, target.dtype)
        grid = None if schedule is None else schedule.grid(None if schedule.sigmas is not None else nft.nft_rollout_steps)
        spec = ScheduleSpec(steps=len(grid) if grid else nft.nft_rollout_steps, latent_hw=tuple(target.shape[-2:]),
                            sigmas=grid)
        out.append(sample_flow_match(ops.velocity(dit, cond, 1.0), noise, spec, ops.schedule))
    return out


def score(state: NFTState, samples, batch: dict):
    """Rewards ``[B·K]`` of the rollouts (decoded) against each source's decoded source, target and mask; a reward
    that fails (raises, times out, a judge past its share of failures) stops the run on every rank with one
    line (:class:`~diffsynth_qie.metrics.rewards.RewardFailed`)."""
    from accelerate.state import PartialState

    from ...metrics.rewards import RewardFailed
    from ...utils.collective import raise_on_every_rank

    failure, values = None, None
    try:
        values = _score_groups(state, samples, batch)
    except RewardFailed as e:
        failure = e
    raise_on_every_rank(PartialState(), failure)
    return values


def _score_groups(state: NFTState, samples, batch: dict):
    import torch
    import torch.nn.functional as F

    from ...metrics.rewards import RewardBatch, call_reward

    values = []
    for b, group in enumerate(samples):
        k = group.shape[0]
        output = torch.stack([state.decode(x) for x in group]).cpu()
        source = state.decode(batch["edit_latents"][b][0]).cpu()
        target = state.decode(batch["target_latents"][b]).cpu()
        mask = batch["back_mask"][b]
        if mask is not None:
            mask = F.interpolate(mask.float().reshape(1, 1, *mask.shape[-2:]).cpu(), size=output.shape[-2:],
                                 mode="nearest").expand(k, -1, -1, -1)
        if source.shape != output.shape[1:]:  # a reference of another size: compare at the output's size
            source = F.interpolate(source[None], size=output.shape[-2:], mode="bilinear", align_corners=False)[0]
        text = (batch.get("prompt_text") or [""] * len(samples))[b]
        key = str((batch.get("entry_id") or [b] * len(samples))[b])
        rows = RewardBatch(source=source.expand(k, -1, -1, -1), output=output, target=target.expand(k, -1, -1, -1),
                           mask=mask, instructions=[text] * k, keys=[key] * k)
        values.append(call_reward(state.reward, rows, state.reward_timeout, f"the reward of row {key}"))
    return torch.cat(values)


def nft_loss_fn(dit, batch: dict, config, generator=None, nft=None):
    """DiffusionNFT's loss of a batch of sources (the module docstring); ``nft``: the run's :class:`NFTState`."""
    import torch

    from ...models.family_ops import ops_for
    from ...models.presets import family_of
    from .common import draw_flow_points, joined_prompts
    from .nft_math import nft_loss, optimality

    if nft is None:
        raise ValueError("--loss nft needs its rollout state; the loss's set-up (attach_rollouts) did not run")
    c = nft_config_of(config)
    ops = ops_for(family_of(config.train.model))
    n, k = len(batch["target_latents"]), c.nft_group_size
    bare = [str((batch.get("entry_id") or [b] * n)[b]) for b in range(n) if not batch["edit_latents"][b]]
    if bare:
        raise ValueError(f"--loss nft edits a source image and scores the edit against it, but cache rows {bare[:3]} "
                         "have no reference image (text-to-image rows); train them with --loss sft, or leave them "
                         "out of the cache")
    prompts = joined_prompts(ops, batch)
    zero_cond_t = bool(config.train.zero_cond_t)
    nft.follow(dit)
    flat_prompts = [p for p in prompts for _ in range(k)]
    flat_refs = [list(ref) for ref in batch["edit_latents"] for _ in range(k)]
    # one swap of the old policy per micro-batch: the rollouts, their scores, the noise of the training samples
    # (nothing there uses the DiT) and the old policy's velocity on them
    with torch.no_grad(), nft.old_policy(dit):
        samples = rollouts(dit, ops, c, prompts, batch["edit_latents"], batch["target_latents"], zero_cond_t,
                           generator, nft.schedule)
        rewards = nft.score(samples, batch)
        x0 = [x for group in samples for x in group]
        points = draw_flow_points(x0, config.timesteps, generator, family=ops.family, weighting="none")
        noisy, target, timesteps = points.noisy, points.target, points.timesteps.to(x0[0].device)
        v_old = ops.forward(dit, noisy, timesteps, flat_prompts, flat_refs, zero_cond_t=zero_cond_t)
    r = optimality(rewards, k, c.nft_adv_clip)
    v_theta = ops.forward(dit, noisy, timesteps, flat_prompts, flat_refs, zero_cond_t=zero_cond_t,
                          use_gradient_checkpointing=config.train.gradient_checkpointing and torch.is_grad_enabled())
    losses = torch.stack([nft_loss(vt[None], vo[None], v[None].to(vt.device), r[i:i + 1].to(vt.device),
                                   c.nft_beta)[0] for i, (vt, vo, v) in enumerate(zip(v_theta, v_old, target))])
    grouped = rewards.reshape(n, k)
    metrics = {"reward_mean": float(rewards.mean()), "reward_group_std": float(grouped.std(1).mean()),
               "nft_loss": losses.detach().mean()}
    return losses.mean(), metrics


SPEC = LossSpec(
    name="nft", summary="DiffusionNFT: online reward tuning on K rollouts per source (--reward)", fn=nft_loss_fn,
    config=NFTConfig, needs_rollouts=True, check=check_nft, setup=attach_rollouts)
