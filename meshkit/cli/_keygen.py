"""``meshkit keygen``: a node's Ed25519 key pair, for ``meshkit node --key``.

The private key is written mode 0600 (a key others can read is refused when
loaded); the public key goes to ``FILE.pub`` as one ``authorized_nodes``
line, its ``rank=``/``tag=`` bindings included, which is also printed,
ready to append to the coordinator's file.
:mod:`meshkit.cli` loads this module only when the command runs.
"""

from __future__ import annotations

from pathlib import Path

import click

from meshkit import wire

__all__ = ["keygen"]


@click.command("keygen", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--comment", default="", help="Text after the key on the .pub line (a name).")
@click.option("--rank", "ranks", type=int, multiple=True,
              help="Bind the printed authorized_nodes line to this rank (repeatable).")
@click.option("--tag", "tags", multiple=True,
              help="Bind a placement tag to the printed line (repeatable); only keys bound "
                   "to a tag may carry it.")
@click.option("--force", is_flag=True, help="Replace FILE and FILE.pub if they exist.")
def keygen(file: str, comment: str, ranks: tuple[int, ...], tags: tuple[str, ...],
           force: bool) -> None:
    """Write a node key pair: FILE (private, 0600) and FILE.pub.

    Prints the public key as an authorized_nodes line; append it to the file
    named by the coordinator's [mesh] authorized_nodes (add `rank=N` to bind
    it to a rank, `tag=T` to bind a placement tag, or start the line with
    `revoked` to refuse it later).
    """
    if tags and not all(t and "," not in t and not t.isspace() and " " not in t for t in tags):
        raise click.UsageError("--tag takes one name without spaces or commas")
    public = wire.generate_node_key(file, comment=comment, overwrite=force)
    line = wire.public_key_text(public)
    if ranks:
        line += " rank=" + ",".join(str(r) for r in ranks)
    if tags:
        line += " tag=" + ",".join(tags)
    if comment:
        line += f" {comment}"
    # FILE.pub is the same line, bindings included: `cat keys/*.pub > authorized`
    # must keep them (the public key alone would admit the node at any rank).
    Path(f"{file}.pub").write_text(line + "\n")
    click.echo(line)
    click.echo(f"wrote {file} (private, mode 600) and {file}.pub; fingerprint "
               f"{wire.fingerprint(public)}", err=True)
