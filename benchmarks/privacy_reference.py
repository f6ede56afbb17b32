"""Reference ε values from Google's ``dp-accounting`` (run in its own venv, not meshkit's).

``dp-accounting`` 0.6 pins ``attrs<24``, which meshkit's cattrs cannot take,
so it is not a dependency: this script imports nothing from meshkit and is
run with a Python that has ``dp-accounting`` installed::

    python -m venv /tmp/dpvenv && /tmp/dpvenv/bin/pip install dp-accounting==0.6.0
    /tmp/dpvenv/bin/python benchmarks/privacy_reference.py > tests/privacy/data/dp_accounting_reference.json

It prints, as JSON, ε at δ for the Poisson-subsampled Gaussian mechanism
(sensitivity 1, noise multiplier z, sampling probability q) composed over T
rounds, with the PLD accountant (add-or-remove neighbours, pessimistic
connect-the-dots, value discretisation 1e-4: the library's defaults) and the
RDP accountant (its default orders). ``benchmarks/privacy.py --accountant``
compares meshkit's accountant with these values (recomputing them when the
library is importable there or ``--reference-python`` names such a Python).
"""

from __future__ import annotations

import json
import sys

#: (q, z, T, delta): q from 0.001 to 0.1, z from 0.3 to 2, T up to 2,000.
GRID = [
    (0.05, 1.0, 200, 1e-5),  # the figure: 4.77 (PLD), 5.37 (RDP)
    (0.001, 0.5, 2000, 1e-5),
    (0.001, 1.0, 2000, 1e-6),
    (0.001, 2.0, 1000, 1e-5),
    (0.01, 0.5, 100, 1e-5),
    (0.01, 0.8, 2000, 1e-5),
    (0.01, 1.0, 1000, 1e-6),
    (0.01, 2.0, 2000, 1e-5),
    (0.05, 0.5, 10, 1e-5),
    (0.05, 0.7, 50, 1e-5),
    (0.05, 1.0, 2000, 1e-5),
    (0.05, 1.5, 500, 1e-7),
    (0.05, 2.0, 2000, 1e-5),
    (0.1, 0.5, 1, 1e-5),
    (0.1, 0.8, 20, 1e-5),
    (0.1, 1.0, 200, 1e-5),
    (0.1, 1.2, 1000, 1e-6),
    (0.1, 2.0, 2000, 1e-5),
    # little noise: each round's loss spans a wide range (the benchmark's z = 0.3)
    (0.05, 0.3, 100, 1e-5),
    (0.02, 0.3, 300, 1e-5),
]


def reference(grid: list[tuple[float, float, int, float]]) -> list[dict[str, float]]:
    import dp_accounting
    from dp_accounting import pld, rdp

    rows = []
    for q, z, t, delta in grid:
        event = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), t)
        accountant = pld.PLDAccountant()
        accountant.compose(event)
        eps_pld = accountant.get_epsilon(delta)
        accountant = rdp.RdpAccountant()
        accountant.compose(event)
        eps_rdp = accountant.get_epsilon(delta)
        rows.append({"q": q, "z": z, "rounds": t, "delta": delta,
                     "pld": float(eps_pld), "rdp": float(eps_rdp)})
    return rows


def main() -> None:
    from importlib.metadata import version as installed

    grid = [tuple(x) for x in json.loads(sys.argv[1])] if len(sys.argv) > 1 else GRID
    version = installed("dp-accounting")
    json.dump({"library": f"dp-accounting {version}", "rows": reference(grid)},  # type: ignore[arg-type]
              sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
