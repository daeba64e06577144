"""``--loss dmd``'s fake score: a second LoRA adapter on the same DiT, and its own optimizer.

One copy of the base: the student is PEFT's ``default`` adapter (what the run trains and writes), the fake score
the adapter :data:`FAKE` injected into the same layers beside it, and the teacher the frozen unmerged branches of
``--teacher_lora`` under both (``lora/frozen.py``). :func:`active_adapter` switches which adapter the LoRA layers
add (``None``: neither, i.e. the teacher), writing no weight. The fake score therefore starts as the teacher
(PEFT's ``lora_B`` starts at 0), as DMD2 initialises it.

The fake adapter's parameters do not require a gradient outside :meth:`DMDState.update_fake`: the run's optimizer,
its gradient clipping, its checkpoint of trainable tensors and the written LoRA never see them. They, the fake
optimizer's state and the count of updates travel with every checkpoint through :meth:`DMDState.state_dict`
(accelerate's custom objects), so a resume is exact.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Optional, Sequence

import torch

FAKE = "dmd_fake"  # the fake score's PEFT adapter name
STUDENT = "default"  # the trained LoRA's (PEFT's default, as DiffSynth injects it)


def _lora_layers(dit) -> list:
    from peft.tuners.lora import LoraLayer

    return [m for m in dit.modules() if isinstance(m, LoraLayer)]


def add_fake_adapter(dit, rank: int, alpha: float, targets: Sequence[str]) -> list[tuple[str, torch.nn.Parameter]]:
    """Inject the fake score's adapter (rank, alpha and targets of the student's) into ``dit``'s LoRA layers,
    in the student's dtype and linear class; returns its (name, parameter) pairs, not requiring a gradient.
    What required a gradient before still does (PEFT marks only adapters as trainable when it injects)."""
    from peft import LoraConfig, inject_adapter_in_model

    before = {n: p.requires_grad for n, p in dit.named_parameters()}
    layers = _lora_layers(dit)
    if not layers:
        raise ValueError("--loss dmd trains a student LoRA; --lora_rank 0 leaves none (give a rank > 0)")
    peft_targets = list(targets) if len(targets) > 1 else list(targets) * 2  # (PEFT's suffix matching: module.py)
    with warnings.catch_warnings():  # PEFT's warning that the model already holds an adapter: it is meant to
        warnings.simplefilter("ignore", UserWarning)
        inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=alpha, target_modules=peft_targets), dit,
                                adapter_name=FAKE)
    for m in _lora_layers(dit):
        if FAKE in m.lora_A and STUDENT in m.lora_A:
            ref = m.lora_A[STUDENT]
            for lin in (m.lora_A[FAKE], m.lora_B[FAKE]):
                lin.to(ref.weight.dtype)
                lin.__class__ = type(ref)  # --compute_precision pure's CastLinear, as the student's
        m._active_adapter = [STUDENT]
    fake = []
    for n, p in dit.named_parameters():
        if f".{FAKE}." in n:
            p.requires_grad_(False)
            fake.append((n, p))
        else:
            p.requires_grad_(before.get(n, False))
    return fake


@contextlib.contextmanager
def active_adapter(dit, name: Optional[str]):
    """The LoRA layers add only adapter ``name`` (None: none, the base with the teacher's branches); restored
    after. A gradient-checkpointed forward must also be backpropagated inside (its recompute reads the switch)."""
    layers = _lora_layers(dit)
    saved = [m._active_adapter for m in layers]
    try:
        for m in layers:
            m._active_adapter = [] if name is None else [name]
        yield dit
    finally:
        for m, s in zip(layers, saved):
            m._active_adapter = s


class DMDState:
    """The fake score's parameters (by name) and optimizer, and the teacher samples of ``--dmd_regression_weight``.
    ``state_dict``/``load_state_dict``: accelerate's checkpointing protocol."""

    def __init__(self, dit, fake: list[tuple[str, torch.nn.Parameter]], updates: int, lr: float, schedule=None):
        self.dit, self.updates, self.schedule = dit, int(updates), schedule
        self.names = [n for n, _ in fake]
        self.params = [p for _, p in fake]
        # AdamW with the trainer's usual betas and decay, whatever the run's optimizer; fused on a GPU as the run's
        # (optim.fused_adamw: no DeepSpeed here), else one tensor at a time
        fused = all(p.device.type == "cuda" for p in self.params)
        self.optimizer = torch.optim.AdamW(self.params, lr=float(lr), betas=(0.9, 0.999), weight_decay=0.01,
                                           **({"fused": True} if fused else {"foreach": False}))
        self.fake_steps = 0
        self.backward: Callable[[torch.Tensor], None] = torch.Tensor.backward  # (the fake-device check: its own walk)
        self.teacher_samples: dict[str, torch.Tensor] = {}  # entry id -> the teacher's sample of its fixed noise

    def update_fake(self, loss_of: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``--dmd_fake_updates`` optimizer steps of the fake score on ``loss_of()`` (called once per step, under
        the fake adapter); gradients averaged over the processes. Returns the last loss (detached)."""
        import torch.distributed as dist

        last = torch.zeros(())
        for _ in range(self.updates):
            for p in self.params:
                p.requires_grad_(True)
            try:
                with torch.enable_grad(), active_adapter(self.dit, FAKE):
                    loss = loss_of()
                    self.backward(loss)
                if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                    for p in self.params:
                        if p.grad is not None:
                            dist.all_reduce(p.grad)
                            p.grad /= dist.get_world_size()
                self.optimizer.step()
            finally:
                self.optimizer.zero_grad(set_to_none=True)
                for p in self.params:
                    p.requires_grad_(False)
            self.fake_steps += 1
            last = loss.detach()
        return last

    def state_dict(self) -> dict:
        return {"fake": {n: p.detach().cpu().clone() for n, p in zip(self.names, self.params)},
                "optimizer": self.optimizer.state_dict(), "fake_steps": self.fake_steps}

    def load_state_dict(self, state: dict) -> None:
        if set(state["fake"]) != set(self.names):
            raise ValueError("the checkpoint's DMD fake score holds other tensors than this run trains; resume with "
                             "the checkpoint's LoRA settings")
        with torch.no_grad():
            for n, p in zip(self.names, self.params):
                p.copy_(state["fake"][n].to(p.device, p.dtype))
        self.optimizer.load_state_dict(state["optimizer"])
        self.fake_steps = int(state.get("fake_steps", 0))
