"""A row with more references than the model family takes (3 for Qwen-Image-Edit 2509/2511, 10 for 2.1) is a
logged skip naming the row in the cache, not a failure later in DiffSynth."""
from __future__ import annotations

import json
import logging

import pytest
from PIL import Image


@pytest.mark.parametrize("model, allowed", [("2511", 3), ("2.1", 10)])
def test_too_many_references_are_a_logged_skip_naming_the_row(tmp_path, caplog, model, allowed):
    from diffsynth_qie.cache.config import CacheConfig
    from diffsynth_qie.cache.ranks import rank_rows
    from diffsynth_qie.data.formats import DatasetConfig
    from diffsynth_qie.models.presets import get_preset

    for i in range(allowed + 2):
        Image.new("RGB", (64, 64), (i * 20, 0, 0)).save(tmp_path / f"{i}.png")
    refs = [f"{i}.png" for i in range(1, allowed + 2)]
    rows = [{"prompt": "ok", "image": "0.png", "edit_image": refs[:allowed]},
            {"prompt": "too many", "image": "0.png", "edit_image": refs}]
    (tmp_path / "metadata.json").write_text(json.dumps(rows))
    config = CacheConfig(cache_dir=str(tmp_path / "c"), model=model,
                         dataset=DatasetConfig(dataset_metadata=str(tmp_path / "metadata.json")))
    with caplog.at_level(logging.WARNING):
        share = rank_rows(config, get_preset(model), 0, 1)
    assert [r.num_sources for r in share.good] == [allowed]
    (skip,) = share.skipped
    assert f"{allowed + 1} reference images, but {model} takes at most {allowed}" in skip.reason
    assert any(skip.row_id in r.getMessage() and "takes at most" in r.getMessage() for r in caplog.records)


def test_the_editor_refuses_more_references_than_the_family_takes(tiny_pipe):
    """The UI and `qie eval-edits` edit through ``Editor`` too: the limit is the editor's, not only `qie edit`'s."""
    from diffsynth_qie.inference.editor import Editor, EditRequest

    editor = Editor(tiny_pipe)
    limit = editor.family.max_references
    images = [Image.new("RGB", (32, 32), (i * 40, 0, 0)) for i in range(limit + 1)]
    with pytest.raises(ValueError, match=f"{limit + 1} reference images: .* takes at most {limit}"):
        editor.edit(EditRequest(images=images, prompt="edit", steps=1))
