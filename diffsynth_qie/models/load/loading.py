"""Build DiffSynth pipelines from a preset, from the hub or a local directory.

The preset's family (``models/family.py``) names the pipeline class: ``QwenImagePipeline`` for
Qwen-Image-Edit, ``QwenImage21Pipeline`` for Qwen-Image-2.1. Why a layer over ``from_pretrained``: DiffSynth silently downloads
whatever it cannot find (and falls back to ModelScope ``Qwen/Qwen-Image`` for an
omitted tokenizer), retrying for ~20 s when the hub is unreachable. Here every file
is checked *before* DiffSynth runs: local files are used by path; files missing
with no way to download them raise one clear error naming what to download and
where. Only components that are asked for are loaded (training phase 2 loads the
DiT alone; tokenizer/processor come only with the text encoder).

Where files are looked for, per component:

1. ``model_dir`` (if given): the preset's relative pattern inside it, i.e. the
   layout of ``modelscope download --model Qwen/Qwen-Image-Edit-2511 --local_dir DIR``.
2. otherwise DiffSynth's own download folder ``$DIFFSYNTH_MODEL_BASE_PATH/<model_id>``
   (default ``./models/<model_id>``) and ModelScope's cache, as ModelScope itself
   finds it (``snapshot_download(..., local_files_only=True)``: ``$MODELSCOPE_CACHE``,
   its current and legacy layouts; nothing is downloaded or created);
3. otherwise DiffSynth downloads it, unless ``DIFFSYNTH_SKIP_DOWNLOAD`` is true or
   the hub is unreachable, in which case :func:`load_pipeline` fails fast.

The folders and the hub check are ``hub.py``'s; this module resolves a preset's files and loads.

DiffSynth's loader prints a download-source box, every loaded model's config as
JSON and a line per optional model it did not find; :func:`load_pipeline` sends
those lines to the ``diffsynth`` logger at DEBUG (``qie --verbose`` shows them).

The ``tiny`` preset lives in ``$QIE_HOME/models/Qwen-Image-Edit-tiny`` by default
(``QIE_HOME`` defaults to ``~/.cache/diffsynth-qie``) and is built there on first use.
"""
from __future__ import annotations

import glob
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from ...utils.logging import library_warnings_once, prints_to_log
from .hub import (HUB_CHECK_TIMEOUT_S, default_tiny_dir, diffsynth_model_base, hub_reachable,  # noqa: F401 (re-exported)
                  modelscope_snapshot, qie_home, why_no_download)
from ..presets import Preset, Source, get_preset

log = logging.getLogger(__name__)

MODEL_COMPONENTS = ("dit", "text_encoder", "vae")


# --- resolution ------------------------------------------------------------------
@dataclass
class ResolvedModels:
    """What ``QwenImagePipeline.from_pretrained`` needs, plus where each piece came from."""

    model_configs: list = field(default_factory=list)  # diffsynth ModelConfig for DiT/text encoder/VAE
    model_components: list[str] = field(default_factory=list)  # component name of each model_configs entry
    tokenizer_config: Any = None
    processor_config: Any = None

    def configs(self) -> dict[str, Any]:
        """Component name -> its ``ModelConfig`` (tokenizer/processor included when resolved)."""
        out = dict(zip(self.model_components, self.model_configs))
        for name in ("tokenizer", "processor"):
            if getattr(self, f"{name}_config") is not None:
                out[name] = getattr(self, f"{name}_config")
        return out

    def paths(self) -> dict[str, list[str]]:
        """Component -> local files/folders; hub components appear once DiffSynth has downloaded them."""
        out = {}
        for name, config in self.configs().items():
            if config.path is not None:
                out[name] = [str(p) for p in config.path] if isinstance(config.path, list) else [str(config.path)]
        return out


def _find_local(root: Path, source: Source) -> list[str] | None:
    """Files (weights) or the folder (tokenizer/processor) for ``source`` under ``root``; None if absent/incomplete."""
    if source.is_folder:
        folder = root / source.pattern.rstrip("/")
        return [str(folder)] if folder.is_dir() and any(folder.iterdir()) else None
    files = sorted(glob.glob(str(root / source.pattern)))
    files = [f for f in files if not f.endswith(".index.json")]
    if not files or not _shards_complete(files):
        return None
    return files


def _shards_complete(files: list[str]) -> bool:
    """For sharded weights, every shard listed in the ``*.safetensors.index.json`` is present."""
    folder = Path(files[0]).parent
    present = {Path(f).name for f in files}
    for index in folder.glob("*.safetensors.index.json"):
        try:
            needed = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, json.JSONDecodeError):
            return False
        if needed & present and not needed <= present:
            return False
    return True


def _candidate_roots(repos: Sequence[str]):
    """Where downloaded repos may lie, cheapest first: DiffSynth's download folder, then ModelScope's cache
    (asked lazily: most loads are satisfied by the first)."""
    for repo in repos:
        yield diffsynth_model_base() / repo
    for repo in repos:
        yield from modelscope_snapshot(repo)


class MissingModelFiles(FileNotFoundError):
    """A model's weights are not on disk (and cannot be downloaded): the message lists each missing file and
    the command that fetches them, for the user to run."""


def _required_components(components: Iterable[str]) -> list[str]:
    components = list(components)
    bad = [c for c in components if c not in MODEL_COMPONENTS]
    if bad:
        raise ValueError(f"unknown component(s) {bad}; valid components: {', '.join(MODEL_COMPONENTS)}")
    if not components:
        raise ValueError("components is empty; ask for at least one of " + ", ".join(MODEL_COMPONENTS))
    needed = [c for c in MODEL_COMPONENTS if c in components]
    if "text_encoder" in needed:  # prompts need the tokenizer (text-only) and the processor (with images)
        needed += ["tokenizer", "processor"]
    return needed  # (a family without a tokenizer folder has no source for it: skipped by the caller)


def _download_hint(preset: Preset, model_dir: str | os.PathLike | None) -> str:
    if preset.is_tiny:
        return f"Build it with: qie make-tiny --model {preset.name} --out {model_dir or default_tiny_dir()}"
    target = model_dir or f"./models/{preset.repo_id}"
    return (f"Download it with: modelscope download --model {preset.repo_id} --local_dir {target}\n"
            f"then pass --model_dir {target} (model_dir=... in Python)")


def resolve_model_configs(preset: str | Preset, model_dir: str | os.PathLike | None = None,
                          components: Sequence[str] = MODEL_COMPONENTS) -> ResolvedModels:
    """DiffSynth ``ModelConfig``s for ``components`` of ``preset`` (+ tokenizer/processor with the text encoder).

    With ``model_dir`` every file must be there (FileNotFoundError naming each missing
    one and the download command). Without it, files already downloaded are used by
    path; the rest become ``ModelConfig(model_id, origin_file_pattern)`` for DiffSynth
    to download — after checking that a download can happen at all.
    """
    preset = get_preset(preset)
    needed = _required_components(components)
    if preset.is_tiny and model_dir is None:
        raise ValueError("the tiny preset needs model_dir (load_pipeline defaults it to "
                         f"{default_tiny_dir()}); build one with `qie make-tiny --out DIR`")
    found: list[tuple[str, Source, list[str] | None]] = []
    missing: list[str] = []
    for name in needed:
        source = preset.source(name)
        if source is None:  # not a separate component in this family (2.1's processor holds its tokenizer)
            continue
        if model_dir is not None:
            paths = _find_local(Path(model_dir), source)
            if paths is None:
                missing.append(f"{name}: {Path(model_dir) / source.pattern}")
        else:
            # DiffSynth's download folder and ModelScope's cache, for the component's own
            # repo and for the preset's repo (every Edit repo holds all five components).
            repos = list(dict.fromkeys((source.model_id, preset.repo_id)))
            paths = next((p for p in (_find_local(r, source) for r in _candidate_roots(repos)) if p is not None), None)
            if paths is None:
                missing.append(f"{name}: {source.pattern} of {source.model_id} "
                               f"(looked in {(diffsynth_model_base() / source.model_id).resolve()})")
        found.append((name, source, paths))

    # Decide before importing diffsynth (~6 s), so a hopeless load fails at once.
    listing = "".join(f"\n  - {m}" for m in missing)
    if model_dir is not None and missing:
        raise MissingModelFiles(
            f"model_dir {model_dir} lacks files of the {preset.name} preset:{listing}\n"
            f"{_download_hint(preset, model_dir)}")
    if missing:
        reason = why_no_download()
        if reason:
            raise MissingModelFiles(
                f"{preset.name} ({preset.repo_id}) weights are not downloaded and {reason}. Missing:{listing}\n"
                f"{_download_hint(preset, None)}\n"
                f"(or put the <model_id>/ folders under $DIFFSYNTH_MODEL_BASE_PATH, default ./models)")
        log.info("will download from the hub: %s", "; ".join(missing))

    from diffsynth.core import ModelConfig

    resolved = ResolvedModels()
    for name, source, paths in found:
        if paths is None:  # left to DiffSynth's downloader
            config = ModelConfig(model_id=source.model_id, origin_file_pattern=source.pattern)
        else:
            config = ModelConfig(path=paths[0] if len(paths) == 1 else paths)
        _attach(resolved, name, config)
    return resolved


def _attach(resolved: ResolvedModels, name: str, config) -> None:
    if name == "tokenizer":
        resolved.tokenizer_config = config
    elif name == "processor":
        resolved.processor_config = config
    else:
        resolved.model_configs.append(config)
        resolved.model_components.append(name)


# --- loading ---------------------------------------------------------------------
def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str):
    """bf16 on GPUs; fp32 on CPU, where bf16 matmuls are ~100x slower without avx512_bf16."""
    import torch

    return torch.float32 if str(device).startswith("cpu") else torch.bfloat16


def provider_of(preset: Preset):
    """The function that prepares a locally built preset's files (see ``Preset.provider``)."""
    import importlib

    module, _, function = preset.provider.partition(":")
    return getattr(importlib.import_module(module), function)


def load_pipeline(preset_or_name: str | Preset, model_dir: str | os.PathLike | None = None,
                  components: Sequence[str] = MODEL_COMPONENTS, device: str | None = None,
                  torch_dtype=None, zero_cond_t: bool | None = None,
                  model_config_kwargs: dict[str, dict] | None = None, vram_limit: float | None = None,
                  map_weights: bool = False):
    """The preset family's DiffSynth pipeline, built by DiffSynth's own ``from_pretrained``.

    ``components`` picks the weights: ``("dit",)`` loads only the DiT (training phase 2),
    leaving ``pipe.text_encoder``/``pipe.vae``/tokenizer/processor ``None``.
    ``device`` defaults to CUDA when available; ``torch_dtype`` to bf16 on GPU, fp32 on CPU.
    ``zero_cond_t`` overrides the preset's flag. The preset (with the override) is
    attached as ``pipe.qie_preset`` — later code reads ``zero_cond_t`` from there.
    ``model_config_kwargs`` maps a component to extra ``ModelConfig`` fields (e.g.
    ``{"text_encoder": {"offload_device": "cpu", "offload_dtype": torch.bfloat16}}``
    for DiffSynth's VRAM management on small GPUs). ``map_weights`` (a host load that stages the weights
    for a GPU): views of the files' memory maps instead of private copies (``models/load/host_weights.py``).
    """
    preset = get_preset(preset_or_name, zero_cond_t=zero_cond_t)
    library_warnings_once()
    if preset.provider:
        model_dir = provider_of(preset)(model_dir)
    resolved = resolve_model_configs(preset, model_dir=model_dir, components=components)
    from ..family import get_family
    from .host_weights import map_host_weights

    family = get_family(preset.family)
    if model_dir is not None and "dit" in components:  # the other family's DiT, named before DiffSynth fails
        from .dit_family import check_dit_family

        check_dit_family(resolved.paths().get("dit", []), preset, family, f"--model_dir {model_dir}")

    device = device or default_device()
    torch_dtype = torch_dtype or default_dtype(device)
    if model_config_kwargs:
        _apply_model_config_kwargs(resolved, model_config_kwargs)
    try:
        with prints_to_log("diffsynth"):
            if map_weights and str(device) == "cpu":
                map_host_weights(resolved.model_configs, torch_dtype)
            # Explicit None (not DiffSynth's default) so nothing falls back to a hub download.
            tokenizer = {"tokenizer_config": resolved.tokenizer_config} if family.has_tokenizer else {}
            pipe = family.pipeline_type().from_pretrained(
                torch_dtype=torch_dtype, device=device, model_configs=resolved.model_configs,
                processor_config=resolved.processor_config, vram_limit=vram_limit, **tokenizer,
            )
    except ValueError as e:
        if "Cannot detect the model type" not in str(e):
            raise
        raise ValueError(f"{e}\nThese weights are not a {preset.name} ({preset.repo_id}) checkpoint "
                         "DiffSynth knows; check --model/--model_dir (a tiny model needs --model tiny)") from e
    pipe.qie_preset = preset
    # Component -> local files actually loaded (after any download): what the cache
    # layer fingerprints (``cache.fingerprint.weights_fingerprint``).
    pipe.qie_model_paths = resolved.paths()
    log.info("loaded %s (%s) on %s/%s", preset.name, ", ".join(components), device, str(torch_dtype).replace("torch.", ""))
    return pipe


def _apply_model_config_kwargs(resolved: ResolvedModels, kwargs: dict[str, dict]) -> None:
    unknown = set(kwargs) - set(resolved.model_components)
    if unknown:
        raise ValueError(f"model_config_kwargs names components not being loaded: {sorted(unknown)}; "
                         f"loading: {resolved.model_components}")
    for name, config in zip(resolved.model_components, resolved.model_configs):
        for key, value in kwargs.get(name, {}).items():
            if not hasattr(config, key):
                raise ValueError(f"model_config_kwargs[{name!r}] has unknown ModelConfig field {key!r}")
            setattr(config, key, value)
