"""The import rules of DESIGN §2, checked by walking every kernel module's AST.

* The kernel (``meshkit/``) never imports a plugin (``meshkit_*``).
* A lower layer never imports a higher one, at module level, inside a
  function, or under ``TYPE_CHECKING`` -- except that the hook contract
  (``meshkit.hookspecs``) names the types its hooks are called with
  (``Config``, ``NodeCaps``, ``RoundReport``) under ``TYPE_CHECKING``: for the
  type checker only, never executed.
* No import cycles between kernel modules (imports that run; ``TYPE_CHECKING``
  ones do not).
* A function-local import is only for a heavy optional third-party library.
* Built-in plugins import only meshkit's public API: a package or module
  that is not ``_private``, and only names it lists in ``__all__``.

The layers are listed here once; a new kernel module must be given one, so
the layout stays a decision rather than an accident.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNEL = ROOT / "meshkit"
PLUGINS = ROOT / "plugins"

#: Low to high; a module may import its own layer (without cycles) and lower ones.
LAYERS: list[tuple[str, ...]] = [
    ("meshkit.errors", "meshkit.components"),
    ("meshkit.state", "meshkit.options", "meshkit.hookspecs", "meshkit.plugins",
     "meshkit.registry", "meshkit.checkpoint", "meshkit.safetensors", "meshkit._atomic",
     "meshkit._npz",
     "meshkit._lazy",
     "meshkit.spill",
     "meshkit.exporter", "meshkit.transport_traits"),
    ("meshkit.wire",),
    ("meshkit.transport",),
    ("meshkit.aggregation", "meshkit.outer", "meshkit.partitioner", "meshkit.attack",
     "meshkit.privacy", "meshkit.simulation", "meshkit.secure_aggregation", "meshkit.compression"),
    ("meshkit.node", "meshkit.task", "meshkit.population"),
    ("meshkit.train", "meshkit.pipeline", "meshkit.config", "meshkit.torch", "meshkit.flower"),
    ("meshkit.service",),
    ("meshkit.cli",),
    ("meshkit.testing", "meshkit", "meshkit.__main__"),
]

#: Modules allowed to name a higher layer's types under ``TYPE_CHECKING`` (module doc).
TYPES_FROM_ABOVE = {"meshkit.hookspecs"}

#: Third-party libraries heavy enough, and optional enough, to import late.
HEAVY_OPTIONAL = {"torch", "matplotlib"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _kernel_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(KERNEL.rglob("*.py"))}


def _layer(module: str) -> int:
    best, where = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, where = len(prefix), index
    return where


def _imports(path: Path, module: str) -> list[tuple[str, int, bool, list[str]]]:
    """(imported module, line, function-local?, names) for every import in a file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, int, bool, list[str]]] = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.append((alias.name, child.lineno, local, []))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - (child.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                names = [a.name for a in child.names]
                found.append((base, child.lineno, local, names))
                # "from meshkit import wire" imports the submodule meshkit.wire.
                for name in names:
                    candidate = f"{base}.{name}"
                    if (KERNEL.parent / Path(*candidate.split("."))).with_suffix(".py").exists() \
                            or (KERNEL.parent / Path(*candidate.split(".")) / "__init__.py").exists():
                        found.append((candidate, child.lineno, local, []))
            visit(child, inner)

    visit(tree, False)
    return found


def _type_checking_lines(path: Path) -> set[int]:
    """Lines of the imports under ``if TYPE_CHECKING:`` in a file (never executed)."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        test = node.test if isinstance(node, ast.If) else None
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            lines |= {n.lineno for child in node.body for n in ast.walk(child)
                      if isinstance(n, (ast.Import, ast.ImportFrom))}
    return lines


def _kernel_target(name: str, modules: dict[str, Path]) -> str | None:
    """The kernel module an import resolves to (the longest existing prefix)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


MODULES = _kernel_modules()


def test_every_kernel_module_has_a_layer():
    unplaced = [m for m in MODULES if _layer(m) < 0]
    assert unplaced == [], f"give these modules a layer in LAYERS: {unplaced}"


def test_the_kernel_never_imports_a_plugin():
    offences = [f"{m}:{line} imports {name}"
                for m, path in MODULES.items()
                for name, line, _, _ in _imports(path, m)
                if name.split(".")[0].startswith("meshkit_")]
    assert offences == []


def test_no_lower_layer_imports_a_higher_one():
    offences = []
    for module, path in MODULES.items():
        types_only = _type_checking_lines(path) if module in TYPES_FROM_ABOVE else set()
        for name, line, _, _ in _imports(path, module):
            target = _kernel_target(name, MODULES)
            if target is None or target == "meshkit" or line in types_only:
                continue
            if _layer(target) > _layer(module):
                offences.append(f"{module}:{line} (layer {_layer(module)}) imports {target} "
                                f"(layer {_layer(target)})")
    assert offences == [], "\n".join(offences)


def test_function_local_imports_are_only_for_heavy_optional_libraries():
    offences = [f"{m}:{line} imports {name} inside a function"
                for m, path in MODULES.items()
                for name, line, local, _ in _imports(path, m)
                if local and name.split(".")[0] not in HEAVY_OPTIONAL]
    assert offences == [], "\n".join(offences)


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        types_only = _type_checking_lines(path)
        for name, line, _, _ in _imports(path, module):
            target = _kernel_target(name, MODULES)
            if target is not None and target != module and line not in types_only:
                graph[module].add(target)
    return graph


def test_the_membership_module_imports_nothing_of_meshkit():
    """Whoever owns a membership (the group's ledger, a pool, a host relay) can use it:
    it is a leaf, so deciding who is dead never depends on how bytes move."""
    path = KERNEL / "transport" / "_membership.py"
    kernel = [m for m, *_ in _imports(path, "meshkit.transport._membership")
              if m.split(".")[0] == "meshkit"]
    assert kernel == [], kernel


def test_no_import_cycles():
    graph = _graph()
    # The top-level package re-exports; cycles through it are its lazy map's business.
    for edges in graph.values():
        edges.discard("meshkit")
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def strongconnect(v: str) -> None:  # Tarjan, bounded by the module count
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            strongconnect(v)
    assert cycles == [], f"import cycles: {cycles}"


def _public_names(module: str) -> set[str] | None:
    mod = importlib.import_module(module)
    names = getattr(mod, "__all__", None)
    return None if names is None else set(names)


def _plugin_files() -> list[Path]:
    return sorted(PLUGINS.rglob("*.py"))


@pytest.mark.parametrize("path", _plugin_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_builtin_plugins_import_only_public_names(path: Path):
    module = ".".join(path.relative_to(PLUGINS).with_suffix("").parts)
    offences = []
    for name, line, _, names in _imports(path, module):
        if not (name == "meshkit" or name.startswith("meshkit.")):
            continue
        if any(part.startswith("_") for part in name.split(".")):
            offences.append(f"line {line}: {name} is private")
            continue
        try:
            public = _public_names(name)
        except ImportError as exc:  # meshkit.torch without torch: checked where it imports
            pytest.skip(f"{name} needs an optional library here: {exc}")
        for imported in names:
            submodule = f"{name}.{imported}"
            if _kernel_target(submodule, MODULES) == submodule:
                if imported.startswith("_"):
                    offences.append(f"line {line}: {submodule} is private")
                continue
            if public is None or imported not in public:
                offences.append(f"line {line}: {name}.{imported} is not in {name}.__all__")
    assert offences == [], "\n".join(offences)
