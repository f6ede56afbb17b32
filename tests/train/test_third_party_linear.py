"""A third-party linear aggregator gets every guarantee fedavg gets; one that declares nothing is refused.

``tests/fixtures/meshkit-workmean`` is installed for real (pip, its own
pyproject.toml and entry point, into a temporary directory on PYTHONPATH),
outside meshkit's package. Its ``work-mean`` declares
``AggregatorTraits(linear=True)`` with the default weight, so it is the
weighted mean fedavg is: under ``[privacy]``, ``[secure_aggregation]``, a
batched round, host relays and torchrun's spmd rounds the model is fedavg's,
bit for bit, and nothing in the kernel names it. Its ``undeclared-mean`` (the
same arithmetic, no ``traits``) is refused by each path that only has sums,
naming the config keys and the missing trait. Real processes (``meshkit
run``, ``meshkit check``, torchrun) throughout; the in-process test proves the
batched round really played batched.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meshkit.checkpoint import load_checkpoint
from meshkit.train import fold_round

from tests.support.cli import pip_install_target, plugin_env, run_cli
from tests.support.rounds import fits, make_ctx, same_bytes

pytestmark = pytest.mark.slow

PACKAGE = Path(__file__).resolve().parents[1] / "fixtures" / "meshkit-workmean"

JOB = """\
[run]
task = "digits"
seed = 3
out = "{out}"

[mesh]
transport = "tcp"
launch = "local"
workers = 2
{mesh}

[strategy]
name = "federated"
rounds = 2
clients = 6
{strategy}

[aggregator]
name = "{aggregator}"

{tables}
"""

PRIVACY = """\
[privacy]
name = "dp-fixed"
clip_norm = 1.0
noise_multiplier = 0.5
noise = "seeded"  # reproducible noise, so two runs can be compared bit for bit
"""

SECURE = """\
[secure_aggregation]
name = "secagg+"
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> str:
    target = tmp_path_factory.mktemp("workmean-site")
    pip_install_target(target, PACKAGE)
    return str(target)


def _config(tmp_path: Path, aggregator: str, *, mesh: str = "", strategy: str = "",
            tables: str = "") -> Path:
    path = tmp_path / f"{aggregator}.toml"
    path.write_text(JOB.format(out=tmp_path / aggregator, mesh=mesh, strategy=strategy,
                               aggregator=aggregator, tables=tables))
    return path


def _run_both(tmp_path: Path, site: str, **tables: str) -> None:
    """``meshkit run`` of the job with fedavg and with the package's work-mean, side by side."""
    runs = [subprocess.Popen([sys.executable, "-m", "meshkit", "run", "-q",
                              str(_config(tmp_path, name, **tables))],
                             cwd=tmp_path, env=plugin_env(site), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
            for name in ("fedavg", "work-mean")]
    for process in runs:
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, output


def _same_model(tmp_path: Path) -> None:
    fedavg, theirs = load_checkpoint(tmp_path / "fedavg"), load_checkpoint(tmp_path / "work-mean")
    assert fedavg.round == theirs.round == 2
    assert fedavg.state.keys() == theirs.state.keys()
    for key, value in fedavg.state.items():
        assert theirs.state[key].tobytes() == value.tobytes(), key


def _refused(tmp_path: Path, site: str, *words: str, **tables: str) -> None:
    result = run_cli("check", str(_config(tmp_path, "undeclared-mean", **tables)),
                     pythonpath=site)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    for word in ("[aggregator] name = 'undeclared-mean'", "declares no traits",
                 "lacks the trait AggregatorTraits.linear = True", *words):
        assert word in result.stderr, (word, result.stderr)


def test_the_package_is_found_through_its_entry_point_with_its_distribution(site):
    result = run_cli("plugins", pythonpath=site)
    assert result.returncode == 0, result.stderr
    for name in ("work-mean", "sqrt-work-mean", "undeclared-mean"):
        line = next(line for line in result.stdout.splitlines() if f" {name} " in f" {line} ")
        assert "meshkit-workmean" in line, line


def test_under_privacy_it_runs_and_the_model_is_fedavgs_bit_for_bit(tmp_path, site):
    _run_both(tmp_path, site, strategy='sampling = "poisson"\nfraction = 0.5', tables=PRIVACY)
    _same_model(tmp_path)


def test_under_privacy_an_aggregator_that_declares_nothing_is_refused_naming_the_trait(
        tmp_path, site):
    _refused(tmp_path, site, "[privacy] name = 'dp-fixed'", "noised sum",
             strategy='sampling = "poisson"\nfraction = 0.5', tables=PRIVACY)


def test_under_secure_aggregation_it_runs_and_the_model_is_fedavgs_bit_for_bit(tmp_path, site):
    _run_both(tmp_path, site, tables=SECURE)
    _same_model(tmp_path)


def test_under_secure_aggregation_one_that_declares_nothing_is_refused_naming_the_trait(
        tmp_path, site):
    _refused(tmp_path, site, "[secure_aggregation] name = 'secagg+'", "masked updates",
             tables=SECURE)


def test_through_host_relays_it_runs_and_the_model_is_fedavgs_bit_for_bit(tmp_path, site):
    _run_both(tmp_path, site, mesh="relays = 1")
    _same_model(tmp_path)


def test_a_batched_round_is_fedavgs_bit_for_bit(tmp_path, site):
    _run_both(tmp_path, site)
    _same_model(tmp_path)


def _installed(site: str, name: str):
    sys.path.insert(0, site)
    try:
        module = importlib.import_module("meshkit_workmean")
    finally:
        sys.path.remove(site)
    return getattr(module, name)()


def test_in_process_a_declared_linear_rule_plays_batched_and_one_that_declares_nothing_flat(
        site):
    state = make_ctx().task.init_state(0)
    expected = fold_round(make_ctx(workers=2), fits(9), state=state)
    linear = make_ctx(workers=2)
    linear.aggregator = _installed(site, "WorkMean")
    folded = fold_round(linear, fits(9), state=state)
    assert "fit_batch" in [r["op"] for _, r in linear.pool.log]
    assert same_bytes(folded.result, expected.result)
    undeclared = make_ctx(workers=2)
    undeclared.aggregator = _installed(site, "UndeclaredMean")
    flat = fold_round(undeclared, fits(9), state=state)
    ops = [r["op"] for _, r in undeclared.pool.log]
    assert "fit_batch" not in ops and "take" in ops  # each fit pulled, folded by its own fold
    for key, value in flat.result.items():  # its own float64 mean: fedavg's to float32 precision
        np.testing.assert_allclose(value, expected.result[key], rtol=2e-6, atol=1e-7)


class _Recorder:
    """A fold that keeps every contribution and its weight (to compute a rule by hand)."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict, float]] = []

    def add(self, state, weight=1.0, *, source=None):
        self.seen.append((dict(state), float(weight)))

    def result(self):
        return None


def test_a_linear_rule_with_its_own_weight_folds_flat_through_its_own_fold(site):
    state = make_ctx().task.init_state(0)
    ctx = make_ctx(workers=2)
    ctx.aggregator = _installed(site, "SqrtWorkMean")
    folded = fold_round(ctx, fits(9), state=state)
    # Its weight(w) = √w cannot travel to a worker's batch: the round folds flat.
    assert "fit_batch" not in [r["op"] for _, r in ctx.pool.log]
    recorder = _Recorder()
    fold_round(make_ctx(workers=2), fits(9), state=state, fold=recorder)
    assert len(recorder.seen) == 9 and len({w for _, w in recorder.seen}) > 1
    omega = [np.sqrt(w) for _, w in recorder.seen]
    for key, value in folded.result.items():
        if np.issubdtype(value.dtype, np.floating):
            by_hand = sum(o * s[key].astype(np.float64) for o, (s, _) in zip(omega, recorder.seen))
            np.testing.assert_allclose(value, by_hand / sum(omega), rtol=2e-6, atol=1e-7)


TORCH_JOB = """\
[run]
task = "digits"
seed = 5
out = "{out}"

[mesh]
transport = "{transport}"
workers = 2
timeout = 20

{transport_table}

[strategy]
name = "federated"
rounds = 2
clients = 8

[aggregator]
name = "{aggregator}"
"""


def _torch_config(tmp_path: Path, name: str, aggregator: str, spmd: bool) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(TORCH_JOB.format(
        out=tmp_path / name, transport="torchdist" if spmd else "tcp",
        transport_table='[transport]\nmode = "spmd"' if spmd else "", aggregator=aggregator))
    return path


def test_torchrun_spmd_plays_it_and_the_model_is_fedavgs_on_the_star_bit_for_bit(tmp_path, site):
    pytest.importorskip("torch.distributed")
    spmd = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "meshkit_torchdist", str(_torch_config(tmp_path, "spmd", "work-mean", True))],
        cwd=tmp_path, env=plugin_env(site), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    star = subprocess.run([sys.executable, "-m", "meshkit", "run", "-q",
                           str(_torch_config(tmp_path, "star", "fedavg", False))],
                          cwd=tmp_path, env=plugin_env(site), capture_output=True, text=True,
                          timeout=300)
    assert star.returncode == 0, star.stdout + star.stderr
    output, _ = spmd.communicate(timeout=300)
    assert spmd.returncode == 0, output
    reference, theirs = load_checkpoint(tmp_path / "star"), load_checkpoint(tmp_path / "spmd")
    assert theirs.round == reference.round == 2
    for key, value in reference.state.items():
        assert theirs.state[key].tobytes() == value.tobytes(), key


def test_torchrun_spmd_refuses_one_that_declares_nothing_naming_the_trait(tmp_path, site):
    pytest.importorskip("torch.distributed")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
         "-m", "meshkit_torchdist",
         str(_torch_config(tmp_path, "spmd", "undeclared-mean", True))],
        cwd=tmp_path, env=plugin_env(site), capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "[aggregator] with [transport] mode = \"spmd\"" in output, output
    assert "lacks the trait AggregatorTraits.linear = True" in output, output
