"""What a row's instruction says about its edit, for ``qie check-dataset``: whether it asks for a change at all,
and the colour it asks for (the last colour word: "make the red car blue" → blue), which the edit region must
move towards. A pair whose region moves away from the named colour, towards where it came from, is reversed."""
from __future__ import annotations

import re
from typing import Optional

import numpy as np

COLOURS = {
    "red": (215, 40, 35), "blue": (40, 70, 215), "green": (40, 170, 60), "yellow": (235, 205, 30),
    "purple": (140, 50, 175), "violet": (140, 50, 175), "orange": (240, 130, 20), "pink": (235, 120, 170),
    "红": (215, 40, 35), "蓝": (40, 70, 215), "绿": (40, 170, 60), "黄": (235, 205, 30), "紫": (140, 50, 175),
    "橙": (240, 130, 20), "粉": (235, 120, 170),
}
_WORD = re.compile(r"[a-z]+|[\u4e00-\u9fff]")
_RECOLOUR = re.compile(r"\b(make|turn|change|paint|recolou?r|colou?r|dye|tint)\b|变成|改成|涂成|染成|换成")
_REMOVE = re.compile(r"\b(remove|delete|erase|disappear|take away|get rid)\b|去掉|删除|移除")
_NO_CHANGE = re.compile(r"\b(no change|unchanged|do nothing|keep (it|the image|everything) (the same|as (it )?is)|"
                        r"identity)\b|保持不变|不变")


def asks_no_change(prompt: Optional[str]) -> bool:
    """The instruction asks for the image as it is (an identity pair is then what it wants)."""
    return bool(prompt) and bool(_NO_CHANGE.search(prompt.lower()))


def named_colour(prompt: Optional[str]) -> Optional[str]:
    """The colour a recolour instruction asks for: its last colour word (None: it names none, or it does not
    ask for a colour: "remove the blue triangle", "move the red square up")."""
    if not prompt or not _RECOLOUR.search(prompt.lower()) or _REMOVE.search(prompt.lower()):
        return None
    words = [w for w in _WORD.findall(prompt.lower()) if w in COLOURS]
    return words[-1] if words else None


def _chroma(rgb: np.ndarray) -> np.ndarray:
    return rgb / max(float(rgb.sum()), 1e-6)


def colour_evidence(prompt: Optional[str], s: np.ndarray, t: np.ndarray, region: np.ndarray) -> Optional[float]:
    """How much closer the target's region is to the named colour than the source's (chromaticity distance,
    source minus target: positive = the edit goes the way the instruction says; negative = the other way).
    None when the instruction names no colour or the region is too small to tell."""
    name = named_colour(prompt)
    if name is None or region.sum() < 16:
        return None
    want = _chroma(np.array(COLOURS[name], np.float64))
    ds = float(np.linalg.norm(_chroma(s[region].mean(0).astype(np.float64)) - want))
    dt = float(np.linalg.norm(_chroma(t[region].mean(0).astype(np.float64)) - want))
    return ds - dt
