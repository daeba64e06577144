"""Random-weight models at real (or tiny) sizes, LoRA, and the optional speed-ups under test.

Speed does not depend on weight values, so the benchmarks build DiffSynth's real
classes (``QwenImageDiT``, ``QwenImageTextEncoder``, ``QwenImageVAE``) with random
weights directly on the target device instead of loading checkpoints:

1. **Meta init.** The module is constructed under ``accelerate.init_empty_weights``
   (parameters on the meta device, nothing allocated, no slow CPU init of 20 B
   weights). Buffers and plain tensor attributes (the text encoder's RoPE
   ``inv_freq``, the DiT's ``pos_embed`` frequency tables, the VAE's latent mean/std)
   are still computed normally — plain ``Module.to_empty`` would leave those as
   uninitialised memory, which is why we do not use it.
2. **Materialise.** Each meta parameter is replaced by an uninitialised tensor on the
   device in the benchmark dtype (``to_empty`` for parameters only), and
3. **fast random init** in place on that device: N(0, 0.02) for matrices and
   convolutions, 1 for norm scales, 0 for biases.

The tiny sizes are the test model's (``diffsynth_qie.tiny.build``), built the same
way on the CPU.

Optional speed-ups (each off by default; ``NOTES.md`` records predictions and
outcomes): :func:`sdpa_context` (attention backend), :func:`compile_blocks`
(regional ``torch.compile``), :func:`wrap_selective_checkpointing` (checkpoint every
k-th block) and :func:`apply_fp8_base` (the product's FP8 base weights).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator, Sequence

import torch

log = logging.getLogger(__name__)

INIT_STD = 0.02


# --- random-weight construction ------------------------------------------------------
def materialize_(model: torch.nn.Module, device: torch.device | str, dtype: torch.dtype,
                 seed: int = 0, std: float = INIT_STD) -> torch.nn.Module:
    """Allocate every meta parameter on ``device`` in ``dtype`` and fill it with random values.

    Parameters already materialised are re-initialised too (same rule), so the result
    depends only on ``seed`` and the module structure. Buffers move to ``device``
    keeping their dtype (RoPE tables stay fp32, as in DiffSynth's loaded models).
    """
    gen_device = torch.device(device)
    torch.manual_seed(seed)
    for module_name, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            new = torch.empty(param.shape, device=device, dtype=dtype)
            with torch.no_grad():
                if new.ndim >= 2:
                    new.normal_(0.0, std)
                elif name == "weight":
                    new.fill_(1.0)
                else:
                    new.zero_()
            module._parameters[name] = torch.nn.Parameter(new, requires_grad=param.requires_grad)
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                if buf.is_meta:
                    raise AssertionError(f"buffer {module_name}.{name} is on the meta device")
                module._buffers[name] = buf.to(gen_device)
    return model


def _build(factory: Callable[[], torch.nn.Module], device, dtype, seed: int) -> torch.nn.Module:
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = factory()
    return materialize_(model, device, dtype, seed).eval()


def build_dit(tiny: bool, device, dtype, seed: int = 0, num_layers: int = 60) -> torch.nn.Module:
    """DiffSynth's ``QwenImageDiT`` (60 blocks, dim 3072) or the tiny test DiT, random weights.

    ``num_layers`` < 60 builds a shorter real-width DiT (harness checks on small machines).
    """
    if tiny:
        from diffsynth_qie.tiny.build import DIT_SIZES, TinyQwenImageDiT

        return _build(lambda: TinyQwenImageDiT(**DIT_SIZES), device, dtype, seed)
    from diffsynth.models.qwen_image_dit import QwenImageDiT

    return _build(lambda: QwenImageDiT(num_layers=num_layers), device, dtype, seed)


def build_text_encoder(tiny: bool, device, dtype, seed: int = 1) -> torch.nn.Module:
    """``QwenImageTextEncoder`` (Qwen2.5-VL-7B) or the tiny one, random weights.

    The full-size encoder gets the tiny tokenizer's special-token ids (the real
    tokenizer cannot be downloaded on the GPU machine); every other size is the 7B's.
    """
    if tiny:
        from diffsynth_qie.tiny.build import TinyQwenImageTextEncoder

        return _build(TinyQwenImageTextEncoder, device, dtype, seed)
    from diffsynth.models.qwen_image_text_encoder import QwenImageTextEncoder
    from diffsynth_qie.tiny.build import TOKEN_ID

    model = _build(QwenImageTextEncoder, device, dtype, seed)
    ids = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
           "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
           "vision_token_id": "<|vision_pad|>"}
    for config in {id(c): c for c in (model.config, model.model.config)}.values():
        for key, token in ids.items():
            setattr(config, key, TOKEN_ID[token])
    return model


def build_vae(tiny: bool, device, dtype, seed: int = 2) -> torch.nn.Module:
    """``QwenImageVAE`` (full size, ≈0.13 B) or the tiny one, random weights."""
    from diffsynth.models.qwen_image_vae import QwenImageVAE

    if tiny:
        from diffsynth_qie.tiny.build import VAE_KWARGS

        return _build(lambda: QwenImageVAE(**VAE_KWARGS), device, dtype, seed)
    return _build(QwenImageVAE, device, dtype, seed)


def build_tokenizer_and_processor(tiny: bool):
    """The tiny model's tokenizer, with a processor at the tiny or the real image-size limits.

    The real Qwen2.5-VL processor limits (min 56², max 28²·1280 pixels, patch 14,
    merge 2) decide how many vision tokens the text encoder sees; DiffSynth resizes
    the reference to ≈384² before encoding, i.e. ≈180 vision tokens.
    """
    from diffsynth_qie.tiny.build import build_processor, build_tokenizer

    tokenizer = build_tokenizer()
    if tiny:
        return tokenizer, build_processor(tokenizer)
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    image_processor = Qwen2VLImageProcessor(size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
                                            patch_size=14, merge_size=2, temporal_patch_size=2)
    return tokenizer, Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                       video_processor=Qwen2VLVideoProcessor())


# --- LoRA --------------------------------------------------------------------------
def add_lora(dit: torch.nn.Module, rank: int, targets: Sequence[str], dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """Freeze ``dit`` and inject LoRA with DiffSynth's own ``add_lora_to_model`` (PEFT); return the LoRA params.

    Same call as DiffSynth's ``switch_pipe_to_training_mode`` (alpha = rank,
    trainable weights upcast to the pipeline dtype).
    """
    from diffsynth.diffusion.training_module import DiffusionTrainingModule

    dit.requires_grad_(False)
    DiffusionTrainingModule().add_lora_to_model(dit, target_modules=list(targets), lora_rank=rank, upcast_dtype=dtype)
    params = [p for p in dit.parameters() if p.requires_grad]
    if not params:
        raise AssertionError("LoRA injection produced no trainable parameters")
    return params


def strip_lora(dit: torch.nn.Module) -> int:
    """Undo :func:`add_lora`: put every PEFT-wrapped layer's ``base_layer`` back. Returns how many."""
    from peft.tuners.lora import LoraLayer

    swaps = [(name, module) for name, module in dit.named_modules() if isinstance(module, LoraLayer)]
    for name, module in swaps:
        parent_name, _, child = name.rpartition(".")
        parent = dit.get_submodule(parent_name) if parent_name else dit
        setattr(parent, child, module.get_base_layer())
    return len(swaps)


# --- optional speed-ups --------------------------------------------------------------
SDPA_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")


@contextlib.contextmanager
def sdpa_context(backend: str) -> Iterator[None]:
    """Restrict ``scaled_dot_product_attention`` to one backend (``auto`` = PyTorch's choice)."""
    if backend == "auto":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    if backend not in names:
        raise ValueError(f"unknown --sdpa_backend {backend!r}; choose from {', '.join(SDPA_BACKENDS)}")
    with sdpa_kernel([names[backend]]):
        yield


def compile_blocks(dit: torch.nn.Module, backend: str = "inductor") -> None:
    """Regional compilation: ``torch.compile`` each transformer block in place (not the whole DiT).

    Every block has the same code, so Dynamo compiles one graph and reuses it for the
    other 59 (a guard check each); compile time stays ≈ one block's. Mixed shapes
    recompile once with dynamic sequence lengths.
    """
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for block in _blocks(dit):
        block.compile(backend=backend)


class CheckpointedBlock(torch.nn.Module):
    """Runs ``block`` under non-reentrant activation checkpointing (for selective checkpointing)."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.block(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def wrap_selective_checkpointing(dit: torch.nn.Module, every: int) -> Callable[[], None]:
    """Checkpoint blocks 0, k, 2k, … (run the step with the forward's own checkpointing off).

    Returns a function that unwraps the blocks again. ``every=1`` equals full
    checkpointing; larger k keeps more activations and recomputes fewer blocks.
    """
    if every < 1:
        raise ValueError(f"--selective_checkpointing must be >= 1 (checkpoint every k-th block), got {every}")
    blocks = dit.transformer_blocks
    originals = list(blocks)
    for i in range(0, len(blocks), every):
        blocks[i] = CheckpointedBlock(blocks[i])

    def undo() -> None:
        for i, block in enumerate(originals):
            blocks[i] = block

    return undo


def _blocks(dit: torch.nn.Module) -> list[torch.nn.Module]:
    return [b.block if isinstance(b, CheckpointedBlock) else b for b in dit.transformer_blocks]


def apply_fp8_base(dit: torch.nn.Module) -> int:
    """``--fp8_base``: the product's FP8 base weights (``diffsynth_qie.memory.fp8.quantize_linears``).

    Quantises every frozen linear of the transformer blocks (e4m3, a scale per output
    channel, compute in the activation dtype). Call after :func:`add_lora` (only PEFT's
    ``base_layer`` is quantised; the adapters stay in their dtype); calling it again after a
    new injection converts only what is new. Returns the number of FP8 layers in ``dit``.
    """
    from diffsynth_qie.memory.fp8 import fp8_layers, quantize_linears

    quantize_linears(dit)
    return len(fp8_layers(dit))


def checkpoint_blocks(value: str, rank: int, policy: str, compile_blocks: bool, fp8_base: bool, tiny: bool):
    """``--checkpoint_blocks`` of the training benchmark as ``qie train`` takes it: "" = every block (None), a
    number, or ``auto``: the fewest checkpointed 2511 blocks whose planned peak at 1024² + 1 reference fits this
    GPU (``training/checkpoint_auto.fewest_fitting``; every block on the tiny model or without a GPU)."""
    if value in ("", "all"):
        return None
    if value != "auto":
        return int(value)
    if tiny or not torch.cuda.is_available():
        return None
    from diffsynth_qie.memory.census import preset_census
    from diffsynth_qie.memory.plan import PlanOptions
    from diffsynth_qie.training.checkpoint_auto import PROMPT_TOKENS, RESOLUTION, fewest_fitting

    options = PlanOptions(resolution=RESOLUTION, prompt_tokens=PROMPT_TOKENS, lora_rank=rank,
                          gradient_checkpointing=True, checkpoint_policy=policy or "full", compile=compile_blocks,
                          fp8_base=fp8_base)
    n, _ = fewest_fitting(preset_census("2511"), options, torch.cuda.get_device_properties(0).total_memory)
    return n  # (None: even every block does not fit; the row then runs them all and may record OOM)
