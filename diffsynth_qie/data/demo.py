"""A small synthetic editing dataset: coloured shapes on plain backgrounds.

Used by the tests, the launch scripts' no-config default run and the README.
Every pair is built so that the *target differs from the source only inside the
mask* (``back_mask``, white = edit region): the edit is drawn, then composited
through the mask, so mask-aware losses and mask-blended inference can be tested
exactly. About a quarter of the rows have a second source, a colour swatch
("paint the circle with the colour of picture 2"). Every row has a ``ref_gt``:
the target's shape on white, same size as the target.

The CPU demo uses one consistent edit instead (:func:`make_recolour_demo`: "make
the red circle blue", with held-out pairs); a LoRA trained on mixed edits only learns
to erase shapes. :func:`random_shapes_image` draws the pretrained tiny base's images.

Deterministic from ``seed`` (no timestamps in the PNGs), fast (well under a
second for the default 36 pairs). The metadata file is written last and
atomically, so a half-written directory is never mistaken for a dataset.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

from ..utils.atomic import atomic_save, atomic_write_json, atomic_write_text

#: (width, height) pairs cycled through with ``mixed_sizes``; all multiples of 16.
MIXED_SIZES: tuple[tuple[int, int], ...] = ((64, 64), (64, 96), (96, 64), (128, 128), (96, 128))
SWATCH_SIZE = (64, 64)

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 170, 50), "blue": (30, 60, 220),
    "yellow": (240, 210, 20), "purple": (140, 40, 180), "orange": (250, 130, 10),
}
COLOURS_CN = {"red": "红色", "green": "绿色", "blue": "蓝色", "yellow": "黄色", "purple": "紫色", "orange": "橙色"}
SHAPES = ("circle", "square", "triangle")
SHAPES_CN = {"circle": "圆形", "square": "正方形", "triangle": "三角形"}
BACKGROUNDS = ((235, 235, 235), (245, 238, 220), (220, 232, 240), (230, 240, 225))
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
DIRECTIONS_EN = {"left": "to the left", "right": "to the right", "up": "up", "down": "down"}
DIRECTIONS_CN = {"left": "左", "right": "右", "up": "上", "down": "下"}
OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}


@dataclass
class DemoPair:
    """One generated example; paths relative to the dataset directory."""

    index: int
    op: str  # recolor | move | remove | swatch
    source: str
    target: str
    mask: str
    ref_gt: str
    swatch: str | None
    prompt: str
    prompt_cn: str
    inverse: str | None
    inverse_cn: str | None
    description: str  # caption of the target (for text-to-image rows)
    description_cn: str


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], colour) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=colour)


def _mask_from_boxes(size, boxes, pad: int = 2) -> Image.Image:
    mask = Image.new("L", size, 0)
    d = ImageDraw.Draw(mask)
    for x0, y0, x1, y1 in boxes:
        d.rectangle((max(0, x0 - pad), max(0, y0 - pad), min(size[0] - 1, x1 + pad), min(size[1] - 1, y1 + pad)),
                    fill=255)
    return mask


def _make_pair(i: int, rng: random.Random, size: tuple[int, int]) -> tuple[dict[str, Image.Image], dict]:
    w, h = size
    bg = BACKGROUNDS[rng.randrange(len(BACKGROUNDS))]
    shape = SHAPES[rng.randrange(len(SHAPES))]
    names = list(COLOURS)
    colour = names[rng.randrange(len(names))]
    # About a quarter of the rows use a colour swatch as a second source.
    op = "swatch" if i % 4 == 3 else ("recolor", "move", "remove")[rng.randrange(3)]
    s = rng.randrange(max(12, min(w, h) // 4), max(13, min(w, h) // 3) + 1)
    x0 = rng.randrange(w // 2 - s // 2 - w // 8, w // 2 - s // 2 + w // 8 + 1)
    y0 = rng.randrange(h // 2 - s // 2 - h // 8, h // 2 - s // 2 + h // 8 + 1)
    box = (x0, y0, x0 + s - 1, y0 + s - 1)

    source = Image.new("RGB", size, bg)
    _draw_shape(ImageDraw.Draw(source), shape, box, COLOURS[colour])
    edited = Image.new("RGB", size, bg)
    ed = ImageDraw.Draw(edited)
    new_colour, new_box, swatch = colour, box, None
    cn_c, cn_s = COLOURS_CN[colour], SHAPES_CN[shape]
    if op in ("recolor", "swatch"):
        new_colour = rng.choice([c for c in names if c != colour])
        _draw_shape(ed, shape, box, COLOURS[new_colour])
        if op == "recolor":
            text = (f"make the {colour} {shape} {new_colour}", f"把{cn_c}{cn_s}变成{COLOURS_CN[new_colour]}",
                    f"make the {new_colour} {shape} {colour}", f"把{COLOURS_CN[new_colour]}{cn_s}变成{cn_c}")
        else:
            swatch = Image.new("RGB", SWATCH_SIZE, COLOURS[new_colour])
            text = (f"paint the {shape} with the colour of picture 2", f"用图2的颜色给{cn_s}上色", None, None)
        boxes = [box]
    elif op == "move":
        direction = rng.choice(list(DIRECTIONS))
        dx, dy = DIRECTIONS[direction]
        step = max(8, min(w, h) // 5)
        nx0 = min(max(0, x0 + dx * step), w - s)
        ny0 = min(max(0, y0 + dy * step), h - s)
        new_box = (nx0, ny0, nx0 + s - 1, ny0 + s - 1)
        _draw_shape(ed, shape, new_box, COLOURS[colour])
        text = (f"move the {colour} {shape} {DIRECTIONS_EN[direction]}", f"把{cn_c}{cn_s}向{DIRECTIONS_CN[direction]}移动",
                f"move the {colour} {shape} {DIRECTIONS_EN[OPPOSITE[direction]]}",
                f"把{cn_c}{cn_s}向{DIRECTIONS_CN[OPPOSITE[direction]]}移动")
        boxes = [box, new_box]
    else:  # remove: the background is plain, so the edit is exactly the shape
        new_box = None
        text = (f"remove the {colour} {shape}", f"删除{cn_c}{cn_s}", f"add a {colour} {shape}", f"添加一个{cn_c}{cn_s}")
        boxes = [box]

    mask = _mask_from_boxes(size, boxes)
    # Composite through the mask: outside it the target *is* the source, by construction.
    target = Image.composite(edited, source, mask)
    ref_gt = Image.new("RGB", size, (255, 255, 255))
    if new_box is not None:
        _draw_shape(ImageDraw.Draw(ref_gt), shape, new_box, COLOURS[new_colour])
    if new_box is not None:
        desc = (f"a {new_colour} {shape} on a plain background", f"纯色背景上的一个{COLOURS_CN[new_colour]}{cn_s}")
    else:
        desc = ("an empty plain background", "空白的纯色背景")
    images = {"src": source, "tgt": target, "mask": mask, "ref": ref_gt}
    if swatch is not None:
        images["src2"] = swatch
    meta = dict(op=op, prompt=text[0], prompt_cn=text[1], inverse=text[2], inverse_cn=text[3],
                description=desc[0], description_cn=desc[1])
    return images, meta


def generate_pairs(out_dir: str | os.PathLike, num_pairs: int = 36, seed: int = 0,
                   mixed_sizes: bool = True) -> list[DemoPair]:
    """Write the images of ``num_pairs`` examples under ``out_dir/images`` and describe them."""
    if num_pairs < 1:
        raise ValueError(f"num_pairs must be >= 1, got {num_pairs}")
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    pairs = []
    for i in range(num_pairs):
        size = MIXED_SIZES[i % len(MIXED_SIZES)] if mixed_sizes else (64, 64)
        images, meta = _make_pair(i, rng, size)
        rel = {k: f"images/{i:03d}_{k}.png" for k in images}
        for k, im in images.items():
            atomic_save(out / rel[k], lambda path, im=im: im.save(path, format="PNG"))
        pairs.append(DemoPair(index=i, source=rel["src"], target=rel["tgt"], mask=rel["mask"], ref_gt=rel["ref"],
                              swatch=rel.get("src2"), **meta))
    return pairs


def make_demo_data(out_dir: str | os.PathLike, num_pairs: int = 36, seed: int = 0,
                   mixed_sizes: bool = True) -> Path:
    """Write a DiffSynth-format demo dataset (``metadata.json`` + ``images/``); returns ``out_dir``."""
    out = Path(out_dir)
    pairs = generate_pairs(out, num_pairs, seed, mixed_sizes)
    rows = [{
        "prompt": p.prompt,
        "image": p.target,
        "edit_image": [p.source] + ([p.swatch] if p.swatch else []),
        "back_mask": p.mask,
        "ref_gt": p.ref_gt,
    } for p in pairs]
    atomic_write_json(out / "metadata.json", rows)
    return out


def make_demo_jsonl(out_dir: str | os.PathLike, num_pairs: int = 36, seed: int = 0,
                    mixed_sizes: bool = True, num_t2i: int = 2) -> Path:
    """Write a FireRed-style ``metadata.jsonl`` over the same images; returns ``out_dir``.

    Single-source rows have ``instruction_cn`` and inverse instructions; swatch
    rows have a list of two sources (and no inverse); ``num_t2i`` extra rows have
    ``source_image: null`` with a caption of their target — read them with
    ``t2i_mode`` (without it they are reported as bad rows).
    """
    out = Path(out_dir)
    pairs = generate_pairs(out, num_pairs, seed, mixed_sizes)
    lines = []
    for p in pairs:
        rec: dict = {"source_image": [p.source, p.swatch] if p.swatch else p.source, "target_image": p.target,
                     "instruction": p.prompt, "instruction_cn": p.prompt_cn}
        if p.inverse:
            rec["inverse_instruction"] = p.inverse
            rec["inverse_instruction_cn"] = p.inverse_cn
        lines.append(rec)
    # Captions of targets that show a shape make better text-to-image rows.
    t2i_pairs = sorted(pairs, key=lambda p: p.op == "remove")[:num_t2i]
    for p in t2i_pairs:
        lines.append({"source_image": None, "target_image": p.target,
                      "instruction": p.description, "instruction_cn": p.description_cn})
    atomic_write_text(out / "metadata.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in lines))
    return out


# --- one consistent edit: "make the red circle blue" ----------------------------------
#: The CPU demo's edit. The pretrained tiny base reproduces its source image; a LoRA
#: teaches it this edit (see ``training/pretrain_tiny.py`` and the launch scripts).
RECOLOUR_PROMPT = "make the red circle blue"
RECOLOUR_SIZE = (64, 64)


def _free_box(rng: random.Random, size, s: int, avoid=None) -> tuple[int, int, int, int]:
    w, h = size
    for _ in range(50):
        x0, y0 = rng.randrange(2, w - s - 1), rng.randrange(2, h - s - 1)
        box = (x0, y0, x0 + s - 1, y0 + s - 1)
        if avoid is None or box[2] + 3 < avoid[0] or avoid[2] + 3 < box[0] or box[3] + 3 < avoid[1] or avoid[3] + 3 < box[1]:
            return box
    return box


def random_shapes_image(rng: random.Random, size=RECOLOUR_SIZE) -> Image.Image:
    """A plain background with one or two shapes of any colour (the tiny base's pretraining images)."""
    image = Image.new("RGB", size, BACKGROUNDS[rng.randrange(len(BACKGROUNDS))])
    draw = ImageDraw.Draw(image)
    box = None
    for _ in range(rng.choice((1, 2))):
        s = rng.randrange(min(size) // 5, min(size) // 2)
        box = _free_box(rng, size, s, avoid=box)
        _draw_shape(draw, rng.choice(SHAPES), box, COLOURS[rng.choice(list(COLOURS))])
    return image


def recolour_pair(rng: random.Random, size=RECOLOUR_SIZE) -> dict[str, Image.Image]:
    """A red circle (and sometimes another, non-red shape) -> the same circle in blue, inside the mask."""
    bg = BACKGROUNDS[rng.randrange(len(BACKGROUNDS))]
    s = rng.randrange(min(size) // 4, min(size) // 2)
    box = _free_box(rng, size, s)
    source = Image.new("RGB", size, bg)
    edited = Image.new("RGB", size, bg)
    other = None
    if rng.random() < 0.5:  # a distractor the edit must leave alone
        t = rng.randrange(min(size) // 6, min(size) // 3)
        other = (_free_box(rng, size, t, avoid=box), rng.choice(SHAPES),
                 COLOURS[rng.choice([c for c in COLOURS if c not in ("red", "blue")])])
    for image, colour in ((source, COLOURS["red"]), (edited, COLOURS["blue"])):
        draw = ImageDraw.Draw(image)
        _draw_shape(draw, "circle", box, colour)
        if other is not None:
            _draw_shape(draw, other[1], other[0], other[2])
    mask = _mask_from_boxes(size, [box])
    target = Image.composite(edited, source, mask)
    return {"src": source, "tgt": target, "mask": mask}


def make_recolour_demo(out_dir: str | os.PathLike, num_pairs: int = 32, num_heldout: int = 8, seed: int = 0) -> Path:
    """Write the one-edit demo: ``metadata.json`` (training) and ``heldout.json`` (evaluation).

    Every row asks for :data:`RECOLOUR_PROMPT`; held-out rows come from their own
    random stream, so they never repeat a training image. Returns ``out_dir``.
    """
    if num_pairs < 1 or num_heldout < 0:
        raise ValueError(f"num_pairs must be >= 1 and num_heldout >= 0, got {num_pairs} and {num_heldout}")
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    for name, n, stream in (("metadata.json", num_pairs, "train"), ("heldout.json", num_heldout, "heldout")):
        rng = random.Random(f"{seed}:{stream}")
        rows = []
        for i in range(n):
            images = recolour_pair(rng)
            rel = {k: f"images/{stream}_{i:03d}_{k}.png" for k in images}
            for k, im in images.items():
                atomic_save(out / rel[k], lambda path, im=im: im.save(path, format="PNG"))
            rows.append({"prompt": RECOLOUR_PROMPT, "image": rel["tgt"], "edit_image": [rel["src"]],
                         "back_mask": rel["mask"]})
        atomic_write_json(out / name, rows)
    return out
