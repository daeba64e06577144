"""The UI's examples: rows of a dataset metadata file (source image, every other reference, mask, prompt), two
clicks to a first edit.

``--examples FILE`` takes any metadata file ``qie cache`` reads (JSON, JSONL, CSV; the
same field names). ``auto`` (the default) uses the CPU demo's held-out rows: those
under the LoRA folder (``<lora_dir>/demo-red-circle-blue/heldout.json``, written by the
training scripts) or, for the tiny models, a fresh copy in the UI's temp folder. The
demo LoRA never saw these rows, so they show what it learned.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

AUTO = "auto"
MAX_EXAMPLES = 8
DEMO_FOLDER = "demo-red-circle-blue"
HELDOUT = "heldout.json"


@dataclass(frozen=True)
class Example:
    image: str            # the source image
    mask: str | None      # its mask file (white = may change), or None
    prompt: str
    references: tuple[str, ...] = ()  # the row's other reference images, in order (a multi-image edit)

    def editor_value(self) -> dict:
        return {"background": self.image, "layers": [], "composite": self.image}


def examples_file(setting: str | None, lora_dir: str, model: str, temp_dir: Path) -> Path | None:
    """The metadata file ``--examples`` means (``auto``: the demo's held-out rows), or None for no examples."""
    if not setting:
        return None
    if setting != AUTO:
        path = Path(setting).expanduser()
        if not path.is_file():
            raise ValueError(f"--examples {setting} is not a file; give a dataset metadata file (JSON, JSONL or "
                             "CSV), or `auto`, or `` for none")
        return path
    trained = Path(lora_dir).expanduser() / DEMO_FOLDER / HELDOUT
    if trained.is_file():
        return trained
    from ..models.presets import get_preset

    if not get_preset(model).is_tiny:
        return None
    from ..data.demo import make_recolour_demo

    out = Path(temp_dir) / "examples-demo"
    if not (out / HELDOUT).is_file():
        make_recolour_demo(out, num_pairs=1, num_heldout=4)
    return out / HELDOUT


def load_examples(metadata: Path, limit: int = MAX_EXAMPLES) -> list[Example]:
    """Up to ``limit`` rows of ``metadata`` with a source image (its first), mask and first prompt.

    Rows whose files are missing or unreadable are skipped (logged), as the cache skips them.
    """
    from ..data.formats import read_rows
    from ..data.rows import validate_rows

    rows, _ = validate_rows(read_rows(metadata), check_images=True)
    out = [Example(image=str(row.edit_images[0]), mask=str(row.back_mask) if row.back_mask else None,
                   prompt=row.prompts[0], references=tuple(str(p) for p in row.edit_images[1:]))
           for row in rows if row.edit_images][:limit]
    log.info("%d example(s) from %s", len(out), metadata)
    return out


DEMO_FAMILY = "qwen-image-edit"  # the model family the demo's rows were made and trained for


def examples_label(model: str) -> str:
    """The examples table's label: what the rows are, and, on another family than the demo's, that they are only
    images to start from (a Qwen-Image-2.1 model was not trained on the Edit demo)."""
    from ..models.presets import family_of

    family = family_of(model)
    if family.name == DEMO_FAMILY:
        return "Examples (held-out rows: click one, then Generate)"
    return (f"Example images (the Qwen-Image-Edit demo's rows: {family.label} was not trained on them, so they are "
            "only images to start from; write your own prompt)")
