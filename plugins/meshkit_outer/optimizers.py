"""Outer optimizer implementations."""

from __future__ import annotations

from typing import Any, Mapping


class Average:
    """Adopts the consensus: ``x <- consensus``. Stateless."""

    def step(self, global_state: Mapping[str, Any], consensus: Mapping[str, Any]) -> dict[str, Any]:
        return dict(consensus)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            raise ValueError(f"average keeps no state, got keys {sorted(state)}")
