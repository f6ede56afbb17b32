"""A third-party secure-aggregation scheme, installed through its entry point, runs a real round.

``tests/fixtures/meshkit-addmask`` is a package of its own (pyproject.toml,
entry point ``addmask``) installed for real with pip into a temporary
directory on PYTHONPATH, outside meshkit. Its ``add-mask`` (pairwise
additive masks, no dropout recovery) is selected by ``[secure_aggregation]
name = "add-mask"``: ``meshkit run`` plays its rounds over real worker
processes, and since it quantises as secagg+ does, the model is secagg+'s
bit for bit. It passes meshkit's contract suite from its own tests, and what
it cannot do (lose a member) is refused naming the trait it does not declare,
by ``meshkit check`` beforehand and by the round when it happens.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import pytest

import meshkit
from meshkit.checkpoint import load_checkpoint
from meshkit.secure_aggregation import SchemeChoice
from meshkit.testing import make_plugin_set, use_plugins
from meshkit.train import LocalPool, StrategyContext, Trainer, secure_sum

from tests.support.cli import pip_install_target, plugin_env, run_cli

PACKAGE = Path(__file__).resolve().parents[2] / "fixtures" / "meshkit-addmask"

JOB = """\
[run]
task = "digits"
seed = 5
out = "{out}"

[mesh]
transport = "tcp"
launch = "local"
workers = 2

[strategy]
name = "federated"
rounds = 2
clients = 6

[secure_aggregation]
name = "{scheme}"
clip_range = 1.0
{extra}
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> str:
    target = tmp_path_factory.mktemp("addmask-site")
    pip_install_target(target, PACKAGE)
    return str(target)


def _config(tmp_path: Path, scheme: str, extra: str = "") -> Path:
    name = scheme.replace("+", "plus")
    path = tmp_path / f"{name}.toml"
    path.write_text(JOB.format(out=tmp_path / name, scheme=scheme, extra=extra))
    return path


@pytest.mark.slow
def test_the_scheme_is_listed_with_its_distribution(site):
    result = run_cli("plugins", pythonpath=site)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if " add-mask " in f" {line} ")
    assert "meshkit-addmask" in line, line


@pytest.mark.slow
def test_the_installed_scheme_passes_the_contract_suite_from_its_own_tests(site):
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "-p", "no:xdist", str(PACKAGE / "tests")],
                            capture_output=True, text=True, env=plugin_env(site), cwd=PACKAGE,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout, result.stdout[-2000:]


@pytest.mark.slow
def test_a_real_run_with_the_third_party_scheme_is_secagg_plus_bit_for_bit(tmp_path, site):
    runs = [subprocess.Popen([sys.executable, "-m", "meshkit", "run", "-q",
                              str(_config(tmp_path, scheme))],
                             cwd=tmp_path, env=plugin_env(site), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
            for scheme in ("add-mask", "secagg+")]
    for process in runs:
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, output
    ours, builtin = load_checkpoint(tmp_path / "add-mask"), load_checkpoint(tmp_path / "secaggplus")
    assert ours.round == builtin.round == 2
    for key, value in builtin.state.items():
        assert ours.state[key].tobytes() == value.tobytes(), key
    rows = [line for line in (tmp_path / "add-mask" / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    assert len(rows) == 2 and all('"secure_sum_of": 6' in row for row in rows), rows


@pytest.mark.slow
def test_check_says_the_scheme_does_not_survive_losing_a_worker(tmp_path, site):
    result = run_cli("check", str(_config(tmp_path, "add-mask")), pythonpath=site)
    assert result.returncode == 0, result.stderr
    assert "aggregation: secure (add-mask)" in result.stdout
    assert ("the scheme does not tolerate dropouts (SecureAggregationTraits.tolerates_dropouts "
            "is false): losing one worker after the keys step stops the round") in result.stdout


@pytest.mark.slow
def test_a_bad_option_of_the_scheme_names_the_file_table_and_key(tmp_path, site):
    result = run_cli("check", str(_config(tmp_path, "add-mask", "modulus_bits = 8")),
                     pythonpath=site)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "add-mask.toml: [secure_aggregation] modulus_bits" in result.stderr, result.stderr


# -- in process: the round refuses what the scheme's traits do not declare ----------------


def _addmask() -> Any:
    sys.path.insert(0, str(PACKAGE))
    try:
        import meshkit_addmask
    finally:
        sys.path.remove(str(PACKAGE))
    return meshkit_addmask


def _task() -> Any:
    return meshkit.plugins.create("task", "synthetic", {"params": 32, "arrays": 2, "rows": 60})


def _play(fail: Callable[[int, Mapping[str, Any]], str | None] | None = None) -> Any:
    plugin = _addmask()
    pset = make_plugin_set(plugin, entry_points=True)
    with use_plugins(plugin):  # the workers build the scheme by name, as a worker process does
        ranks = [1, 2, 3]
        pool = LocalPool({r: Trainer(_task()) for r in ranks}, fail=fail)
        ctx = StrategyContext(
            task=_task(), aggregator=meshkit.plugins.create("aggregator", "fedavg"), pool=pool,
            workers=ranks, rng=np.random.default_rng(0), seed=3,
            outer=meshkit.plugins.create("outer_optimizer", "average"), timeout=30.0)
        scheme = SchemeChoice("add-mask", pset.create("secure_aggregation", "add-mask",
                                                      {"clip_range": 1.0}))
        state = ctx.task.init_state(3)
        return pool, secure_sum(ctx, list(range(6)), state=state, scheme=scheme, rnd=1,
                                shards=6, seeds={c: 70 + c for c in range(6)})


def test_in_process_every_worker_plays_the_named_scheme_and_the_sum_has_every_client():
    pool, revealed = _play()
    keys = [q for _, q in pool.log if q["op"] == "secagg_keys"]
    assert len(keys) == 3 and all(q["scheme"] == "add-mask" for q in keys)
    assert revealed.contributors == tuple(range(6)) and revealed.not_served == {}


def test_a_lost_worker_ends_the_round_naming_the_trait_the_scheme_lacks():
    with pytest.raises(meshkit.RefusedError) as caught:
        _play(fail=lambda rank, q: "gone" if rank == 2 and q["op"] == "secagg_mask" else None)
    message = str(caught.value)
    assert "scheme 'add-mask' cannot unmask a round that lost clients [1, 4] of 6" in message
    assert "lacks the trait SecureAggregationTraits.tolerates_dropouts" in message
