"""What a row's cached tensors depend on besides the row itself, and the encoders that make them.

:func:`cache_settings` is hashed into every row's content hash. It needs the encoders' fingerprint and the
tokenizer (prompt lengths), not the encoders' weights: :func:`light_pipeline` gives both from the model's
files alone (``encoder_fingerprint`` reads safetensors headers), so a relaunch over an unchanged dataset loads
no 16 GB text encoder. :func:`load_encoders` loads the real ones when a row needs encoding.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..data.rows import EditRow, SkippedRow, log_skip
from . import store
from .config import CacheConfig
from ..models.family import get_family
from .fingerprint import encoder_fingerprint


def cache_settings(config: CacheConfig, preset, pipe) -> dict:
    """Everything besides a row's own inputs that its cached tensors depend on (hashed per row)."""
    return {
        "format_version": store.FORMAT_VERSION,
        "preset": preset.name,
        "multi_image_prompt": preset.multi_image_prompt,
        "encoder_fingerprint": encoder_fingerprint(pipe),
        "max_pixels": config.max_pixels,
        "edit_max_pixels": config.resolved_edit_max_pixels(),
        "divisor": max(config.divisor, get_family(preset.family).size_divisor),  # (2.1: multiples of 32)
        "dtype": str(pipe.torch_dtype).replace("torch.", ""),
        # (only when on: a cache written without it keeps its content hashes)
        **({"auto_mask": vars(config.auto_mask_params())} if config.auto_mask != "none" else {}),
    }


def _device_and_dtype(config: CacheConfig, device):
    import torch

    from ..models.load.devices import check_device_for
    from ..models.load.loading import default_device, default_dtype
    from ..models.presets import get_preset

    device = config.device or (str(device) if device is not None else default_device())
    check_device_for(get_preset(config.model), device, explicit_cpu=config.device == "cpu")
    return device, (getattr(torch, config.dtype) if config.dtype else default_dtype(device))


def load_encoders(config: CacheConfig, device):
    """The text encoder, VAE, tokenizer and processor, loaded (phase 1's models), each on its device
    (``--text_encoder_device`` / ``--vae_device``, default ``--device``)."""
    from ..models.load.loading import load_pipeline

    device, dtype = _device_and_dtype(config, device)
    return load_encoder_pipeline(config.model, config.model_dir, dtype, device, config.text_encoder_device,
                                 config.vae_device)


def load_encoder_pipeline(model: str, model_dir, dtype, device, text_encoder_device=None, vae_device=None):
    """A text encoder + VAE pipeline with each component on its own device (loaded on the host first when they
    differ). The VAE's decoder is freed: encoding never uses it."""
    import torch

    from ..models.load.loading import load_pipeline

    devices = {"text_encoder": torch.device(text_encoder_device or device), "vae": torch.device(vae_device or device)}
    one = len(set(devices.values())) == 1
    pipe = load_pipeline(model, model_dir=model_dir, components=("text_encoder", "vae"),
                         device=str(devices["vae"]) if one else "cpu", torch_dtype=dtype)
    if not one:
        pipe.text_encoder.to(devices["text_encoder"])
        pipe.vae.to(devices["vae"])
    pipe.device = devices["text_encoder"]
    pipe.vae.decoder = None  # (an encoder-only pipeline: about half the VAE's memory)
    return pipe


@dataclass
class LightPipeline:
    """What :func:`cache_settings` and the prompt-length check read of a pipeline, without its weights."""

    torch_dtype: Any
    qie_model_paths: dict = field(default_factory=dict)
    tokenizer: Any = None
    text_encoder: Any = None
    vae: Any = None
    processor: Any = None


def light_pipeline(config: CacheConfig, device):
    """A :class:`LightPipeline` from the local files; the loaded encoders when a file is not local yet (a hub
    download happens then, as before)."""
    from ..models.load.loading import provider_of, resolve_model_configs
    from ..models.presets import get_preset

    preset = get_preset(config.model)
    model_dir = provider_of(preset)(config.model_dir) if preset.provider else config.model_dir
    try:
        resolved = resolve_model_configs(preset, model_dir=model_dir, components=("text_encoder", "vae"))
    except (FileNotFoundError, ValueError):
        return load_encoders(config, device)
    paths = resolved.paths()
    needed = [name for name in ("text_encoder", "vae", "tokenizer", "processor") if preset.source(name) is not None]
    if not all(paths.get(name) for name in needed):
        return load_encoders(config, device)
    from transformers import AutoTokenizer

    _, dtype = _device_and_dtype(config, device)
    # (Qwen-Image-2.1 keeps its tokenizer in the processor's folder)
    return LightPipeline(torch_dtype=dtype, qie_model_paths=paths,
                         tokenizer=AutoTokenizer.from_pretrained((paths.get("tokenizer") or paths["processor"])[0]))


def skip_long_prompts(rows: list[EditRow], pipe, max_tokens: int) -> tuple[list[EditRow], list[SkippedRow]]:
    """``rows`` split into those whose prompts fit ``max_tokens`` tokens and the skips (logged) of the rest."""
    from ..models.prompts import prompt_token_count

    good, skipped = [], []
    for row in rows:
        longest = max(prompt_token_count(pipe, p) for p in row.prompts)
        if longest > max_tokens:
            s = SkippedRow(row.row_id, "prompts", None,
                           f"prompt of {longest} tokens, more than --max_prompt_tokens {max_tokens}")
            log_skip(s)
            skipped.append(s)
        else:
            good.append(row)
    return good, skipped
