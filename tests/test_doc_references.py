"""Every file and module that a docstring, ``README.md`` or ``docs/*.md`` names exists.

A name is looked up where a reader would look: the repository root, the package and each of its sub-packages
(``losses.py`` in ``training/losses/``), ``tests/``, ``benchmarks/``, ``scripts/``; and, for DiffSynth's own
files, the installed ``diffsynth`` package. Files named by a path under a top-level folder of the repository
(``deepspeed_configs/zero3.yaml``, ``docs/MEMORY.md``) must exist there, whatever their type. Dotted names
(``diffsynth_qie.models.qwen_image_edit.forward.dit_forward``) must name a module, and a name that module defines.
"""
from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import diffsynth_qie

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(diffsynth_qie.__file__).resolve().parent
# Files of other projects that the docs cite by their own path and that no installed package holds (ComfyUI,
# diffusers, DiffSynth-Studio's examples folder, Qwen-Image-Lightning's repository, the serving runtimes); everything else must
# resolve in this repository or in the installed DiffSynth.
EXTERNAL = ("comfy/", "loaders/lora_conversion_utils.py", "examples/", "generate_with_diffusers.py",
            # the LoRA runtimes of docs/LORA_RUNTIMES.md
            "src/diffusers/", "src/musubi_tuner/", "python/sglang/", "vllm_omni/", "nunchaku/",
            # the public edit benchmarks' scorers of docs/SCORECARD.md
            "step2_basic_bench.py")
# (a placeholder such as ``models/<family>/<family>_ops.py`` or ``tests/test_<name>.py`` names no file)
SOURCE = re.compile(r"(?<![\w./:>-])((?:[\w-]+/)*[\w-]+\.(?:py|sh))\b")
TOP_DIRS = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")
                  and p.name not in ("DiffSynth-Studio", "outputs"))
ROOTED = re.compile(r"(?<![\w./:-])((?:%s)/[\w./-]*\w)(?![\w./<-])" % "|".join(map(re.escape, TOP_DIRS)))
DOTTED = re.compile(r"\bdiffsynth_qie(?:\.\w+)+")


def _texts():
    """(where, text) for every docstring of the package and ``app_gradio.py``, and every document."""
    for path in [*sorted(PACKAGE.rglob("*.py")), ROOT / "app_gradio.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    yield f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 1)}", doc
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        yield str(path.relative_to(ROOT)), path.read_text()


def _installed(name: str) -> list[Path]:
    spec = importlib.util.find_spec(name)
    return [Path(spec.origin).parent] if spec and spec.origin else []


def _bases() -> list[Path]:
    packages = [p.parent for p in PACKAGE.rglob("__init__.py")]
    third_party = [d for top in _installed("diffsynth") for d in (top.parent, top, *top.rglob("*")) if d.is_dir()]
    return [ROOT, ROOT / "tests", ROOT / "benchmarks", ROOT / "scripts", *packages, *third_party]


def test_the_scan_finds_names():
    names = {m.group(1) for _, text in _texts() for m in SOURCE.finditer(text)}
    assert {"cli.py", "app_gradio.py"} <= names and "deepspeed_configs" in TOP_DIRS


def test_every_file_named_in_a_docstring_or_document_exists():
    bases = _bases()
    missing = []
    for where, text in _texts():
        for match in SOURCE.finditer(text):
            name = match.group(1)
            if not name.startswith(EXTERNAL) and not any((base / name).exists() for base in bases):
                missing.append(f"{where}: {name}")
        for match in ROOTED.finditer(text):
            name = match.group(1).rstrip(".")
            if "*" not in name and not (ROOT / name).exists():
                missing.append(f"{where}: {name}")
    assert not missing, "names of files that do not exist:\n" + "\n".join(missing)


def _module_file(dotted: str) -> Path | None:
    path = ROOT.joinpath(*dotted.split("."))
    return next((p for p in (path.with_suffix(".py"), path / "__init__.py") if p.is_file()), None)


def _defines(source: Path, name: str) -> bool:
    """``name`` is bound in the module (def, class, assignment, import) or named in its lazy table."""
    return re.search(rf"^(?:\s*)(?:def|class|async def) {name}\b|^{name}\s*[:=]|\bimport\b.*\b{name}\b|"
                     rf"[\"']{name}[\"']", source.read_text(), flags=re.M) is not None


def test_every_module_named_in_a_docstring_or_document_exists():
    missing = []
    for where, text in _texts():
        for match in DOTTED.finditer(text):
            parts = match.group(0).removesuffix(".py").split(".")
            known = max(i for i in range(1, len(parts) + 1) if _module_file(".".join(parts[:i])))
            rest = parts[known:]
            if rest and not _defines(_module_file(".".join(parts[:known])), rest[0]):
                missing.append(f"{where}: {match.group(0)}")
    assert not missing, "names of modules or attributes that do not exist:\n" + "\n".join(missing)
