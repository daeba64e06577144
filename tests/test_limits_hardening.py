"""Documented limits enforced by name, and library messages in our words: the family's reference limit, a
--model_dir of the other family, `qie plan --verify_blocks 0`, `--mixed` without `--verify`."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image


def test_more_references_than_the_family_takes_are_refused(tmp_path, capfd):
    from diffsynth_qie.cli import main
    from diffsynth_qie.models.family import EDIT, QWEN21

    img = tmp_path / "a.png"
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(img)
    for model, family in (("tiny", EDIT), ("tiny-2.1", QWEN21)):
        n = family.max_references + 1
        argv = ["edit", "--model", model, "--prompt", "x", "--out", str(tmp_path / "o.png")]
        assert main(argv + [a for _ in range(n) for a in ("--image", str(img))]) == 2
        err = capfd.readouterr().err
        assert f"{n} reference images (--image)" in err and f"takes at most {family.max_references}" in err


def test_a_model_dir_of_the_other_family_is_named(tiny_model_dir, tiny21_dir):
    from diffsynth_qie.models.load.loading import load_pipeline

    with pytest.raises(ValueError, match="holds a Qwen-Image-Edit DiT, but --model tiny-2.1 is Qwen-Image-2.1"):
        load_pipeline("tiny-2.1", model_dir=tiny_model_dir, components=("dit",), device="cpu")
    with pytest.raises(ValueError, match="holds a Qwen-Image-2.1 DiT, but --model tiny is Qwen-Image-Edit"):
        load_pipeline("tiny", model_dir=tiny21_dir, components=("dit",), device="cpu")


def test_plan_verify_blocks_0_and_mixed_without_verify(capfd):
    from diffsynth_qie.cli import main

    with pytest.raises(SystemExit):
        main(["plan", "--verify", "--verify_blocks", "0"])
    assert "--verify_blocks" in capfd.readouterr().err
    assert main(["plan", "--model", "2511", "--mixed"]) == 2
    assert "--mixed shapes the batch of the --verify run" in capfd.readouterr().err
