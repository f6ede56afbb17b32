"""The virtual clock's durations (meshkit.simulation) and the ``[simulation]`` table."""

from __future__ import annotations

import math

import numpy as np
import pytest

from meshkit import ConfigError
from meshkit.config import parse_config
from meshkit.simulation import Speeds, lognormal_duration


def test_a_lognormal_duration_is_a_pure_function_of_seed_and_client_with_median_one():
    draws = np.array([lognormal_duration(4, c, 1.0) for c in range(2000)])
    again = np.array([Speeds(seed=4, sigma=1.0).duration(c) for c in range(2000)])
    assert np.array_equal(draws, again)
    assert lognormal_duration(5, 0, 1.0) != draws[0]
    # exp(sigma z): median 1, and log-durations have the standard deviation sigma.
    assert np.median(draws) == pytest.approx(1.0, abs=0.06)
    assert np.log(draws).std() == pytest.approx(1.0, abs=0.05)
    assert lognormal_duration(4, 7, 0.0) == 1.0
    assert lognormal_duration(4, 7, 2.0) == pytest.approx(math.exp(2 * math.log(draws[7])))


def test_a_speeds_file_gives_each_client_its_listed_duration(tmp_path):
    (tmp_path / "speeds.csv").write_text("client,seconds\n0,1.5\n1,0.25\n")
    config = parse_config({"simulation": {"speeds_file": str(tmp_path / "speeds.csv")}},
                          path="run.toml")
    speeds = config.speeds()
    assert speeds.duration(0) == 1.5 and speeds.duration(1) == 0.25
    with pytest.raises(ConfigError, match=r"no duration for client\(s\) 2, 3 of the run's 4"):
        speeds.check_covers(4)


@pytest.mark.parametrize("text, words", [
    ("0,1\n0,2\n", "line 2: client 0 is listed twice"),
    ("0,1,3\n", "line 1: expected 'client,seconds'"),
    ("0,fast\n", "line 1: expected an integer client id and a number of seconds"),
    ("0,0\n", "client 0 takes 0.0 s"),
    ("0,nan\n", "client 0 takes nan s"),
])
def test_a_speeds_file_that_does_not_fit_names_file_key_and_line(tmp_path, text, words):
    (tmp_path / "speeds.csv").write_text(text)
    config = parse_config({"simulation": {"speeds_file": str(tmp_path / "speeds.csv")}},
                          path="run.toml")
    with pytest.raises(ConfigError) as info:
        config.speeds()
    assert "run.toml: [simulation] speeds_file" in str(info.value) and words in str(info.value)


def test_sigma_beside_a_speeds_file_would_do_nothing_and_is_refused(tmp_path):
    (tmp_path / "speeds.csv").write_text("0,1\n")
    config = parse_config({"simulation": {"speeds_file": str(tmp_path / "speeds.csv"),
                                          "sigma": 0.5}}, path="run.toml")
    with pytest.raises(ConfigError, match=r"\[simulation\] sigma: .* would do nothing"):
        config.speeds()


@pytest.mark.parametrize("table, words", [
    ({"clock": "real"}, "clock = 'real': the only clock is \"virtual\""),
    ({"speeds": "uniform"}, "speeds = 'uniform'"),
    ({"sigma": -1.0}, "sigma must be a number from 0 to 10"),
    ({"speed": "lognormal"}, "speed"),
])
def test_a_bad_simulation_table_is_a_config_error_naming_the_key(table, words):
    with pytest.raises(ConfigError) as info:
        parse_config({"simulation": table}, path="run.toml")
    assert "run.toml" in str(info.value) and words in str(info.value)
