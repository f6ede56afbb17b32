"""NodeControl: the step budget and the stop handle another thread raises."""

from __future__ import annotations

import threading

import pytest

from meshkit import ConfigError, NodeControl


def test_node_control_budget_and_stop():
    control = NodeControl(steps=2)
    assert control.should_continue()
    control.count()
    control.count()
    assert not control.should_continue() and control.reason() == "budget"
    other = NodeControl()
    threading.Thread(target=other.stop).start()
    assert other.stop_handle.wait(5)
    assert not other.should_continue() and other.reason() == "stop"
    with pytest.raises(ConfigError, match="non-negative integer"):
        NodeControl(steps=-1)
