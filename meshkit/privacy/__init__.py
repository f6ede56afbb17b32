"""Differential privacy: the accountant (and, below, the mechanism's contract)."""

from __future__ import annotations

from meshkit.privacy._accountant import (ACCOUNTANTS, RDP_ORDERS, Accountant,
                                         effective_noise_multiplier, epsilon_pld, epsilon_rdp)

__all__ = ["ACCOUNTANTS", "RDP_ORDERS", "Accountant", "effective_noise_multiplier",
           "epsilon_pld", "epsilon_rdp"]
