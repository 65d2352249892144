"""Ranks left waiting by a rank that finished: the cell says so while the run goes on (a real kernel, 2 CPU ranks).

A ``break`` that only rank 0 takes leaves rank 1 in its next DDP forward, waiting for a rank
that will never join: a run without a timeout would wait for ever, looking slow. After
``UNEVEN_SECONDS`` the launcher looks at rank 1's stack and the cell prints where it waits
and what to do. A rank that ends early while another computes on its own is the usual
uneven end: nothing is said.
"""

from __future__ import annotations

import re

import pytest

from kernel_helpers import nbtrain_kernel
from nbtrain.launch_server.uneven import UNEVEN_SECONDS

pytestmark = pytest.mark.timeout(240)

SETUP = """
import nbtrain, time, torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(256, 8), torch.randn(256, 1)), batch_size=16)
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
"""

DIVERGING = """%%distributed --devices 2
for i, (x, y) in enumerate(loader):
    if nbtrain.rank() == 0 and i == 2:
        break
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
"""


@pytest.fixture(scope="module")
def kernel():
    yield from nbtrain_kernel(SETUP)


def test_ranks_waiting_for_a_rank_that_finished_are_named_with_where_and_what_to_do(kernel):
    msg_id = kernel.start_cell(DIVERGING)
    try:
        seen = kernel.wait_for_stream(msg_id, ["begun no optimizer step since"], timeout=UNEVEN_SECONDS + 60)
    finally:
        kernel.interrupt()
    reply, out = kernel.wait_for_reply(msg_id, timeout=60)
    assert reply["status"] == "error" and out.error is not None and out.error["ename"] == "RunInterrupted"
    note = next(line for line in seen.splitlines() if "begun no optimizer step since" in line)
    assert note.startswith("nbtrain: rank 0 finished the cell "), note
    # In DDP's forward (model(x), line 5: it syncs buckets) or in the backward (line 6), as it happens.
    waits = r"rank 1 has begun no optimizer step since: it waits in (DDP's forward|a backward) .*, Cell In\[\d+\], "
    waits += r"line (5|6)\. "
    assert re.search(waits, note), note
    assert "Stop the run (interrupt the kernel; a background run: its Stop), and make every rank run the same" in note
    # The run is over: the kernel's model is as it was, and the next cell runs.
    out = kernel.run_ok("%%distributed --devices 2\nsteps = sum(1 for _ in loader)\n")
    assert "begun no optimizer step" not in out.text


def test_a_rank_that_ends_early_while_another_works_on_its_own_is_not_named(kernel):
    busy_seconds = UNEVEN_SECONDS + 2.0  # rank 0 evaluates on its own past the first look
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "for x, y in loader:\n"
        "    loss = nn.functional.mse_loss(model(x), y)\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n"
        "if nbtrain.rank() == 0:\n"
        f"    end = time.monotonic() + {busy_seconds}\n"
        "    while time.monotonic() < end:\n"
        "        torch.randn(64, 64) @ torch.randn(64, 64)\n"
    )
    assert "begun no optimizer step" not in out.text, out.text


def test_a_rank_that_skips_one_step_of_a_ddp_model_is_named_by_its_count(kernel):
    # Rank 1 skips its 4th batch (forward, backward, step): it finishes one step early, and rank 0
    # waits in its 8th step's gradient all-reduce, which rank 1 will never join.
    cell = (
        "%%distributed --devices 2\n"
        "for i, (x, y) in enumerate(loader):\n"
        "    if nbtrain.rank() == 1 and i == 3:\n"
        "        continue\n"
        "    loss = nn.functional.mse_loss(model(x), y)\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n"
    )
    msg_id = kernel.start_cell(cell)
    try:
        seen = kernel.wait_for_stream(msg_id, ["begun no optimizer step since"], timeout=UNEVEN_SECONDS + 60)
    finally:
        kernel.interrupt()
    kernel.wait_for_reply(msg_id, timeout=60)
    note = next(line for line in seen.splitlines() if "begun no optimizer step since" in line)
    assert note.startswith("nbtrain: rank 1 finished the cell "), note
    assert "it waits in a backward (DDP's gradient all-reduce)" in note, note
    # Each rank's count: its steps' gradient all-reduces and auto mode's own collectives; rank 1's is one short.
    begun = r"Collectives begun \(DDP's gradient all-reduces among them\): "
    counts = re.search(begun + r"rank 0 (\d+), rank 1 (\d+)\.$", note)
    assert counts is not None and int(counts.group(1)) == int(counts.group(2)) + 1, note
