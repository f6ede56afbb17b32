"""``meshkit check``: refuse everything ``meshkit run`` would refuse, before any process starts.

It runs the very start-up checks ``meshkit run`` runs
(:func:`meshkit.train.build_components`), then prints the plan: every
component with its options, the world the run will really have (the
coordinator, the workers and any fixed-function ranks) and the model's
size. With ``--json`` the plan (or the error) is one JSON document on
stdout. Exit status: 0 ok, 2 refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import attrs
import click

from meshkit.aggregation import holds_every_contribution
from meshkit.attack import Attackers
from meshkit.checkpoint import CHECKPOINT_NAME
from meshkit.train._coordinator.plan import check
from meshkit.errors import MeshError
from meshkit.train import QUARANTINE_AFTER, build_components, strategy_traits

__all__ = ["check_command"]


def _ranks(plan: Any, parts: dict[str, Any]) -> str:
    workers = plan.config.mesh.workers
    boards = parts["boards"]
    text = f"world {parts['world']}: the coordinator, {workers} worker(s)"
    if boards:
        text += f" and {len(boards)} fixed-function board(s) ({', '.join(b for b, _ in boards)})"
    return text


def _client_lines(plan: Any, parts: dict[str, Any]) -> list[str]:
    """One line per client: its examples and its examples per label."""
    shares = parts["clients"]
    name = plan.config.partitioner_name
    if shares is None:
        if not strategy_traits(parts["strategy"]).partitioned:
            return []
        return [f"clients: one per worker, each on its node's own data ([partitioner] {name}); "
                f"the coordinator does not see their examples"]
    if shares.sampled:
        return [f"clients: {shares.count} ({shares.source}); {shares.sampled}: "
                f"{shares.summary()}",
                *(f"  {share.describe()}" for share in shares.shares[:10]),
                *([f"  ... {len(shares.shares) - 10} more sampled"]
                  if len(shares.shares) > 10 else [])]
    return [f"clients: {shares.count} ({shares.source})",
            *(f"  {share.describe()}" for share in shares.shares)]


def _aggregation_memory(plan: Any, parts: dict[str, Any]) -> dict[str, Any]:
    """What the aggregator holds on the coordinator per round: every contribution of the
    round's cohort (``StrategyTraits.cohort``, not all the run's clients), or O(model)."""
    shares = parts["clients"]
    clients = shares.count if shares is not None else plan.config.mesh.workers
    cohort = strategy_traits(parts["strategy"]).cohort
    held = int(cohort(clients)) if cohort is not None else clients
    holds = holds_every_contribution(parts["aggregator"])
    model = parts["model"].nbytes
    return {"holds_every_contribution": holds, "contributions": held if holds else 1,
            "clients": clients, "bytes": model * held if holds else model}


def _memory_line(plan: Any, parts: dict[str, Any]) -> str:
    memory = _aggregation_memory(plan, parts)
    name = plan.config.aggregator.name
    if plan.config.secure_aggregation is not None:
        return (f"aggregation: secure ({plan.config.secure_aggregation.name}): the coordinator "
                f"unmasks one sum a round, each client counting once, {name} never sees a "
                f"contribution (O(model): one running masked sum)")
    if memory["holds_every_contribution"]:
        held, clients = memory["contributions"], memory["clients"]
        cohort = (f"a round's cohort of {held:,} of the {clients:,} clients"
                  if held != clients else f"all {clients:,} clients")
        return (f"aggregation: {name} holds every contribution of a round at once "
                f"(O(cohort x model): {cohort}, up to {held:,} x the model, "
                f"{memory['bytes']:,} bytes, plus its float64 working copy)")
    return f"aggregation: {name} streams (O(model): one contribution folded at a time)"
def _attackers_text(clients: Any) -> str:
    return clients.describe() if isinstance(clients, Attackers) else str(list(clients))


def _attackers_json(clients: Any) -> dict[str, Any]:
    """The attackers as JSON: every id, or for a population's many just how many."""
    if isinstance(clients, Attackers) and clients.bijection is not None:
        return {"count": len(clients), "population": clients.population}
    return {"clients": list(clients)}


def _failures(parts: Mapping[str, Any]) -> dict[str, Any] | None:
    """What a member's failure costs in this run (``[strategy] accept_failures``), or None
    for a strategy that does not declare it (``StrategyTraits.accept_failures``)."""
    accept = strategy_traits(parts["strategy"]).accept_failures
    if accept is None:
        return None
    return {"accept_failures": bool(accept), "quarantine_after": QUARANTINE_AFTER}


def _failures_line(failures: dict[str, Any]) -> str:
    if not failures["accept_failures"]:
        return ("member failures: accept_failures = false: any member's error reply, breach, "
                "non-finite contribution or stall stops the run (exit 2, naming the rank)")
    return (f"member failures: accepted (accept_failures = true): a failing rank sits out "
            f"the round, its clients are served by the others; a client failing on two "
            f"ranks is its own failure; a rank failing in {failures['quarantine_after']} "
            f"rounds is quarantined for the run")


def _privacy_line(plan: dict[str, Any]) -> str:
    """The ε a private run will reach, and where its budget stops it."""
    line = (f"privacy: epsilon {plan['epsilon']:.4g} at delta {plan['delta']:g} after "
            f"{plan['rounds']} round(s) (q = {plan['q']:g}, expected cohort "
            f"{plan['expected_cohort']:g})")
    if "rounds_within_target" in plan:
        line += (f"; target_epsilon {plan['target_epsilon']:g} stops the run after round "
                 f"{plan['rounds_within_target']}")
    return line


def _upload_line(upload: dict[str, Any]) -> str:
    """What one client's compressed update carries, against float32."""
    bits = upload["bits_per_coordinate"]
    line = (f"upload: {upload['name']} sends {bits:.3g} bits per coordinate of "
            f"{upload['coordinates']:,} ({32 / bits:.3g}x smaller than float32)"
            if bits else f"upload: {upload['name']} compresses no coordinate of this model")
    if upload["whole"]:
        shown = ", ".join(upload["whole"][:4]) + (", ..." if len(upload["whole"]) > 4 else "")
        line += f"; sent whole: {shown}"
    if upload["residual_bytes"]:
        where = ("stays on the worker each client is pinned to"
                 if upload.get("residual_kept") == "worker" else "travels with each fit")
        line += (f"; error feedback's residual ({upload['residual_bytes']:,} bytes a client) "
                 f"{where}")
    if upload.get("broadcast"):
        line += ("; broadcast: the model goes down the same way, as a delta against the "
                 "model each worker holds (whole in a worker's first round)")
    return line


def _out_note(plan: Any) -> str | None:
    out = Path(plan.config.run.out)
    if (out / CHECKPOINT_NAME).exists():
        return (f"out: {out} holds a checkpoint; `meshkit run` will need --resume (continue "
                f"it) or --overwrite (replace it)")
    return None


def _as_json(plan: Any, parts: dict[str, Any]) -> dict[str, Any]:
    cfg = plan.config
    components = {}
    for selection in cfg.selections():
        component = plan.components[selection.kind]
        opts = plan.options[selection.kind]
        prov = component.provenance
        components[selection.kind] = {
            "name": component.name,
            "plugin": prov.plugin if prov else None,
            "distribution": prov.distribution if prov else None,
            "version": prov.version if prov else None,
            "options": (attrs.asdict(opts) if opts is not None and attrs.has(type(opts))
                        else {}),
        }
    return {
        "ok": True,
        "config": cfg.path,
        "out": cfg.run.out,
        "out_has_checkpoint": (Path(cfg.run.out) / CHECKPOINT_NAME).exists(),
        "world": parts["world"],
        "workers": cfg.mesh.workers,
        "boards": [b for b, _ in parts["boards"]],
        "launch": cfg.mesh.launch,
        "rounds": parts["rounds"],
        "model": parts["model"].to_json(),
        "components": components,
        "aggregation": _aggregation_memory(plan, parts),
        "failures": _failures(parts),
        "attack": (None if parts.get("attack") is None else
                   {"name": parts["attack"].name, **_attackers_json(parts["attack"].clients)}),
        "clients": (None if parts["clients"] is None
                    else [share.to_json() for share in parts["clients"].shares]),
        "client_count": None if parts["clients"] is None else parts["clients"].count,
        "clients_sampled": None if parts["clients"] is None else parts["clients"].sampled,
        "privacy": parts.get("privacy_plan"),
        "secure_aggregation": parts.get("secure_plan"),
        "upload": parts.get("upload"),
        "observers": [
            {"name": component.name,
             "plugin": component.provenance.plugin if component.provenance else None,
             "options": attrs.asdict(opts) if opts is not None and attrs.has(type(opts)) else {}}
            for component, opts in plan.observers],
    }


def _secure_line(plan: dict[str, Any]) -> str:
    """What a secure round survives, in one line."""
    if not plan["tolerates_dropouts"]:
        return (f"secure aggregation: a cohort of {plan['cohort']} clients over "
                f"{plan['workers']} worker(s), at most {plan['clients_per_worker']} each; the "
                f"scheme does not tolerate dropouts (SecureAggregationTraits.tolerates_dropouts "
                f"is false): losing one worker after the keys step stops the round")
    lost, clients = plan["survives_losing_workers"], plan["survives_losing_clients"]
    return (f"secure aggregation: a cohort of {plan['cohort']} clients over {plan['workers']} "
            f"worker(s), at most {plan['clients_per_worker']} each; degree "
            f"{plan['degree']}, threshold {plan['threshold']}: a round survives losing any "
            f"{lost} worker{'' if lost == 1 else 's'} (any {clients} "
            f"client{'' if clients == 1 else 's'}) at any step" + ("" if lost else
                                      "; losing one stops the round: add workers, lower "
                                      "threshold or raise degree"))


def _field_line(plan: dict[str, Any], compression: Any) -> str:
    """What a masked coordinate costs on the wire, and why (the field's width)."""
    bits = plan["modulus_bits"]
    if compression is None:
        return (f"secure aggregation: updates masked mod 2^{bits} ([secure_aggregation] "
                f"modulus_bits): {bits} bits a coordinate up")
    codes = compression.compressor.field_bits
    step = 2 * plan["clip_range"] / ((1 << codes) - 1)
    return (f"secure aggregation: updates masked mod 2^{bits} ([compression] "
            f"{compression.name!r}'s {codes}-bit codes summed over {plan['cohort']} clients): "
            f"{bits} bits a coordinate up; the shared grid is [-{plan['clip_range']:g}, "
            f"{plan['clip_range']:g}] ([secure_aggregation] clip_range) in steps of "
            f"{step:.3g}: set clip_range near the largest coordinate of a client's update")


@click.command("check")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("-q", "--quiet", is_flag=True, help="Print only the final line (ok).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the resolved plan (or the error) as JSON on stdout.")
def check_command(config: str, quiet: bool, as_json: bool) -> None:
    """Validate CONFIG, resolve every named component, print the plan.

    Components and the initial model are built and every start-up check of
    `run` runs, so `check` refuses everything `run` would refuse before
    starting a process. Exit status: 0 ok, 2 refused.
    """
    try:
        plan = check(config)
        parts = build_components(plan)
    except MeshError as exc:
        if as_json:
            click.echo(json.dumps({"ok": False, "error": str(exc)}))
        raise
    if as_json:
        click.echo(json.dumps(_as_json(plan, parts), indent=2, default=str))
        return
    if not quiet:
        for line in plan.describe(world=parts["world"]):
            click.echo(line)
        click.echo(_ranks(plan, parts))
        click.echo(f"model: {parts['model'].describe()}")
        click.echo(_memory_line(plan, parts))
        failures = _failures(parts)
        if failures is not None:
            click.echo(_failures_line(failures))
        attack = parts.get("attack")
        if attack is not None:
            click.echo(f"attackers: clients {_attackers_text(attack.clients)} run {attack.name} (the "
                       f"coordinator holds each round's contributions to poison them; every "
                       f"attacked contribution is listed in metrics.jsonl's attacked)")
        for line in _client_lines(plan, parts):
            click.echo(line)
        if parts["rounds"] == 0:
            click.echo("rounds = 0: evaluation only; no worker is started")
        if parts.get("privacy_plan"):
            click.echo(_privacy_line(parts["privacy_plan"]))
        if parts.get("secure_plan"):
            click.echo(_secure_line(parts["secure_plan"]))
            click.echo(_field_line(parts["secure_plan"], parts.get("compression")))
        # Under secure aggregation the field line above says what a coordinate costs: the
        # payload of a plain compressed fit is never sent.
        if parts.get("upload") and not parts.get("secure_plan"):
            click.echo(_upload_line(parts["upload"]))
        note = _out_note(plan)
        if note:
            click.echo(note)
    click.echo("ok")
