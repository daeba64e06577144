"""Layout rules for the LoRA, image and UI modules: one job each, small, no duplicated helpers."""
from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import diffsynth_qie

PACKAGE = Path(diffsynth_qie.__file__).resolve().parent
MAX_LINES = 400


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def test_lora_and_ui_modules_are_small():
    checked = [p for p in _modules() if p.name.startswith("lora_") or p.parent.name == "ui"
               or p.name in ("images.py", "encoding.py", "editor.py")]
    assert {p.name for p in checked} >= {"lora_io.py", "lora_format.py", "lora_apply.py", "lora_manager.py",
                                        "lora_export.py", "lora_state.py", "handlers.py", "uploads.py"}
    too_long = {str(p.relative_to(PACKAGE)): n for p in checked if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert too_long == {}


def test_shared_helpers_are_defined_once():
    defined = Counter()
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in ("side_by_side", "_help", "cli_help"):
                defined[node.name] += 1
    assert defined == {"side_by_side": 1, "cli_help": 1}


def test_lora_public_names_still_importable_from_lora_io():
    from diffsynth_qie.models import lora_io

    for name in lora_io.__all__:
        assert getattr(lora_io, name) is not None
    from diffsynth_qie.models.lora_export import save_lora
    from diffsynth_qie.models.lora_manager import LoraManager
    assert lora_io.save_lora is save_lora and lora_io.LoraManager is LoraManager
