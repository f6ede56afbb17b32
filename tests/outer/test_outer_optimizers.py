"""Built-in outer optimizers: hand-computed rules over two rounds, checkpoints, dtypes."""

from __future__ import annotations

import math

import numpy as np
import pytest

import meshkit_outer
from meshkit import AggregationError, ConfigError, plugins
from meshkit.plugins import build_manager
from meshkit.testing import OuterOptimizerContract
from meshkit.state import BFLOAT16, StateError


@pytest.fixture(scope="module")
def pset():
    return build_manager([meshkit_outer], entry_points=False)


def two_rounds(opt, x0=1.0):
    """From x = x0: round 1 consensus 0.7 (g = 0.3), round 2 consensus x - 0.2 (g = 0.2)."""
    x = {"w": np.array([x0])}
    x = opt.step(x, {"w": np.array([0.7])})
    first = float(x["w"][0])
    x = opt.step(x, {"w": x["w"] - 0.2})
    return first, float(x["w"][0])


def test_average_adopts_the_consensus_byte_for_byte(pset):
    opt = pset.create("outer_optimizer", "average")
    consensus = {"w": np.array([0.7, 0.1], dtype=np.float32), "meta": {"k": 1}}
    out = opt.step({"w": np.ones(2, np.float32), "meta": {"k": 0}}, consensus)
    assert out["w"] is consensus["w"] and out["meta"] == {"k": 1}
    assert opt.state_dict() == {"optimizer": "average"}


def test_nesterov_gives_the_design_check_values(pset):
    # b = g = 0.3; x = 1 - 0.7 * (0.3 + 0.9 * 0.3) = 0.601
    # b = 0.9 * 0.3 + 0.2 = 0.47; x = 0.601 - 0.7 * (0.2 + 0.9 * 0.47) = 0.1649
    first, second = two_rounds(pset.create("outer_optimizer", "nesterov"))
    assert first == pytest.approx(0.601, abs=1e-12)
    assert second == pytest.approx(0.1649, abs=1e-12)


def test_fedavgm_applies_server_momentum(pset):
    # b = 0.3, x = 1 - 1.0 * 0.3 = 0.7; b = 0.9 * 0.3 + 0.2 = 0.47, x = 0.7 - 0.47 = 0.23
    first, second = two_rounds(pset.create("outer_optimizer", "fedavgm"))
    assert first == pytest.approx(0.7, abs=1e-12)
    assert second == pytest.approx(0.23, abs=1e-12)


def test_fedadagrad_accumulates_squared_pseudo_gradients(pset):
    # m = 0.1 * 0.3 = 0.03, v = tau^2 + 0.09 = 0.090001,
    #   x = 1 - 0.1 * 0.03 / (sqrt(0.090001) + 0.001) = 0.990033277777...
    # m = 0.9 * 0.03 + 0.1 * 0.2 = 0.047, v = 0.090001 + 0.04 = 0.130001,
    #   x = 0.990033... - 0.1 * 0.047 / (sqrt(0.130001) + 0.001) = 0.977033926876...
    first, second = two_rounds(pset.create("outer_optimizer", "fedadagrad"))
    assert first == pytest.approx(1 - 0.1 * 0.03 / (math.sqrt(0.090001) + 0.001), rel=1e-12)
    assert first == pytest.approx(0.9900332777779322, rel=1e-12)
    assert second == pytest.approx(0.9770339268765257, rel=1e-12)


def test_fedadam_uses_an_exponential_second_moment(pset):
    # v = 0.99 * 1e-6 + 0.01 * 0.09 = 0.00090099, x = 1 - 0.1*0.03/(sqrt(v)+0.001)
    # v = 0.99 * 0.00090099 + 0.01 * 0.04 = 0.0012919801, m = 0.047
    first, second = two_rounds(pset.create("outer_optimizer", "fedadam"))
    assert first == pytest.approx(1 - 0.1 * 0.03 / (math.sqrt(0.00090099) + 0.001), rel=1e-12)
    assert first == pytest.approx(0.9032772737530621, rel=1e-12)
    assert second == pytest.approx(0.7760581275705339, rel=1e-12)


def test_fedadam_bias_correction_divides_by_one_minus_beta_to_the_t(pset):
    # Adam: m and v both start at 0 (not v at tau^2), then are divided by 1 - beta^t.
    # t=1: m = 0.03, v = 0.01 * 0.09 = 0.0009; m_hat = 0.3, v_hat = 0.09
    #   x = 1 - 0.1 * 0.3 / (0.3 + 0.001) = 0.900332225913...
    # t=2: m = 0.9 * 0.03 + 0.1 * 0.2 = 0.047, v = 0.99 * 0.0009 + 0.01 * 0.04 = 0.001291
    #   m_hat = 0.047 / 0.19, v_hat = 0.001291 / 0.0199
    opt = pset.create("outer_optimizer", "fedadam", {"bias_correction": True})
    first, second = two_rounds(opt)
    assert first == pytest.approx(1 - 0.1 * 0.3 / (0.3 + 0.001), rel=1e-12)
    assert first == pytest.approx(0.9003322259136213, rel=1e-12)
    assert second == pytest.approx(
        first - 0.1 * (0.047 / 0.19) / (math.sqrt(0.001291 / 0.0199) + 0.001), rel=1e-12)
    assert second == pytest.approx(0.803592262041793, rel=1e-12)
    state = opt.state_dict()
    assert state["m/w"].tolist() == pytest.approx([0.047], rel=1e-12)
    assert state["v/w"].tolist() == pytest.approx([0.001291], rel=1e-12)  # stored uncorrected


def test_fedadam_with_bias_correction_takes_adams_first_step():
    # Issue 13's numbers: g = 0.01, tau = 1e-3. Adam's first step is
    # lr * g / (|g| + tau) = 0.1 * 0.01 / 0.011, whatever beta1 and beta2 are;
    # starting v at tau^2 gave 0.93380 instead.
    pset = build_manager([meshkit_outer], entry_points=False)
    opt = pset.create("outer_optimizer", "fedadam", {"bias_correction": True})
    out = opt.step({"w": np.array([1.0])}, {"w": np.array([0.99])})
    assert float(out["w"][0]) == pytest.approx(1 - 0.1 * 0.01 / 0.011, rel=1e-12)
    assert float(out["w"][0]) == pytest.approx(0.90909, abs=1e-5)


def test_fedadam_without_bias_correction_keeps_v_starting_at_tau_squared(pset):
    # DESIGN §4: without bias correction v starts at tau^2 (Reddi et al.).
    opt = pset.create("outer_optimizer", "fedadam")
    opt.step({"w": np.array([1.0])}, {"w": np.array([0.99])})
    assert opt.state_dict()["v/w"].tolist() == pytest.approx([0.99 * 1e-6 + 0.01 * 1e-4],
                                                             rel=1e-12)


@pytest.mark.parametrize("beta1, beta2, lr, tau", [(0.9, 0.99, 0.1, 1e-3),
                                                   (0.8, 0.999, 0.05, 1e-8)])
def test_fedadam_with_bias_correction_is_torch_adam_over_several_rounds(
        pset, beta1, beta2, lr, tau):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal((3, 4))
    # Pseudo-gradients of changing size and sign, as rounds give them.
    gradients = [rng.standard_normal((3, 4)) * scale for scale in (1.0, 0.1, 2.0, 0.01, 0.5, 1.0)]

    opt = pset.create("outer_optimizer", "fedadam", {
        "lr": lr, "beta1": beta1, "beta2": beta2, "tau": tau, "bias_correction": True})
    param = torch.nn.Parameter(torch.tensor(x0, dtype=torch.float64))
    adam = torch.optim.Adam([param], lr=lr, betas=(beta1, beta2), eps=tau)
    x = {"w": x0.copy()}
    for round_, g in enumerate(gradients, start=1):
        # meshkit descends on g = global - consensus: the consensus is x - g.
        x = opt.step(x, {"w": x["w"] - g})
        param.grad = torch.tensor(g, dtype=torch.float64)
        adam.step()
        np.testing.assert_allclose(x["w"], param.detach().numpy(), rtol=1e-12, atol=1e-14,
                                   err_msg=f"round {round_}")


def test_fedyogi_moves_the_second_moment_by_the_sign_of_v_minus_g_squared(pset):
    # v = 1e-6 < 0.09, so v grows: v = 1e-6 + 0.01 * 0.09 = 0.000901
    # x = 1 - 0.01 * 0.03 / (sqrt(0.000901) + 0.001) = 0.99032777932...
    # v = 0.000901 < 0.04: v = 0.000901 + 0.01 * 0.04 = 0.001301, m = 0.047
    opt = pset.create("outer_optimizer", "fedyogi")
    first, second = two_rounds(opt)
    assert first == pytest.approx(1 - 0.01 * 0.03 / (math.sqrt(0.000901) + 0.001), rel=1e-12)
    assert second == pytest.approx(0.9776488504977777, rel=1e-12)
    assert opt.state_dict()["v/w"].tolist() == pytest.approx([0.001301], rel=1e-12)


def test_fedyogi_shrinks_the_second_moment_when_it_exceeds_g_squared(pset):
    opt = pset.create("outer_optimizer", "fedyogi", {"tau": 1.0})  # v starts at 1 > g^2
    opt.step({"w": np.array([1.0])}, {"w": np.array([0.5])})          # g^2 = 0.25
    assert opt.state_dict()["v/w"].tolist() == pytest.approx([1 - 0.01 * 0.25])


@pytest.mark.parametrize("name, options", [
    ("nesterov", {"lr": 1.0, "momentum": 0.0}),
    ("fedavgm", {"lr": 1.0, "momentum": 0.0}),
])
def test_the_sign_convention_makes_lr_one_without_momentum_adopt_the_consensus(
        pset, name, options):
    opt = pset.create("outer_optimizer", name, options)
    out = opt.step({"w": np.array([1.0, -2.0])}, {"w": np.array([0.25, 4.0])})
    assert out["w"].tolist() == [0.25, 4.0]


def test_every_optimizer_moves_the_global_model_toward_the_consensus(pset):
    # g = global - consensus > 0, so descending on g lowers every parameter.
    for name in ("nesterov", "fedavgm", "fedadagrad", "fedadam", "fedyogi"):
        opt = pset.create("outer_optimizer", name)
        out = opt.step({"w": np.array([1.0, -1.0])}, {"w": np.array([0.0, 0.0])})
        assert out["w"][0] < 1 and out["w"][1] > -1, name


@pytest.mark.parametrize("name", ["nesterov", "fedavgm", "fedadagrad", "fedadam", "fedyogi"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, BFLOAT16])
def test_a_restored_optimizer_continues_bit_for_bit(pset, name, dtype):
    rng = np.random.default_rng(11)
    consensus = [{"w": rng.standard_normal((4, 3)).astype(dtype), "n": i}
                 for i in range(6)]
    start = {"w": rng.standard_normal((4, 3)).astype(dtype), "n": 0}

    straight = pset.create("outer_optimizer", name)
    x = start
    for c in consensus:
        x = straight.step(x, c)

    first = pset.create("outer_optimizer", name)
    y = start
    for c in consensus[:3]:
        y = first.step(y, c)
    saved = first.state_dict()
    first.step(y, consensus[3])  # stepping on must not change the saved state
    resumed = pset.create("outer_optimizer", name)
    resumed.load_state_dict(saved)
    for c in consensus[3:]:
        y = resumed.step(y, c)

    assert y["w"].dtype == np.dtype(dtype)
    assert y["w"].tobytes() == x["w"].tobytes()
    assert resumed.state_dict()["t"] == 6


def test_half_precision_parameters_keep_float32_moments_and_their_dtype(pset):
    opt = pset.create("outer_optimizer", "fedadam")
    x = {"w": np.ones(3, BFLOAT16)}
    out = opt.step(x, {"w": np.full(3, 0.5, BFLOAT16)})
    assert out["w"].dtype == BFLOAT16
    state = opt.state_dict()
    assert state["m/w"].dtype == np.float32 and state["v/w"].dtype == np.float32


def test_json_values_and_integer_arrays_adopt_the_consensus(pset):
    opt = pset.create("outer_optimizer", "nesterov")
    out = opt.step({"w": np.array([1.0]), "steps": np.array([1]), "meta": {"round": 1}},
                   {"w": np.array([0.7]), "steps": np.array([5]), "meta": {"round": 2}})
    assert out["steps"].tolist() == [5] and out["meta"] == {"round": 2}
    assert out["w"][0] == pytest.approx(0.601)
    assert set(opt.state_dict()) == {"optimizer", "t", "options", "b/w"}


def test_a_consensus_with_other_keys_is_refused(pset):
    opt = pset.create("outer_optimizer", "fedavgm")
    with pytest.raises(AggregationError) as err:
        opt.step({"w": np.ones(2), "b": np.ones(1)}, {"w": np.ones(2), "c": np.ones(1)})
    assert str(err.value) == (
        "outer optimizer fedavgm: the consensus lacks 'b'; the consensus has 'c' the global "
        "model does not; the consensus must have exactly the global model's keys")


def test_a_consensus_with_another_shape_is_refused(pset):
    opt = pset.create("outer_optimizer", "fedadam")
    with pytest.raises(AggregationError, match=r"'w' has shape \(2,\) in the global model "
                                               r"but \(3,\) in the consensus"):
        opt.step({"w": np.ones(2)}, {"w": np.ones(3)})


def test_a_model_that_changes_between_rounds_is_refused(pset):
    opt = pset.create("outer_optimizer", "nesterov")
    opt.step({"w": np.ones(2)}, {"w": np.zeros(2)})
    with pytest.raises(StateError, match="float parameters changed between rounds"):
        opt.step({"v": np.ones(2)}, {"v": np.zeros(2)})
    with pytest.raises(StateError, match="the model changed between rounds"):
        opt.step({"w": np.ones(3)}, {"w": np.zeros(3)})


def test_loading_another_optimizers_state_is_refused(pset):
    adam = pset.create("outer_optimizer", "fedadam")
    adam.step({"w": np.ones(2)}, {"w": np.zeros(2)})
    with pytest.raises(StateError, match="the checkpoint holds the state of 'fedadam', not "
                                         "'fedyogi'; resume with the optimizer that wrote it"):
        pset.create("outer_optimizer", "fedyogi").load_state_dict(adam.state_dict())
    with pytest.raises(StateError, match="average keeps no state"):
        pset.create("outer_optimizer", "average").load_state_dict(adam.state_dict())


def test_a_damaged_checkpoint_is_refused(pset):
    adam = pset.create("outer_optimizer", "fedadam")
    adam.step({"w": np.ones(2)}, {"w": np.zeros(2)})
    state = adam.state_dict()
    del state["v/w"]
    with pytest.raises(StateError, match="do not cover the same parameters"):
        pset.create("outer_optimizer", "fedadam").load_state_dict(state)
    state = adam.state_dict()
    state["t"] = -1
    with pytest.raises(StateError, match="'t' must be a round count"):
        pset.create("outer_optimizer", "fedadam").load_state_dict(state)


@pytest.mark.parametrize("name, options, message", [
    ("nesterov", {"lr": 0}, "lr must be a finite number > 0, got 0"),
    ("fedavgm", {"momentum": 1.0}, "momentum must be in [0, 1), got 1.0"),
    ("fedadam", {"beta2": -0.1}, "beta2 must be in [0, 1), got -0.1"),
    ("fedyogi", {"tau": 0.0}, "tau must be a finite number > 0, got 0.0"),
    ("fedadagrad", {"beta2": 0.9}, "beta2: unknown key"),
])
def test_bad_options_are_config_errors(pset, name, options, message):
    with pytest.raises(ConfigError) as err:
        pset.create("outer_optimizer", name, options)
    assert message in str(err.value)


def test_defaults_follow_the_design_table(pset):
    components = pset.available("outer_optimizer")
    defaults = {name: c.options() if c.options else None for name, c in components.items()}
    assert defaults["average"] is None
    assert (defaults["nesterov"].lr, defaults["nesterov"].momentum) == (0.7, 0.9)
    assert (defaults["fedavgm"].lr, defaults["fedavgm"].momentum) == (1.0, 0.9)
    d = defaults["fedadagrad"]
    assert (d.lr, d.beta1, d.tau) == (0.1, 0.9, 1e-3)
    d = defaults["fedadam"]
    assert (d.lr, d.beta1, d.beta2, d.tau, d.bias_correction) == (0.1, 0.9, 0.99, 1e-3, False)
    d = defaults["fedyogi"]
    assert (d.lr, d.beta1, d.beta2, d.tau) == (0.01, 0.9, 0.99, 1e-3)


# -- models without float arrays, checkpoints without moments ---------------------

STATEFUL = ["nesterov", "fedavgm", "fedadagrad", "fedadam", "fedyogi"]


@pytest.mark.parametrize("name", STATEFUL)
def test_an_optimizer_reloads_its_own_state_for_a_model_without_float_arrays(name):
    # A Python filter's {"mu": 1.5} state has nothing to step: the optimizer
    # counts rounds but holds no moments, and resuming must still work.
    opt = plugins.create("outer_optimizer", name, {})
    new = opt.step({"mu": 1.5, "n": np.arange(2)}, {"mu": 1.0, "n": np.arange(2)})
    assert new["mu"] == 1.0
    restored = plugins.create("outer_optimizer", name, {})
    restored.load_state_dict(opt.state_dict())
    assert restored.state_dict()["t"] == 1
    assert restored.step({"mu": 1.0}, {"mu": 0.5}) == {"mu": 0.5}


@pytest.mark.parametrize("name", STATEFUL)
def test_a_checkpoint_past_round_0_without_moments_is_refused_for_a_float_model(name):
    opt = plugins.create("outer_optimizer", name, {})
    opt.load_state_dict({"optimizer": name, "t": 3})
    x = {"w": np.ones(2, np.float32)}
    with pytest.raises(StateError, match="round 3 but holds no moment buffers"):
        opt.step(x, {"w": np.zeros(2, np.float32)})


# -- the conformance kit ----------------------------------------------------------


def test_the_outer_contract_accepts_a_numpy_scalar_in_state_dict():
    class Counting:
        """A correct optimizer (average) that counts rounds in a numpy int."""

        def __init__(self) -> None:
            self.rounds = np.int64(0)

        def step(self, global_state, consensus):
            self.rounds += 1
            return dict(consensus)

        def state_dict(self):
            return {"rounds": self.rounds}

        def load_state_dict(self, d):
            self.rounds = np.int64(d["rounds"])

    class Suite(OuterOptimizerContract):
        def make(self, **overrides):
            return Counting()

    suite = Suite()
    suite.test_state_dict_holds_only_arrays_and_json()
    suite.test_a_fresh_state_round_trips()
    suite.test_a_restored_optimizer_continues_bit_for_bit(np.float32)
