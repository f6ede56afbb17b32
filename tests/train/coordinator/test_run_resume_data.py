"""``--resume`` reads back only what it can trust: each bad piece is a ConfigError naming its file.

Damaged resume data (a checkpoint header of the wrong shape, an RNG state
of another generator, a metrics line that records no round, a metrics file
that is not UTF-8) is a user's problem to fix, not a bug: the message says
which file, what is wrong, and what to do (fix or remove it, or
``--overwrite``), and the CLI exits 2 without a traceback.
"""

from __future__ import annotations

import json
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest

from meshkit.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from meshkit.train._coordinator.plan import check
from meshkit.errors import ConfigError
from meshkit.train import build_components
from meshkit.train._coordinator.resume import identity, prepare_out

from tests.support.cli import run_cli
def setup(tmp_path: Path, rng_state=None) -> tuple[Path, Path]:
    """A config and, in its out dir, a checkpoint of its round 2 of 4 and a metrics file."""
    out = tmp_path / "out"
    path = tmp_path / "c.toml"
    path.write_text(textwrap.dedent(f"""
        [run]
        out = "{out}"
        [mesh]
        workers = 1
        [strategy]
        rounds = 4
    """))
    plan = check(path)
    parts = build_components(plan)
    line = {"round": 2, "rounds": 4, "strategy": "federated", "accuracy": 0.5}
    save_checkpoint(out, Checkpoint(
        round=2, state=parts["task"].init_state(0), identity=identity(plan), report=line,
        rng_state=rng_state if rng_state is not None else parts["rng"].bit_generator.state))
    (out / "metrics.jsonl").write_text(
        "".join(json.dumps({**line, "round": r}) + "\n" for r in (1, 2)))
    return path, out


def resume(path: Path) -> None:
    plan = check(path)
    prepare_out(plan, build_components(plan), resume=True)


def rewrite_header(file: Path, **changes) -> None:
    """Change fields of a checkpoint's JSON header in place (as a damaged file might)."""
    with np.load(file, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    meta = json.loads(arrays["__meta__"].tobytes())
    meta.update(changes)
    arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(file, **arrays)


def assert_actionable(message: str, file: Path, *fragments: str) -> None:
    assert str(file) in message, message
    assert "--overwrite" in message, message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("field, value, fragment", [
    ("round", "two", "round is 'two', not a round number"),
    ("round", -1, "round is -1"),
    ("identity", ["digits"], "identity is ['digits'], not a JSON object"),
    ("rng", 7, "rng is 7, not a JSON object"),
    ("state", None, "state is missing"),
    ("report", "yesterday", "report is 'yesterday'"),
])
def test_a_checkpoint_header_of_the_wrong_shape_is_a_config_error_naming_the_field(
        tmp_path, field, value, fragment):
    path, out = setup(tmp_path)
    rewrite_header(out / "checkpoint.npz", **{field: value})
    with pytest.raises(ConfigError) as err:
        load_checkpoint(out)
    assert_actionable(str(err.value), out / "checkpoint.npz", fragment)
    result = run_cli("run", str(path), "--resume")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert fragment in result.stderr


def test_an_rng_state_of_another_generator_is_a_config_error(tmp_path):
    path, out = setup(tmp_path, rng_state=np.random.Generator(np.random.MT19937(3))
                      .bit_generator.state)
    with pytest.raises(ConfigError) as err:
        resume(path)
    assert_actionable(str(err.value), out / "checkpoint.npz",
                      "rng: the saved state is for a 'MT19937' generator, this run's is 'PCG64'")


def test_a_damaged_rng_state_of_the_right_generator_is_a_config_error(tmp_path):
    path, out = setup(tmp_path, rng_state={"bit_generator": "PCG64", "state": "garbage"})
    with pytest.raises(ConfigError) as err:
        resume(path)
    assert_actionable(str(err.value), out / "checkpoint.npz", "rng: the saved PCG64 state")


@pytest.mark.parametrize("line, fragment", [
    ('{"round": "three", "accuracy": 0.1}', "line 3: its round is 'three', not a round number"),
    ('{"accuracy": 0.1}', "line 3: its round is None"),
    ('[1, 2, 3]', "line 3: it is list, not a JSON object"),
])
def test_a_metrics_line_that_records_no_round_is_a_config_error_naming_file_and_line(
        tmp_path, line, fragment):
    path, out = setup(tmp_path)
    with open(out / "metrics.jsonl", "a") as fh:
        fh.write(line + "\n")
    with pytest.raises(ConfigError) as err:
        resume(path)
    assert_actionable(str(err.value), out / "metrics.jsonl", fragment, "Fix or remove the line")
    result = run_cli("run", str(path), "--resume")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr


def test_a_torn_last_metrics_line_from_a_crash_is_still_dropped_quietly(tmp_path):
    path, out = setup(tmp_path)
    with open(out / "metrics.jsonl", "a") as fh:
        fh.write('{"round": 3, "accur')
    resume(path)
    assert [json.loads(x)["round"] for x in (out / "metrics.jsonl").read_text().splitlines()] \
        == [1, 2]


def test_a_metrics_file_that_is_not_utf8_is_a_config_error(tmp_path):
    path, out = setup(tmp_path)
    (out / "metrics.jsonl").write_bytes(b'{"round": 1}\n\xff\xfe{"round": 2}\n')
    with pytest.raises(ConfigError) as err:
        resume(path)
    assert_actionable(str(err.value), out / "metrics.jsonl", "is not UTF-8 text (byte 13")
    result = run_cli("run", str(path), "--resume")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "not UTF-8" in result.stderr


def test_a_checkpoint_that_is_not_a_zip_says_to_restore_it_or_overwrite(tmp_path):
    path, out = setup(tmp_path)
    (out / "checkpoint.npz").write_bytes(b"not a zip at all")
    with pytest.raises(ConfigError) as err:
        load_checkpoint(out)
    assert_actionable(str(err.value), out / "checkpoint.npz", "unreadable")
    assert not zipfile.is_zipfile(out / "checkpoint.npz")


def test_resume_with_another_partitioner_is_refused_and_an_older_checkpoint_means_contiguous(
        tmp_path):
    path, out = setup(tmp_path)
    file = out / "checkpoint.npz"
    with np.load(file, allow_pickle=False) as data:
        meta = json.loads(data["__meta__"].tobytes())
    older = {k: v for k, v in meta["identity"].items() if k != "partitioner"}
    rewrite_header(file, identity=older)
    resume(path)  # written before partitioners existed: it used contiguous blocks
    path.write_text(path.read_text() + '\n[partitioner]\nname = "iid"\n')
    with pytest.raises(ConfigError, match="partitioner: checkpoint 'contiguous', config 'iid'"):
        resume(path)
