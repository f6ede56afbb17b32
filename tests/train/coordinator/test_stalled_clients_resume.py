"""A client whose fit stalled two ranks stays out of a resumed run too (issue 34's last note).

Each try of such a client costs a worker (the pool declares it dead at the
stall timeout), so the run does not try it again: ``StrategyContext.stalled_clients``.
That used to live only in memory -- a ``--resume`` learned it again, at the cost of
two more workers. The checkpoint now keeps it.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import attrs
import numpy as np
import pytest

from meshkit.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from meshkit.errors import ConfigError
from meshkit.train import build_components
from meshkit.train._coordinator.plan import check
from meshkit.train._coordinator.resume import identity, prepare_out

WHY = ("failed on 2 ranks, so the failure is its own (rank 1: lost while fitting it (no "
       "reply within 4 s); rank 2: lost while fitting it (no reply within 4 s))")


def test_the_checkpoint_keeps_the_stalled_clients(tmp_path):
    save_checkpoint(tmp_path, Checkpoint(round=3, state={"w": np.zeros(2)},
                                         stalled_clients={7: WHY, 12: "x"}))
    assert load_checkpoint(tmp_path).stalled_clients == {"7": WHY, "12": "x"}
    save_checkpoint(tmp_path, Checkpoint(round=4, state={"w": np.zeros(2)}))
    assert load_checkpoint(tmp_path).stalled_clients == {}  # none: no header field


def test_a_damaged_stalled_entry_is_a_config_error_naming_it(tmp_path):
    save_checkpoint(tmp_path, Checkpoint(round=1, state={"w": np.zeros(2)},
                                         stalled_clients={3: WHY}))
    file = tmp_path / "checkpoint.npz"
    with np.load(file, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    meta = json.loads(arrays["__meta__"].tobytes())
    meta["stalled"] = {"three": 5}
    arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    np.savez(file, **arrays)
    with pytest.raises(ConfigError, match=r"stalled is not a JSON object of client number -> "
                                          r"reason"):
        load_checkpoint(tmp_path)


def test_resume_hands_the_stalled_clients_to_the_run(tmp_path):
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
    assert parts["stalled_clients"] == {}
    line = {"round": 2, "rounds": 4, "strategy": "federated"}
    save_checkpoint(out, Checkpoint(
        round=2, state=parts["task"].init_state(0), identity=identity(plan), report=line,
        rng_state=parts["rng"].bit_generator.state, stalled_clients={3: WHY}))
    (out / "metrics.jsonl").write_text(
        "".join(json.dumps({**line, "round": r}) + "\n" for r in (1, 2)))
    parts = build_components(plan)
    prepare_out(plan, parts, resume=True)
    assert parts["stalled_clients"] == {3: WHY}


@pytest.mark.slow
def test_a_resumed_run_does_not_try_a_stalled_client_again_and_keeps_it(tmp_path):
    from meshkit.train import Runner

    from tests.support.configs import write_config

    config = write_config(tmp_path / "run.toml", tmp_path / "out", workers=2, rounds=1,
                          extra="clients = 3")
    first = Runner(str(config)).run()
    assert first.ok and first.rounds_completed == 1, first.error
    # As the round engine records a client that stalled two ranks (engine.py, _lost).
    ckpt = load_checkpoint(tmp_path / "out")
    save_checkpoint(tmp_path / "out", attrs.evolve(ckpt, stalled_clients={1: WHY}))
    config.write_text(config.read_text().replace("rounds = 1", "rounds = 2"))
    second = Runner(str(config), resume=True).run()
    assert second.ok and second.rounds_completed == 2, second.error
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [row["round"] for row in rows] == [1, 2]
    assert rows[1]["not_served"] == {"1": f"quarantined: {WHY}"}, rows[1]
    assert sorted(map(int, rows[1]["served"])) == [0, 2] and rows[1]["dropped"] == []
    assert load_checkpoint(tmp_path / "out").stalled_clients == {"1": WHY}
