"""docs/writing-a-plugin.md lists every RoundReport field, in one table (issue 35 item 12)."""

from __future__ import annotations

import re
from pathlib import Path

import attrs

from meshkit.train import RoundReport

DOC = (Path(__file__).resolve().parents[3] / "docs" / "writing-a-plugin.md").read_text()


def test_every_round_report_field_is_in_the_plugin_guides_table():
    table = DOC[DOC.index("| field | type | meaning |"):]
    table = table[:table.index("\n\n")]
    documented = set(re.findall(r"`(\w+)`", "\n".join(
        row.split("|")[1] for row in table.splitlines()[2:])))
    assert documented == {f.name for f in attrs.fields(RoundReport)}
    assert "`report.to_json()` returns `dict[str, Any]`" in DOC
