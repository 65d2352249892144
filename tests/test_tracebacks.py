"""A failed cell's error as the notebook shows it (nbtrain.kernel.tracebacks).

The rank's traceback is checked in a real Jupyter kernel (ipykernel, nbclient); the wording
pieces are checked directly, on the errors a run raises.
"""

from __future__ import annotations

import pytest

from kernel_helpers import OUR_FILES
from nbtrain.errors import RankError, RunStoppedError
from nbtrain.kernel import tracebacks

pytestmark = pytest.mark.timeout(240)


def test_a_failure_on_rank_one_names_the_rank_and_the_cells_line(kernel):
    kernel.run_ok("value = 10")
    number = kernel.value("len(In)")  # the next cell's In[N]
    out = kernel.run(
        "%%distributed --devices 2\n"
        "import nbtrain\n"
        "value = value + 1\n"
        "if nbtrain.rank() == 1:\n"
        "    raise ValueError('only rank 1 fails')\n"
    )
    assert out.error is not None
    text = "\n".join(out.error["traceback"])
    assert text.startswith("RankError: rank 1 raised ValueError: only rank 1 fails")
    assert f"Cell In[{number}], line 5, in <module>" in text
    assert "raise ValueError('only rank 1 fails')" in text
    assert OUR_FILES not in text  # no frames of ours
    # The failed rank is held for a post-mortem (tests/test_debugger.py): the last line says so.
    kept, held = text.rsplit("\n", 1)
    # Rank 1 raised alone: the kernel holds what it held there (value + 1 done), as its error says.
    assert kept.endswith(
        f"The kernel holds rank 1's state at the failing line (Cell In[{number}], line 5), as one process would: "
        "value, nbtrain as the cell had set them."
    ), kept
    assert held.startswith("%nbtrain_debug opens the debugger in rank 1's frames (held for 10 min")
    assert kernel.value("value") == 11


def test_an_error_in_a_prepared_models_forward_or_backward_reads_as_in_the_kernel(kernel):
    """A shape mismatch in the model, and a second backward through a freed graph: the frames
    are the kernel's own (the cell, torch's module calls and layers, autograd), with no DDP
    wrapper or nbtrain frame between the cell's line and the error."""
    kernel.run_ok(
        "import torch, torch.nn as nn\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "shape_net = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 1))\n"
        "shape_data = DataLoader(TensorDataset(torch.randn(32, 8)), batch_size=8)\n"
    )
    for failing, error, after_the_cell in [
        (
            "shape_net(x[:, :5]).sum().backward()",
            "mat1 and mat2 shapes cannot be multiplied",
            ["module.py, _wrapped_call_impl", "module.py, _call_impl", "container.py, forward"],  # the Sequential's
        ),
        (
            "loss = shape_net(x).sum()\n    loss.backward(); loss.backward()",
            "Trying to backward through the graph",
            ["_tensor.py, backward"],
        ),
    ]:
        out = kernel.run(f"%%distributed --devices 2\nfor (x,) in shape_data:\n    {failing}\n")
        assert out.error is not None
        text = "\n".join(out.error["traceback"])
        assert error in text, text
        assert OUR_FILES not in text and "distributed.py" not in text, text
        frames = [line.strip() for line in text.splitlines() if line.startswith(("  File ", "  Cell In"))]
        assert frames[0].startswith("Cell In"), text
        called = [f"{f.split(chr(34))[1].rsplit('/', 1)[-1]}, {f.rsplit(' in ', 1)[1]}" for f in frames[1:]]
        assert called[: len(after_the_cell)] == after_the_cell, text


@pytest.mark.parametrize("strategy", ["ddp_notebook", "ddp_spawn"])
def test_a_function_from_an_earlier_cell_shows_its_line_in_a_later_runs_traceback(kernel, strategy):
    """Each cell's lines go to the launcher once; its ranks (forked, standby or spawned) still have them."""
    kernel.run_ok(f"def check_{strategy}(value):\n    assert value > 1, 'too small: ' + str(value)\n")
    first = f"%%distributed --devices 2 --strategy {strategy}\ncheck_{strategy}(5)\n"
    kernel.run_ok(first)  # the function's cell goes with this run
    out = kernel.run(f"%%distributed --devices 2 --strategy {strategy}\ncheck_{strategy}(0)\n")
    text = "\n".join(out.error["traceback"]) if out.error else out.stdout
    # The frame's line, with its source (how the cell is named differs between IPython 7 and 8).
    assert f", line 2, in check_{strategy}\n    assert value > 1, 'too small: ' + str(value)" in text, text


def test_a_syntax_error_is_shown_at_the_cells_own_line(kernel):
    number = kernel.value("len(In)")  # the next cell's In[N]
    out = kernel.run("%%distributed --devices 2\nx = 1\nif x:\nprint(x)\n")
    assert out.error is not None and out.error["ename"] == "CellSyntaxError"
    text = "\n".join(out.error["traceback"])
    assert f"Cell In[{number}], line 4" in text and "IndentationError" in text and OUR_FILES not in text


def test_a_rank_error_keeps_its_rank_and_gets_the_note_and_the_device_hint():
    error = RankError(
        1, "RuntimeError", "Expected all tensors to be on the same device, but found at least two devices",
        'Traceback:\n  File "/tmp/x.py", line 3, in f\n', "",
    )
    shown = tracebacks.explain_failure(error, None, "Nothing in the kernel was changed.")
    assert isinstance(shown, RankError) and shown.rank == 1
    assert 'File "/tmp/x.py", line 3' in str(shown.remote_traceback)  # not a cell: its name stays
    assert "Move them with `.to(nbtrain.device())`" in shown.note
    assert shown.note.endswith("Nothing in the kernel was changed.")


def test_a_stop_says_what_it_means_for_the_kernel():
    error = tracebacks.explain_failure(RunStoppedError("the run was stopped."), None, "Nothing changed.")
    assert str(error) == "the run was stopped. Nothing changed."


def test_what_the_kernel_kept_names_its_objects_but_not_its_functions_or_modules():
    import math

    assert tracebacks.unchanged_note({}) == "Nothing in the kernel was changed."
    note = tracebacks.unchanged_note({"f": len, "math": math, **{f"v{i}": i for i in range(9)}})
    listed = "v0, v1, v2, v3, v4, v5, v6, v7, ..."
    assert note == f"Nothing in the kernel was changed: {listed} are as they were before the cell."
