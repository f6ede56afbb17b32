"""A meshkit task made of a torch model factory, a loss, an optimizer factory and data.

:func:`task` returns a :class:`meshkit.Component`, so a module attribute set
to it is selectable as ``[run] task = "module:attribute"``, with the
``[task]`` table structured into its options class (:class:`TorchOptions` or
a subclass).

How the task contract maps onto torch:

* ``train_data()`` returns the training set's *row numbers* (and its labels
  when the dataset has them, else the row numbers again): strategies shard
  rows, and a fit reads its rows from the map-style Dataset through a
  DataLoader, so no node materialises the data as numpy.
* ``fit`` trains a fresh optimizer on the rows (seeded: torch's RNG and the
  DataLoader's generator), as Flower's clients do.
* ``gradients``/``apply`` keep one *replica* (module and optimizer) alive on
  the worker between requests, which is what makes data-parallel behave as
  DDP does: the optimizer's state (momentum, Adam moments) carries across
  steps, and the buffers (BatchNorm's running statistics) travel beside the
  gradients so ``apply`` loads the replicas' mean. Every replica applies the
  same bytes to the same model, so the replicas stay bit-identical.
* ``evaluate`` runs the held-out set on the process that asks: the
  coordinator, or each client with ``[strategy] evaluate = "clients"``
  (``test_data()`` gives the held-out row numbers; ``evaluate(state, x, y)``
  runs some of them). The data factory receives the options, so a node's own
  data comes from its task options (``meshkit node --task-option
  data_dir=...`` with an options subclass that has the key); nothing is read
  until a method needs it.
"""

from __future__ import annotations

import contextlib
import inspect
import time
import threading
from typing import Any, Callable, Iterator, Mapping

import attrs
import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, \
    SequentialSampler, Subset, TensorDataset

from meshkit.components import Component
from meshkit.errors import ConfigError, MeshError
from meshkit.task import FitResult
from meshkit.torch._convert import INT_BUFFERS, from_numpy, load_module_state, module_state, \
    state_from_tensors, tensors_from_state, to_numpy
from meshkit.torch._options import TorchOptions

__all__ = ["task", "TorchTask", "pick_device", "NORM_LAYERS", "is_lora_key"]


def is_lora_key(key: str) -> bool:
    """Whether a state key is a LoRA adapter's (``"@lora"``): one of its dotted parts
    starts with ``lora_`` -- PEFT's ``lora_A``/``lora_B``/``lora_embedding_A``/
    ``lora_magnitude_vector`` and a hand-written ``self.lora_a`` alike. The base
    layer's own ``weight``/``bias`` (``base_layer.weight``) are not."""
    return any(part.startswith("lora_") for part in key.split("."))

#: The normalisation layers whose parameters and buffers ``"@norm"`` names
#: (FedBN keeps them on each client).
NORM_LAYERS: tuple[type[torch.nn.Module], ...] = tuple(
    layer for layer in (
        torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d,
        torch.nn.SyncBatchNorm, torch.nn.InstanceNorm1d, torch.nn.InstanceNorm2d,
        torch.nn.InstanceNorm3d, torch.nn.GroupNorm, torch.nn.LayerNorm,
        getattr(torch.nn, "RMSNorm", None))
    if layer is not None)


def task(*, model: Callable[..., torch.nn.Module], loss: Callable[..., torch.Tensor],
         data: Callable[..., Any], optimizer: Callable[..., torch.optim.Optimizer] | None = None,
         options: type = TorchOptions, name: str = "torch", summary: str = "") -> Component:
    """A torch task as a :class:`meshkit.Component` (assign it to a module attribute).

    ``model([options])`` builds the ``nn.Module``; ``loss(output, target)`` is
    a mean-reduced loss (``nn.CrossEntropyLoss()``); ``optimizer(parameters[,
    options])`` builds a ``torch.optim.Optimizer`` (default: SGD at
    ``options.lr``); ``data([options])`` returns ``(train, test)``, each a
    map-style Dataset of ``(input, target)`` pairs or a pair of arrays. Each
    factory receives the options when it takes an argument for them.
    """
    if not (isinstance(options, type) and issubclass(options, TorchOptions)):
        raise ConfigError(f"meshkit.torch.task(options=...) must be TorchOptions or a subclass "
                          f"of it (an attrs class), got {options!r}")
    for what, value in (("model", model), ("loss", loss), ("data", data)):
        if not callable(value):
            raise ConfigError(f"meshkit.torch.task({what}=...) must be callable, got {value!r}")

    def build(opts: TorchOptions) -> TorchTask:
        return TorchTask(model=model, loss=loss, data=data, optimizer=optimizer, options=opts)

    return Component(name, build, options=options,
                     summary=summary or "a torch model (meshkit.torch.task)")


def pick_device(name: str) -> torch.device:
    """``auto``: cuda, then mps, then cpu; a named device must be present."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"[task] device = {name!r}, but torch sees no CUDA device here; use "
                          f"\"auto\" or \"cpu\"")
    if device.type == "mps" and not (getattr(torch.backends, "mps", None)
                                     and torch.backends.mps.is_available()):
        raise ConfigError(f"[task] device = {name!r}, but torch sees no MPS device here; use "
                          f"\"auto\" or \"cpu\"")
    return device


def _positional(f: Any) -> int:
    """How many positional arguments ``f`` accepts (a large number for ``*args``)."""
    try:
        parameters = inspect.signature(f).parameters.values()
    except (TypeError, ValueError):
        return 0
    count = 0
    for p in parameters:
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            return 1 << 16
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            count += 1
    return count


def _as_dataset(part: Any, which: str) -> tuple[Dataset, np.ndarray | None]:
    """A map-style Dataset (and its labels, when it has them) from what the data factory gave."""
    if isinstance(part, (tuple, list)) and len(part) == 2:
        x, y = (from_numpy(v) if isinstance(v, np.ndarray) else torch.as_tensor(v) for v in part)
        if len(x) != len(y):
            raise MeshError(f"the {which} data has {len(x)} inputs but {len(y)} targets; rows "
                            f"pair input i with target i")
        return TensorDataset(x, y), to_numpy(y) if y.ndim == 1 else None
    if callable(getattr(part, "__getitem__", None)) and callable(getattr(part, "__len__", None)):
        targets = getattr(part, "targets", None)
        labels = None
        if targets is not None:
            labels = np.asarray(targets.numpy() if isinstance(targets, torch.Tensor) else targets)
            if labels.ndim != 1 or len(labels) != len(part):
                labels = None
        return part, labels
    raise MeshError(f"the {which} data must be a map-style Dataset (__getitem__ and __len__) "
                    f"or a pair of arrays (inputs, targets), got {type(part).__name__}")


@attrs.define
class _Replica:
    """A data-parallel replica: the module and optimizer that live between steps."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    #: The state this replica last loaded or handed out; a request carrying
    #: exactly these arrays continues from the replica instead of reloading.
    state: dict[str, Any]
    steps: int = 0

    def holds(self, state: Mapping[str, Any]) -> bool:
        return (state.keys() == self.state.keys()
                and all(state[k] is v for k, v in self.state.items()))


class TorchTask:
    """The :class:`meshkit.task.Task` of a torch model (build it with :func:`task`)."""

    def __init__(self, *, model: Callable[..., torch.nn.Module], loss: Callable[..., Any],
                 data: Callable[..., Any], optimizer: Callable[..., Any] | None = None,
                 options: TorchOptions | None = None) -> None:
        self.options = options or TorchOptions()
        self._model_factory = model
        self._loss = loss
        self._optimizer_factory = optimizer
        self._data_factory = data
        self.device = pick_device(self.options.device)
        if self.options.threads:
            torch.set_num_threads(self.options.threads)
        self._lock = threading.Lock()
        self._data: tuple[Dataset, Dataset, np.ndarray | None] | None = None
        self._test_labels: np.ndarray | None = None
        self._module: torch.nn.Module | None = None
        self._replica: _Replica | None = None
        self._layout: tuple[frozenset[str], frozenset[str], frozenset[str]] | None = None

    # -- what the state's keys are -------------------------------------------------

    def buffers(self) -> frozenset[str]:
        """The state keys that are the module's buffers (``named_buffers()``: BatchNorm's
        running statistics and ``num_batches_tracked``): outer optimizers never step them."""
        return self._keys()[0]

    def key_groups(self) -> dict[str, frozenset[str]]:
        """``{"norm": ..., "lora": ...}``: every parameter and buffer of the module's
        normalisation layers (:data:`NORM_LAYERS`), which ``[strategy] local_keys =
        ["@norm"]`` names; and the LoRA adapters' keys (:func:`is_lora_key`), which
        ``[strategy] trainable = ["@lora"]`` names."""
        keys = self._keys()
        return {"norm": keys[1], "lora": frozenset(k for k in keys[2] if is_lora_key(k))}

    def _keys(self) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
        if self._layout is None:
            with torch.random.fork_rng(devices=[]):
                module = self.build_model()
            keys = set(module.state_dict())
            params = {k for k, _ in module.named_parameters()}
            norm: set[str] = set()
            for name, layer in module.named_modules():
                if isinstance(layer, NORM_LAYERS):
                    prefix = f"{name}." if name else ""
                    norm.update(prefix + k for k in layer.state_dict())
            self._layout = (frozenset(keys - params), frozenset(norm & keys), frozenset(keys))
        return self._layout

    # -- building ----------------------------------------------------------------

    def _call(self, factory: Callable[..., Any], *args: Any) -> Any:
        if _positional(factory) > len(args):
            return factory(*args, self.options)
        return factory(*args)

    def build_model(self) -> torch.nn.Module:
        """A new module from the model factory (on the CPU, weights from torch's RNG)."""
        module = self._call(self._model_factory)
        if not isinstance(module, torch.nn.Module):
            raise MeshError(f"the model factory returned a {type(module).__name__}, not a "
                            f"torch.nn.Module")
        return module

    def _make_optimizer(self, module: torch.nn.Module) -> torch.optim.Optimizer:
        if self._optimizer_factory is None:
            return torch.optim.SGD(module.parameters(), lr=self.options.lr)
        return self._call(self._optimizer_factory, module.parameters())

    def _working_module(self) -> torch.nn.Module:
        if self._module is None:
            self._module = self.build_model().to(self.device)
        return self._module

    @contextlib.contextmanager
    def _seeded(self, seed: int) -> Iterator[None]:
        """torch's RNG seeded for one fit, the caller's RNG state restored after."""
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            yield

    # -- data --------------------------------------------------------------------

    def _datasets(self) -> tuple[Dataset, Dataset, np.ndarray | None]:
        with self._lock:
            if self._data is None:
                parts = self._call(self._data_factory)
                if not (isinstance(parts, (tuple, list)) and len(parts) == 2):
                    raise MeshError(f"the data factory must return (train, test), got "
                                    f"{type(parts).__name__}")
                train, labels = _as_dataset(parts[0], "train")
                test, test_labels = _as_dataset(parts[1], "test")
                self._test_labels = test_labels
                self._data = (train, test, labels)
            return self._data

    def train_data(self) -> tuple[np.ndarray, np.ndarray]:
        """``(row numbers, labels)`` of the training set; a fit reads its rows' examples."""
        train, _, labels = self._datasets()
        rows = np.arange(len(train), dtype=np.int64)
        return rows, rows if labels is None else labels

    def test_data(self) -> tuple[np.ndarray, np.ndarray]:
        """``(row numbers, labels)`` of the held-out set (``evaluate(state, x, y)`` takes them)."""
        _, test, _ = self._datasets()
        rows = np.arange(len(test), dtype=np.int64)
        return rows, rows if self._test_labels is None else self._test_labels

    def _rows(self, x: Any, train: Dataset) -> list[int]:
        rows = np.asarray(x)
        if rows.ndim != 1 or rows.dtype.kind not in "iu":
            raise MeshError(f"a torch task's shard is a 1-D array of row numbers of its "
                            f"training set (what train_data() returns), got "
                            f"{rows.dtype}{list(rows.shape)}")
        if len(rows) and (rows.min() < 0 or rows.max() >= len(train)):
            raise MeshError(f"row numbers {int(rows.min())}..{int(rows.max())} fall outside "
                            f"the training set's {len(train)} rows")
        return rows.tolist()

    def _loader(self, dataset: Dataset, rows: list[int] | None, *, batch: int,
                seed: int | None) -> DataLoader:
        subset = dataset if rows is None else Subset(dataset, rows)
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        sampler = (SequentialSampler(subset) if seed is None
                   else RandomSampler(subset, generator=generator))
        pin = self.device.type == "cuda"
        if isinstance(dataset, TensorDataset):
            # Arrays: fetch each batch with one indexing instead of per example
            # (the same batches DataLoader(shuffle=True, generator=g) would draw).
            return DataLoader(subset, sampler=BatchSampler(sampler, batch, drop_last=False),
                              batch_size=None, num_workers=self.options.loader_workers,
                              pin_memory=pin)
        return DataLoader(subset, batch_size=batch, sampler=sampler,
                          num_workers=self.options.loader_workers, pin_memory=pin)

    def _to_device(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise MeshError(f"a torch task's dataset yields (input, target) pairs; a batch "
                            f"was a {type(batch).__name__}")
        x, y = batch
        blocking = self.device.type != "cuda"
        return x.to(self.device, non_blocking=not blocking), y.to(self.device,
                                                                  non_blocking=not blocking)

    # -- federated ---------------------------------------------------------------

    def init_state(self, seed: int) -> dict[str, Any]:
        """The model factory's module with torch seeded by ``seed``, as a state."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = self.build_model()
        return module_state(module)  # the module is dropped: nothing else shares its memory

    def fit(self, state: Mapping[str, Any], x: Any, y: Any, *, seed: int,
            time_budget: float | None = None) -> FitResult:
        """``epochs`` passes of a fresh optimizer over rows ``x``, from ``state``.

        With ``time_budget`` (seconds, ``[strategy] time_budget``) it also stops
        at the first batch boundary once the budget is spent (after at least
        one batch) and reports the examples it actually processed.
        """
        train, _, _ = self._datasets()
        rows = self._rows(x, train)
        module = self._working_module()
        # New tensors for the module (the input state is never written, and a
        # state an earlier fit returned, which shares the old ones, stays put).
        load_module_state(module, state, where="fit", assign=True)
        optimizer = self._make_optimizer(module)
        loader = self._loader(train, rows, batch=self.options.batch_size, seed=seed)
        module.train()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        ends = None if time_budget is None else time.monotonic() + float(time_budget)
        examples = last_pass = 0
        with self._seeded(seed):
            for _ in range(self.options.epochs):
                total.zero_()
                last_pass = 0
                for batch in loader:
                    if ends is not None and examples and time.monotonic() >= ends:
                        break
                    inputs, targets = self._to_device(batch)
                    optimizer.zero_grad(set_to_none=True)
                    loss = self._loss(module(inputs), targets)
                    loss.backward()
                    optimizer.step()
                    total += loss.detach() * len(targets)
                    examples += len(targets)
                    last_pass += len(targets)
                else:
                    continue
                break  # the time budget ran out inside this pass
        return FitResult(module_state(module), examples,
                         {"train_loss": float(total) / max(last_pass, 1)})

    def evaluate(self, state: Mapping[str, Any], x: Any = None,
                 y: Any = None) -> dict[str, float]:
        """Mean held-out ``loss``, and ``accuracy`` when the model outputs class scores.

        ``x`` (row numbers of the held-out set, from :meth:`test_data`) limits it
        to those rows: one client's share.
        """
        _, test, _ = self._datasets()
        rows = None if x is None else self._rows(x, test)
        module = self._working_module()
        load_module_state(module, state, where="evaluate", assign=True, copy=False)
        module.eval()
        loss_sum, correct, seen, classes = 0.0, 0, 0, True
        with torch.no_grad():
            for batch in self._loader(test, rows, batch=self.options.eval_batch_size,
                                      seed=None):
                inputs, targets = self._to_device(batch)
                out = module(inputs)
                loss_sum += float(self._loss(out, targets)) * len(targets)
                seen += len(targets)
                classes = classes and out.ndim == 2 and targets.ndim == 1 and \
                    not targets.is_floating_point()
                if classes:
                    correct += int((out.argmax(dim=1) == targets).sum())
        if seen == 0:
            raise MeshError("evaluate: the test set is empty")
        metrics = {"loss": loss_sum / seen}
        if classes:
            metrics["accuracy"] = correct / seen
        return metrics

    # -- data-parallel -----------------------------------------------------------

    def _replica_for(self, state: Mapping[str, Any], where: str) -> _Replica:
        replica = self._replica
        if replica is None or not replica.holds(state):
            # A state this replica did not hand out (the run's start, a
            # resume): load it and start the optimizer afresh.
            module = replica.module if replica is not None else self.build_model().to(
                self.device)
            load_module_state(module, state, where=where, assign=True)
            replica = self._replica = _Replica(module, self._make_optimizer(module),
                                               dict(state))
        return replica

    def load_replica(self, state: Mapping[str, Any],
                     optimizer_state: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Make ``state`` the replica's model; the live model (as :meth:`apply` returns it).

        ``optimizer_state`` None keeps the optimizer's state (DiLoCo: an outer
        update moved the model, the inner AdamW moments carry on); ``{}``
        starts it afresh; else it is :meth:`optimizer_state` of another
        replica (a healed one), loaded as it was.
        """
        replica = self._replica
        if replica is None:
            replica = self._replica_for(state, "load_replica")
        else:
            # Copied into the module's own tensors: the optimizer holds them.
            load_module_state(replica.module, state, where="load_replica")
        if optimizer_state is not None:
            if not optimizer_state:
                replica.optimizer = self._make_optimizer(replica.module)
            else:
                replica.optimizer.load_state_dict(
                    _optimizer_dict(replica.optimizer, replica.module, optimizer_state))
        replica.state = module_state(replica.module)
        return replica.state

    def optimizer_state(self) -> dict[str, Any]:
        """The replica's optimizer state as a meshkit state: ``"<parameter>/<entry>"`` ->
        array (or number); {} before the first step. :meth:`load_replica` takes it back."""
        replica = self._replica
        if replica is None:
            return {}
        names = {id(p): name for name, p in replica.module.named_parameters()}
        out: dict[str, Any] = {}
        for param, entries in replica.optimizer.state.items():
            for entry, value in entries.items():
                key = f"{names[id(param)]}/{entry}"
                if isinstance(value, torch.Tensor):
                    out[key] = to_numpy(value.detach().to("cpu")).copy()
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    out[key] = value
                else:
                    raise MeshError(f"optimizer_state: {key} holds a {type(value).__name__}; "
                                    f"only tensors and numbers can be handed to a replica")
        return out

    def gradients(self, state: Mapping[str, Any], x: Any, y: Any) -> FitResult:
        """Gradients of the mean loss on rows ``x``, and the buffers this batch left.

        The forward runs in training mode, so BatchNorm updates the replica's
        running statistics as DDP's would; they travel beside the gradients
        and :meth:`apply` loads the replicas' mean.
        """
        train, _, _ = self._datasets()
        rows = self._rows(x, train)
        replica = self._replica_for(state, "gradients")
        module = replica.module
        module.train()
        (batch,) = list(self._loader(train, rows, batch=max(len(rows), 1), seed=None))
        inputs, targets = self._to_device(batch)
        replica.optimizer.zero_grad(set_to_none=True)
        with self._seeded(replica.steps):
            loss = self._loss(module(inputs), targets)
            loss.backward()
        out: dict[str, Any] = {}
        for key, p in module.named_parameters():
            # set_to_none: the next backward allocates new grads, so these
            # views stay what they are after this reply.
            out[key] = to_numpy(p.grad if p.grad is not None else torch.zeros_like(p))
        params = set(out)
        buffers = {k: t for k, t in module.state_dict().items() if k not in params}
        for key, value in state_from_tensors(buffers).items():
            if key != INT_BUFFERS:
                out[key] = np.array(value)  # small, and the next forward rewrites them
        return FitResult(out, len(rows), {"train_loss": float(loss.detach())})

    def apply(self, state: Mapping[str, Any], gradients: Mapping[str, Any]) -> dict[str, Any]:
        """One optimizer step on the averaged gradients; the buffers become their mean.

        The returned state shares the replica's memory: it is the live model,
        valid until the next ``gradients``/``apply`` on this task.
        """
        replica = self._replica_for(state, "apply")
        module = replica.module
        params = dict(module.named_parameters())
        missing = sorted(k for k in params if k not in gradients)
        if missing:
            raise MeshError(f"apply: the averaged gradients lack {', '.join(map(repr, missing))}"
                            f"; every parameter needs its gradient")
        for key, p in params.items():
            p.grad = from_numpy(gradients[key]).to(device=p.device, dtype=p.dtype)
        buffers = {k: t for k, t in module.state_dict().items() if k not in params}
        present = {k: gradients[k] for k in buffers if k in gradients}
        if present:
            ints = dict(state.get(INT_BUFFERS) or {})
            loaded = tensors_from_state({**present, INT_BUFFERS: {
                k: v for k, v in ints.items() if k in present}})
            with torch.no_grad():
                for key, value in loaded.items():
                    buffers[key].copy_(value)
        replica.optimizer.step()
        replica.optimizer.zero_grad(set_to_none=True)
        replica.steps += 1
        replica.state = module_state(module)
        return replica.state



def _optimizer_dict(optimizer: torch.optim.Optimizer, module: torch.nn.Module,
                    saved: Mapping[str, Any]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with its per-parameter state replaced by ``saved``
    (:meth:`TorchTask.optimizer_state`'s form); its hyperparameters stay its own."""
    current = optimizer.state_dict()
    index = {name: i for i, (name, _) in enumerate(module.named_parameters())}
    state: dict[int, dict[str, Any]] = {}
    for key, value in saved.items():
        name, _, entry = key.rpartition("/")
        if name not in index or not entry:
            raise MeshError(f"load_replica: optimizer state entry {key!r} names no parameter "
                            f"of the model")
        state.setdefault(index[name], {})[entry] = (
            from_numpy(np.array(value)) if isinstance(value, np.ndarray) else value)
    return {"state": state, "param_groups": current["param_groups"]}
