"""`qie cache`: phase 1 of split training (text encoder + VAE -> safetensors cache).

Under ``accelerate launch`` every process takes its share of the rows (row ``i`` ->
rank ``i % world_size``) and rank 0 finalises the manifest. Re-running into the
same ``--cache_dir`` resumes: unchanged rows are skipped, changed rows recomputed,
rows no longer in the metadata dropped.
"""
from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)
# no output may be an input (cli.py): the files written into --cache_dir beside the shards
INPUTS = ("dataset_metadata", "model_dir")
WRITES = {"cache_dir": ("manifest.json", "skipped.jsonl")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..cache.writer import CacheConfig
    from ..data.formats import DatasetConfig, FieldNames
    from ..utils.config_cli import add_dataclass_args

    add_dataclass_args(parser, DatasetConfig, title="dataset")
    add_dataclass_args(parser, CacheConfig, title="cache")
    add_dataclass_args(parser, FieldNames, title="metadata field names")


def config_from_args(args: argparse.Namespace):
    """CacheConfig with its dataset and field-name parts filled from their flag groups."""
    from ..cache.writer import CacheConfig
    from ..data.formats import DatasetConfig, FieldNames
    from ..utils.config_cli import dataclass_from_args

    config = dataclass_from_args(CacheConfig, args)
    config.dataset = dataclass_from_args(DatasetConfig, args)
    config.fields = dataclass_from_args(FieldNames, args)
    return config


def run(args: argparse.Namespace) -> int:
    from ..cache.writer import write_cache
    from ..models.load.devices import check_device_flags

    config = config_from_args(args)
    check_device_flags({"--device": config.device, "--text_encoder_device": config.text_encoder_device,
                        "--vae_device": config.vae_device})  # before anything loads
    summary = write_cache(config)
    if summary.manifest is not None:
        log.info("cache ready: %s (%d entries; %d encoded at %.2f rows/s on rank 0, %d reused, %d skipped)",
                 config.cache_dir, len(summary.manifest["entries"]), summary.computed, summary.rows_per_second,
                 summary.reused, summary.manifest.get("num_skipped", 0))
    return 0
