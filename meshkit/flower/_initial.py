"""The initial model, given the way a Flower user gives it to their ``ServerApp``.

``[task] initial = "module:attribute"`` names a callable (or a class) whose
result is the initial model. A ``ServerApp`` builds it (``Net()``) and hands
``ArrayRecord(net.state_dict())`` to ``strategy.start(initial_arrays=...)``;
meshkit calls the same callable once per run on the coordinator, after
seeding ``random``, numpy's global RNG and torch (when imported) with
``[run] seed``, so every run of the same config starts from the same model.

What the callable may return, each made into a Flower ``ArrayRecord`` the way
Flower itself would (:func:`as_array_record`):

* a torch ``nn.Module``: its ``state_dict()``;
* a ``state_dict`` (names to torch tensors or numpy arrays);
* a Flower ``ArrayRecord``, as it is;
* a list (or tuple) of arrays: Flower's ``ArrayRecord(list)``, keys ``"0"``, ``"1"``, ...
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np
from flwr.app import Array, ArrayRecord

from meshkit.errors import ConfigError
from meshkit.task import import_reference

__all__ = ["load_initial", "as_array_record"]

_WHAT = ("a torch nn.Module, a state_dict, a Flower ArrayRecord or a list of arrays "
         "(what your ServerApp passes to strategy.start as initial_arrays)")


def load_initial(reference: str) -> Callable[[], Any]:
    """The callable ``[task] initial`` names (refused, naming the key, when it is not one)."""
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError(f"[task] initial = {reference!r}: expected \"module:attribute\" "
                          f"naming a callable (or class) that returns the initial model")
    obj = import_reference(reference)
    if not callable(obj):
        raise ConfigError(
            f"[task] initial = {reference!r} is a {type(obj).__name__}, not a callable: name "
            f"the function (or class) that builds the initial model, e.g. \"pkg.task:Net\", "
            f"so that every run builds it afresh from the seed")
    return obj


def as_array_record(model: Any, where: str) -> ArrayRecord:
    """``model`` (see the module docstring) as the ``ArrayRecord`` Flower would send."""
    if isinstance(model, ArrayRecord):
        record = model
    elif callable(getattr(model, "state_dict", None)):  # a torch nn.Module
        record = ArrayRecord(model.state_dict())
    elif isinstance(model, Mapping):
        values = list(model.values())
        if values and all(isinstance(v, np.ndarray) for v in values):
            record = ArrayRecord({str(k): Array(np.asarray(v)) for k, v in model.items()})
        else:
            try:  # names to torch tensors: Flower's own conversion
                record = ArrayRecord(dict(model))
            except TypeError as exc:
                raise ConfigError(f"{where} returned a mapping that is not a state_dict "
                                  f"({exc}); it should return {_WHAT}") from None
    elif isinstance(model, (list, tuple)) and all(isinstance(v, np.ndarray) for v in model):
        record = ArrayRecord(list(model))
    else:
        raise ConfigError(f"{where} returned a {type(model).__name__}; it should return "
                          f"{_WHAT}")
    if not record:
        raise ConfigError(f"{where} returned a model with no arrays; it should return {_WHAT}")
    return record
