"""What a run may do with the out directory it finds: start afresh, or continue.

* A fresh run never replaces another run's checkpoint: an out directory
  holding one is refused unless ``--overwrite`` says to replace it
  (``--resume`` continues it instead, or another ``out`` leaves it alone).
* ``--resume`` trusts nothing it reads back: the checkpoint must be this
  run's (task, strategy, seed, aggregator, outer optimizer), its model must
  have the shapes this config's task builds, its RNG state must be one for
  this run's generator and its outer-optimizer state (and a stateful
  aggregator's, such as centered clipping's centre) must load; and each
  ``metrics.jsonl`` line it keeps must be a round. Each failure is a
  :class:`ConfigError` naming the file, what is wrong and what to do.
* ``--resume`` of a run whose checkpoint already covers every round is
  complete: nothing is started, and its results are left as they are.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

import attrs

from meshkit.aggregation import load_aggregator_state
from meshkit.checkpoint import Checkpoint, checkpoint_path, load_checkpoint
from meshkit.errors import ConfigError, MeshError
from meshkit.partitioner import DEFAULT_PARTITIONER
from meshkit.spill import Spill, spill_dir
from meshkit.train._coordinator.artifacts import clear_results, truncate_metrics

__all__ = ["Start", "prepare_out", "identity"]

log = logging.getLogger(__name__)


@attrs.frozen
class Start:
    """Where a run begins: after round ``round`` (0 for a fresh run)."""

    round: int = 0
    resumed: bool = False
    #: The checkpoint already covers every round the config asks for.
    complete: bool = False
    checkpoint: Checkpoint | None = attrs.field(default=None, repr=False)


def identity(plan: Any) -> dict[str, Any]:
    """What makes a checkpoint this run's (checked by ``--resume``)."""
    cfg = plan.config
    return {"task": cfg.run.task, "strategy": cfg.strategy.name, "seed": cfg.run.seed,
            "aggregator": cfg.aggregator.name, "outer_optimizer": cfg.outer_optimizer.name,
            "partitioner": cfg.partitioner_name,
            "attack": None if cfg.attack is None else cfg.attack.selection.name,
            "privacy": "" if cfg.privacy is None else cfg.privacy.name,
            "simulation": "" if cfg.simulation is None else cfg.simulation.clock,
            "compression": "" if cfg.compression is None else cfg.compression.name}


#: What a checkpoint written before a key joined the identity meant by it.
_BEFORE: dict[str, Any] = {"partitioner": DEFAULT_PARTITIONER, "attack": None, "privacy": "",
                           "simulation": "", "compression": ""}


def prepare_out(plan: Any, parts: dict[str, Any], *, resume: bool = False,
                overwrite: bool = False) -> Start:
    """Create ``[run] out`` and decide where the run starts (see the module docstring).

    On resume, ``parts`` (from :func:`~meshkit.train._coordinator.preflight.build_components`)
    gets the checkpoint's model, and its outer optimizer and RNG their saved
    states.
    """
    cfg = plan.config
    out = Path(cfg.run.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{cfg.path}: [run] out = {cfg.run.out!r}: cannot create it: "
                          f"{exc.strerror or exc}; choose a directory you can write to") from None
    parts["spill"] = _open_spill(cfg, out) if cfg.run.spill else None
    if resume:
        return _resume(plan, out, parts)
    if not overwrite and checkpoint_path(out).exists():
        raise ConfigError(
            f"{cfg.path}: [run] out = {cfg.run.out!r} holds another run's checkpoint "
            f"({_describe(out)}); a fresh run would replace it. Continue it with --resume, "
            f"replace it with --overwrite, or set another [run] out")
    try:
        clear_results(out)
    except OSError as exc:
        raise ConfigError(f"{cfg.path}: [run] out = {cfg.run.out!r}: cannot write in it: "
                          f"{exc.strerror or exc}; choose a directory you can write to") from None
    return Start()


def _open_spill(cfg: Any, out: Path) -> Spill:
    """``[run] spill``'s directory, created (a ConfigError naming the key if it cannot be)."""
    directory = spill_dir(out, cfg.run.spill_dir)
    try:
        return Spill(directory)
    except OSError as exc:
        raise ConfigError(f"{cfg.path}: [run] spill_dir: cannot create {str(directory)!r}: "
                          f"{exc.strerror or exc}; choose a writable spill_dir (or set spill "
                          f"= false)") from None


def _describe(out: Path) -> str:
    try:
        ckpt = load_checkpoint(out)
    except ConfigError:
        return "unreadable"
    rounds = (ckpt.report or {}).get("rounds")
    of = f" of {rounds}" if isinstance(rounds, int) else ""
    return (f"{ckpt.identity.get('strategy', '?')} on {ckpt.identity.get('task', '?')}, "
            f"round {ckpt.round}{of}")


def _resume(plan: Any, out: Path, parts: dict[str, Any]) -> Start:
    ckpt = load_checkpoint(out)
    file = checkpoint_path(out)
    expected = identity(plan)
    differs = {k: (ckpt.identity.get(k, _BEFORE.get(k)), v) for k, v in expected.items()
               if ckpt.identity.get(k, _BEFORE.get(k)) != v}
    if differs:
        what = "; ".join(f"{k}: checkpoint {a!r}, config {b!r}"
                         for k, (a, b) in differs.items())
        raise ConfigError(
            f"cannot resume {str(out)!r}: its checkpoint belongs to a different run "
            f"({what}). Use the same config, or start afresh with --overwrite")
    check_model_fits(out, ckpt.state, parts["initial_state"])
    rounds = parts["rounds"]
    if rounds is not None and ckpt.round >= rounds:
        log.info("%s is complete: its checkpoint covers round %d of %d", out, ckpt.round,
                 rounds)
        return Start(ckpt.round, resumed=True, complete=True, checkpoint=ckpt)
    if ckpt.outer_state:
        try:
            parts["outer"].load_state_dict(ckpt.outer_state)
        except MeshError:
            raise
        except Exception as exc:
            raise ConfigError(
                f"checkpoint {str(file)!r}: its outer optimizer state does not load into "
                f"{plan.config.outer_optimizer.name!r} ({type(exc).__name__}: {exc}); the file "
                f"is damaged or from another meshkit. Start afresh with --overwrite") from None
    try:
        load_aggregator_state(parts["aggregator"], ckpt.aggregator_state)
    except MeshError as exc:
        raise ConfigError(f"checkpoint {str(file)!r}: {exc}. Start afresh with --overwrite"
                          ) from None
    if ckpt.rng_state:
        _restore_rng(file, parts["rng"], ckpt.rng_state)
    if parts.get("privacy") is not None:
        _restore_privacy(file, parts["privacy"], ckpt.privacy_state)
    truncate_metrics(out, ckpt.round, ckpt.report)
    parts["client_local"] = dict(ckpt.clients)
    parts["strategy_state"] = dict(ckpt.strategy_state)
    # A client whose fit stalled two ranks is not tried again after a resume either.
    parts["stalled_clients"].update({int(k): v for k, v in ckpt.stalled_clients.items()})
    parts["global_state"] = dict(ckpt.state)
    parts["ctx_state"] = dict(ckpt.state)
    log.info("resuming %s after round %d", out, ckpt.round)
    return Start(ckpt.round, resumed=True, checkpoint=ckpt)


def _restore_privacy(file: Path, privacy: Any, saved: Mapping[str, Any]) -> None:
    """The accountant's history and clip norm, so ε and S continue where they were."""
    if not saved:
        raise ConfigError(
            f"checkpoint {str(file)!r} holds no privacy state, but this run has a [privacy] "
            f"table: the rounds it already played were not accounted. Start afresh with "
            f"--overwrite")
    try:
        privacy.load_state_dict(saved)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"checkpoint {str(file)!r}: its privacy state does not load into this run's "
            f"[privacy] mechanism ({type(exc).__name__}: {exc}). Use the same [privacy] "
            f"table, or start afresh with --overwrite") from None


def _restore_rng(file: Path, rng: Any, saved: Mapping[str, Any]) -> None:
    mine = type(rng.bit_generator).__name__
    theirs = saved.get("bit_generator")
    if theirs != mine:
        raise ConfigError(
            f"checkpoint {str(file)!r}: rng: the saved state is for a {theirs!r} generator, "
            f"this run's is {mine!r}; the run could not sample the clients it would have. "
            f"Start afresh with --overwrite")
    try:
        rng.bit_generator.state = dict(saved)
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(
            f"checkpoint {str(file)!r}: rng: the saved {mine} state does not load "
            f"({type(exc).__name__}: {exc}); the file is damaged. Start afresh with "
            f"--overwrite") from None


def check_model_fits(out: Path, saved: Mapping[str, Any], fresh: Mapping[str, Any]) -> None:
    """Refuse a checkpoint whose model is not the shape this config's task builds.

    The identity check cannot see ``[task]`` options: a checkpoint made with
    ``hidden = 32`` would otherwise be trained on under ``hidden = 64``,
    silently keeping the old shapes (or failing deep inside a worker).
    """
    problems = []
    for key, value in fresh.items():
        shape = getattr(value, "shape", None)
        if shape is None:
            continue
        if key not in saved:
            problems.append(f"{key}: not in the checkpoint")
        elif getattr(saved[key], "shape", None) != shape:
            problems.append(f"{key}: checkpoint shape {getattr(saved[key], 'shape', None)}, "
                            f"this config's task {shape}")
    if problems:
        raise ConfigError(
            f"cannot resume {str(out)!r}: its checkpoint's model does not fit the task this "
            f"config builds ({'; '.join(problems[:5])}). Use the same [task] options, or start "
            f"afresh with --overwrite")
