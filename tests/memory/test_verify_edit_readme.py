"""No false alarms: every ``qie edit`` example of the README passes its preflight with its real preset and flags
(its files stood in by blank images and LoRA files shaped as real ones of the preset: two full-width blocks' keys at
rank 32, read and attached by the LoRA manager, then switched), the memory verdict on an 80 GB GPU."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from PIL import Image

from edit_planting import qwen21_verified

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_edit_examples() -> list[list[str]]:
    """The ``qie edit`` command lines of the README's bash blocks (continuations joined, comments dropped)."""
    examples = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:2] == ["qie", "edit"]:
                examples.append(words[2:])
    return examples


class Loaded(Exception):
    """Raised where the real model would load: the preflight has passed."""


def stand_in_files(argv: list[str], tmp: Path) -> list[str]:
    """``argv`` with its files made in ``tmp``: a 1024x768 image, a mask, a rank-32 LoRA of the ``--model`` preset
    shaped as a real one (its first two blocks: what the preflight attaches), outputs."""
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.preflight.lora_files import standin_lora_file

    model = argv[argv.index("--model") + 1] if "--model" in argv else "tiny"
    out, flags = [], iter(argv)
    for word in flags:
        out.append(word)
        if word in ("--image", "--mask", "--lora", "--out", "--model_dir"):
            path = tmp / Path(next(flags)).name
            if word == "--image":
                Image.new("RGB", (1024, 768), (40, 90, 160)).save(path)
            elif word == "--mask":
                Image.new("L", (1024, 768), 255).save(path)
            elif word == "--lora":
                standin_lora_file(get_preset(model), path, rank=32, blocks=2)
            out.append(str(path))
    return out


@pytest.mark.parametrize("argv", readme_edit_examples(), ids=lambda a: " ".join(a[:2]))
def test_the_readme_edit_examples_pass_their_preflight(argv, tmp_path, monkeypatch):
    from diffsynth_qie.cli import build_parser
    from diffsynth_qie.commands import edit
    from diffsynth_qie.inference import editor
    from diffsynth_qie.preflight import edit as verify_preflight
    from diffsynth_qie.models.presets import family_of, get_preset

    args = build_parser().parse_args(["edit", *stand_in_files(argv, tmp_path), "--gpu_memory_gb", "80"])
    ran = []
    real = verify_preflight.preflight
    monkeypatch.setattr(verify_preflight, "preflight", lambda *a, **k: ran.append(real(*a, **k)))
    monkeypatch.setattr(editor.Editor, "from_preset", classmethod(lambda *a, **k: (_ for _ in ()).throw(Loaded())))
    with qwen21_verified():
        with pytest.raises(Loaded):
            edit.run(args)
        preset = get_preset(args.model)
        assert len(ran) == (0 if preset.is_tiny or not family_of(preset).fullsize_verify else 1)
