"""The layout rules issue 33 added to DESIGN §2's: one idea per module, no module over 800
lines, and no import cycle anywhere -- the kernel's are checked in ``test_layers.py``, the
built-in plugins' here -- walked over the AST, so a new file is held to them at once.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 800

def _sources() -> list[Path]:
    return sorted([*(ROOT / "meshkit").rglob("*.py"), *(ROOT / "plugins").rglob("*.py")])


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_is_over_800_lines(path: Path):
    name = str(path.relative_to(ROOT))
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines; split it by idea (at most {MAX_LINES})"


def _plugin_imports(path: Path, package: str, module: str) -> set[str]:
    """The modules of the same plugin package that ``path`` imports when it runs."""
    found: set[str] = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing module
                base = module.split(".")[:-node.level] if not path.name == "__init__.py" \
                    else module.split(".")[:len(module.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            found.add(target)
            found |= {f"{target}.{a.name}" for a in node.names}
    return {f for f in found if f == package or f.startswith(package + ".")}


def test_no_import_cycles_in_the_builtin_plugins():
    modules: dict[str, Path] = {}
    for path in (ROOT / "plugins").rglob("*.py"):
        parts = path.relative_to(ROOT / "plugins").with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name.split(".")[0]
        targets = {t for t in _plugin_imports(path, package, name) if t in modules}
        # A package's __init__ importing its own modules is how it registers them.
        graph[name] = {t for t in targets if t != name and not (
            path.name == "__init__.py" and t.startswith(name + "."))}
    cycles = []
    remaining = dict(graph)
    for _ in range(len(graph) + 1):  # bounded: each pass removes a cycle's edge or ends
        try:
            tuple(graphlib.TopologicalSorter(remaining).static_order())
            break
        except graphlib.CycleError as exc:
            cycle = exc.args[1]
            cycles.append(cycle)
            remaining = {k: v - {cycle[1]} if k == cycle[0] else v for k, v in remaining.items()}
    assert cycles == [], f"import cycles among the built-in plugins: {cycles}"
