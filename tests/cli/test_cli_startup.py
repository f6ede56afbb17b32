"""Start-up: ``--version``, ``--help`` and ``meshkit plugins`` load no heavy code.

The group lists its commands from a table without importing them; these
tests hold the table to the commands it stands for.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest

from meshkit.cli import _COMMANDS, main

from tests.support.cli import run_cli
def test_version_and_help():
    assert run_cli("--version").stdout.strip() == "meshkit, version 0.1.0"
    help_text = run_cli("--help").stdout
    assert "plugins" in help_text and "check" in help_text


@pytest.mark.parametrize("args", [["--help"], ["plugins"], ["plugins", "--json"]])
def test_help_and_plugins_import_no_heavy_code(args):
    """Listing must stay fast everywhere: no plugin may import numpy (or torch) to list."""
    code = textwrap.dedent(f"""
        import sys
        from meshkit.cli import main
        try:
            main({args!r}, standalone_mode=False)
        finally:
            heavy = sorted(m for m in ("numpy", "torch", "ml_dtypes") if m in sys.modules)
            print("HEAVY:" + ",".join(heavy), file=sys.stderr)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "HEAVY:\n" in result.stderr or result.stderr.rstrip().endswith("HEAVY:"), result.stderr


def test_the_command_table_holds_each_commands_own_help():
    for name, (_, summary) in _COMMANDS.items():
        command = main.get_command(None, name)
        assert command is not None and command.name == name
        first = inspect.cleandoc(command.help or "").split("\n\n")[0]
        assert " ".join(first.split()) == summary, (
            f"meshkit.cli._COMMANDS[{name!r}] says {summary!r}; the command's help opens "
            f"with {first!r}")


def test_help_lists_the_commands_as_if_every_one_were_loaded():
    code = textwrap.dedent("""
        import sys
        from click.testing import CliRunner
        from meshkit.cli import _COMMANDS, main

        lazy = CliRunner().invoke(main, ["--help"]).output
        assert "numpy" not in sys.modules
        for name in _COMMANDS:
            main.get_command(None, name)
        assert "numpy" in sys.modules  # the commands really are loaded now
        loaded = CliRunner().invoke(main, ["--help"]).output
        assert lazy == loaded, (lazy, loaded)
        print(loaded)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "coordinator  Run only the coordinator of CONFIG" in result.stdout
