"""The task contract: a user's model and data, and how one is found by name.

A task is any object with the methods of :class:`Task`. It is selected in a
config as ``[run] task = NAME``, where ``NAME`` is either a registered task
(``meshkit plugins --kind task``) or ``"module:attribute"``. The attribute is
a task factory (a class or function) or a :class:`meshkit.Component`; a
factory with an attrs ``Options`` attribute receives the ``[task]`` table
structured into it, one without is called with no arguments.

Every node builds its own copy of the task from the same name and options, so
the data never travels: the coordinator tells a worker *which shard* to fit,
not what is in it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import threading
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence, runtime_checkable

import attrs

from meshkit import plugins
from meshkit.components import Component
from meshkit.errors import ConfigError, MeshError
from meshkit.options import structure_options

if TYPE_CHECKING:
    import numpy as np

__all__ = ["FitResult", "Task", "import_reference", "resolve_task_component", "create_task",
           "build_task", "check_task", "accepts_data", "has_held_out", "buffer_keys",
           "key_groups", "reference_of", "importing_script"]

#: The methods every task has; the rest are needed only by the strategies that use them.
REQUIRED = ("init_state", "train_data", "fit", "evaluate")
OPTIONAL = {
    "gradients": "data-parallel",
    "apply": "data-parallel",
    "stages": "model-parallel",
    "run_stage": "model-parallel",
}


@attrs.frozen
class FitResult:
    """What a fit (or a gradient computation) on one shard produced.

    ``examples`` is the realized work (examples processed), which is the
    weight ``fedavg`` gives this contribution.
    """

    state: Mapping[str, Any]
    examples: int
    metrics: Mapping[str, float] = attrs.Factory(dict)


@runtime_checkable
class Task(Protocol):
    """A model and its data, as meshkit drives them.

    States are mappings ``name -> numpy array | JSON value``.
    """

    def init_state(self, seed: int) -> dict[str, Any]:
        """The initial model, a pure function of ``seed`` (every node agrees)."""

    def train_data(self) -> tuple[np.ndarray, np.ndarray]:
        """Training inputs and targets, rows paired; strategies shard them."""

    def fit(self, state: Mapping[str, Any], x: np.ndarray, y: np.ndarray, *,
            seed: int) -> FitResult:
        """Train from ``state`` on one shard; deterministic given ``seed``."""

    def evaluate(self, state: Mapping[str, Any]) -> dict[str, float]:
        """Held-out metrics (``loss``, ``accuracy``, ...) of ``state``."""

    # Optional, what the state's keys are (docs/tasks.md):
    #   buffers() -> Iterable[str]              (keys that are statistics, not
    #                                            parameters: outer optimizers
    #                                            never step them)
    #   key_groups() -> Mapping[str, Iterable[str]]  (named key sets that
    #                                            [strategy] local_keys can name
    #                                            as "@group", e.g. "norm")
    # Optional, for evaluation on the clients ([strategy] evaluate = "clients"):
    #   test_data() -> (x, y)                   (this node's held-out examples)
    #   evaluate(state, x=None, y=None)         (metrics on some of them: one
    #                                            simulated client's share; a
    #                                            figure "examples" says over how
    #                                            many examples they are, when not
    #                                            len(y): a client that reads its
    #                                            own data, as a Flower client)
    # Optional, per strategy:
    #   gradients(state, x, y) -> FitResult     (data-parallel)
    #   apply(state, gradients) -> state        (data-parallel, diloco)
    #   load_replica(state, optimizer_state=None) -> state
    #                                           (diloco: the replica's model moved,
    #                                            its inner optimizer kept, reset or
    #                                            loaded; docs/tasks.md)
    #   optimizer_state() -> state              (diloco: the inner optimizer's
    #                                            state, to heal a newcomer)
    #   stages() -> Sequence[str]               (model-parallel: the graph, in order)
    #   run_stage(state, node, x) -> activation (model-parallel)


def buffer_keys(task: Any) -> frozenset[str]:
    """The state keys ``task`` marks as buffers (``task.buffers()``; none when it has no such method).

    Integer and bool arrays need no marking: they are never stepped. A numpy
    task's float arrays are all parameters unless its ``buffers()`` says otherwise.
    """
    buffers = getattr(task, "buffers", None)
    if not callable(buffers):
        return frozenset()
    return frozenset(str(k) for k in buffers())


def key_groups(task: Any) -> dict[str, frozenset[str]]:
    """The named key sets ``task.key_groups()`` offers (``"norm"`` for ``"@norm"``), or none."""
    groups = getattr(task, "key_groups", None)
    if not callable(groups):
        return {}
    return {str(name): frozenset(map(str, keys)) for name, keys in dict(groups()).items()}


def has_held_out(task: Any) -> bool:
    """Whether the task can say what its held-out data is (``test_data()``)."""
    return callable(getattr(task, "test_data", None))


def accepts_data(task: Any) -> bool:
    """Whether ``task.evaluate`` takes the examples to evaluate on: ``evaluate(state, x, y)``."""
    try:
        signature = inspect.signature(task.evaluate)
    except (TypeError, ValueError):
        return False
    try:
        signature.bind(None, None, None)
    except TypeError:
        return False
    return True


def import_reference(reference: str) -> Any:
    """The object at ``"module:attribute"``, the current directory importable (as ``python -m``).

    Every failure (no such module, a module that imports something missing or
    raises, no such attribute) is a :class:`ConfigError` saying which.
    """
    module_name, _, attribute = reference.rpartition(":") if _is_script(
        reference.rpartition(":")[0]) else reference.partition(":")
    if not module_name or not attribute:
        raise ConfigError(
            f"task {reference!r}: expected a registered task name or 'module:attribute'")
    _current_directory_importable()
    try:
        obj: Any = (_import_script(module_name) if _is_script(module_name)
                    else importlib.import_module(module_name))
    except ModuleNotFoundError as exc:
        if exc.name and not _is_or_contains(exc.name, module_name):
            # The task module was found; something it imports was not.
            raise ConfigError(
                f"task {reference!r}: module {module_name!r} imports {exc.name!r}, which is "
                f"not installed ({exc}); install it on every node") from exc
        raise ConfigError(
            f"task {reference!r}: cannot import module {module_name!r} ({exc}); it must be "
            f"importable from the current directory ({os.getcwd()}) or PYTHONPATH on every "
            f"node") from None
    except Exception as exc:  # the user's module raised while importing
        raise ConfigError(
            f"task {reference!r}: cannot import module {module_name!r}: importing it "
            f"raised {type(exc).__name__}: {exc}") from exc
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(
                f"task {reference!r}: module {module_name!r} has no attribute "
                f"{attribute!r}") from None
    return obj


def _is_script(module_name: str) -> bool:
    """Whether a reference's module part is a script's path (``/work/train.py``)."""
    return module_name.endswith(".py")


#: Held while a script is imported by reference (:func:`importing_script`).
_SCRIPT = threading.local()


def importing_script() -> str:
    """The script being imported by reference on this thread ("" when none is).

    A script that calls ``meshkit.run`` outside ``if __name__ == "__main__":``
    would start a run again in every worker that imports it; the runner asks
    this and refuses, saying so.
    """
    return getattr(_SCRIPT, "path", "")


def _import_script(path: str) -> Any:
    """A script (the file behind a ``__main__`` object) as a module, its main block not run.

    The script that is running (this process's ``__main__``) is itself, never
    run twice; elsewhere (a worker) the file is executed once under a name of
    its own, as ``multiprocessing``'s spawn does, so ``if __name__ ==
    "__main__":`` keeps its run from starting again there.
    """
    path = os.path.abspath(path)
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    if main_file and os.path.abspath(main_file) == path:
        return main
    name = "__meshkit_script__" + "".join(c if c.isalnum() else "_" for c in path)
    if name in sys.modules:
        return sys.modules[name]
    if not os.path.isfile(path):
        raise ModuleNotFoundError(f"no script {path}", name=path)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    directory = os.path.dirname(path)
    if directory not in sys.path:  # as Python does for the script it runs
        sys.path.insert(0, directory)
    sys.modules[name] = module
    _SCRIPT.path = path
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        _SCRIPT.path = ""
    return module


def reference_of(obj: Any, where: str = "[run] task") -> str:
    """The ``"module:attribute"`` by which worker processes import ``obj`` (a task given as an
    object to :func:`meshkit.run`), or a :class:`ConfigError` saying what to do instead.

    ``obj`` must be a module-level name (searched in ``__main__`` first, then
    in its own module). One defined in a running script becomes
    ``"/path/script.py:name"``: workers import the script without running its
    ``if __name__ == "__main__":`` block. One defined in a notebook or an
    interactive session has no file any process could import.
    """
    label = getattr(obj, "__qualname__", None) or getattr(obj, "name", None) or type(obj).__name__
    own = getattr(obj, "__module__", None) if (inspect.isclass(obj) or inspect.isroutine(obj)) \
        else None
    for module_name in dict.fromkeys(["__main__", *([own] if own else [])]):
        module = sys.modules.get(module_name)
        names = [n for n, v in vars(module).items() if v is obj] if module is not None else []
        if not names:
            continue
        attribute = getattr(obj, "__name__", None) if getattr(obj, "__name__", None) in names \
            else names[0]
        if module_name != "__main__":
            return f"{module_name}:{attribute}"
        script = getattr(module, "__file__", None)
        if not script or not os.path.isfile(script):
            raise ConfigError(
                f"{where}: {label} is defined in a notebook (or an interactive session), "
                f"which worker processes cannot import; move it into a .py file beside the "
                f"notebook and import it from there (from mytask import {attribute}), then "
                f"pass that object or \"mytask:{attribute}\"")
        return f"{os.path.abspath(script)}:{attribute}"
    raise ConfigError(
        f"{where}: {label} is not a module-level name that worker processes can import; "
        f"assign it to a name at the top level of your script or module (task = ...) and "
        f"pass that, or pass \"module:attribute\"")


def _is_or_contains(missing: str, module_name: str) -> bool:
    """Whether ``missing`` is ``module_name`` itself or one of its parent packages."""
    return module_name == missing or module_name.startswith(missing + ".")


def _current_directory_importable() -> None:
    """Put the current directory on ``sys.path``, as ``python -m`` does.

    A ``"module:attribute"`` task is found from the current directory
    (DESIGN §4), whether meshkit was started as ``meshkit`` (whose script
    directory is what Python puts first) or as ``python -m meshkit``.
    """
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)


def resolve_task_component(name: str, pset: Any = None) -> Component:
    """The :class:`Component` behind a task name or ``module:attribute``."""
    if ":" in name:
        obj = import_reference(name)
        if isinstance(obj, Component):
            return obj
        if not callable(obj):
            raise ConfigError(
                f"task {name!r} is a {type(obj).__name__}, not a task factory; point it at "
                f"a class or function that builds the task")
        options = getattr(obj, "Options", None)
        if options is not None and not attrs.has(options):
            options = None
        return Component(name, obj, options=options, summary="selected by module reference")
    if pset is None:
        pset = plugins.default()
    return pset.registry.get("task", name)


def create_task(name: str, options: Mapping[str, Any] | Any = None, pset: Any = None) -> Any:
    """Build the task ``name`` with its ``[task]`` table (a mapping or options object)."""
    component = resolve_task_component(name, pset)
    if component.options is None or not isinstance(options, component.options):
        options = structure_options(component, dict(options or {}), where="[task]")
    return check_task(build_task(component, options, name), name)


def build_task(component: Component, options: Any, name: str) -> Any:
    """Call a task factory; whatever it raises becomes a :class:`ConfigError` naming it."""
    try:
        return component.build(options)
    except MeshError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"task {name!r}: building it raised {type(exc).__name__}: {exc}") from exc


def check_task(task: Any, name: str = "task", needs: Sequence[str] = ()) -> Any:
    """Refuse a task that lacks a method the run will call (before anything starts)."""
    missing = [m for m in (*REQUIRED, *needs) if not callable(getattr(task, m, None))]
    if missing:
        why = "; ".join(
            f"{m}()" + (f" (needed by {OPTIONAL[m]})" if m in OPTIONAL else "") for m in missing)
        raise ConfigError(
            f"task {name!r} ({type(task).__name__}) is missing {why}. A task needs "
            f"{', '.join(REQUIRED)}; see docs/tasks.md")
    return task
