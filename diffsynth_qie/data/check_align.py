"""``qie check-dataset``'s measurements of one pair, vectorised over numpy arrays at the working size.

- :func:`block_motion`: phase correlation of the textured blocks of a grid (batched FFTs; a Hann window per
  block; sub-pixel peaks), each block's shift, peak height and texture (a flat block is not transformed: it says
  nothing of motion, and :func:`fit_motion` leaves it out);
- :func:`fit_motion`: the global motion those shifts agree on, ``d = t + a·(p − c)`` (a shift ``t`` and a zoom
  ``k = 1 / (1 − a)`` about the centre), fitted robustly (every one- and two-block hypothesis scored by its
  inliers, the best refitted on them) over the blocks that did not change: flat blocks and blocks inside the
  mask are left out, and a moved or inserted object is a minority of blocks that the fit ignores. The identity
  wins whenever it explains nearly as many blocks as the best motion;
- :func:`change_region`: where the pair differs (blurred largest channel difference over a threshold);
- :func:`structure`: the correlation of the two images' gradient magnitudes at a coarse scale (an edit, a
  colour grade or a style keeps the photo's structure; a target made from another photo does not);
- :func:`dhash` / :func:`thumb`: the duplicate pass's 64-bit difference hash and a 16x16 grey thumbnail.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import numpy as np
from PIL import Image, ImageFilter

LUMA = np.array([0.299, 0.587, 0.114], np.float32)
THUMB_SIDE = 16                      # the duplicate pass's thumbnails: THUMB_SIDE² grey pixels
THUMB_MAX_DIFF, THUMB_MEAN_DIFF = 10, 2.5  # two thumbnails of one picture differ at most this much per pixel, on average
MIN_TEXTURE = 0.02                   # blocks flatter than this (grey level standard deviation) say nothing of motion


def gray(a: np.ndarray) -> np.ndarray:
    return a @ LUMA


def block_side(h: int, w: int) -> int:
    side = min(h, w)
    return 64 if side >= 192 else 32 if side >= 64 else 16


@functools.lru_cache(maxsize=8)
def _hann2(b: int) -> np.ndarray:
    """The ``b`` x ``b`` Hann window of a block (read-only: shared between calls)."""
    window = np.outer(np.hanning(b), np.hanning(b)).astype(np.float32)
    window.flags.writeable = False
    return window


def block_motion(gs: np.ndarray, gt: np.ndarray, block: Optional[int] = None, min_texture: float = MIN_TEXTURE
                 ) -> dict:
    """Per block of a half-overlapping grid: ``centre`` (y, x; from the image centre), ``shift`` (dy, dx: where
    the source block's content is in the target), ``peak`` (the phase correlation's height, 1 for equal
    blocks) and ``texture`` (the lower of the two blocks' standard deviations). Only the blocks with a texture
    above ``min_texture`` are transformed (:func:`fit_motion` judges no other): the others' shift and peak are 0."""
    h, w = gs.shape
    b = block or block_side(h, w)
    ys, xs = np.arange(0, h - b + 1, b // 2), np.arange(0, w - b + 1, b // 2)
    view = np.lib.stride_tricks.sliding_window_view
    vs, vt = view(gs, (b, b))[::b // 2, ::b // 2], view(gt, (b, b))[::b // 2, ::b // 2]  # (no copy)
    gy, gx = (g.ravel() for g in np.meshgrid(np.arange(len(ys)), np.arange(len(xs)), indexing="ij"))
    # (the textures of every block at once; the transforms a few blocks at a time: each block's numbers are the
    # same in any batch, and the transforms' arrays stay small enough for the allocator to reuse: a 49-block rfft2
    # alone took 2.1 ms with its fresh pages faulted in, 0.75 ms in chunks)
    step = max(1, BLOCK_CHUNK // (2 * b * b))  # (a step holds its source and target blocks together)
    texture = _texture(vs[gy, gx], vt[gy, gx])
    judged = np.flatnonzero(texture > min_texture)  # (flat blocks, most of a plain background, are not transformed)
    dy, dx, peak = np.zeros(len(gy)), np.zeros(len(gy)), np.zeros(len(gy), np.float32)
    for i in range(0, len(judged), step):
        at = judged[i:i + step]
        dy[at], dx[at], peak[at] = _phase_peaks(vs[gy[at], gx[at]], vt[gy[at], gx[at]], b)
    cy, cx = np.meshgrid(ys + b / 2 - h / 2, xs + b / 2 - w / 2, indexing="ij")
    return {"centre": np.stack([cy.ravel(), cx.ravel()], 1), "shift": np.stack([dy, dx], 1), "peak": peak,
            "texture": texture, "block": b, "starts": (ys, xs), "min_texture": min_texture}


BLOCK_CHUNK = 16 * 32 * 32  # pixels of the blocks (source and target) :func:`block_motion` holds at once


def _texture(bs: np.ndarray, bt: np.ndarray) -> np.ndarray:
    """The lower of the standard deviations of each of the ``[n, b, b]`` blocks ``bs`` and its ``bt``."""
    sd = np.concatenate([bs, bt]).std(axis=(1, 2))  # (each block's own sum: the same numbers in any batch)
    return np.minimum(sd[:len(bs)], sd[len(bs):])


def _phase_peaks(bs: np.ndarray, bt: np.ndarray, b: int) -> tuple[np.ndarray, ...]:
    """``dy``, ``dx`` and ``peak`` of :func:`block_motion` for the ``[n, b, b]`` blocks ``bs``, ``bt``."""
    n = len(bs)
    both = np.concatenate([bs, bt])  # (one call per step for the two sides: each block's numbers are its own)
    f = np.fft.rfft2((both - both.mean(axis=(1, 2), keepdims=True)) * _hann2(b))
    fa, fb = f[:n], f[n:]
    cross = fb * np.conj(fa)
    corr = np.fft.irfft2(cross / np.maximum(np.abs(cross), 1e-9), s=(b, b))
    flat = corr.reshape(len(corr), -1)
    idx = flat.argmax(1)
    py, px = np.divmod(idx, b)
    rows = np.arange(n)
    peak = flat[rows, idx]

    def sub(c_minus, c_plus):
        den = c_minus - 2 * peak + c_plus
        return np.clip(np.where(np.abs(den) > 1e-9, 0.5 * (c_minus - c_plus) / np.where(den == 0, 1, den), 0), -.5, .5)

    dy = ((py + b // 2) % b - b // 2) + sub(corr[rows, (py - 1) % b, px], corr[rows, (py + 1) % b, px])
    dx = ((px + b // 2) % b - b // 2) + sub(corr[rows, py, (px - 1) % b], corr[rows, py, (px + 1) % b])
    return dy, dx, peak


@dataclass
class Motion:
    blocks: int           # blocks that could be judged (textured, clear peak, outside the mask)
    identity: float       # the share of them that did not move
    inliers: float        # the share the best motion explains
    shift: tuple          # (dy, dx) of the best motion, working px
    scale: float          # its zoom factor
    aligned: bool         # the identity explains the pair (nearly) as well as any motion


def fit_motion(m: dict, keep: Optional[np.ndarray] = None, min_texture: float = MIN_TEXTURE, min_peak: float = 0.15,
               tol: float = 0.6) -> Motion:
    """The global motion the judged blocks agree on (see the module's doc). ``keep``: blocks allowed (e.g. those
    outside the mask); ``tol``: a block's residual, working px, that still counts as explained."""
    if min_texture < m["min_texture"]:
        raise ValueError(f"fit_motion: min_texture {min_texture} is below the {m['min_texture']} block_motion "
                         "transformed the blocks from: measure them with block_motion(..., min_texture) at most that")
    textured = m["texture"] > min_texture
    if keep is not None:
        textured &= keep
    total = int(textured.sum())
    if total < 4:  # (flat images: nothing to judge the motion on)
        return Motion(total, 1.0, 1.0, (0.0, 0.0), 1.0, True)
    ok = textured & (m["peak"] > min_peak)
    p, d = m["centre"][ok], m["shift"][ok]
    wgt = np.ones(len(p))
    n = len(p)
    if n < 3:  # (textured, but no block matches: no motion explains the pair)
        return Motion(total, 0.0, 0.0, (0.0, 0.0), 1.0, False)
    ident = float((np.hypot(d[:, 0], d[:, 1]) < tol).sum() / total)
    i, j = np.triu_indices(n, 1)
    if len(i) > 400:
        pick = np.random.default_rng(0).choice(len(i), 400, replace=False)
        i, j = i[pick], j[pick]
    dp, dd = p[i] - p[j], d[i] - d[j]
    a2 = (dd * dp).sum(1) / np.maximum((dp * dp).sum(1), 1e-9)
    a = np.concatenate([np.zeros(n), a2])
    t = np.concatenate([d, (d[i] - a2[:, None] * p[i] + d[j] - a2[:, None] * p[j]) / 2])
    res = np.hypot(*(d[None] - t[:, None] - a[:, None, None] * p[None]).transpose(2, 0, 1))
    score = ((res < tol) * wgt[None]).sum(1)
    best = int(score.argmax())
    inl = res[best] < tol * 1.5
    if inl.sum() >= 3:  # least squares on the inliers: d = t + a·p
        rows = np.zeros((2 * inl.sum(), 3))
        rows[0::2, 0], rows[1::2, 1] = 1, 1
        rows[0::2, 2], rows[1::2, 2] = p[inl, 0], p[inl, 1]
        sol = np.linalg.lstsq(rows, d[inl].ravel(), rcond=None)[0]
        t_best, a_best = sol[:2], float(sol[2])
    else:
        t_best, a_best = t[best], float(a[best])
    fit_res = np.hypot(*(d - t_best - a_best * p).T)
    inliers = float((fit_res < tol).sum() / total)
    aligned = ident >= 0.5 or ident >= 0.8 * inliers
    return Motion(total, ident, inliers, (float(t_best[0]), float(t_best[1])), 1.0 + a_best, aligned)


def zoomed(g: np.ndarray, k: float) -> np.ndarray:
    """``g`` (float grey) zoomed by ``k`` about its centre, same size."""
    h, w = g.shape
    c = (w / 2 * (1 - 1 / k), h / 2 * (1 - 1 / k))
    im = Image.fromarray(g.astype(np.float32), "F").transform(
        (w, h), Image.Transform.AFFINE, (1 / k, 0, c[0], 0, 1 / k, c[1]), Image.Resampling.BILINEAR)
    return np.asarray(im)


def search_zoom(gs: np.ndarray, gt: np.ndarray, keep_fn=None, factors=(0.8, 0.86, 0.92, 1.08, 1.15, 1.22, 1.3)
                ) -> tuple[float, Motion]:
    """The zoom of ``gs`` (among ``factors``, then refined by the fit) whose block motion against ``gt``
    explains the most blocks: ``(zoom, motion)``. For pairs a zoom beyond a few per cent separates: the
    blocks' own content is then too scaled for their phase correlation to agree."""
    best = (1.0, Motion(0, 0.0, 0.0, (0.0, 0.0), 1.0, False))
    for k in factors:
        m = block_motion(zoomed(gs, k), gt)
        mo = fit_motion(m, keep_fn(m) if keep_fn else None)
        if mo.inliers > best[1].inliers:
            best = (k * mo.scale, mo)
    return best


def block_keep(m: dict, inside: np.ndarray, limit: float = 0.25) -> np.ndarray:
    """Blocks of ``m``'s grid with at most ``limit`` of their pixels inside ``inside`` (bool, image size)."""
    b = m["block"]
    ys, xs = m["starts"]
    q = b // 2  # (the grid's step: a block is 2x2 tiles of q x q pixels, the tiles reach (n + 1)·q <= the side)
    tiles = inside[:(len(ys) + 1) * q, :(len(xs) + 1) * q].reshape(len(ys) + 1, q, len(xs) + 1, q).sum(
        (1, 3), dtype=np.int32)
    cover = tiles[:-1, :-1] + tiles[1:, :-1] + tiles[:-1, 1:] + tiles[1:, 1:]
    return cover.ravel() <= limit * b * b


def _channel_max(a: np.ndarray) -> np.ndarray:
    """``a.max(-1)`` of an ``HxWx3`` array, channel by channel (a reduction over an axis of 3 costs far more)."""
    return np.maximum(np.maximum(a[..., 0], a[..., 1]), a[..., 2])


def change_region(s: np.ndarray, t: np.ndarray, threshold: float = 0.1, blur: float = 1.5) -> np.ndarray:
    """Where ``t`` differs from ``s`` (float HxWx3 in [0, 1]): the blurred largest channel difference over
    ``threshold``."""
    diff = Image.fromarray((_channel_max(np.abs(t - s)) * 255).astype(np.uint8))
    return np.asarray(diff.filter(ImageFilter.GaussianBlur(blur))) > threshold * 255


def dilate(mask: np.ndarray, px: int) -> np.ndarray:
    """``mask`` (bool) grown by ``px`` pixels on every side (a square, separable: 2·px array ors)."""
    out = mask.copy()
    for axis in (0, 1):
        grown = out.copy()
        n = out.shape[axis]
        for r in range(1, min(px, n - 1) + 1):
            lo = [slice(None)] * 2
            hi = [slice(None)] * 2
            lo[axis], hi[axis] = slice(0, n - r), slice(r, n)
            grown[tuple(lo)] |= out[tuple(hi)]
            grown[tuple(hi)] |= out[tuple(lo)]
        out = grown
    return out


def _pool(g: np.ndarray, f: int) -> np.ndarray:
    """The means of ``g``'s ``f`` x ``f`` cells (``HxW`` or ``HxWxC``, each channel on its own), with the sums in
    the order numpy's ``reshape(h // f, f, w // f, f).mean(axis=(1, 3))`` of one channel adds them (the same
    float32 numbers, several times faster: a small multi-axis reduction costs far more)."""
    h, w = g.shape[0] // f * f, g.shape[1] // f * f
    if h // f < 2 or w // f < 2 or f > 128:  # (one row or column of cells, or long rows: numpy orders those otherwise)
        if g.ndim == 3:
            return np.stack([_pool(g[..., c], f) for c in range(g.shape[2])], -1)
        return g[:h, :w].reshape(h // f, f, w // f, f).mean(axis=(1, 3))
    v = g[:h, :w].reshape(h // f, f, w // f, f, *g.shape[2:])
    rows = _reduce_add(v, 3)  # (each cell row's sum, as numpy's pairwise loop adds a row)
    total = rows[:, 0]
    for k in range(1, f):  # (then the rows one after another)
        total = total + rows[:, k]
    return total / np.float32(f * f)


def _reduce_add(v: np.ndarray, axis: int) -> np.ndarray:
    """``np.add.reduce`` of float ``v`` along a short ``axis`` in the order of numpy's pairwise loop (below 8 items
    one after another; from 8 on, eight running sums added pairwise, then the rest), vectorised over the others."""
    def at(k):
        return v[(slice(None),) * axis + (k,)]

    n = v.shape[axis]
    if n < 8:
        acc = at(0)
        for k in range(1, n):
            acc = acc + at(k)
        return acc
    r = [at(k) for k in range(8)]
    for i in range(8, n - n % 8, 8):
        r = [r[k] + at(i + k) for k in range(8)]
    acc = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
    for k in range(n - n % 8, n):
        acc = acc + at(k)
    return acc


def structure(gs: np.ndarray, gt: np.ndarray) -> float:
    """Correlation (−1..1) of the gradient magnitudes of ``gs`` and ``gt`` at about 64 px on the short side."""
    f = max(1, min(gs.shape) // 64)
    a, b = _pool(gs, f), _pool(gt, f)

    def grad(g):
        return np.hypot(np.diff(g, axis=0)[:, :-1], np.diff(g, axis=1)[:-1])

    ga, gb = grad(a).ravel(), grad(b).ravel()
    ga, gb = ga - ga.mean(), gb - gb.mean()
    den = float(np.sqrt((ga * ga).sum() * (gb * gb).sum()))
    return float((ga * gb).sum() / den) if den > 1e-12 else 1.0


def dhash(im: Image.Image) -> int:
    """64-bit difference hash (9x8 grayscale, left-right gradients)."""
    g = np.asarray(_grey(im).resize((9, 8), Image.Resampling.BILINEAR), dtype=np.int16)
    return int.from_bytes(np.packbits((g[:, 1:] > g[:, :-1]).ravel(), bitorder="little").tobytes(), "little")


def thumb(im: Image.Image) -> bytes:
    """A 16x16 grey thumbnail (box filter), the duplicate pass's check of a hash match."""
    return _grey(im).resize((THUMB_SIDE, THUMB_SIDE), Image.Resampling.BOX).tobytes()


def hash_and_thumb(im: Image.Image) -> tuple[int, bytes]:
    """:func:`dhash` and :func:`thumb` of ``im``, from one grey conversion."""
    grey = _grey(im)
    return dhash(grey), thumb(grey)


def _grey(im: Image.Image) -> Image.Image:
    return im if im.mode == "L" else im.convert("L")


def coarse_change(s: np.ndarray, t: np.ndarray, threshold: float = 0.1) -> float:
    """The share of 8x8-pooled cells whose largest channel difference is over ``threshold``: re-encoding
    noise averages out, an edit does not."""
    f = max(1, min(s.shape[:2]) // 32)
    return float((_channel_max(np.abs(_pool(s, f) - _pool(t, f))) > threshold).mean())


def thumbs_match(a: bytes, b: bytes, max_diff: int = THUMB_MAX_DIFF, mean_diff: float = THUMB_MEAN_DIFF) -> bool:
    """Two thumbnails of one picture: no pixel differs by more than ``max_diff``, and on average by at most
    ``mean_diff`` (:func:`thumbs_match_many` compares many at once)."""
    d = np.abs(np.frombuffer(a, np.uint8).astype(np.int16) - np.frombuffer(b, np.uint8))
    return bool(d.max() <= max_diff and d.mean() <= mean_diff)


def thumbs_match_many(rows: np.ndarray, b: np.ndarray, max_diff: int = THUMB_MAX_DIFF,
                      mean_diff: float = THUMB_MEAN_DIFF) -> np.ndarray:
    """:func:`thumbs_match` of each thumbnail of ``rows`` (``[n, L]`` uint8) with ``b`` (``[L]``): bool ``[n]``."""
    d = np.abs(rows.astype(np.int16) - b)
    return (d.max(1) <= max_diff) & (d.sum(1) / d.shape[1] <= mean_diff)  # (the mean: exact integer sums)
