"""A package's public names imported on first use: its ``__getattr__`` and ``__dir__``.

Rule: a package whose names load lazily keeps one map, ``_WHERE`` (public
name -> the module defining it), and takes its module-level ``__getattr__``
and ``__dir__`` from :func:`on_first_use` (PEP 562). A name is imported
from its module the first time it is read and then kept in the package's
namespace, so later reads cost nothing; a name the map does not hold is the
usual ``AttributeError``. For the type checker each package imports the same
names under ``TYPE_CHECKING`` (tests/kernel/test_lazy_imports.py keeps the
two in step).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, MutableMapping

__all__ = ["on_first_use"]


def on_first_use(package: str, where: Mapping[str, str], namespace: MutableMapping[str, Any]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``package``'s ``__getattr__`` and ``__dir__`` over ``where`` (module docstring);
    ``namespace`` is the package's ``globals()``."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(module), name)
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *where})

    return __getattr__, __dir__
