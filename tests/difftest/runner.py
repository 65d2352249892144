"""Runs generated cases in real kernels, three ways, and compares what each left in the kernel.

Each way pairs a reference with a distributed run of the same cells:

- ``1``: ``%%distributed --devices 1 --accelerator cpu`` against the cells run in the kernel
  (batch size 4); everything bit-identical, RNG states included.
- ``2``: ``--devices 2`` (auto mode, ddp_notebook) against the cells run in the kernel with a
  batch size of 8 and unshuffled loaders: each reference batch is the union of what the two
  ranks read at that step. Floats within ``rtol`` 1e-4 + ``atol`` 1e-5; the inherent
  differences of data-parallel training are compared on what is still defined (INHERENT).
- ``2-no-auto``: ``--devices 2 --no-auto``: each rank runs the cell alone on all the data, so
  the reference is the first way's (rank 0's result comes back); RNG states not compared.

One kernel serves many runs: before each, ``%reset -f`` empties the user's namespace and the
saved files are removed; the kernel is replaced every ``KERNEL_RUNS`` runs and after a failure.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from difftest import compare, grammar

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL_RUNS = 80
DATA_NAMES = frozenset({"x", "y", "loss", "losses"})  # a rank's own batch and loss (INHERENT)
MODEL_FREE = frozenset({"noise", "pick", "scale", "ticks"})  # values no model computes: exact even beside BatchNorm

# Differences of data-parallel training that are inherent, and how the comparison treats them.
INHERENT = {
    "per-rank batch": "x, y, loss and the losses list hold rank 0's own batch and loss: compared by type and length",
    "batchnorm": "without sync BN each rank normalises by its own batch's statistics, so every weight "
    "differs from the union batch's: floats compared only for a lost update (unchanged where the reference moved)",
    "dropout": "each rank draws its own masks: floats compared only for a lost update, as for BatchNorm",
    "rng after the cell": "rank 0's generators advanced by its own draws (dropout's masks of its own batch): "
    "not compared for 2 ranks, nor a later cell's torch draws after dropout",
    "shuffle": "the reference cannot reproduce DistributedSampler's permutation: 2-rank runs use unshuffled loaders",
    "schedule sized before the cell": "a OneCycleLR sized from the kernel's len(loader): each rank takes half its "
    "steps, so learning rates, momenta and every weight differ: the numbers it was sized with and decides "
    "compared by type, the steps it took exactly, tensors only for a lost update",
}


@dataclass(frozen=True)
class Way:
    """One way a case runs: the reference's batch size, the distributed run's magic line, how to compare."""

    name: str
    magic: str
    ref_bs: int
    ranks: int

    def rules(self, case: grammar.Case, before: dict[str, Any]) -> compare.Rules:
        if self.ranks == 1:
            return compare.Rules(before=before)
        auto = "--no-auto" not in self.magic
        sized = case.get("sized") != "none"
        # Dropout draws each rank's masks for its own batch, so the generator that comes back (rank 0's)
        # is not one process's (INHERENT "rng after the cell"): a second cell's torch draws come from it.
        masks_drawn = auto and case.get("dropout") == "dropout" and case.get("second") == "again"
        return compare.Rules(
            rtol=1e-4,
            atol=1e-5,
            rng=False,
            before=before,
            type_only=DATA_NAMES if auto else frozenset(),
            loose_floats=auto and (case.get("model_kind") == "bn" or case.get("dropout") == "dropout" or sized),
            strict=MODEL_FREE - {"noise"} if masks_drawn else MODEL_FREE,
            scheduled=frozenset({"sched", "opt"}) if auto and sized else frozenset(),
        )

    def shuffle(self) -> bool | None:
        return False if self.ranks > 1 and "--no-auto" not in self.magic else None


CPU = "--accelerator cpu"
WAYS = {
    "1": Way("1", f"%%distributed --devices 1 {CPU}", 4, 1),
    "2": Way("2", f"%%distributed --devices 2 {CPU}", 8, 2),
    "2-no-auto": Way("2-no-auto", f"%%distributed --devices 2 {CPU} --no-auto", 4, 2),
}


@dataclass(frozen=True)
class Divergence:
    """A case whose distributed run left the kernel otherwise than its reference."""

    case: grammar.Case
    way: str
    differences: tuple[compare.Difference, ...]
    summary: str = ""  # the distributed cell's own output (nbtrain's summary line)

    def kinds(self) -> set[str]:
        return {d.kind for d in self.differences}


@dataclass
class Runner:
    """Real kernels for many runs, in a folder holding ``train_utils.py`` (the module trainer) and ``models.py``."""

    folder: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="difftest-"))
    kernel: Any = None
    runs: int = 0
    seconds: float = 0.0

    def __post_init__(self) -> None:
        for name, source in (("train_utils.py", grammar.TRAINER), ("models.py", grammar.NET)):
            with open(os.path.join(self.folder, name), "w") as file:
                file.write(source)

    def _kernel(self) -> Any:
        from kernel_helpers import NotebookKernel

        if self.kernel is None or self.runs % KERNEL_RUNS == 0 and self.runs:
            self.close()
            self.kernel = NotebookKernel(cwd=self.folder)
            self.kernel.run_ok("%load_ext nbtrain")
        return self.kernel

    def close(self) -> None:
        """Shut the kernel down (and every process it started)."""
        if self.kernel is not None:
            self.kernel.shutdown()
            self.kernel = None

    def once(self, case: grammar.Case, magic: str, bs: int, shuffle: bool | None) -> dict[str, Any]:
        """Run the case's cells once (the training cell under ``magic``); the kernel's description after."""
        began = time.monotonic()
        kernel = self._kernel()
        self.runs += 1
        try:
            return self._once(kernel, case, magic, bs, shuffle)
        except Exception as error:  # noqa: BLE001 - a cell past its deadline leaves the kernel busy: replace it
            self.close()
            return {
                "names": {},
                "rng": {},
                "files": {},
                "error": f"harness: {type(error).__name__}: {error}"[:200],
                "before": {},
            }
        finally:
            self.seconds += time.monotonic() - began

    def _once(self, kernel: Any, case: grammar.Case, magic: str, bs: int, shuffle: bool | None) -> dict[str, Any]:
        kernel.notebook.cells.clear()
        for name in os.listdir(self.folder):
            if name.endswith(".pt"):
                os.remove(os.path.join(self.folder, name))
        kernel.run_ok("%reset -f")
        # accelerate's singletons outlive %reset (rule ``framework``): each run starts from none, as a new kernel
        # would (a run that raised in a prepared loader leaves it registered in GradientState, for one).
        kernel.run_ok(RESET_ACCELERATE)
        kernel.run_ok(
            f"import sys as _sys\n_sys.path.insert(0, {TESTS!r})\nimport difftest.snapshot as _snap\nBS = {bs}"
        )
        cells = grammar.render(case, magic, shuffle)
        for cell in cells.setup:
            kernel.run_ok(cell)
        before = compare.flat_values(_describe(kernel))
        out = kernel.run(cells.train)
        error = _error(out)
        if cells.second is not None:
            error = _error(kernel.run(cells.second)) or error
        shot = _describe(kernel)
        shot.update(error=error, before=before, output=out.stdout[-600:] + out.stderr[-600:])
        return shot


RESET_ACCELERATE = """import sys as _sys
if "accelerate.state" in _sys.modules:
    _sys.modules["accelerate.state"].AcceleratorState._reset_state(reset_partial_state=True)
    _sys.modules["accelerate.state"].GradientState._reset_state()"""


def _describe(kernel: Any) -> dict[str, Any]:
    out = kernel.run_ok("print(__import__('json').dumps(_snap.describe(globals(), '.')))")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _error(out: Any) -> str | None:
    """The cell's error as ``Type: message``; a rank's, which nbtrain raises as a RankError, as the rank raised it."""
    if not out.error:
        return None
    name, message = out.error["ename"], out.error["evalue"]
    raised = RANK_RAISED.match(message) if name == "RankError" else None
    if raised is not None:
        name, message = raised.group(1), raised.group(2)
    if name in INTERRUPTED:  # the stop rule: RunInterrupted under %%distributed, KeyboardInterrupt in the kernel
        return "interrupted"
    return f"{name}: {message[:80]}"


INTERRUPTED = frozenset({"KeyboardInterrupt", "RunInterrupted"})


# "rank 0 raised RuntimeError: the cell fails part-way" (nbtrain.errors.RankError's first line)
RANK_RAISED = re.compile(r"rank \d+ raised ([\w.]+): (.*)")


def check(
    runner: Runner, case: grammar.Case, ways: tuple[str, ...], refs: dict[tuple[int, bool | None], Any] | None = None
) -> list[Divergence]:
    """Run ``case`` each of ``ways`` (and each reference once); the ways whose run diverged."""
    refs = {} if refs is None else refs
    found = []
    for name in ways:
        way = WAYS[name]
        key = (way.ref_bs, way.shuffle())
        if key not in refs:
            refs[key] = runner.once(case, "", way.ref_bs, way.shuffle())
        ref = refs[key]
        got = runner.once(case, way.magic, 4, way.shuffle())
        diffs = compare.compare(ref, got, way.rules(case, ref["before"]))
        if diffs:
            found.append(Divergence(case, name, tuple(diffs), got.get("output", "")))
    return found
