"""A function run on a thread whose result or exception the test collects."""

from __future__ import annotations

import threading
from typing import Any, Callable


class Outcome:
    """Runs ``fn`` on a thread and keeps its result or exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.value = fn()
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            self.error = exc

    def get(self, timeout: float = 10.0) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "background side did not finish"
        if self.error is not None:
            raise self.error
        return self.value
