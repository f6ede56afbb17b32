"""What ``meshkit run`` refuses at start, ``meshkit check`` refuses too — before any process.

Each case runs the real CLI (exit status 2, one paragraph, no traceback)
and, for ``run``, checks that nothing was started: no worker log, no
results.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.cli import run_cli
def config(tmp_path: Path, out: Path | str, *, mesh: str = "", strategy: str = "",
           task: str = "", name: str = "c.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(f"""
        [run]
        task = "digits"
        out = "{out}"

        [mesh]
        workers = 1
        timeout = 10.0
        {mesh}

        [strategy]
        rounds = 1
        {strategy}

        [task]
        {task}
    """))
    return path


def refused(result, *fragments: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("meshkit: error:") == 1, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def both_refuse(path: Path, *fragments: str) -> None:
    refused(run_cli("check", str(path)), *fragments)
    refused(run_cli("run", str(path)), *fragments)


# -- the out directory -------------------------------------------------------------


def test_an_out_dir_under_a_file_is_refused_by_check_and_run(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    path = config(tmp_path, tmp_path / "a-file" / "out")
    both_refuse(path, "[run] out", "a-file' is a file", "choose another out")


def test_an_out_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "out").write_text("")
    both_refuse(config(tmp_path, tmp_path / "out"), "is a file, not a directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root bypasses permission bits")
def test_an_out_dir_in_a_read_only_directory_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        both_refuse(config(tmp_path, locked / "out"), "[run] out", "is not writable")
    finally:
        locked.chmod(0o755)


@pytest.mark.skipif(not sys.platform.startswith("linux") or not Path("/sys/kernel").is_dir(),
                    reason="needs Linux's sysfs, where even root cannot make a directory")
def test_an_out_dir_the_system_refuses_to_create_is_a_config_error_not_a_traceback(tmp_path):
    refused(run_cli("run", str(config(tmp_path, "/sys/meshkit-test-out"))),
            "[run] out = '/sys/meshkit-test-out': cannot create it")


# -- the model -----------------------------------------------------------------------


def test_a_model_too_big_for_memory_is_refused_by_check_and_by_run_before_any_worker(tmp_path):
    out = tmp_path / "out"
    path = config(tmp_path, out, task=f"hidden = {10**12}")
    both_refuse(path, "[task]", "does not fit in this machine's memory")
    assert not (out / "logs").exists(), "no worker was spawned"


MODEL_PARALLEL = """
[run]
out = "{out}"
[mesh]
workers = 2
[strategy]
name = "model-parallel"
[[strategy.boards]]
board = "loopback"
options = {{ stage_id = "scale", input_elems = 64, output_elems = 64, function = "scale", scale = 0.0625 }}
[[strategy.partitions]]
nodes = ["hidden"]
rank = 1
[[strategy.partitions]]
nodes = ["output"]
rank = {output_rank}
[[strategy.partitions]]
nodes = ["scale"]
tag = "scale"
"""


def test_check_prints_the_model_size_and_the_real_world_of_a_model_parallel_run(tmp_path):
    path = tmp_path / "mp.toml"
    path.write_text(MODEL_PARALLEL.format(out=tmp_path / "out", output_rank=2))
    result = run_cli("check", str(path))
    assert result.returncode == 0, result.stderr
    # 64*32 + 32 + 32*10 + 10 float64 parameters.
    assert "model: 2,410 parameters in 4 array(s), 18.8 KiB" in result.stdout
    assert "(world 4)" in result.stdout and "world 3" not in result.stdout
    assert ("world 4: the coordinator, 2 worker(s) and 1 fixed-function board(s) (loopback)"
            in result.stdout)


def test_a_partition_pinned_to_a_rank_the_run_will_not_have_is_refused_by_check(tmp_path):
    path = tmp_path / "mp.toml"
    path.write_text(MODEL_PARALLEL.format(out=tmp_path / "out", output_rank=5))
    both_refuse(path, "partition ['output'] is pinned to rank 5",
                "ranks 1..3 (2 worker(s), 1 board(s))")
    assert not (tmp_path / "out" / "logs").exists()


# -- the mesh --------------------------------------------------------------------


@pytest.mark.parametrize("bind, fragment", [
    ("127.0.0.1:70000", "port 70000 is out of range 0..65535"),
    ("127.0.0.1", "must be host:port"),
    ("127.0.0.1:http", "port 'http' is not a number"),
])
def test_a_bind_the_transport_would_refuse_is_refused_by_check(tmp_path, bind, fragment):
    both_refuse(config(tmp_path, tmp_path / "out", mesh=f'bind = "{bind}"'),
                "[mesh]", "bind", fragment)


def test_a_bind_of_localhost_is_accepted_by_check_and_run_alike(tmp_path):
    path = config(tmp_path, tmp_path / "out", mesh='bind = "localhost:0"')
    assert run_cli("check", str(path)).returncode == 0
    result = run_cli("run", str(path), timeout=120)
    assert result.returncode == 0, result.stderr


def test_a_mesh_that_cannot_form_is_refused_by_check(tmp_path):
    # Host relays carry a star's ranks; the other star-only keys are checked
    # in-process (tests/train/coordinator/test_run_mesh.py).
    both_refuse(config(tmp_path, tmp_path / "out", mesh='topology = "mesh"\nrelays = 1'),
                "[mesh] relays = 1", "topology = \"star\"")


def _external(tmp_path: Path, secret_file: Path) -> Path:
    return config(tmp_path, tmp_path / "out",
                  mesh=f'launch = "external"\nsecret_file = "{secret_file}"')


def test_a_missing_secret_file_is_refused_by_check(tmp_path):
    path = _external(tmp_path, tmp_path / "absent-secret")
    refused(run_cli("check", str(path)), "[mesh] secret_file", "cannot read it", "absent-secret")
    refused(run_cli("coordinator", str(path)), "[mesh] secret_file", "cannot read it")


def test_a_secret_file_shorter_than_16_bytes_is_refused_by_check(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("short-secret")
    secret.chmod(0o600)
    path = _external(tmp_path, secret)
    refused(run_cli("check", str(path)), "holds 12 bytes; use at least 16")
    refused(run_cli("coordinator", str(path)), "holds 12 bytes; use at least 16")


def test_a_short_meshkit_secret_is_refused_like_a_short_file(tmp_path):
    path = config(tmp_path, tmp_path / "out", mesh='launch = "external"')
    refused(run_cli("check", str(path), env={"MESHKIT_SECRET": "too-short"}),
            "MESHKIT_SECRET holds 9 bytes; use at least 16")
