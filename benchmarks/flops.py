"""FLOP counting and MFU for the Qwen-Image(-Edit) DiT — pure functions, no torch.

Why our own counter: ``torch.utils.flop_counter.FlopCounterMode`` sees every matmul
but costs a forward pass per count and does not count fused CPU/cuDNN attention
kernels; the benchmark needs the count for shapes it never ran (and tests pin this
counter against ``FlopCounterMode`` on the tiny model).

What is counted (the *model* FLOPs of one forward, per sample, summed over the batch;
a linear layer ``[N, in] @ [in, out]`` costs ``2·N·in·out``):

With ``d`` the model width, ``F = ff_mult·d`` the MLP width, ``C`` the patchified
input channels (64 = 16 latent channels × 2×2), ``D_txt`` the prompt-embedding width,
``T`` the sinusoidal timestep width (256), ``S_img`` the image tokens of the sample
(target + every reference, ``h·w/4`` each for latents ``h×w``), ``S_txt`` its prompt
tokens, ``S = S_img + S_txt`` and ``n_t`` = 2 with ``zero_cond_t`` (the conditioning
is computed for t and for 0) else 1::

    embed    = 2·S_img·C·d  (img_in)  +  2·S_txt·D_txt·d  (txt_in)
             + 2·n_t·(T·d + d·d)      (time_text_embed's two linears)
    block    = 2·(S_img + S_txt)·(4·d² + 2·d·F)   (q, k, v, out + MLP up/down; both streams)
             + 2·n_t·d·6d + 2·d·6d               (img_mod on n_t rows, txt_mod on one)
             + 4·S²·d                            (attention: QKᵀ and P·V, summed over heads)
    head     = 2·d·2d  (norm_out.linear)  +  2·S_img·d·C  (proj_out, on all image tokens)
    forward  = embed + num_layers·block + head
    LoRA step FLOPs = 2 · forward      (forward + input-gradient backward; frozen base
                                        weights get no weight gradient)

Not counted: element-wise work (norms, RoPE, modulation, softmax, GELU), the LoRA
adapters' own matmuls (r·(in+out) per token and target, ≈2 % of the base at r=32
and ≈8 % at r=128), recomputation under gradient checkpointing, and the extra cost
of the attention backward (flash-style kernels do ≈2.5× the forward's attention
FLOPs in backward, we count 1×). MFU is therefore conservative, and comparable
between our step and DiffSynth's because both do the same model FLOPs. Padding in
mixed-shape batches is not counted either: it is waste, not useful work.

    MFU = step_flops / (step_time_s · measured_matmul_flops_per_s)

where the denominator's rate is the bf16 matmul throughput measured on the same GPU
in the same run (``common.measure_matmul_flops``), not the datasheet peak.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

# Width of the sinusoidal timestep projection (TimestepEmbeddings(256, dim)).
TIMESTEP_DIM = 256


@dataclass(frozen=True)
class DiTDims:
    """The sizes of a ``QwenImageDiT`` that decide its FLOPs (defaults: the real 20B model)."""

    dim: int = 3072
    num_layers: int = 60
    text_dim: int = 3584
    in_channels: int = 64
    ff_mult: int = 4
    timestep_dim: int = TIMESTEP_DIM

    @property
    def ff_dim(self) -> int:
        return self.ff_mult * self.dim


@dataclass(frozen=True)
class SampleShape:
    """One training/inference sample: latent sizes (h, w) of the target and each reference, prompt length."""

    target: tuple[int, int]
    refs: tuple[tuple[int, int], ...] = ()
    text_len: int = 0

    @property
    def image_tokens(self) -> int:
        return sum(h * w // 4 for h, w in (self.target, *self.refs))

    @property
    def tokens(self) -> int:
        return self.image_tokens + self.text_len


@dataclass(frozen=True)
class FlopBreakdown:
    """Forward FLOPs of a batch by component (see the module docstring)."""

    embed: int = 0
    linears: int = 0      # per-token q/k/v/out + MLP linears of every block, both streams
    modulation: int = 0   # img_mod / txt_mod of every block
    attention: int = 0
    head: int = 0
    components: dict[str, int] = field(default_factory=dict, compare=False)

    @property
    def forward(self) -> int:
        return self.embed + self.linears + self.modulation + self.attention + self.head

    @property
    def lora_step(self) -> int:
        """FLOPs of one LoRA training step: forward + input-gradient backward."""
        return 2 * self.forward


def dims_of(dit) -> DiTDims:
    """Read :class:`DiTDims` off a built ``QwenImageDiT`` (plain or LoRA-injected)."""
    block = dit.transformer_blocks[0]
    return DiTDims(
        dim=int(dit.img_in.out_features),
        num_layers=len(dit.transformer_blocks),
        text_dim=int(dit.txt_in.in_features),
        in_channels=int(dit.img_in.in_features),
        ff_mult=int(block.img_mlp.net[0].proj.out_features) // int(dit.img_in.out_features),
        timestep_dim=int(dit.time_text_embed.timestep_embedder.linear_1.in_features),
    )


def sample_forward_flops(dims: DiTDims, sample: SampleShape, zero_cond_t: bool = False) -> FlopBreakdown:
    """Forward FLOPs of the DiT on one sample."""
    d, f, c = dims.dim, dims.ff_dim, dims.in_channels
    s_img, s_txt = sample.image_tokens, sample.text_len
    s = s_img + s_txt
    n_t = 2 if zero_cond_t else 1
    img_in = 2 * s_img * c * d
    txt_in = 2 * s_txt * dims.text_dim * d
    time_embed = 2 * n_t * (dims.timestep_dim * d + d * d)
    per_block_linears = 2 * s * (4 * d * d + 2 * d * f)
    per_block_mod = 2 * n_t * d * 6 * d + 2 * d * 6 * d
    per_block_attn = 4 * s * s * d
    norm_out = 2 * d * 2 * d
    proj_out = 2 * s_img * d * c
    L = dims.num_layers
    return FlopBreakdown(
        embed=img_in + txt_in + time_embed,
        linears=L * per_block_linears,
        modulation=L * per_block_mod,
        attention=L * per_block_attn,
        head=norm_out + proj_out,
        components={
            "img_in": img_in, "txt_in": txt_in, "time_embed": time_embed,
            "block_linears": per_block_linears, "block_modulation": per_block_mod,
            "block_attention": per_block_attn, "norm_out": norm_out, "proj_out": proj_out,
        },
    )


def batch_forward_flops(dims: DiTDims, samples: Iterable[SampleShape], zero_cond_t: bool = False) -> FlopBreakdown:
    """Forward FLOPs of a batch: the sum over its samples (padding excluded)."""
    parts = [sample_forward_flops(dims, s, zero_cond_t) for s in samples]
    if not parts:
        raise ValueError("need at least one sample to count FLOPs")
    return FlopBreakdown(
        embed=sum(p.embed for p in parts),
        linears=sum(p.linears for p in parts),
        modulation=sum(p.modulation for p in parts),
        attention=sum(p.attention for p in parts),
        head=sum(p.head for p in parts),
    )


def lora_step_flops(dims: DiTDims, samples: Sequence[SampleShape], zero_cond_t: bool = False) -> int:
    """Counted FLOPs of one LoRA training step on ``samples`` (2 × forward)."""
    return batch_forward_flops(dims, samples, zero_cond_t).lora_step


def mfu(step_flops: float, step_time_s: float, matmul_flops_per_s: float) -> float:
    """Model FLOPs utilisation: ``step_flops / (step_time_s · matmul_flops_per_s)``."""
    if step_time_s <= 0 or matmul_flops_per_s <= 0:
        raise ValueError(f"need positive time and rate, got {step_time_s} s and {matmul_flops_per_s} FLOP/s")
    return step_flops / (step_time_s * matmul_flops_per_s)
