"""A stop at a step boundary on a rank (nbtrain.rank.machinery.stepcheck): optimizer steps counted on the board.

The board is the process's, so each test runs in a fresh interpreter: a real StepBoard in shared memory, a real
optimizer, and the launcher's part (choosing the stop step) played by the script.
The graceful stop of a whole run is tested in test_graceful_stop.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = """
import contextlib, json, torch
from nbtrain.system import stepboard
from nbtrain.rank.auto import stephooks
from nbtrain.rank.machinery import stepcheck

board = stepboard.StepBoard.create(2)
seen = {"without_board": stepcheck.counting()}
stepcheck.attach(board, 1)
seen["hooked"] = stepcheck.counting()
stephooks.hook_steps(contextlib.ExitStack())  # a cell's, left open: the script is the cell
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
seen["counts"] = board.counts()
seen["timed"] = board.median_step_seconds() is not None
board.request_stop()
seen["stop"] = board.choose_stop()
before = model.weight.detach().clone()
try:
    opt.step()
    seen["raised"] = None
except stepcheck.StopAtStep as stop:
    seen["raised"] = stop.step
seen["unchanged"] = torch.equal(before, model.weight)
seen["counts_after"] = board.counts()
seen["is_exception"] = isinstance(stepcheck.StopAtStep(1), Exception)
print(json.dumps(seen))
"""


def test_steps_are_counted_once_each_and_the_step_past_the_stop_raises_before_it_changes_anything():
    env = {**os.environ, "NBTRAIN_PREWARM": "0"}
    command = [sys.executable, "-c", SCRIPT]
    out = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["without_board"] is False and seen["hooked"] is True
    assert seen["counts"] == [0, 3] and seen["timed"]  # this rank's slot; two whole iterations timed
    assert seen["stop"] == 3 and seen["raised"] == 3 and seen["unchanged"]
    assert seen["counts_after"] == [0, 3]  # the step that did not run is not counted
    assert seen["is_exception"] is False  # a cell's ``except Exception`` lets the stop by
