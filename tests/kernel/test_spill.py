"""The spill (:mod:`meshkit.spill`): the global model and the outer state in mapped files."""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import meshkit.plugins
from meshkit.errors import ConfigError
from meshkit.safetensors import read_safetensors
from meshkit.spill import GLOBAL_FILE, OUTER_FILE, Spill, check_spill
from tests.support.rounds import make_ctx

MB = 1 << 20


def mapped_rss_kb(file: Path) -> int:
    """Resident kB of this process's mappings of ``file`` (``/proc/self/smaps``)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's line
            inside = len(head) >= 6 and head[5] == str(file)
        elif inside and line.startswith("Rss:"):
            total += int(head[1])
    return total


def test_the_global_model_is_written_as_safetensors_and_mapped_back_bit_for_bit(tmp_path):
    rng = np.random.default_rng(1)
    state = {"w": rng.standard_normal((64, 33)).astype(np.float32),
             "b": rng.standard_normal(7), "steps": np.array(5, np.int64), "mu": {"x": 1.5}}
    spill = Spill(tmp_path / "spill")
    mapped = spill.global_state(state)
    for key in ("w", "b", "steps"):
        assert isinstance(mapped[key], np.memmap) and spill.owns(mapped[key])
        assert mapped[key].dtype == state[key].dtype and mapped[key].shape == state[key].shape
        assert mapped[key].tobytes() == state[key].tobytes()
    assert mapped["mu"] == {"x": 1.5}
    tensors, _ = read_safetensors(tmp_path / "spill" / GLOBAL_FILE)
    assert tensors["w"].tobytes() == state["w"].tobytes()
    # Already spilled: handed back as it is, nothing rewritten.
    again = spill.global_state(mapped)
    assert all(again[k] is mapped[k] for k in ("w", "b", "steps"))


def test_a_read_model_s_pages_leave_the_resident_set_on_release(tmp_path):
    spill = Spill(tmp_path / "spill", interval=3600.0)  # no pager pass during the test
    mapped = spill.global_state({"w": np.ones(8 * MB // 4, np.float32)})
    file = (tmp_path / "spill" / GLOBAL_FILE).resolve()
    assert float(mapped["w"].sum()) == 8 * MB // 4  # every page read
    assert mapped_rss_kb(file) >= 8 * 1024 - 64
    spill.release()
    assert mapped_rss_kb(file) < 1024
    assert float(mapped["w"][-1]) == 1.0  # faulted back from the page cache, unchanged


def test_the_pager_drops_pages_without_being_asked(tmp_path):
    spill = Spill(tmp_path / "spill", interval=0.001)
    mapped = spill.global_state({"w": np.ones(8 * MB // 4, np.float32)})
    file = (tmp_path / "spill" / GLOBAL_FILE).resolve()
    mapped["w"].sum()
    for _ in range(2):  # the second pass began after the read had ended
        spill.paged.clear()
        assert spill.paged.wait(30)
    assert mapped_rss_kb(file) < 1024
    pager = spill._pager
    assert pager is not None
    spill.close()  # the run is over: the pager stops, the model stays readable
    assert not pager.is_alive() and float(mapped["w"][0]) == 1.0


def outer_step_heap(tmp_path: Path, spill: Spill | None) -> tuple[int, dict, object]:
    """Heap bytes (tracemalloc) still held after two nesterov steps of a 16 MB model."""
    ctx = make_ctx(workers=1)
    ctx.outer = meshkit.plugins.create("outer_optimizer", "nesterov")
    ctx.outer_name = "nesterov"
    ctx.spill = spill
    ctx._buffers = frozenset()
    state = {"w": np.full(4 * MB, 1.0, np.float32)}
    gc.collect()
    tracemalloc.start()
    try:
        for target in (0.7, 0.5):
            consensus = {"w": np.full(4 * MB, target, np.float32)}
            state = ctx.outer_step(state, consensus)
            del consensus
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return held, state, ctx.outer


def test_the_global_model_and_the_momentum_are_not_held_in_the_heap(tmp_path):
    held_off, off, _ = outer_step_heap(tmp_path, None)
    held_on, on, outer = outer_step_heap(tmp_path, Spill(tmp_path / "spill"))
    # In memory: the global model and the momentum, 16 MB each.
    assert held_off >= 2 * 16 * MB
    assert held_on < 2 * MB, f"{held_on / MB:.1f} MB still in the heap with the spill"
    assert on["w"].tobytes() == off["w"].tobytes()  # same numbers, bit for bit
    assert isinstance(on["w"], np.memmap)
    momentum = outer.state_dict()["b/w"]  # type: ignore[attr-defined]
    assert isinstance(momentum, np.memmap) and momentum.mode == "r+"
    tensors, _ = read_safetensors(tmp_path / "spill" / OUTER_FILE)
    momentum.flush()
    assert tensors["b/w"].shape == momentum.shape


def test_an_unwritable_spill_dir_is_a_config_error_naming_the_key(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"\[run\] spill_dir.*is a file"):
        check_spill(tmp_path / "file", "run.toml: [run] spill_dir")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        import os
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user who may write anywhere (root)")
        with pytest.raises(ConfigError, match=r"\[run\] spill_dir.*spill = false"):
            check_spill(locked / "spill", "run.toml: [run] spill_dir")
    finally:
        locked.chmod(0o700)
