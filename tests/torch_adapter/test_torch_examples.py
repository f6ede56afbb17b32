"""The torch examples end to end: accuracy, buffers in sync, the model back as torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="meshkit.torch needs PyTorch (the torch extra)")

import meshkit.torch as mt  # noqa: E402
from meshkit.train import read_metrics  # noqa: E402

from tests.support.cli import run_cli  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "torch"

pytestmark = pytest.mark.slow


def test_the_federated_torch_example_reaches_its_accuracy_and_exports_a_state_dict(tmp_path):
    result = run_cli("run", str(EXAMPLES / "federated.toml"), cwd=str(tmp_path),
                     pythonpath=str(REPO), timeout=300)
    assert result.returncode == 0, result.stderr
    rows = read_metrics(tmp_path / "runs" / "torch-federated")
    assert [r["round"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[-1]["accuracy"] >= 0.95  # 0.98 with seed 0 (docs/torch.md)

    exported = run_cli("export", str(tmp_path / "runs" / "torch-federated"), "--format", "torch",
                       "-o", str(tmp_path / "model.pt"), cwd=str(tmp_path), timeout=120)
    assert exported.returncode == 0, exported.stderr
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert state["features.1.num_batches_tracked"].dtype == torch.int64

    sys.path.insert(0, str(REPO))
    try:
        from examples.torch.digits_cnn import Net
    finally:
        sys.path.remove(str(REPO))
    net = Net()
    net.load_state_dict(state)  # strict: every key, the int64 counts included
    loaded = mt.load(tmp_path / "runs" / "torch-federated", Net())
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_the_data_parallel_torch_example_keeps_held_out_loss_near_training_loss(tmp_path):
    result = run_cli("run", str(EXAMPLES / "data-parallel.toml"), cwd=str(tmp_path),
                     pythonpath=str(REPO), timeout=300)
    assert result.returncode == 0, result.stderr
    rows = read_metrics(tmp_path / "runs" / "torch-data-parallel")
    last = rows[-1]
    # Unsynchronised BatchNorm statistics gave 1.14 held out against 0.12
    # in training (issue 15); with the buffers averaged the two agree.
    assert last["loss"] <= 1.5 * last["train_loss"], last
    assert last["accuracy"] >= 0.95


def test_meshkit_its_plugins_and_its_help_never_import_torch():
    code = textwrap.dedent("""
        import sys
        import meshkit
        meshkit.plugins.available("task")
        from meshkit.cli import main
        try:
            main(["--help"])
        except SystemExit:
            pass
        print("TORCH" if "torch" in sys.modules else "NO-TORCH")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip().endswith("NO-TORCH"), out.stdout + out.stderr
