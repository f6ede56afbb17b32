"""``diloco`` with ``exchange = "ring"``: the replicas sum their codes exactly over the tcp
mesh's ring and step the outer optimizer themselves -- the same model bits as the star's
exchange, at 2 and 4 replicas, with the ring's bytes measured on the transport."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import meshkit
from meshkit.aggregation import (
    BLOCK,
    GridSum,
    decode_blocks,
    encode_blocks,
    mean_of_sum,
    on_grid,
    sum_dtype,
)
from meshkit.train import Runner, read_metrics, state_digest
from tests.support.configs import write_config

pytestmark = pytest.mark.slow


def diloco(tmp_path: Path, name: str, *, workers: int, exchange: str, bits: int,
           topology: str) -> Path:
    extra = (f"inner_steps = 4\nbatch_size = 16\nouter_bits = {bits}\n"
             f"exchange = \"{exchange}\"\nquorum = {workers}")
    return write_config(tmp_path / f"{name}.toml", tmp_path / name, workers=workers,
                        rounds=3, strategy="diloco", timeout=30.0, extra=extra,
                        outer="nesterov", mesh=f'topology = "{topology}"')


@pytest.mark.parametrize("workers, bits", [(2, 8), (4, 8), (4, 4)],
                         ids=["2 replicas int8", "4 replicas int8", "4 replicas int4"])
def test_the_ring_exchange_gives_the_stars_model_bits_and_its_bytes_are_measured(
        tmp_path, workers, bits):
    star = Runner(str(diloco(tmp_path, "star", workers=workers, exchange="star", bits=bits,
                             topology="star"))).run()
    ring = Runner(str(diloco(tmp_path, "ring", workers=workers, exchange="ring", bits=bits,
                             topology="mesh"))).run()
    assert star.ok and ring.ok, (star.error, ring.error)
    assert state_digest(ring.state) == state_digest(star.state)
    rows = read_metrics(tmp_path / "ring")
    assert len(rows) == 3
    params = sum(int(np.asarray(v).size) for v in star.state.values()
                 if isinstance(v, np.ndarray) and v.dtype.kind == "f")
    blocks = sum(-(-int(np.asarray(v).size) // BLOCK) for v in star.state.values()
                 if isinstance(v, np.ndarray) and v.dtype.kind == "f")
    # Per replica, 2 (R - 1) / R of the int16 sums and of the float32 scales' max, plus
    # the frames' heads: 2 collectives a key set, 2 (R - 1) frames each.
    share = 2 * (workers - 1) / workers
    payload = workers * share * (params * sum_dtype(bits, workers).itemsize + blocks * 4)
    frames = workers * 2 * 2 * (workers - 1)  # 2 collectives, 2 (R - 1) frames each
    for row in rows:
        sent = row["payload_up"]  # the replicas' transports' counters, summed
        assert payload <= sent <= payload + 500 * frames, (sent, payload)
        assert row["peak_exchange_bytes"] == sent
        # One replica hands the int sums to the coordinator: far less than the star's
        # pseudo-gradients from every replica once the model is large (here it is tiny).
        assert row["replicas"] == workers
    # Every replica's anchor after the ring's outer step is the global model.
    assert rows[-1][f"digest_rank{workers}"] == rows[-1]["model_digest"]


def test_the_grid_sum_is_exact_and_order_free_and_the_ring_arithmetic_is_the_stars():
    rng = np.random.default_rng(3)
    replicas = [rng.normal(scale=s, size=2 * BLOCK + 9).astype(np.float32)
                for s in (0.1, 1.0, 0.01)]
    encoded = [encode_blocks(v, 8) for v in replicas]
    values = [decode_blocks(c, s, v.size, 8) for (c, s), v in zip(encoded, replicas)]
    fold = GridSum(8)
    for v, (_, s) in zip(values, encoded):
        fold.add({"w": v}, {"w": s})
    star = fold.result()["w"]
    # The ring's way: max of the scales, codes on them, an int16 sum in any order.
    shared = np.maximum.reduce([s for _, s in encoded])
    total = sum(on_grid(v, shared, 8).astype(np.int16) for v in reversed(values))
    assert total.dtype == sum_dtype(8, 3) == np.int16
    assert mean_of_sum(total, shared, 3).tobytes() == star.tobytes()
    # Within half a shared step plus half an own step of the true mean.
    true = np.mean(replicas, axis=0)
    bound = np.repeat(shared, BLOCK)[:true.size] * 1.0 + 1e-7
    assert np.all(np.abs(star - true) <= bound)


def test_sum_dtype_is_the_narrowest_integer_that_cannot_overflow():
    assert sum_dtype(8, 2) == np.int16 and sum_dtype(8, 258) == np.int16
    assert sum_dtype(8, 259) == np.int32
    assert sum_dtype(4, 18) == np.int8 and sum_dtype(4, 19) == np.int16


def test_a_ring_exchange_at_32_bits_is_refused_naming_what_it_would_need():
    with pytest.raises(meshkit.RefusedError, match="int64 fixed-point ring"):
        meshkit.plugins.create("strategy", "diloco", {"exchange": "ring", "outer_bits": 32}) \
            .check(task=meshkit.plugins.create("task", "digits"), outer_name="nesterov",
                   workers=2)


def test_a_ring_exchange_on_a_star_is_refused_naming_the_mesh_it_needs():
    from tests.train.test_diloco import run

    with pytest.raises(meshkit.RefusedError, match=r'needs direct links .*topology = "mesh"'):
        run(exchange="ring", outer_bits=8)
