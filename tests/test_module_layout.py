"""Layout rules beyond tests/test_architecture.py (layers, cycles, module size): no duplicated helpers, and
the LoRA modules' public names are importable from the ``lora`` package."""
from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import diffsynth_qie

PACKAGE = Path(diffsynth_qie.__file__).resolve().parent


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def test_shared_helpers_are_defined_once():
    defined = Counter()
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in ("side_by_side", "_help", "cli_help"):
                defined[node.name] += 1
    assert defined == {"side_by_side": 1, "cli_help": 1}


def test_lora_public_names_importable_from_the_lora_package():
    from diffsynth_qie import lora as lora_io

    for name in lora_io.__all__:
        assert getattr(lora_io, name) is not None
    from diffsynth_qie.lora.export import save_lora
    from diffsynth_qie.lora.manager import LoraManager
    assert lora_io.save_lora is save_lora and lora_io.LoraManager is LoraManager
