"""The ``digits`` task: a small numpy MLP on the 8x8 handwritten digits.

The data (1,797 images, see ``data/README.md`` for provenance and licence)
ships inside this package, so nothing is downloaded at run time. The model is
``scale -> hidden (tanh) -> output (logits)``, each stage a node of the graph
model-parallel runs: ``scale`` divides the 0..16 pixels by 16 and has no
parameters, which is what lets a fixed-function board serve it.

Building the task reads no data: the images are read the first time a method
needs them, so a coordinator that only sends models (``[partitioner] name =
"local"``, ``[strategy] evaluate = "clients"``) runs with no data at all. A
node may train on images of its own with ``train_csv``/``test_csv``.
"""

from __future__ import annotations

import gzip
import importlib.resources
import threading
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from meshkit import ConfigError
from meshkit.task import FitResult
from meshkit_tasks.options import DigitsOptions

__all__ = ["DigitsOptions", "DigitsTask", "load_digits", "read_digits_csv"]

_DATA_LOCK = threading.Lock()
_DATA: tuple[np.ndarray, np.ndarray] | None = None

#: The graph model-parallel partitions, in execution order.
STAGES = ("scale", "hidden", "output")
PIXEL_MAX = 16.0
CLASSES = 10
FEATURES = 64


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """All 1,797 images as ``(x float64 [n, 64] in 0..16, y int64 [n])``, read once."""
    global _DATA
    with _DATA_LOCK:
        if _DATA is None:
            resource = importlib.resources.files("meshkit_tasks") / "data" / "digits.csv.gz"
            with resource.open("rb") as raw, gzip.open(raw, "rt") as text:
                table = np.loadtxt(text, delimiter=",", dtype=np.float64)
            x = np.ascontiguousarray(table[:, :FEATURES])
            y = table[:, FEATURES].astype(np.int64)
            x.setflags(write=False)
            y.setflags(write=False)
            _DATA = (x, y)
        return _DATA


#: The longest line a digits CSV may have (65 numbers need about 2 KiB);
#: longer is not this format, and is refused before it is held whole.
MAX_LINE = 64 * 1024


def read_digits_csv(path: str, *, key: str = "csv") -> tuple[np.ndarray, np.ndarray]:
    """A node's own images: ``(x [n, 64], y [n])`` from a CSV file (see :class:`DigitsOptions`).

    Every value is checked: 65 numbers a row, pixels finite and in
    0..``PIXEL_MAX``, the label an integer 0..9, at least one row. An error
    names the file, the row and the column and what was expected, never
    what the file holds: it is sent to the coordinator, which must not read
    a node's files through it.
    """
    where = f"[task] {key} = {path!r}"
    file = Path(path).expanduser()
    try:
        opener = gzip.open if file.suffix == ".gz" else open
        with opener(file, "rt", encoding="utf-8", errors="strict") as text:
            rows = _read_lines(text, where)
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file on this node; give each node the path of "
                          f"its own file (meshkit node --task-option {key}=PATH)") from None
    except (OSError, EOFError) as exc:  # gzip's BadGzipFile is an OSError
        reason = getattr(exc, "strerror", None) or type(exc).__name__
        raise ConfigError(f"{where}: cannot read it: {reason}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not a CSV of numbers (it is not UTF-8 text)") from None
    if not rows:
        raise ConfigError(f"{where}: the file holds no rows; a client needs at least one "
                          f"image to train or evaluate on")
    lines = [line for _, line in rows]
    try:
        table = np.loadtxt(lines, delimiter=",", dtype=np.float64, ndmin=2, comments=None)
    except ValueError:  # numpy's message quotes the field: find and name it ourselves
        table = None
    if table is None or table.shape[1] != FEATURES + 1:
        for number, line in rows:
            _parse_row(line, where, number)
        raise ConfigError(f"{where}: not a CSV of {FEATURES + 1} numbers a row")
    pixels, labels = table[:, :FEATURES], table[:, FEATURES]
    bad = ~((pixels >= 0) & (pixels <= PIXEL_MAX))  # NaN is neither
    bad_labels = ~((labels >= 0) & (labels <= CLASSES - 1) & (labels == np.round(labels)))
    if bad.any() or bad_labels.any():
        row, column = (int(i) for i in np.argwhere(np.column_stack([bad, bad_labels]))[0])
        _value(lines[row].split(",")[column], where, rows[row][0], column + 1)
    return np.ascontiguousarray(pixels), labels.astype(np.int64)


def _read_lines(text: Any, where: str) -> list[tuple[int, str]]:
    """(line number, text) of each data line; blank lines and ``#`` comments skipped."""
    rows: list[tuple[int, str]] = []
    line_no = 0
    while True:
        line = text.readline(MAX_LINE + 1)
        if not line:
            return rows
        line_no += 1
        if len(line) > MAX_LINE and not line.endswith("\n"):
            raise ConfigError(f"{where}: row {line_no} is longer than {MAX_LINE} characters; "
                              f"not a digits CSV")
        body = line.split("#", 1)[0].strip()
        if body:
            rows.append((line_no, body))


def _parse_row(body: str, where: str, line_no: int) -> list[float]:
    """One line's 65 checked numbers, or the error naming its row and column."""
    fields = body.split(",")
    if len(fields) != FEATURES + 1:
        raise ConfigError(f"{where}: row {line_no} has {len(fields)} columns; expected "
                          f"{FEATURES + 1} (64 pixels, then the label)")
    return [_value(field, where, line_no, column) for column, field in enumerate(fields, 1)]


def _value(field: str, where: str, row: int, column: int) -> float:
    """One checked number (the value itself never appears in the error)."""
    is_label = column == FEATURES + 1
    expected = (f"a label 0..{CLASSES - 1}" if is_label
                else f"a pixel value 0..{PIXEL_MAX:g}")
    try:
        value = float(field)
    except ValueError:
        raise ConfigError(f"{where}: row {row}, column {column} is not a number; expected "
                          f"{expected}") from None
    if not (0.0 <= value <= (CLASSES - 1 if is_label else PIXEL_MAX)) or (
            is_label and value != int(value)):
        what = "not finite" if not np.isfinite(value) else "out of range"
        raise ConfigError(f"{where}: row {row}, column {column} is {what}; expected "
                          f"{expected}")
    return value


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    np.exp(shifted, out=shifted)
    shifted /= shifted.sum(axis=1, keepdims=True)
    return shifted


class DigitsTask:
    """Model and data for the 8x8 digits (the :class:`meshkit.task.Task` protocol)."""

    Options = DigitsOptions

    def __init__(self, options: DigitsOptions | None = None) -> None:
        self.options = options or DigitsOptions()
        #: The clock a time budget is measured on (tests slow a client with a fake one).
        self.clock = time.monotonic
        n_test = int(round(1797 * self.options.test_fraction))
        if not 0 < n_test < 1797:
            # An empty split would evaluate to NaN (or leave nothing to train on).
            raise ConfigError(
                f"[task] test_fraction = {self.options.test_fraction} holds out {n_test} of "
                f"1797 images, leaving an empty "
                f"{'test' if n_test == 0 else 'training'} set; use a value that keeps at "
                f"least one image on each side (e.g. 0.2)")
        self._lock = threading.Lock()
        self._train: tuple[np.ndarray, np.ndarray] | None = None
        self._test: tuple[np.ndarray, np.ndarray] | None = None

    # -- data ---------------------------------------------------------------

    def _shipped(self) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        x, y = load_digits()
        order = np.random.default_rng(self.options.split_seed).permutation(len(y))
        n_test = int(round(len(y) * self.options.test_fraction))
        test, train = np.sort(order[:n_test]), np.sort(order[n_test:])
        return (x[train], y[train]), (x[test], y[test])

    def _load(self) -> None:
        with self._lock:
            if self._train is not None:
                return
            opts = self.options
            if opts.train_csv:
                train = read_digits_csv(opts.train_csv, key="train_csv")
                test = (read_digits_csv(opts.test_csv, key="test_csv") if opts.test_csv
                        else (np.zeros((0, FEATURES)), np.zeros(0, dtype=np.int64)))  # none
            else:
                train, test = self._shipped()
                if opts.test_csv:
                    test = read_digits_csv(opts.test_csv, key="test_csv")
            self._train, self._test = train, test

    def train_data(self) -> tuple[np.ndarray, np.ndarray]:
        self._load()
        assert self._train is not None
        return self._train

    def test_data(self) -> tuple[np.ndarray, np.ndarray]:
        """This node's held-out images (none when ``train_csv`` is set without ``test_csv``)."""
        self._load()
        assert self._test is not None
        return self._test

    # -- model --------------------------------------------------------------

    def init_state(self, seed: int) -> dict[str, Any]:
        """Glorot-uniform weights, zero biases, all from ``seed``."""
        rng = np.random.default_rng(seed)
        h = self.options.hidden

        def glorot(fan_in: int, fan_out: int) -> np.ndarray:
            limit = np.sqrt(6.0 / (fan_in + fan_out))
            return rng.uniform(-limit, limit, size=(fan_in, fan_out))

        return {
            "hidden.w": glorot(FEATURES, h),
            "hidden.b": np.zeros(h),
            "output.w": glorot(h, CLASSES),
            "output.b": np.zeros(CLASSES),
        }

    def _params(self, state: Mapping[str, Any]) -> dict[str, np.ndarray]:
        params = {}
        for key in ("hidden.w", "hidden.b", "output.w", "output.b"):
            if key not in state:
                raise KeyError(f"digits: the state has no {key!r}; keys are {sorted(state)}")
            params[key] = np.array(state[key], dtype=np.float64)  # a private, writable copy
        return params

    def _loss_and_grads(self, p: Mapping[str, np.ndarray], x: np.ndarray,
                        y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        a0 = x / PIXEL_MAX
        h = np.tanh(a0 @ p["hidden.w"] + p["hidden.b"])
        probs = _softmax(h @ p["output.w"] + p["output.b"])
        n = len(y)
        rows = np.arange(n)
        loss = float(-np.log(np.maximum(probs[rows, y], 1e-12)).mean())
        # d(mean cross-entropy)/d(logits) = (softmax - onehot) / n, in place.
        probs[rows, y] -= 1.0
        probs /= n
        grads = {"output.w": h.T @ probs, "output.b": probs.sum(axis=0)}
        dh = probs @ p["output.w"].T
        dh *= 1.0 - h * h
        grads["hidden.w"] = a0.T @ dh
        grads["hidden.b"] = dh.sum(axis=0)
        return loss, grads

    def fit(self, state: Mapping[str, Any], x: np.ndarray, y: np.ndarray, *,
            seed: int, time_budget: float | None = None) -> FitResult:
        """Minibatch SGD over the shard for ``epochs`` passes, from ``state``.

        With ``proximal_mu > 0`` this is FedProx's client update: the gradient
        gains ``mu * (w - w_start)``, where ``w_start`` is the global model the
        round handed this client.

        With ``time_budget`` (seconds), the fit also stops at the first batch
        boundary once the budget is spent (at least one batch is always
        trained) and reports the examples it actually processed: a slow
        client contributes, and weighs, less. ``fit_delay`` seconds are
        waited after training (outside any budget): a slower device, emulated.
        """
        opts = self.options
        p = self._params(state)
        anchor = {k: v.copy() for k, v in p.items()} if opts.proximal_mu > 0 else None
        rng = np.random.default_rng(seed)
        n = len(y)
        losses: list[float] = []
        seen = 0  # rows trained on, counted at the end of a pass or where the budget ran out
        ends = None if time_budget is None else self.clock() + float(time_budget)
        for _ in range(opts.epochs):
            order = rng.permutation(n)
            losses.clear()
            for start in range(0, n, opts.batch_size):
                if ends is not None and (seen or start) and self.clock() >= ends:
                    seen += start
                    break
                batch = order[start:start + opts.batch_size]
                loss, grads = self._loss_and_grads(p, x[batch], y[batch])
                losses.append(loss * len(batch))
                for key, g in grads.items():
                    if anchor is not None:
                        g += opts.proximal_mu * (p[key] - anchor[key])
                    g *= opts.lr
                    np.subtract(p[key], g, out=p[key])
            else:
                seen += n
                continue
            break  # the budget ran out inside this pass
        # The mean loss of the last pass, over the rows that pass trained on.
        last_pass = seen - n * ((seen - 1) // n) if seen and n else n
        if opts.fit_delay:
            time.sleep(opts.fit_delay)  # [task] fit_delay: a slower device, emulated
        return FitResult(state=p, examples=seen,
                         metrics={"train_loss": float(sum(losses) / max(last_pass, 1))})

    def gradients(self, state: Mapping[str, Any], x: np.ndarray, y: np.ndarray) -> FitResult:
        """Mean cross-entropy gradients on ``(x, y)``; ``state`` of the result holds them."""
        loss, grads = self._loss_and_grads(self._params(state), x, y)
        return FitResult(state=grads, examples=len(y), metrics={"train_loss": loss})

    def apply(self, state: Mapping[str, Any], gradients: Mapping[str, Any]) -> dict[str, Any]:
        """One SGD step: ``w - lr * g``."""
        p = self._params(state)
        for key, value in p.items():
            g = np.asarray(gradients[key], dtype=np.float64)
            value -= self.options.lr * g
        return p

    def evaluate(self, state: Mapping[str, Any], x: np.ndarray | None = None,
                 y: np.ndarray | None = None) -> dict[str, float]:
        """Loss and accuracy on the held-out split (or on the held-out examples ``x, y``)."""
        if x is None or y is None:
            x, y = self.test_data()
        if len(y) == 0:
            raise ConfigError(
                "[task] digits has no held-out images on this node (train_csv is set and "
                "test_csv is not): set test_csv, or let the clients evaluate on theirs "
                "([strategy] evaluate = \"clients\")")
        probs = self.predict(state, x)
        loss = float(-np.log(np.maximum(probs[np.arange(len(y)), y], 1e-12)).mean())
        accuracy = float((probs.argmax(axis=1) == y).mean())
        return {"loss": loss, "accuracy": accuracy}

    def predict(self, state: Mapping[str, Any], x: np.ndarray) -> np.ndarray:
        out = np.asarray(x, dtype=np.float64)
        for node in STAGES:
            out = self.run_stage(state, node, out)
        return _softmax(out)

    # -- model-parallel -----------------------------------------------------

    def stages(self) -> tuple[str, ...]:
        return STAGES

    def run_stage(self, state: Mapping[str, Any], node: str, x: np.ndarray) -> np.ndarray:
        """Run one node of the graph on an activation (logits come out of ``output``)."""
        x = np.asarray(x, dtype=np.float64)
        if node == "scale":
            return x / PIXEL_MAX
        if node == "hidden":
            return np.tanh(x @ np.asarray(state["hidden.w"]) + np.asarray(state["hidden.b"]))
        if node == "output":
            return x @ np.asarray(state["output.w"]) + np.asarray(state["output.b"])
        raise KeyError(f"digits has no stage {node!r}; its stages are {', '.join(STAGES)}")

    def stage_keys(self, node: str) -> tuple[str, ...]:
        """The state keys a stage needs (what a worker running it is sent)."""
        return tuple(k for k in ("hidden.w", "hidden.b", "output.w", "output.b")
                     if k.startswith(node + "."))
