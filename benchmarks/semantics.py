"""The differential tester's large run: generated training cells, each run in the kernel and under
``%%distributed`` (1 rank, 2 ranks, 2 ranks ``--no-auto``), every divergence shrunk and classed.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/semantics.py --cases 400 --seed 1000

Prints one line per case, then the figures: cases, divergent cases per way, classes (each with
its count and shrunk cell), coverage of each grammar rule, runs and duration. ``--json PATH``
writes them too. See docs/semantics.md for the contract and the references.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter

os.environ.setdefault("NBTRAIN_TEMPLATE", "0")  # each kernel its own launcher, as the tests run
os.environ.setdefault("NBTRAIN_RUNTIME_DIR", tempfile.mkdtemp(prefix="nbtrain-semantics-registry-"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from difftest import grammar, report, runner, shrink


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--ways", default="1,2,2-no-auto")
    parser.add_argument("--json", default="")
    parser.add_argument("--budget", type=float, default=0.0, help="seconds: start no case after this (0: none)")
    args = parser.parse_args()
    ways = tuple(args.ways.split(","))
    began = time.monotonic()
    run = runner.Runner()
    cases = [grammar.generate(args.seed + n) for n in range(args.cases)]
    classes: list[shrink.Class] = []
    counts: Counter[str] = Counter()
    divergent: Counter[str] = Counter()
    try:
        for number, case in enumerate(cases):
            if args.budget and time.monotonic() - began > args.budget:
                print(f"budget of {args.budget:.0f} s spent: {number} of {len(cases)} cases run", flush=True)
                cases = cases[:number]
                break
            found = runner.check(run, case, ways)
            names = []
            for divergence in found:
                divergent[divergence.way] += 1
                match = shrink.classify(run, divergence, classes)
                counts[match.name] += 1
                names.append(match.name)
            rules = ", ".join(case.present()) or "plain"
            print(
                f"case {number} (seed {case.seed}): {rules} -> {', '.join(names) or 'same'}",
                flush=True,
            )
    finally:
        run.close()
    seconds = time.monotonic() - began
    _summary(args, cases, ways, divergent, classes, counts, run, seconds)


def _summary(args, cases, ways, divergent, classes, counts, run, seconds) -> None:  # type: ignore[no-untyped-def]
    print(f"\n{len(cases)} cases (seed {args.seed}..{args.seed + len(cases) - 1}), ways {', '.join(ways)}")
    for way in ways:
        print(f"  way {way}: {divergent[way]} of {len(cases)} cases diverged")
    print(f"{len(classes)} divergence classes:")
    for found in sorted(classes, key=lambda c: (c.way, c.kind, c.rules)):
        print(f"\n== {found.name}: {counts[found.name]} cases\n{found.cell}")
    counted = report.coverage(cases)
    print("\ncoverage (cases each rule=option appeared in):")
    print("\n".join(report.coverage_lines(counted)))
    print(f"\n{run.runs} kernel runs in {run.seconds:.0f} s; the whole run {seconds:.0f} s ({seconds / 60:.1f} min)")
    if args.json:
        figures = {
            "cases": len(cases),
            "seed": args.seed,
            "ways": ways,
            "divergent": dict(divergent),
            "classes": [{"name": c.name, "cases": counts[c.name], "cell": c.cell} for c in classes],
            "coverage": counted,
            "runs": run.runs,
            "seconds": round(seconds),
        }
        with open(args.json, "w") as file:
            json.dump(figures, file, indent=1)


if __name__ == "__main__":
    main()
