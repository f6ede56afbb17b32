"""A node's digits CSV: every value checked, and no error quotes what the file holds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from meshkit_tasks.digits import load_digits, read_digits_csv

from meshkit import ConfigError


def write(path: Path, rows: list[list[str]]) -> str:
    path.write_text("".join(",".join(row) + "\n" for row in rows))
    return str(path)


def good_rows(n: int = 3) -> list[list[str]]:
    x, y = load_digits()
    return [[f"{v:g}" for v in x[i]] + [str(y[i])] for i in range(n)]


def refusal(path: str) -> str:
    with pytest.raises(ConfigError) as info:
        read_digits_csv(path, key="train_csv")
    return str(info.value)


def test_a_good_file_reads_back_its_rows(tmp_path):
    x, y = read_digits_csv(write(tmp_path / "ok.csv", good_rows(3)))
    want_x, want_y = load_digits()
    assert x.shape == (3, 64) and np.array_equal(x, want_x[:3]) and np.array_equal(y, want_y[:3])


@pytest.mark.parametrize("value, what", [("nan", "not finite"), ("inf", "not finite"),
                                         ("1e308", "out of range"), ("-1", "out of range"),
                                         ("16.5", "out of range")])
def test_a_pixel_that_is_not_finite_or_out_of_range_is_named_by_file_row_and_column(
        tmp_path, value, what):
    rows = good_rows(3)
    rows[1][4] = value
    path = write(tmp_path / "bad.csv", rows)
    message = refusal(path)
    assert f"train_csv = {path!r}" in message and "row 2, column 5" in message
    assert what in message and "0..16" in message


@pytest.mark.parametrize("label", ["10", "2.5", "-1", "nan"])
def test_a_label_that_is_not_a_digit_is_named(tmp_path, label):
    rows = good_rows(2)
    rows[0][64] = label
    message = refusal(write(tmp_path / "bad.csv", rows))
    assert "row 1, column 65" in message and "a label 0..9" in message


def test_an_empty_file_is_refused_not_trained_as_a_client_of_no_examples(tmp_path):
    (tmp_path / "empty.csv").write_text("\n# only a comment\n")
    assert "holds no rows" in refusal(str(tmp_path / "empty.csv"))


def test_a_row_of_the_wrong_width_is_named(tmp_path):
    rows = good_rows(3)
    rows[2] = rows[2][:10]
    assert "row 3 has 10 columns; expected 65" in refusal(write(tmp_path / "w.csv", rows))


def test_the_error_for_a_file_that_is_not_numbers_never_quotes_its_contents(tmp_path):
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n")
    message = refusal(str(secret))
    assert "row 1 has 1 columns" in message and "root:x" not in message
    wide = ["s3cr3t-field"] + ["0"] * 64
    message = refusal(write(tmp_path / "wide.csv", [wide]))
    assert "row 1, column 1 is not a number" in message and "s3cr3t" not in message


def test_a_binary_file_is_refused_without_its_bytes(tmp_path):
    blob = tmp_path / "blob"
    blob.write_bytes(b"\xff\xfe" + b"\x00" * 100)
    message = refusal(str(blob))
    assert "not UTF-8 text" in message and "xff" not in message
