"""The ``meshkit`` command line. Every :class:`MeshError` is a message and exit 2.

Exit statuses, the same for every command (docs/cli.md has the table): 0
done; 2 a user's mistake or a refusal (one paragraph on stderr, no
traceback); 130 / 143 interrupted by Ctrl-C / SIGTERM; 1 a bug (the
traceback is printed).

Each command lives in a module named for it and loads only when it runs:

* ``_plugins`` — ``meshkit plugins``;
* ``_check`` — ``meshkit check``;
* ``_run`` — ``meshkit run`` and ``meshkit coordinator``;
* ``_keygen`` — ``meshkit keygen``;
* ``_export`` — ``meshkit export`` (a run's model through an exporter plugin);
* ``_node`` — ``meshkit node`` (with ``_options``: ``KEY=VALUE`` flags and
  the secret);
* ``_relay`` — ``meshkit relay`` (a host relay, from the transport);
* ``_serve`` — ``meshkit serve`` and its clients ``submit``, ``ls``, ``status``,
  ``logs``, ``stop``.

``meshkit --help`` lists the commands from :data:`_COMMANDS` without loading
any, so it starts fast everywhere (no numpy, no plugin's heavy code).
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

import click

from meshkit import __version__
from meshkit.errors import MeshError

__all__ = ["main", "read_secret", "parse_options", "parse_board_options"]

#: Helpers re-exported from ``_options``, loaded on first use: they reach
#: meshkit.wire (numpy), which ``meshkit --help`` must not import.
_LAZY = {"read_secret", "parse_options", "parse_board_options"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module("meshkit.cli._options"), name)
    raise AttributeError(f"module 'meshkit.cli' has no attribute {name!r}")

#: Every command: name -> (its "module:attribute", the first paragraph of its
#: help, which ``meshkit --help`` shortens the way click would).
_COMMANDS: Mapping[str, tuple[str, str]] = {
    "check": ("meshkit.cli._check:check_command",
              "Validate CONFIG, resolve every named component, print the plan."),
    "coordinator": ("meshkit.cli._run:coordinator",
                    "Run only the coordinator of CONFIG, for nodes started elsewhere."),
    "export": ("meshkit.cli._export:export_command", "Write RUN's model in an exporter's format (torch, safetensors, ...)."),
    "keygen": ("meshkit.cli._keygen:keygen",
               "Write a node key pair: FILE (private, 0600) and FILE.pub."),
    "node": ("meshkit.cli._node:node",
             "Join a mesh as a worker, or with --board as a fixed-function rank."),
    "plugins": ("meshkit.cli._plugins:plugins_command",
                "List every discovered component, and plugins that failed to load."),
    "relay": ("meshkit.cli._relay:relay",
              "A host relay: one connection to the coordinator for this host's ranks."),
    "run": ("meshkit.cli._run:run", "Run the training job CONFIG."),
    "serve": ("meshkit.cli._serve:serve",
              "Run the service CONFIG ([serve] table): nodes join once, runs come and go."),
    "submit": ("meshkit.cli._serve:submit", "Submit the run CONFIG to a service; prints its run id."),
    "ls": ("meshkit.cli._serve:ls", "List the service's runs, oldest first."),
    "status": ("meshkit.cli._serve:status", "Show RUN: its state, rounds and latest metrics."),
    "logs": ("meshkit.cli._serve:logs",
             "Print RUN's events (rounds, nodes, the end); with --follow, as they happen."),
    "stop": ("meshkit.cli._serve:stop",
             "Stop RUN: a queued run never starts; a running one ends after its round, "
             "checkpoint kept."),
}


class _MeshGroup(click.Group):
    """A click group that turns a MeshError into one paragraph and exit status 2.

    Its commands load on first use (:data:`_COMMANDS`), so listing them
    imports none of the code they drive.
    """

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except MeshError as exc:
            click.echo(f"meshkit: error: {exc}", err=True)
            ctx.exit(2)
        except KeyboardInterrupt:
            # Not click's "Aborted!" and status 1 (a bug's): an interrupt is
            # 130, as for `meshkit run` (which says how to resume itself).
            click.echo("meshkit: interrupted", err=True)
            ctx.exit(130)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in _COMMANDS:
            module, _, attribute = _COMMANDS[cmd_name][0].partition(":")
            self.add_command(getattr(importlib.import_module(module), attribute), cmd_name)
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # A command not loaded yet is described by its table entry, shortened
        # by click itself, so the listing reads as if every command were loaded.
        names = self.list_commands(ctx)
        shown = {name: self.commands.get(name) or click.Command(name, help=_COMMANDS[name][1])
                 for name in names}
        limit = formatter.width - 6 - max(map(len, names))
        rows = [(name, cmd.get_short_help_str(limit)) for name, cmd in shown.items()
                if not cmd.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=_MeshGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="meshkit")
def main() -> None:
    """meshkit: train and serve models across a mesh of heterogeneous nodes.

    Components (transports, aggregators, outer optimizers, boards, strategies,
    tasks) come from plugins in the `meshkit` entry-point group; select them by
    name in one TOML config.
    """


if __name__ == "__main__":  # pragma: no cover
    main()
