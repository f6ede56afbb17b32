"""The privacy contract a strategy drives: :class:`PrivacyMechanism` and the fold it begins.

A *privacy mechanism* (kind ``privacy``, hook ``meshkit_privacy()``, table
``[privacy]``) turns a federated round into a differentially private one.
The kernel keeps the contract (this module), the accountant
(``_accountant.py``) and a client's clipping (``_clip.py``, which a worker
runs with ``clip = "client"``); the mechanisms themselves are plugins: the
built-in ``dp-fixed`` and ``dp-adaptive`` build
``meshkit_privacy.GaussianMechanism``, whose fold is
``meshkit_privacy.NoisedSum``. A third-party mechanism implements the same
two protocols.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

__all__ = ["PrivacyMechanism", "PrivacyFold", "PLACEMENTS", "NOISE_SOURCES", "DISTRIBUTED"]

#: ``clip`` values: who clips an update before it is summed.
PLACEMENTS = ("coordinator", "client")
#: ``placement`` values: who adds the noise (the coordinator to the sum, or the
#: clients in the secure aggregation's field, :mod:`meshkit.privacy._skellam`).
DISTRIBUTED = ("central", "distributed")
#: ``noise`` values: where the noise's randomness comes from (the OS's entropy, or
#: (run seed, round): reproducible, and no privacy against whoever knows the seed).
NOISE_SOURCES = ("os", "seeded")


class PrivacyFold(Protocol):
    """One private round's fold: clipped updates in, one released model out.

    ``expected`` is the fixed denominator m (the expected cohort size) and
    ``unclipped`` the number of updates that were within the clip norm
    (adaptive clipping reads it).
    """

    expected: float
    unclipped: int

    def add(self, state: Mapping[str, Any], weight: float = 1.0, *,
            source: str | None = None) -> None: ...
    def add_total(self, total: Mapping[str, Any], count: int) -> None:
        """A sum of ``count`` clipped updates at once (a secure round reveals only that)."""
    def result(self) -> dict[str, Any]: ...


class PrivacyMechanism(Protocol):
    """What a ``meshkit_privacy`` factory builds.

    Per round the strategy asks :meth:`epsilon_after` (the ε the next round
    would bring the run to: ``target_epsilon`` stops the run before it),
    :meth:`begin` (the fold that clips, sums and noises the round's updates)
    and :meth:`finish` (compose the round into the accountant; adaptive
    clipping moves its clip norm). Its state is checkpointed with the run.
    """

    placement: str
    delta: float
    target_epsilon: float

    def epsilon(self) -> float: ...
    def epsilon_after(self, q: float, rounds: int = 1) -> float: ...
    def begin(self, reference: Mapping[str, Any], *, expected: float, seed: int,
              round_: int) -> PrivacyFold: ...
    def finish(self, fold: PrivacyFold, q: float, *, unclipped: int | None = None,
               seed: int = 0, round_: int = 0) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...
