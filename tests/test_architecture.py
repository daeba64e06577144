"""The shape of the package: one-way layers, no import cycles, small modules.

Layers, lowest first: ``utils`` < ``models`` < ``tiny`` < ``lora``, ``memory``, ``metrics`` < ``fakegpu`` < ``data``
< ``cache`` < ``training`` < ``inference`` < ``preflight`` < ``ui`` < ``commands`` / ``cli``. A module may import from its own layer and the
ones below (packages sharing a layer may import each other, without cycles); imports inside functions count the
same as top-level ones (they are edges all the same, only later).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "diffsynth_qie"
LAYERS = [("utils",), ("models",), ("tiny",), ("lora", "memory", "metrics"), ("fakegpu",), ("data",), ("cache",),
          ("training",), ("inference",), ("preflight",), ("ui",), ("commands",)]
MAX_LINES = 350


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package that ``path`` imports (anywhere in the file)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` imports the submodule pkg.sub where one exists
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import diffsynth_qie.tiny.build.X` -> the module part
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def layer(name: str) -> int:
    parts = name.split(".")
    if len(parts) == 1 or parts[1] in ("cli", "__main__"):
        return len(LAYERS)  # the package root and the CLI sit on top
    return next(i for i, packages in enumerate(LAYERS) if parts[1] in packages)


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {n: imports_of(n, p, set(mods)) for n, p in mods.items()}


def test_every_module_has_a_layer():
    for name in modules():
        assert layer(name) >= 0, name  # layer() raises StopIteration for a package missing from LAYERS


def test_no_module_imports_upward():
    upward = sorted(f"{a} -> {b}" for a, deps in import_graph().items() for b in deps
                    if b != "diffsynth_qie" and layer(b) > layer(a))
    assert not upward, "upward imports (see LAYERS; utils, models, tiny, lora/memory/metrics below the data flow):\n" \
        + "\n".join(upward)


def test_no_import_cycles():
    graph = import_graph()
    # package __init__ files that only re-export their own submodules form no real cycle with them
    graph = {a: {b for b in deps if not (a.startswith(b + ".") and modules()[b].name == "__init__.py")}
             for a, deps in graph.items()}
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checker_sees_function_level_and_relative_imports(tmp_path):
    """The graph must catch what the rules are about, or the tests above prove nothing."""
    graph = import_graph()
    assert "diffsynth_qie.models.presets" in graph["diffsynth_qie.models.load.loading"]  # relative, top level
    src = "def f():\n    from ..inference.editor import Editor\n"
    fake = tmp_path / "x.py"
    fake.write_text(src)
    got = imports_of("diffsynth_qie.training.x", fake, set(modules()))
    assert got == {"diffsynth_qie.inference.editor"}
    assert layer("diffsynth_qie.inference.editor") > layer("diffsynth_qie.training.x")


def test_no_module_over_350_lines():
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py"), ROOT / "app_gradio.py"]
    long = sorted(f"{p.relative_to(ROOT)}: {n} lines" for p in files
                  if (n := len(p.read_text().splitlines())) > MAX_LINES)
    assert not long, f"modules over {MAX_LINES} lines (split them by job):\n" + "\n".join(long)
