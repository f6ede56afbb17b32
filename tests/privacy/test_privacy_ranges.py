"""Every ``[privacy]`` value is validated to a range its mechanism and accountant can use
(issue 34): a value outside is a ``ConfigError`` naming the file, table and key, and a
client's ``unclipped`` report cannot overflow the adaptive clip norm."""

from __future__ import annotations

import math

import numpy as np
import pytest

from meshkit_privacy import AdaptiveClip

from tests.support.cli import run_cli

PRIVATE = """
[run]
task = "digits"
out = "{out}"

[strategy]
name = "federated"
clients = 4
rounds = {rounds}

[privacy]
name = "{name}"
{extra}
"""


def _check(tmp_path, *, name="dp-fixed", extra="", rounds=3):
    path = tmp_path / "private.toml"
    path.write_text(PRIVATE.format(out=tmp_path / "run", name=name, extra=extra,
                                   rounds=rounds))
    return path, run_cli("check", str(path))


@pytest.mark.parametrize("name, extra, key", [
    ("dp-fixed", "noise_multiplier = 1e-300", "noise_multiplier"),  # ZeroDivisionError before
    ("dp-fixed", "noise_multiplier = 0.01", "noise_multiplier"),  # terabytes of PLD grid
    ("dp-fixed", "noise_multiplier = inf", "noise_multiplier"),
    ("dp-fixed", "noise_multiplier = nan", "noise_multiplier"),
    ("dp-fixed", "clip_norm = 1e300", "clip_norm"),
    ("dp-fixed", "delta = 1e-300", "delta"),  # the PLD read ε as infinite
    ("dp-adaptive", "count_noise_multiplier = 1e-300", "count_noise_multiplier"),
    ("dp-adaptive", "clip_lr = 1e300", "clip_lr"),
])
def test_a_value_the_mechanism_cannot_use_is_refused_naming_file_table_and_key(
        tmp_path, name, extra, key):
    path, result = _check(tmp_path, name=name, extra=extra)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith(f"meshkit: error: {path}: [privacy] ")
    assert key in result.stderr


def test_a_small_noise_multiplier_is_accepted_with_the_rdp_accountant(tmp_path):
    path, result = _check(tmp_path, extra='noise_multiplier = 0.01\naccountant = "rdp"')
    assert result.returncode == 0, result.stderr


def test_more_rounds_than_the_accountant_composes_are_refused(tmp_path):
    path, result = _check(tmp_path, rounds=2 ** 63 - 1)  # a MemoryError before
    assert result.returncode == 2, result.stderr
    assert f"{path}: [strategy] rounds = {2 ** 63 - 1}: a private run" in result.stderr


@pytest.mark.parametrize("unclipped", [-10 ** 9, 10 ** 30, 0, 40])
def test_no_count_of_unclipped_updates_overflows_the_adaptive_clip_norm(unclipped):
    # A client's report is hostile input: -1e9 raised OverflowError in math.exp.
    rule = AdaptiveClip(target_quantile=0.5, clip_lr=0.2, count_z=10.0)
    clip = rule.next_clip(1.0, unclipped, expected=4.0, rng=np.random.default_rng(0))
    assert math.isfinite(clip) and clip > 0


def test_an_honest_count_moves_the_clip_norm_by_the_papers_step():
    rule = AdaptiveClip(target_quantile=0.5, clip_lr=0.2, count_z=1e-9)
    clip = rule.next_clip(2.0, 0, expected=4.0, rng=np.random.default_rng(0))
    assert clip == pytest.approx(2.0 * math.exp(0.2 * 0.5), rel=1e-9)  # float64 throughout
