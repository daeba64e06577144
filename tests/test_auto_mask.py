"""`qie cache --auto_mask diff`: rows without a mask get the region where target and source differ (blurred,
thresholded, dilated), marked as derived; rows with a mask keep theirs; off, nothing changes."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image


def test_the_derived_region_is_the_changed_square_with_its_margin():
    from diffsynth_qie.data.automask import AutoMask, diff_mask

    source = Image.new("RGB", (96, 64), (200, 200, 200))
    target = source.copy()
    target.paste(Image.new("RGB", (16, 12), (20, 20, 220)), (40, 20))  # the edit: a square turned blue
    mask = np.asarray(diff_mask(target, source, AutoMask(blur=1.0, threshold=0.1, dilate=4))) > 127
    rows, cols = np.nonzero(mask)
    assert mask[20:32, 40:56].all()  # the whole square
    assert 20 - 6 <= rows.min() <= 20 - 3 and 31 + 3 <= rows.max() <= 31 + 6  # plus the 4 px margin (± blur)
    assert 40 - 6 <= cols.min() <= 40 - 3 and 55 + 3 <= cols.max() <= 55 + 6
    assert not mask[:, :30].any() and not mask[:, 70:].any()  # nothing where the pair agrees
    with pytest.raises(ValueError, match="threshold 1.5 in \\(0, 1\\)"):
        AutoMask(threshold=1.5)


def test_cache_derives_masks_only_for_rows_without_one(demo_data_dir, tiny_pipe, tmp_path):
    from diffsynth_qie.cache.store import CacheStore
    from diffsynth_qie.cache.writer import CacheConfig, write_cache
    from diffsynth_qie.data.formats import DatasetConfig

    rows = json.loads((Path(demo_data_dir) / "metadata.json").read_text())[:4]
    for r in rows[:2]:
        r.pop("back_mask", None)  # two rows lose their mask
    (tmp_path / "m.json").write_text(json.dumps(rows))
    (tmp_path / "images").symlink_to(Path(demo_data_dir) / "images")
    common = dict(model="tiny", max_pixels=64 * 64, num_workers=1, device="cpu", dtype="float32",
                  dataset=DatasetConfig(dataset_metadata=str(tmp_path / "m.json")))
    write_cache(CacheConfig(cache_dir=str(tmp_path / "plain"), **common), pipe=tiny_pipe)
    write_cache(CacheConfig(cache_dir=str(tmp_path / "auto"), auto_mask="diff", **common), pipe=tiny_pipe)
    plain, auto = CacheStore.open(tmp_path / "plain"), CacheStore.open(tmp_path / "auto")
    assert [plain.meta(i).has_back_mask for i in range(4)] == [False, False, True, True]
    assert [auto.meta(i).has_back_mask for i in range(4)] == [True, True, True, True]
    assert [auto.meta(i).mask_derived for i in range(4)] == [True, True, False, False]
    assert auto.manifest["auto_mask"] == {"blur": 2.0, "threshold": 0.1, "dilate": 8} and plain.manifest["auto_mask"] is None
    for i in (2, 3):  # a row's own mask is kept as it is
        assert (auto.load(i).back_mask == plain.load(i).back_mask).all()
    derived = auto.load(0).back_mask
    assert 0 < float(derived.mean()) < 1  # a region, not everything or nothing
