"""Pack the paired DP benchmark's per-run files into one small JSONL file, and back.

``python benchmarks/ddp_results.py pack DIR [DIR ...] -o FILE [--tag TAG]``
``python benchmarks/ddp_results.py unpack FILE DIR [--tag TAG]``

benchmarks/distributed_dp.py ``--paired DIR`` saves each run as
``DIR/<kind>-<seed>.json`` (its per-round accuracy and cohort sizes, ~8 kB);
``--summarise`` reads them back. ``pack`` keeps what the summary needs in
about 1 kB a run: the accuracy as the count of correct test examples (every
accuracy is a multiple of 1/``test``, checked exactly), the cohort sizes, and
whether every sampled client contributed in every round (``contributors``,
recorded since issue 41's third pass; ``null`` before). ``unpack`` writes the
per-run files again, the same accuracy floats, so that ``distributed_dp.py
--paired DIR --summarise`` reproduces a committed table from the committed
file (benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

#: Fields copied as they are.
KEPT = ("kind", "seed", "z", "ok", "noise", "rounds", "modulus_bits", "epsilon", "seconds",
        "load", "noise_multiplier_realized", "optimisation")


def _test_size(accuracy: list[float]) -> int:
    """The smallest test-set size of which every accuracy is an exact multiple."""
    for n in range(1, 5001):
        if all(float(round(a * n)) / n == a for a in accuracy):
            return n
    raise SystemExit("the accuracies are not multiples of 1/n for any test set up to 5000")


def pack(folders: list[Path], tag: str) -> list[dict[str, Any]]:
    lines = []
    for folder in folders:
        for path in sorted(folder.glob("*.json")):
            run = json.loads(path.read_text())
            test = _test_size(run["accuracy"])
            line: dict[str, Any] = {k: run.get(k) for k in KEPT}
            line["tag"] = tag
            line["test"] = test
            line["correct"] = [round(a * test) for a in run["accuracy"]]
            line["cohort"] = run["cohort"]
            contributors = run.get("contributors")
            line["all_contributed"] = (None if not contributors or contributors[0] is None
                                       else all(c == n for c, n in
                                                zip(contributors, run["cohort"])))
            # unpack must give back the very floats the summary scores
            assert all(float(c) / test == a for c, a in zip(line["correct"], run["accuracy"]))
            lines.append(line)
    return lines


def unpack(file: Path, folder: Path, tag: str | None = None) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    count = 0
    for text in file.read_text().splitlines():
        line = json.loads(text)
        if tag is not None and line.get("tag") != tag:
            continue  # another design's runs (their files would share names)
        run = {k: line.get(k) for k in KEPT}
        run["accuracy"] = [float(c) / line["test"] for c in line["correct"]]
        run["cohort"] = line["cohort"]
        (folder / f"{line['kind']}-{line['seed']}.json").write_text(json.dumps(run) + "\n")
        count += 1
    return count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack")
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--tag", default="")
    u = sub.add_parser("unpack")
    u.add_argument("file", type=Path)
    u.add_argument("folder", type=Path)
    u.add_argument("--tag", default=None, help="only the runs packed with this tag")
    args = parser.parse_args()
    if args.command == "pack":
        lines = pack(args.folders, args.tag)
        with args.output.open("a") as out:
            for line in lines:
                out.write(json.dumps(line, separators=(",", ":")) + "\n")
        print(f"{len(lines)} runs appended to {args.output}")
    else:
        print(f"{unpack(args.file, args.folder, args.tag)} runs written to {args.folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
