"""A worker's secure clients: a scheme with the trait ``party`` builds them together and is told whom a reply sums."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs
import numpy as np
import pytest

from meshkit.errors import MeshError
from meshkit.secure_aggregation import SecureAggregationTraits
from meshkit.train._worker.secure import SecureClients


@attrs.frozen
class _Params:
    clients: int
    degree: int
    threshold: int
    clip_range: float
    modulus_bits: int


class _Side:
    """A client that masks with nothing (the worker's plumbing is what is under test)."""

    def __init__(self, client: int, log: list[Any]) -> None:
        self.client, self.log = client, log

    def advertise(self) -> bytes:
        return bytes([self.client])

    def mask(self, quantised: np.ndarray, excluded: Sequence[int]) -> np.ndarray:
        self.log.append(("mask", self.client))
        return quantised


class _Party:
    def __init__(self, clients: Sequence[int], log: list[Any]) -> None:
        self.log = log
        self._clients = {c: _Side(c, log) for c in clients}

    @property
    def clients(self) -> Mapping[int, _Side]:
        return self._clients

    def summing(self, clients: Sequence[int]) -> None:
        self.log.append(("summing", tuple(clients)))


class _PartyScheme:
    traits = SecureAggregationTraits(modulus_bits=32, advert_size=1, sealed_size=1,
                                     share_size=1, reveal_size=1, party=True)

    def __init__(self, plays: Sequence[int] | None = None) -> None:
        self.log: list[Any] = []
        self.plays = plays  # the clients its party builds, whatever it is asked for

    def params(self, **fields: Any) -> _Params:
        return _Params(**fields)

    def party(self, params: _Params, clients: Sequence[int], round_seed: bytes,
              length: int) -> _Party:
        self.log.append(("party", tuple(clients)))
        return _Party(clients if self.plays is None else self.plays, self.log)

    def quantize(self, values: np.ndarray, params: _Params) -> np.ndarray:
        return np.rint(values).astype(np.uint32)


def _keys(worker: SecureClients, clients: list[int]) -> dict[str, Any]:
    return worker.handle("secagg_keys", {
        "round": 1, "clients": clients, "cohort": 5, "degree": 0, "threshold": 3,
        "clip_range": 1.0, "modulus_bits": 32, "round_seed": np.zeros((1, 32), np.uint8),
        "length": 3, "scheme": "party-stub"}, fit=_fit)


def _fit(request: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    start = {"w": np.zeros(3, np.float32)}
    return {"w": np.full(3, request["shard"], np.float32)}, start


def test_a_party_scheme_is_told_whom_a_masked_reply_sums_before_any_of_them_masks() -> None:
    scheme = _PartyScheme()
    worker = SecureClients()
    worker.schemes["party-stub"] = scheme
    assert _keys(worker, [4, 1, 2])["clients"] == [1, 2, 4]
    reply = worker.handle("secagg_mask", {"clients": [1, 4], "seeds": [7, 8], "shards": 5,
                                          "excluded": []}, fit=_fit)
    assert scheme.log == [("party", (1, 2, 4)), ("summing", (1, 4)), ("mask", 1), ("mask", 4)]
    assert reply["clients"] == [1, 4] and reply["vector"].tolist() == [5, 5, 5]


def test_a_party_that_plays_other_clients_than_asked_is_refused() -> None:
    worker = SecureClients()
    worker.schemes["party-stub"] = _PartyScheme(plays=[1])
    with pytest.raises(MeshError, match=r"the scheme's party plays clients \[1\], not the "
                                        r"\[1, 2\] it was asked for"):
        _keys(worker, [1, 2])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_the_update_vector_is_the_float64_difference_bit_for_bit(dtype: Any) -> None:
    from meshkit.train._worker.secure import update_vector

    rng = np.random.default_rng(1)
    start = {"a": rng.normal(size=(5, 7)).astype(dtype), "b": rng.normal(size=9).astype(dtype)}
    fitted = {"a": np.asfortranarray(rng.normal(size=(5, 7)).astype(dtype)),  # any layout
              "b": rng.normal(size=9).astype(dtype)}
    expected = np.concatenate([(np.asarray(fitted[k], np.float64)
                                - np.asarray(start[k], np.float64)).ravel() for k in "ab"])
    got = update_vector(fitted, start, ["a", "b"])
    assert got.dtype == np.float64 and got.tobytes() == expected.tobytes()
    with pytest.raises(MeshError, match="the fit's model has no 'b'"):
        update_vector({"a": fitted["a"]}, start, ["a", "b"])
