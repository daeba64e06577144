"""The three models of ``--loss dmd`` on one batch: the student, the teacher with CFG and the fake score, as adapter
switches on one DiT (``dmd_state.active_adapter``), each sample with its own references, prompt and noise.

The student's sampling steps and the teacher's CFG go through the family's sampler velocity (2511 keeps
``zero_cond_t``; 2.1 reuses the references' prefix KV cache, built afresh for each role: a cache belongs to the
adapter it was computed under); the passes with a graph through the family's training forward (gradient
checkpointing as configured). Every random draw comes from the loss's generator, in a fixed order, so a resumed
step draws what the uninterrupted one drew.
"""
from __future__ import annotations

import hashlib

import torch

from ...models.samplers.sampling import sample_flow_match, uses_cfg
from ...models.samplers.schedules import ScheduleSpec
from .common import add_noise, draw_flow_points, joined_prompts, per_sample_mse, sample_noise
from .dmd_math import clean_prediction, dmd_gradient, dmd_loss, euler_steps, student_sigmas
from .dmd_state import FAKE, active_adapter

Tensor = torch.Tensor


class Roles:
    """A batch as the student, the teacher and the fake score see it (see the module docstring)."""

    def __init__(self, dit, ops, batch: dict, config, state, generator, *, student_steps: int, teacher_cfg: float,
                 sigma_range: tuple[float, float]):
        self.dit, self.ops, self.config, self.state, self.generator = dit, ops, config, state, generator
        n = len(batch["target_latents"])
        self.prompts = joined_prompts(ops, batch)
        extras = batch.get("empty_prompt_extras") or [{}] * n
        self.negatives = [ops.join_prompt(e, x) for e, x in zip(batch["empty_prompt_emb"], extras)]
        self.refs = [list(r) for r in batch["edit_latents"]]
        self.targets = batch["target_latents"]
        self.keys = [f"{e}/{p}" for e, p in zip(batch.get("entry_id") or range(n), batch.get("prompt_index") or [0] * n)]
        self.zero_cond_t = bool(config.train.zero_cond_t)
        self.checkpointing = bool(config.train.gradient_checkpointing)
        self.grid = student_sigmas(student_steps)
        self.teacher_cfg, self.sigma_range = float(teacher_cfg), sigma_range

    # --- the DiT calls ---------------------------------------------------------------------------------
    def velocity(self, b: int, cfg: float):
        """Sample ``b``'s sampler velocity ``(x [1, C, h, w], timesteps [1]) -> v`` at ``cfg`` (fresh conditioning)."""
        negatives = [self.negatives[b]] if uses_cfg(cfg) else None
        cond = self.ops.conditioning([self.prompts[b]], negatives, [self.refs[b]], self.zero_cond_t, lambda t: t)
        return self.ops.velocity(self.dit, cond, cfg)

    def forward(self, b: int, x: Tensor, sigma: float, graph: bool) -> Tensor:
        """The training DiT call on one sample ``[C, h, w]`` at ``sigma`` (under the active adapter)."""
        timesteps = torch.tensor([float(sigma) * 1000.0], device=x.device)
        return self.ops.forward(self.dit, [x], timesteps, [self.prompts[b]], [self.refs[b]],
                                zero_cond_t=self.zero_cond_t,
                                use_gradient_checkpointing=graph and self.checkpointing and torch.is_grad_enabled())[0]

    def student(self, b: int, noise: Tensor, i: int) -> Tensor:
        """The student's clean prediction at its step ``i`` from ``noise`` (the steps before it without a graph),
        fp32 ``[C, h, w]``."""
        with torch.no_grad():
            x = euler_steps(self.velocity(b, 1.0), noise[None], self.grid[:i + 1])[0]
        return clean_prediction(x, self.forward(b, x, self.grid[i], graph=True), self.grid[i])

    def teacher_velocity(self, b: int, x_t: Tensor, sigma: float) -> Tensor:
        with torch.no_grad(), active_adapter(self.dit, None):
            t = torch.full((1,), float(sigma) * 1000.0, device=x_t.device)
            return self.velocity(b, self.teacher_cfg)(x_t[None], t)[0]

    def fake_velocity(self, b: int, x_t: Tensor, sigma: float) -> Tensor:
        with torch.no_grad(), active_adapter(self.dit, FAKE):
            return self.forward(b, x_t, sigma, graph=False)

    # --- the terms -------------------------------------------------------------------------------------
    def fake_score_loss(self, b: int, x: Tensor) -> Tensor:
        """Flow matching of the fake score (active) on the student's sample ``x`` (no graph to the student)."""
        points = draw_flow_points([x], self.config.timesteps, self.generator, family=self.ops.family,
                                  weighting="none")
        return per_sample_mse(self.forward(b, points.noisy[0], float(points.sigmas[0]), graph=True), points.target[0])

    def distribution_matching(self, b: int, weight=None) -> tuple[Tensor, Tensor, Tensor]:
        """Sample ``b``: (the student's output, its DMD loss with a graph to the student, the last fake-score loss)."""
        target = self.targets[b]
        noise = sample_noise(target, self.generator)
        i = int(torch.randint(len(self.grid), (1,), generator=self.generator))
        # the student's sample without a graph first: the fake score's steps (their own graphs) and the two
        # scores run before the student's graph exists, so the step's peak is one graph's, not two
        with torch.no_grad():
            free = self.student(b, noise, i)
        sample = free.to(target.dtype)
        fake_loss = self.state.update_fake(lambda: self.fake_score_loss(b, sample))
        lo, hi = self.sigma_range
        sigma = lo + (hi - lo) * float(torch.rand((), generator=self.generator))
        eps = sample_noise(target, self.generator)
        x_t = add_noise(free, eps.float(), sigma).to(target.dtype)
        v_real = self.teacher_velocity(b, x_t, sigma)
        v_fake = self.fake_velocity(b, x_t, sigma)
        grad = dmd_gradient(free[None], x_t[None], v_real[None], v_fake[None], sigma)
        x = self.student(b, noise, i)  # the same sample, now with the graph the gradient flows through
        return x, dmd_loss(x[None], grad, weight)[0], fake_loss

    def regression(self, b: int) -> Tensor:
        """The squared error of the student's sample of row ``b``'s fixed noise to the teacher's sample of it."""
        target = self.targets[b]
        digest = hashlib.sha256(f"{self.config.train.seed}/{self.keys[b]}".encode()).hexdigest()
        noise = torch.randn(target.shape, generator=torch.Generator().manual_seed(int(digest[:15], 16)))
        noise = noise.to(target.device, target.dtype)
        if self.keys[b] not in self.state.teacher_samples:
            spec = ScheduleSpec(steps=self.ops.family.default_steps, latent_hw=tuple(target.shape[-2:]))
            with torch.no_grad(), active_adapter(self.dit, None):
                made = sample_flow_match(self.velocity(b, self.teacher_cfg), noise[None], spec, self.ops.schedule)[0]
            self.state.teacher_samples[self.keys[b]] = made.detach().cpu()
        teacher = self.state.teacher_samples[self.keys[b]].to(target.device)
        return per_sample_mse(self.student(b, noise, len(self.grid) - 1), teacher)
