"""Devices: caps list what is present (torch asked only when wanted), the node's device reaches its task."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import types

import attrs
import pytest

from meshkit import ConfigError, NodeCaps
from meshkit.node import device_matches, local_caps, present_devices, send_job, task_device
from meshkit.task import FitResult
from meshkit.train import GroupPool, call, with_device

#: Each DeviceTask built in this process records its device here (the
#: in-process mesh's nodes are threads of the test process).
BUILT: list[str] = []


@attrs.frozen
class DeviceOptions:
    device: str = "auto"


class DeviceTask:
    """A task that records the device it was built with, and does nothing else."""

    Options = DeviceOptions

    def __init__(self, options: DeviceOptions) -> None:
        BUILT.append(options.device)
        self.device = options.device

    def init_state(self, seed):
        return {"device": self.device}

    def train_data(self):
        import numpy as np
        return np.zeros((2, 1)), np.zeros(2)

    def fit(self, state, x, y, *, seed):
        return FitResult({"device": self.device}, len(y))

    def evaluate(self, state):
        return {}


def test_a_numpy_only_node_advertises_cpu_without_importing_torch():
    script = textwrap.dedent("""
        import json, sys
        from meshkit.node import local_caps
        caps = local_caps(1, device="auto")
        print(json.dumps({"torch": "torch" in sys.modules, "devices": list(caps.devices)}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert json.loads(out) == {"torch": False, "devices": ["cpu"]}


def test_torch_is_asked_once_it_is_imported_and_cpu_is_always_there(monkeypatch):
    torch = pytest.importorskip("torch")
    devices = present_devices("auto")
    assert devices[0] == "cpu"
    assert all(d == "mps" or d.startswith("cuda:") for d in devices[1:])
    # With torch imported, its CUDA devices are listed (faked here: this
    # machine has none, so the lines above would hold had torch not been asked).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert present_devices("auto")[:3] == ("cpu", "cuda:0", "cuda:1")


def test_a_node_asking_for_a_device_it_does_not_have_is_refused_before_it_joins():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(ConfigError, match=r"--device 'cuda:3': this node has no such device "
                                          r"\(found: cpu"):
        local_caps(1, device="cuda:3")


def _torch_with_a_broken_driver() -> types.SimpleNamespace:
    """A stand-in for torch whose CUDA says it is there, then fails when counted."""
    def device_count() -> int:
        raise RuntimeError("CUDA driver initialization failed")
    return types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True,
                                                            device_count=device_count),
                                 backends=types.SimpleNamespace())


def test_a_broken_cuda_set_up_is_refused_when_the_node_asks_for_cuda(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", _torch_with_a_broken_driver())
    with pytest.raises(ConfigError, match=r"CUDA is installed but failed: RuntimeError: CUDA "
                                          r"driver initialization failed; .*--device cpu"):
        present_devices("cuda")


def test_a_broken_cuda_set_up_on_an_auto_node_is_logged_not_hidden(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch", _torch_with_a_broken_driver())
    with caplog.at_level(logging.WARNING, logger="meshkit.node._devices"):
        assert present_devices("auto") == ("cpu",)
    assert "CUDA is installed but failed: RuntimeError: CUDA driver initialization failed" \
        in caplog.text


def test_a_torch_that_fails_to_import_is_refused_when_a_device_needs_it(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with pytest.raises(ConfigError, match=r"torch is installed but failed: \w*Error: import of torch"):
        present_devices("mps")
    with caplog.at_level(logging.WARNING, logger="meshkit.node._devices"):
        assert present_devices("auto", probe=True) == ("cpu",)
    assert "torch is installed but failed: ModuleNotFoundError" in caplog.text


def test_a_device_class_matches_any_of_its_devices():
    assert device_matches("cuda", ["cpu", "cuda:0"])
    assert device_matches("cuda:0", ["cpu", "cuda:0"])
    assert not device_matches("cuda:1", ["cpu", "cuda:0"])
    assert not device_matches("mps", ["cpu"])
    assert device_matches("", ["cpu"]) and device_matches("auto", ["cpu"])
    caps = NodeCaps(rank=1, devices=("cpu", "mps"))
    assert caps.has_device("mps") and not caps.has_device("cuda")


def test_the_task_device_is_the_nodes_own_then_the_required_one_then_auto():
    assert task_device("cpu", "cuda", ("cpu", "cuda:0")) == "cpu"
    assert task_device("auto", "cuda", ("cpu", "cuda:0", "cuda:1")) == "cuda:0"
    assert task_device("auto", "", ("cpu",)) == "auto"


def test_a_task_with_a_device_option_is_built_with_the_nodes_device():
    name = f"{__name__}:DeviceTask"
    assert with_device(name, {}, "cpu") == {"device": "cpu"}
    assert with_device(name, {"device": "cpu"}, "auto") == {"device": "cpu"}
    assert with_device("digits", {}, "cpu") == {"device": "cpu"}


def test_a_task_that_cannot_use_the_device_refuses_it_instead_of_ignoring_it():
    with pytest.raises(ConfigError, match="synthetic.*has no device option, so it runs on "
                                          "the cpu; this node was asked to run it on 'cuda:0'"):
        with_device("synthetic", {}, "cuda:0")
    assert with_device("synthetic", {}, "cpu") == {}
    from meshkit.task import create_task
    with pytest.raises(ConfigError, match="digits is a numpy task and runs on the cpu only"):
        create_task("digits", with_device("digits", {}, "cuda:0"))


def test_the_device_reaches_the_task_on_each_node(mesh_factory):  # noqa: F811
    BUILT.clear()
    # Rank 1 was started with --device cpu; rank 2 with --device auto on a
    # machine that (as its caps say) has a GPU, and the run requires cuda.
    mesh = mesh_factory({1: {"caps": NodeCaps(rank=1, device="cpu", devices=("cpu",))},
                         2: {"caps": NodeCaps(rank=2, devices=("cpu", "cuda:0"))}})
    spec = {"task": f"{__name__}:DeviceTask", "task_options": {}, "strategy": "federated",
            "seed": 0, "device": "cuda"}
    for rank in (1, 2):
        send_job(mesh.g0, rank, {"kind": "train", "job": 1, "spec": spec})
    pool = GroupPool(mesh.g0)
    replies = call(pool, [(r, {"op": "fit", "shard": 0, "shards": 1, "seed": 0,
                                "state": {}}) for r in (1, 2)], timeout=10)
    assert [r.payload["state"]["device"] for r in replies] == ["cpu", "cuda:0"]
    assert sorted(BUILT) == ["cpu", "cuda:0"]
    pool.stop_all([1, 2])
