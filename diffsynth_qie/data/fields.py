"""The metadata's field names and the dataset flags (``--dataset_metadata``, ``--image_field``, ...).

Torch-free and image-free: ``qie --help`` builds these flags; ``formats.py`` reads the rows with them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .rows import DEFAULT_MAX_BAD_FRACTION


@dataclass
class FieldNames:
    """Metadata field names (override with e.g. --source_field when a dataset uses other keys)."""

    id_field: str = field(default="id", metadata={"help": "row id field (optional; default id is <dataset>:<index>)"})
    # DiffSynth format
    prompt_field: str = field(default="prompt", metadata={"help": "DiffSynth format: prompt field"})
    image_field: str = field(default="image", metadata={"help": "DiffSynth format: target image field"})
    edit_image_field: str = field(default="edit_image", metadata={"help": "DiffSynth format: source image(s) field"})
    # FireRed-style format
    source_field: str = field(default="source_image", metadata={"help": "FireRed format: source image(s) field"})
    target_field: str = field(default="target_image", metadata={"help": "FireRed format: target image field"})
    instruction_field: str = field(default="instruction", metadata={"help": "FireRed format: instruction field"})
    instruction_cn_field: str = field(default="instruction_cn",
                                      metadata={"help": "FireRed format: second-language instruction field"})
    inverse_instruction_field: str = field(default="inverse_instruction",
                                           metadata={"help": "FireRed format: inverse instruction field"})
    inverse_instruction_cn_field: str = field(default="inverse_instruction_cn",
                                              metadata={"help": "FireRed format: second-language inverse field"})
    # both formats
    back_mask_field: str = field(default="back_mask", metadata={"help": "edit-region mask field (white = edit)"})
    ref_gt_field: str = field(default="ref_gt", metadata={"help": "reference ground-truth image field"})
    rejected_field: str = field(default="rejected", metadata={
        "help": "preference datasets (--loss dpo): the rejected output's field; the target is the chosen one"})


@dataclass
class DatasetConfig:
    """Dataset reading: metadata file, base directory, format options, bad-row policy."""

    dataset_metadata: str | None = field(default=None, metadata={
        "help": "metadata file: DiffSynth JSON/JSONL/CSV or FireRed-style JSONL", "metavar": "FILE"})
    dataset_base: str | None = field(default=None, metadata={
        "help": "directory image paths are relative to (default: the metadata file's directory)", "metavar": "DIR"})
    dataset_name: str | None = field(default=None, metadata={
        "help": "dataset name for weighted sampling and row ids (default: the metadata file's directory name)"})
    disable_inverse: bool = field(default=False, metadata={"help": "do not add inverse rows from inverse_instruction"})
    t2i_mode: bool = field(default=False, metadata={"help": "accept text-to-image rows (no source image)"})
    max_bad_fraction: float = field(default=DEFAULT_MAX_BAD_FRACTION, metadata={
        "help": "fail when more than this fraction of rows is bad (bad rows are listed in skipped.jsonl)",
        "unbounded": True})
