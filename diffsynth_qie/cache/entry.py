"""One cache entry: its metadata (:class:`EntryMeta`, no tensor I/O) and its tensors (:class:`CacheEntry`), with
the names they have inside a shard. The layout of the cache around them is ``store.py``'s docstring."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # torch is imported lazily so `qie --help` stays fast
    import torch

LBM_NONE, LBM_EDIT0, LBM_OWN = "none", "edit0", "own"


def sub_noise_key(height: int, width: int) -> str:
    """Key of the white-image latents for a ``height x width`` *pixel* image in shared.safetensors."""
    return f"sub_noise/{int(height)}x{int(width)}"


@dataclass
class EntryMeta:
    """Everything about an entry that needs no tensor read (bucketing, sampling, filtering).

    Shapes are latent shapes ``(16, h, w)``; ``target_size`` is the pixel ``(H, W)``.
    """

    entry_id: str
    row_id: str
    dataset: str
    inverse: bool
    content_hash: str
    prompts: list[str]
    prompt_lengths: list[int]
    empty_prompt_length: int
    prompt_dim: int
    target_size: tuple[int, int]
    target_shape: tuple[int, int, int]
    edit_shapes: list[tuple[int, int, int]]
    has_back_mask: bool
    ref_gt_shape: Optional[tuple[int, int, int]]
    lbm_source: str  # LBM_NONE | LBM_EDIT0 (same tensor as edit_latents[0]) | LBM_OWN
    sub_noise_key: str
    sub_noise_ref_gt_key: Optional[str]
    dtype: str
    sources: dict[str, Any] = field(default_factory=dict)  # relative input paths, for humans/debugging
    patch: int = 2  # latent pixels per DiT token side (written by every cache; 2 in caches from before the field)
    prompt_tensors: list[str] = field(default_factory=list)  # each prompt's tensors beside its embedding (Family)
    mask_derived: bool = False  # back_mask derived by --auto_mask (not the row's own)
    rejected_shape: Optional[tuple[int, int, int]] = None  # a preference row's rejected latents (= target_shape)
    shard: str = ""  # shard file name under shards/, set by ShardWriter
    key: str = ""  # tensor key prefix inside the shard, set by ShardWriter

    @property
    def n_edit(self) -> int:
        return len(self.edit_shapes)

    @property
    def n_prompts(self) -> int:
        return len(self.prompt_lengths)

    @property
    def has_ref_gt(self) -> bool:
        return self.ref_gt_shape is not None

    @property
    def has_rejected(self) -> bool:
        return self.rejected_shape is not None

    @property
    def has_lbm_source(self) -> bool:
        return self.lbm_source != LBM_NONE

    @property
    def image_tokens(self) -> int:
        """DiT image tokens (``patch`` x ``patch`` latent pixels each) of the target plus all reference images."""
        return sum((s[1] // self.patch) * (s[2] // self.patch) for s in [self.target_shape, *self.edit_shapes])

    @property
    def text_tokens(self) -> int:
        """Longest prompt alternative (what a batch must be padded to)."""
        return max(self.prompt_lengths)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "EntryMeta":
        d = dict(d)
        d["target_size"] = tuple(d["target_size"])
        d["target_shape"] = tuple(d["target_shape"])
        d["edit_shapes"] = [tuple(s) for s in d["edit_shapes"]]
        d["ref_gt_shape"] = tuple(d["ref_gt_shape"]) if d.get("ref_gt_shape") else None
        d["rejected_shape"] = tuple(d["rejected_shape"]) if d.get("rejected_shape") else None
        if d.pop("has_prompt_pads", False) and "prompt_tensors" not in d:  # sidecars from before the schema
            d["prompt_tensors"] = ["pad"]
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class CacheEntry:
    """The tensors of one dataset row (no batch dimension; see the module docstring).

    ``sub_noise`` is always set (white latents at the target's size);
    ``sub_noise_ref_gt`` is set whenever ``ref_gt_latents`` is (the same tensor as
    ``sub_noise`` when the sizes match). ``lbm_source_latents`` is the first
    reference image resized to the target's pixel size and encoded (LBM's
    main-stream prior), None for text-to-image rows.
    """

    entry_id: str
    row_id: str
    dataset: str
    inverse: bool
    prompt_embs: list["torch.Tensor"]
    prompt_masks: list["torch.Tensor"]
    empty_prompt_emb: "torch.Tensor"
    empty_prompt_mask: "torch.Tensor"
    target_latents: "torch.Tensor"
    edit_latents: list["torch.Tensor"]
    sub_noise: "torch.Tensor"
    back_mask: Optional["torch.Tensor"] = None
    ref_gt_latents: Optional["torch.Tensor"] = None
    sub_noise_ref_gt: Optional["torch.Tensor"] = None
    lbm_source_latents: Optional["torch.Tensor"] = None
    # Each prompt's tensors beside its embedding, by the names of the family's ``Family.prompt_tensors``
    # (Qwen-Image-2.1: {"pad": the references' slot mask [L]}; Qwen-Image-Edit: none).
    prompt_extras: list[dict[str, "torch.Tensor"]] = field(default_factory=list)
    empty_prompt_extras: dict[str, "torch.Tensor"] = field(default_factory=dict)
    rejected_latents: Optional["torch.Tensor"] = None  # a preference row's rejected output, at the target's size

    @property
    def n_edit(self) -> int:
        return len(self.edit_latents)

    def extras_of(self, k: int) -> dict[str, "torch.Tensor"]:
        """Prompt ``k``'s tensors beside its embedding (``k == -1``: the empty prompt's); {} when it has none."""
        if k == -1:
            return self.empty_prompt_extras
        return self.prompt_extras[k] if self.prompt_extras else {}

    def own_tensors(self) -> dict[str, "torch.Tensor"]:
        """Per-entry tensors by shard name (shared white latents and an lbm source equal
        to ``edit_latents[0]`` excluded: those are stored once elsewhere)."""
        out: dict[str, torch.Tensor] = {}
        for k, (emb, mask) in enumerate(zip(self.prompt_embs, self.prompt_masks)):
            out[f"prompt_emb.{k}"] = emb
            out[f"prompt_mask.{k}"] = mask
        out["empty_prompt_emb"] = self.empty_prompt_emb
        out["empty_prompt_mask"] = self.empty_prompt_mask
        for k, extras in enumerate(self.prompt_extras):
            out.update({f"prompt_{name}.{k}": t for name, t in extras.items()})
        out.update({f"empty_prompt_{name}": t for name, t in self.empty_prompt_extras.items()})
        out["target_latents"] = self.target_latents
        for j, lat in enumerate(self.edit_latents):
            out[f"edit_latents.{j}"] = lat
        if self.back_mask is not None:
            out["back_mask"] = self.back_mask
        if self.ref_gt_latents is not None:
            out["ref_gt_latents"] = self.ref_gt_latents
        if self.rejected_latents is not None:
            out["rejected_latents"] = self.rejected_latents
        if self.lbm_source_latents is not None and lbm_source_mode(self) == LBM_OWN:
            out["lbm_source_latents"] = self.lbm_source_latents
        return out


def lbm_source_mode(entry: CacheEntry) -> str:
    """How an entry's LBM source is stored: not at all, as edit_latents[0], or its own tensor."""
    import torch

    src = entry.lbm_source_latents
    if src is None:
        return LBM_NONE
    if entry.edit_latents and (src is entry.edit_latents[0] or (
            src.shape == entry.edit_latents[0].shape and torch.equal(src, entry.edit_latents[0]))):
        return LBM_EDIT0
    return LBM_OWN
