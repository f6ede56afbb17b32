"""Compressed uploads end to end: real processes, real sockets, what the transport counted.

* the bytes on the wire are measured (the coordinator's transport counts every frame
  body it received and sent); a compressed round uploads a fraction of an uncompressed
  one's, and the figure sits on every metrics row;
* error feedback's residuals live in the client-local store, are checkpointed, and after
  the coordinator is killed mid-run and ``--resume``d they -- and the model -- are the
  uninterrupted run's, bit for bit;
* what does not compose is refused by ``meshkit check`` with exit 2, naming both tables
  and the trait;
* int8 under secure aggregation: what the transport counted says each masked coordinate
  cost ``8 + ceil(log2 n)`` bits, not 32;
* ``[compression] clip_range``: a worker uploads one integer sum of its clients' codes,
  and the model is the same bits whichever worker summed which clients.
"""

from __future__ import annotations

import signal

import numpy as np
import pytest

from meshkit.checkpoint import load_checkpoint
from meshkit.compression import is_residual
from meshkit.train import ClientLocal, read_metrics

from tests.support.cli import check_in_process, run_cli
from tests.support.configs import KILLER, write_config

pytestmark = pytest.mark.slow

#: One client per worker, so the uncompressed round uploads one model per client too.
CLIENTS = "clients = 2\n"


def _run(tmp_path, name, extra, workers=2, **kwargs):
    config = write_config(tmp_path / f"{name}.toml", tmp_path / name, workers=workers, rounds=2,
                          extra=extra, **kwargs)
    result = run_cli("run", str(config), cwd=str(tmp_path), timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    return read_metrics(tmp_path / name)


def test_the_transport_counts_a_compressed_upload_at_a_fraction_of_an_uncompressed_one(
        tmp_path):
    whole = _run(tmp_path, "whole", CLIENTS)
    quantized = _run(tmp_path, "int8", CLIENTS + '\n[compression]\nname = "quantize"\n')
    sparse = _run(tmp_path, "topk", CLIENTS + '\n[compression]\nname = "top-k"\n'
                  'fraction = 0.01\nerror_feedback = false\n')
    for rows in (whole, quantized, sparse):
        assert [r["round"] for r in rows] == [1, 2]
        assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 for r in rows)
    up = {name: rows[-1]["bytes_up"] for name, rows in
          (("whole", whole), ("int8", quantized), ("topk", sparse))}
    # The model is 2,410 float64 coordinates: 19,280 bytes a client whole; int8 is 1 byte
    # a coordinate (plus 8 bytes a chunk), top-k 1% is 8 bytes for each of 1% of them.
    # Every reply also carries its metrics, its keys' names and framing (about 1.5 kB a
    # client here, the same in all three), so a small model's ratios sit above the ideal.
    assert up["int8"] < 0.25 * up["whole"], up
    assert up["topk"] < 0.1 * up["whole"], up
    assert up["topk"] < 0.5 * up["int8"], up
    # The model goes down whole: compression is on the upload only.
    assert quantized[-1]["bytes_down"] == pytest.approx(whole[-1]["bytes_down"], rel=0.05)


def test_a_compressed_round_of_many_clients_a_worker_sends_a_batch_not_a_request_a_client(
        tmp_path):
    # 16 clients on 2 workers: the uncompressed round plays batched (one fit_batch a batch of
    # clients, one partial a worker back), and so must a compressed one.
    many = "clients = 16\n"
    whole = _run(tmp_path, "whole", many)
    quantized = _run(tmp_path, "int8", many + '\n[compression]\nname = "quantize"\n')
    broadcast = _run(tmp_path, "int8-down", many + '\n[compression]\nname = "quantize"\n'
                     'broadcast = true\n')
    down = {name: rows[-1]["bytes_down"] for name, rows in
            (("whole", whole), ("int8", quantized), ("broadcast", broadcast))}
    # Without broadcast the model goes down whole either way (19,280 bytes to each worker):
    # a batch's request costs what the uncompressed one's does, and no partial is pulled.
    # One fit request a client (about 700 bytes each with its compress field, and a take
    # for most) would put the compressed round 10 kB above the uncompressed one.
    assert down["int8"] <= down["whole"], down
    # With broadcast, round 2 sends each worker an int8 delta: far below the whole model.
    assert down["broadcast"] < 0.4 * down["whole"], down
    # Up: each client's payload (about a quarter of the float64 model, 2,410 coordinates)
    # crosses the wire once; the uncompressed round sends one int64 partial a worker.
    per_fit = quantized[-1]["bytes_up"] / 16
    assert 2410 < per_fit < 0.25 * 19280, per_fit


def test_a_grid_round_uploads_one_sum_a_worker_and_its_model_ignores_who_summed_what(
        tmp_path):
    # [compression] clip_range: each worker sends one exact integer sum of its clients' codes
    # on the shared grid, not each client's payload.
    many, int8 = "clients = 16\n", '\n[compression]\nname = "quantize"\n'
    per_client = _run(tmp_path, "int8", many + int8)
    summed = _run(tmp_path, "grid", many + int8 + "clip_range = 0.25\n")
    again = _run(tmp_path, "grid3", many + int8 + "clip_range = 0.25\n", workers=3)
    up = {"per_client": per_client[-1]["bytes_up"], "grid": summed[-1]["bytes_up"],
          "grid3": again[-1]["bytes_up"]}
    # One int8 model is 2,410 bytes (2,410 coordinates). A worker's sum packs each
    # coordinate at bit_length(mass * 255) bits, mass its clients' examples (under 1,797):
    # at most 19 bits, 5,724 bytes. The rest is framing and each client's small result
    # (key, examples, metrics: about 150 bytes) -- counted here as 4 kB a worker.
    assert up["grid"] <= 2 * (5724 + 4096), up
    assert up["grid"] < 0.35 * up["per_client"], up
    # Integer sums are exact: 2 or 3 workers summing different clients, the same bits.
    a, b = load_checkpoint(tmp_path / "grid"), load_checkpoint(tmp_path / "grid3")
    assert a.round == b.round == 2
    for key in a.state:
        assert a.state[key].tobytes() == b.state[key].tobytes(), key
    # The grid (0.25, 255 steps) learns as the per-client payloads do (2 rounds: ~0.22).
    assert abs(summed[-1]["accuracy"] - per_client[-1]["accuracy"]) < 0.05


def test_error_feedback_residuals_after_a_kill_and_resume_are_the_uninterrupted_runs(
        tmp_path):
    (tmp_path / "killer.py").write_text(KILLER)
    extra = 'clients = 4\n\n[compression]\nname = "top-k"\nfraction = 0.05\n'
    configs = {name: write_config(tmp_path / f"{name}.toml", tmp_path / name, workers=2,
                                  rounds=4, task="killer:Killer", extra=extra)
               for name in ("straight", "crashed")}
    env = {"PYTHONPATH": str(tmp_path)}
    # Each worker fits about 2 clients a round (a free worker takes over a busy one's),
    # so its 5th fit is in round 2 or 3: the kill lands mid-run, after a checkpoint.
    first = run_cli("run", str(configs["crashed"]), cwd=str(tmp_path), timeout=180,
                    env={**env, "KILL_AT_FIT": "5", "KILL_MARK": str(tmp_path / "killed")})
    assert first.returncode == -signal.SIGKILL, first.stdout + first.stderr
    killed_after = load_checkpoint(tmp_path / "crashed").round
    assert 1 <= killed_after < 4
    resumed = run_cli("run", str(configs["crashed"]), "--resume", cwd=str(tmp_path),
                      timeout=180, env=env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    whole = run_cli("run", str(configs["straight"]), cwd=str(tmp_path), timeout=180, env=env)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    a, b = load_checkpoint(tmp_path / "crashed"), load_checkpoint(tmp_path / "straight")
    assert a.round == b.round == 4
    for key in b.state:
        assert a.state[key].tobytes() == b.state[key].tobytes(), key
    kept_a, kept_b = ClientLocal(), ClientLocal()
    kept_a.load_state_dict(a.clients)
    kept_b.load_state_dict(b.clients)
    assert kept_a.clients == kept_b.clients == 4
    for client in range(4):
        mine, theirs = kept_a.of(client), kept_b.of(client)
        assert sorted(mine) == sorted(theirs) and all(is_residual(k) for k in mine)
        assert len(mine) == 4  # one residual per float key of the digits model
        for name in theirs:
            assert mine[name].dtype == np.float32
            assert mine[name].tobytes() == theirs[name].tobytes(), (client, name)
        # Error feedback really left something behind (top-k 5% of the update).
        assert any(np.abs(v).max() > 0 for v in theirs.values())


@pytest.mark.parametrize("tables, words", [
    ('[secure_aggregation]\nname = "secagg+"\n\n[compression]\nname = "top-k"\n',
     ["[compression] name = 'top-k' with [secure_aggregation]",
      "CompressionTraits.sparse", "indices" if False else "coordinates each client moved"]),
    ('[secure_aggregation]\nname = "secagg+"\n\n[compression]\nname = "quantize"\n'
     'rotate = true\n',
     ["[compression] name = 'quantize' with [secure_aggregation]",
      "CompressionTraits.integer_field", "rotate = false"]),
    ('[privacy]\nname = "dp-fixed"\nclip_norm = 1.0\nnoise_multiplier = 1.0\nclip = "client"\n'
     '\n[compression]\nname = "quantize"\n',
     ["[compression] name = 'quantize' with [privacy] clip = \"client\"",
      "CompressionTraits.contractive", "clip = \"coordinator\""]),
    ('[privacy]\nname = "dp-fixed"\nclip_norm = 1.0\nnoise_multiplier = 1.0\nclip = "client"\n'
     '\n[compression]\nname = "top-k"\nerror_feedback = false\nvalue_bits = 8\n',
     ["[compression] name = 'top-k' with [privacy] clip = \"client\"",
      "CompressionTraits.contractive"]),
    ('[compression]\nname = "top-k"\nclip_range = 0.25\n',
     ["[compression] clip_range with name = 'top-k'", "integer_field, not sparse",
      "Drop clip_range"]),
])
def test_what_does_not_compose_is_refused_by_check_naming_the_trait(tmp_path, tables, words):
    config = write_config(tmp_path / "job.toml", tmp_path / "out", workers=2, rounds=1,
                          extra="clients = 4\n\n" + tables)
    result = check_in_process(str(config))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    for word in [str(config), *words]:
        assert word in result.stderr, (word, result.stderr)


def test_a_strategy_without_the_trait_is_refused(tmp_path):
    config = write_config(tmp_path / "job.toml", tmp_path / "out", workers=2, rounds=1,
                          strategy="data-parallel", extra='\n[compression]\nname = "top-k"\n')
    result = check_in_process(str(config))
    assert result.returncode == 2, result.stderr
    assert "StrategyTraits.compressed" in result.stderr, result.stderr


@pytest.mark.parametrize("line, words", [
    ("bits = 3", ["[compression]", "bits", "8, 4 or 2"]),
    ("fraction = 0.01", ["[compression]", "fraction"]),
    ("clip_range = -1", ["[compression] clip_range", "a positive number"]),
])
def test_a_bad_compression_option_names_file_table_and_key(tmp_path, line, words):
    config = write_config(tmp_path / "job.toml", tmp_path / "out", workers=2, rounds=1,
                          extra=f'\n[compression]\nname = "quantize"\n{line}\n')
    result = check_in_process(str(config))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    for word in [str(config), *words]:
        assert word in result.stderr, (word, result.stderr)


FEDBUFF = """clients = 12
buffer_size = 3
concurrency = 4

[simulation]
clock = "virtual"
"""


def test_fedbuff_uploads_compressed_and_refuses_error_feedback(tmp_path):
    def run(name, tables):
        config = write_config(tmp_path / f"{name}.toml", tmp_path / name, workers=2,
                              rounds=6, strategy="fedbuff", extra=FEDBUFF + tables)
        result = run_cli("run", str(config), cwd=str(tmp_path), timeout=180)
        assert result.returncode == 0, result.stdout + result.stderr
        return read_metrics(tmp_path / name)

    whole = run("whole", "")
    int8 = run("int8", '\n[compression]\nname = "quantize"\n')
    assert [r["round"] for r in int8] == list(range(1, 7))
    up = sum(r["bytes_up"] for r in int8), sum(r["bytes_up"] for r in whole)
    assert up[0] < 0.35 * up[1], up
    config = write_config(tmp_path / "ef.toml", tmp_path / "ef", workers=2, rounds=2,
                          strategy="fedbuff",
                          extra=FEDBUFF + '\n[compression]\nname = "top-k"\n')
    result = check_in_process(str(config))
    assert result.returncode == 2, result.stderr
    assert "CompressionTraits.stateful" in result.stderr and "fedbuff" in result.stderr


def test_check_says_what_one_clients_upload_carries(tmp_path):
    config = write_config(tmp_path / "job.toml", tmp_path / "out", workers=2, rounds=1,
                          extra='clients = 4\n\n[compression]\nname = "top-k"\n'
                                'fraction = 0.015\n')
    result = check_in_process(str(config))
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("upload:"))
    # 2,410 coordinates in keys of 2,048, 320, 32 and 10: top-k keeps 31 + 5 + 1 + 1 of
    # them (ceil(1.5 %) of each), 8 bytes each: 2,432 bits.
    assert "top-k sends 1.01 bits per coordinate of 2,410 (31.7x smaller" in line, line
    assert "error feedback's residual (9,640 bytes a client)" in line, line


def test_int8_under_secure_aggregation_costs_8_plus_log2_n_bits_a_coordinate_on_the_wire(
        tmp_path):
    # 4 clients a round over 2 workers (2 each): each worker's masked reply is one vector of
    # the model's 2,410 coordinates and secagg+'s 2 check elements.
    secure = ('clients = 4\n\n[secure_aggregation]\nname = "secagg+"\nclip_range = 0.5\n'
              'degree = 0\nthreshold = 2\n')
    plain = _run(tmp_path, "secure", secure)
    int8 = _run(tmp_path, "secure-int8", secure + '\n[compression]\nname = "quantize"\n')
    assert [r["round"] for r in int8] == [1, 2] and all(r["secure_sum_of"] == 4 for r in int8)
    check = run_cli("check", str(tmp_path / "secure-int8.toml"), "--json", cwd=str(tmp_path))
    assert check.returncode == 0, check.stderr
    field = 8 + 2  # ceil(log2 4)
    assert f'"modulus_bits": {field}' in check.stdout
    elements, workers = 2410 + 2, 2
    ideal = workers * (4 * elements - -(-elements * field // 8))  # 32 bits -> 10, packed
    for a, b in zip(plain, int8):
        # Measured: what the coordinator's transport received, round by round. Everything
        # but the masked vectors is the same in both runs, to the packed reply's few bytes
        # of framing (its `elements` field: about 60 bytes a reply).
        saved = a["bytes_up"] - b["bytes_up"]
        assert ideal - 128 * workers <= saved <= ideal, (a["bytes_up"], b["bytes_up"], ideal)
        bits = 32 - 8 * saved / (workers * elements)
        assert field <= bits < field + 0.5, bits
    # Both runs learn (the same clipped updates, int8 within a step of the 32-bit field's).
    assert abs(plain[-1]["accuracy"] - int8[-1]["accuracy"]) < 0.1
