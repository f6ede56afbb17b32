"""``[strategy] trainable``: only the trainable keys travel and are aggregated.

Real processes and sockets: examples/torch/lora.toml's frozen MLP with LoRA
adapters (``"@lora"``). What the coordinator's transport counted per round
(``bytes_up``/``bytes_down``) is the adapters' size plus headers after the first
round; the frozen base of the final (checkpointed) model is the initial one bit
for bit; the loss falls. What does not compose is refused.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="meshkit.torch needs PyTorch (the torch extra)")

import meshkit.torch as mt  # noqa: E402
from meshkit.checkpoint import load_checkpoint  # noqa: E402
from meshkit.task import create_task  # noqa: E402
from meshkit.train import read_metrics  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.support.cli import run_cli  # noqa: E402

EXAMPLE = REPO / "examples" / "torch" / "lora.toml"
#: Framing, key names, metrics and the small request fields of one message: a bound,
#: not a figure (a reply here carries ~600 bytes beside its arrays).
HEADERS = 1500


def _config(tmp_path: Path, name: str, *, clients: int, rounds: int = 4, extra: str = "") -> Path:
    text = EXAMPLE.read_text().replace('out = "runs/torch-lora"', f'out = "{tmp_path / name}"')
    text = text.replace("rounds = 5", f"rounds = {rounds}").replace(
        "clients = 4", f"clients = {clients}")
    path = tmp_path / f"{name}.toml"
    path.write_text(text + extra)
    return path


def _run(tmp_path: Path, name: str, **kw) -> list[dict]:
    result = run_cli("run", str(_config(tmp_path, name, **kw)), cwd=str(tmp_path),
                     pythonpath=str(REPO), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return read_metrics(tmp_path / name)


def _sizes() -> tuple[dict, int, int]:
    """The initial model (the run's seed, 0), and its trainable and frozen bytes."""
    task = create_task("examples.torch.lora_mlp:task", {"device": "cpu", "threads": 1})
    initial = dict(task.init_state(0))
    lora = task.key_groups()["lora"]
    assert lora == {k for k in initial if ".lora_" in k}, lora
    trained = sum(initial[k].nbytes for k in lora)
    frozen = sum(v.nbytes for k, v in initial.items() if k not in lora)
    return initial, trained, frozen


@pytest.mark.slow
@pytest.mark.parametrize("clients", [2, 4], ids=["flat", "batched"])
def test_only_the_adapters_travel_the_base_stays_bit_for_bit_and_the_loss_falls(
        tmp_path, clients):
    initial, trained, frozen = _sizes()
    rows = _run(tmp_path, "lora", clients=clients)
    workers = 2
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    # Round 1 sends each worker the whole model; later rounds only the adapters.
    assert rows[0]["bytes_down"] >= workers * (trained + frozen)
    for row in rows[1:]:
        assert workers * trained <= row["bytes_down"] <= workers * (trained + 3 * HEADERS), row
    # Every round (the first too) uploads only the adapters: one float32 fit per
    # client on the flat path; one exact int64 partial per worker on the batched one.
    per_upload = trained if clients == workers else 2 * trained
    for row in rows:
        assert workers * per_upload <= row["bytes_up"] <= workers * (per_upload + 2 * HEADERS), \
            row
        assert row["bytes_up"] < workers * (trained + frozen)
    # The loss falls over rounds.
    losses = [r["train_loss"] for r in rows]
    assert losses[-1] < 0.9 * losses[0], losses
    final = load_checkpoint(tmp_path / "lora").state
    assert set(final) == set(initial)
    lora = {k for k in initial if ".lora_" in k}
    for key in initial:
        if key in lora:
            continue
        assert final[key].dtype == initial[key].dtype
        assert final[key].tobytes() == initial[key].tobytes(), key
    # The adapters trained (lora_b starts at zero).
    assert any(np.any(final[k] != initial[k]) for k in lora)


def test_lora_group_names_every_key_with_a_lora_part():
    assert mt.is_lora_key("head.lora_a")
    assert mt.is_lora_key("model.layers.0.q_proj.lora_A.default.weight")
    assert mt.is_lora_key("embed.lora_embedding_B.default")
    assert not mt.is_lora_key("model.layers.0.q_proj.base_layer.weight")
    assert not mt.is_lora_key("flora_weight")


def test_a_pattern_naming_no_key_stops_the_run_with_a_config_error(tmp_path):
    config = _config(tmp_path, "nomatch", clients=2, rounds=1)
    config.write_text(config.read_text().replace('trainable = ["@lora"]',
                                                 'trainable = ["fc.*"]'))
    result = run_cli("run", str(config), cwd=str(tmp_path), pythonpath=str(REPO), timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "[strategy] trainable" in result.stderr and "'fc.*' matches no array" in \
        result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("table, needle", [
    ('\n[secure_aggregation]\nname = "secagg+"\n', "a secure round masks"),
    ('\n[compression]\nname = "quantize"\n', "with [compression]"),
    ('\n[privacy]\nname = "dp-fixed"\nclip_norm = 1.0\nnoise_multiplier = 1.0\n'
     'delta = 1e-5\n', "with [privacy]"),
])
def test_what_does_not_compose_is_refused_by_check(tmp_path, table, needle):
    # In process (click's runner): the command's own code, without a process that
    # imports torch again for each table; a real `meshkit run` is the test above.
    from click.testing import CliRunner

    from meshkit.cli import main

    config = _config(tmp_path, "refused", clients=2, rounds=1, extra=table)
    result = CliRunner().invoke(main, ["check", str(config)], env={"MESHKIT_SECRET": None})
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    assert "[strategy] trainable" in result.stderr and needle in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
