"""A ``digits`` task whose first replica to reach inner step ``stall_at`` stops there, says so
and waits to be killed: a replica dying mid-exchange, on cue.

Options (``[task]``, the same on every node): ``stall_at`` (the inner step,
counted per process, 0: never) and ``claim`` (a path: the one replica that
creates it first with O_EXCL is the one that stalls; a restarted node finds
it taken and trains on). The staller writes its pid, a line, to the FIFO
``claim + ".fifo"``, which the test opened for reading before the run.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Mapping

import attrs
import numpy as np

from meshkit_tasks.digits import DigitsTask
from meshkit_tasks.options import DigitsOptions


@attrs.frozen
class StallingOptions(DigitsOptions):
    stall_at: int = 0
    claim: str = ""


class Stalling(DigitsTask):
    Options = StallingOptions

    def __init__(self, options: StallingOptions | None = None) -> None:
        super().__init__(options or StallingOptions())
        self.steps = 0

    def gradients(self, state: Mapping[str, Any], x: np.ndarray, y: np.ndarray) -> Any:
        self.steps += 1
        if self.options.stall_at and self.steps == self.options.stall_at and self._claimed():
            with open(self.options.claim + ".fifo", "w") as fifo:
                fifo.write(f"{os.getpid()}\n")
            threading.Event().wait()  # until SIGKILL
        return super().gradients(state, x, y)

    def _claimed(self) -> bool:
        try:
            os.close(os.open(self.options.claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True
