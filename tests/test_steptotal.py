"""The progress total read from a ``%%distributed`` cell's code (nbtrain.planning.steptotal).

Pure: source text and plain values in, a number or None out; no process, no torch. The
rule under test is "a total only when certain": each irregular shape must give None.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from nbtrain.planning import steptotal
from nbtrain.planning.steptotal import BACKWARD, LOG, StepCounter

AUTO = StepCounter(BACKWARD)
LOGS = StepCounter(LOG)
KERNEL_INTS = {"epochs": 3}
KERNEL_LENGTHS = {"loader": 7, "val_loader": 2}


def total(code: str, counter: StepCounter = AUTO, **kernel) -> int | None:
    kernel.setdefault("ints", KERNEL_INTS)
    kernel.setdefault("lengths", KERNEL_LENGTHS)
    return steptotal.total_steps(textwrap.dedent(code), counter, **kernel)


STEP = "loss = loss_fn(model(x), y); opt.zero_grad(); loss.backward(); opt.step()"


@pytest.mark.parametrize(
    ("loops", "expected"),
    [
        ("for epoch in range(3):\n    for x, y in loader:", 21),
        ("for epoch in range(epochs):\n    for x, y in loader:", 21),  # epochs from the kernel
        ("for epoch in range(1, 4):\n    for x, y in loader:", 21),
        ("for epoch in range(10, 0, -4):\n    for x, y in loader:", 21),  # 10, 6, 2
        ("for epoch in range(2 * epochs - 1):\n    for x, y in loader:", 35),
        ("for epoch in range(3):\n    for i, (x, y) in enumerate(loader):", 21),
        ("for epoch in range(3):\n    for i, (x, y) in enumerate(loader, start=1):", 21),
        ("for step in range(len(loader) // 2):\n    with torch.autocast('cpu'):", 3),
        ("for x, y in loader:\n    for micro_batch in range(4):", 28),
        ("for step in range(-2):\n    for x, y in loader:", None),  # no step at all
    ],
)
def test_loops_of_known_length_multiply(loops, expected):
    depth = loops.count("\n") + 1
    assert total(loops + "\n" + "    " * depth + STEP + "\n") == expected


def test_the_issue_cell_counts_epochs_times_batches_per_rank():
    cell = """
    for epoch in range(3):
        for x, y in loader:              # a DataLoader defined earlier in the notebook
            loss = loss_fn(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
        history.append(loss.item())
    """
    assert total(cell) == 3 * 7


def test_epochs_set_in_the_cell_before_the_loop():
    cell = """
    epochs = 4
    steps_per_epoch: int = epochs - 2
    for epoch in range(epochs):
        for step in range(steps_per_epoch):
            loss = model(x).sum()
            loss.backward()
    """
    assert total(cell, ints={}) == 8


def test_a_validation_loop_without_backward_does_not_count():
    cell = """
    for epoch in range(epochs):
        model.train()
        for x, y in loader:
            loss = loss_fn(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
        with torch.no_grad():
            for x, y in val_loader:
                val = loss_fn(model(x), y)
                if val < 0.1:
                    break  # the validation loop's own break: the training loop is whole
    """
    assert total(cell) == 21


def test_with_blocks_and_amp_scaler_backward_count():
    cell = """
    for x, y in loader:
        with torch.autocast("cpu"):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward(retain_graph=False)
        scaler.step(opt)
    """
    assert total(cell) == 7


KERNEL_EVAL_LENGTHS = {"loader": 14, "val_loader": 4}  # the same loaders read whole, under no_grad


def test_each_call_site_adds_its_own_loops():
    cell = """
    for x, y in loader:
        model(x).sum().backward()
    for x, y in val_loader:
        model(x).sum().backward()
    """
    assert total(cell) == 7 + 2
    assert total("for i in range(5):\n    nbtrain.log(loss=1.0)\nnbtrain.log(accuracy=0.5)\n", LOGS) == 6
    per_epoch = (
        "for epoch in range(3):\n    for x, y in loader:\n        loss.backward()\n    nbtrain.log(epoch_loss=1.0)\n"
        "    nbtrain.log(val=0.5)\n"
    )
    assert total(per_epoch, LOGS) == 6


MIXED = """
for epoch in range(epochs):
    for x, y in loader:
        loss = loss_fn(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        nbtrain.log(loss=loss)
    with torch.no_grad():
        for x, y in val_loader:
            nbtrain.log(val_loss=loss_fn(model(x), y))
"""


def test_an_evaluation_loop_reads_its_loader_whole():
    # 3 epochs x (7 training batches per rank + 4 validation batches, the whole loader)
    assert total(MIXED, LOGS, eval_lengths=KERNEL_EVAL_LENGTHS) == 3 * (7 + 4)
    # inference_mode, torch.autograd.no_grad and set_grad_enabled(False) say the same
    for switch in ("torch.inference_mode()", "torch.autograd.no_grad()", "torch.set_grad_enabled(False)", "no_grad()"):
        assert total(MIXED.replace("torch.no_grad()", switch), LOGS, eval_lengths=KERNEL_EVAL_LENGTHS) == 33, switch
    # gradients switched back on inside: the loop is a training pass again (2 batches per rank)
    inner = """
    with torch.no_grad():
        with torch.enable_grad():
            for x, y in val_loader:
                nbtrain.log(val_loss=1.0)
    """
    assert total(inner, LOGS, eval_lengths=KERNEL_EVAL_LENGTHS) == 2


def test_a_validation_loop_without_a_counting_call_adds_nothing_in_a_mixed_cell():
    validation = "            nbtrain.log(val_loss=loss_fn(model(x), y))"
    cell = MIXED.replace(validation, "            val = loss_fn(model(x), y)")
    assert total(cell, LOGS, eval_lengths=KERNEL_EVAL_LENGTHS) == 3 * 7
    backward_only = cell.replace("        nbtrain.log(loss=loss)\n", "")
    assert total(backward_only, eval_lengths=KERNEL_EVAL_LENGTHS) == 3 * 7


def test_len_of_a_loader_under_no_grad_counts_its_whole_batches():
    cell = """
    with torch.no_grad():
        for step in range(len(loader) // 2):
            nbtrain.log(val=1.0)
    """
    assert total(cell, LOGS, eval_lengths=KERNEL_EVAL_LENGTHS) == 7
    assert total(cell.replace("torch.no_grad()", "torch.autocast('cpu')"), LOGS, eval_lengths=KERNEL_EVAL_LENGTHS) == 3


GRAD_UNSURE = {
    "a switch with a value from a variable": MIXED.replace("torch.no_grad()", "torch.set_grad_enabled(training)"),
    "a switch outside a with block": "torch.set_grad_enabled(False)\n" + MIXED,
    "no evaluation length known": MIXED,
}


@pytest.mark.parametrize("case", sorted(GRAD_UNSURE))
def test_no_total_when_a_loaders_grad_mode_is_unsure(case):
    eval_lengths = {} if case == "no evaluation length known" else KERNEL_EVAL_LENGTHS
    assert total(GRAD_UNSURE[case], LOGS, eval_lengths=eval_lengths) is None


def test_an_unsure_grad_mode_is_fine_where_both_lengths_agree():
    # --no-auto, or a loader that cannot be sharded: every pass reads the whole loader
    same = {"loader": 7, "val_loader": 4}
    cell = "torch.set_grad_enabled(False)\n" + MIXED
    assert total(cell, LOGS, lengths=same, eval_lengths=same) == 3 * (7 + 4)
    decorated = "@torch.no_grad()\ndef evaluate():\n    pass\n" + MIXED  # switches inside evaluate() only
    assert total(decorated, LOGS, eval_lengths=KERNEL_EVAL_LENGTHS) == 33


def test_nbtrain_log_counts_when_the_cell_logs_itself():
    cell = """
    import nbtrain as nb
    for epoch in range(2):
        for x, y in loader:
            loss = loss_fn(model(x), y)
            loss.backward()   # not a step: the cell logs itself, auto mode does not
            nb.log(loss=loss, lr=0.1)
    """
    assert total(cell, LOGS) == 14
    assert total(cell.replace("nb.log(", "log("), StepCounter(LOG, log_functions=frozenset({"log"}))) == 14
    from_import = cell.replace("import nbtrain as nb", "from nbtrain import log as record")
    from_import = from_import.replace("nb.log(", "record(")
    assert total(from_import, LOGS) == 14


# --- what it refuses to guess -------------------------------------------------------------


UNKNOWN_CELLS = {
    "while loop": """
        while not done:
            loss = model(x).sum(); loss.backward()
    """,
    "break": """
        for x, y in loader:
            loss = model(x).sum(); loss.backward()
            if loss < 0.1:
                break
    """,
    "continue before the step": """
        for epoch in range(3):
            for x, y in loader:
                if x is None:
                    continue
                loss = model(x).sum(); loss.backward()
    """,
    "break in an inner loop's else belongs to the outer loop": """
        for x, y in loader:
            for k in range(2):
                pass
            else:
                break
            loss = model(x).sum(); loss.backward()
    """,
    "backward under an if": """
        for x, y in loader:
            loss = model(x).sum()
            if loss > 0:
                loss.backward()
    """,
    "backward in a try": """
        for x, y in loader:
            try:
                model(x).sum().backward()
            except RuntimeError:
                pass
    """,
    "backward in a function defined in the cell": """
        def train_step(x):
            model(x).sum().backward()
        for x, y in loader:
            train_step(x)
    """,
    "no backward at all (it is in a notebook function)": """
        for x, y in loader:
            train_step(x, y)
    """,
    "unknown range": """
        for epoch in range(n_epochs):
            for x, y in loader:
                model(x).sum().backward()
    """,
    "range of a float": """
        for epoch in range(3.0):
            model(x).sum().backward()
    """,
    "epochs rebound in the cell twice": """
        epochs = 2
        epochs = 5
        for epoch in range(epochs):
            model(x).sum().backward()
    """,
    "epochs set after the loop started": """
        for epoch in range(epochs):
            model(x).sum().backward()
        epochs = 10
    """,
    "epochs set inside a block": """
        if fast:
            epochs = 1
        for epoch in range(epochs):
            model(x).sum().backward()
    """,
    "epochs from the outer loop": """
        for epochs in range(3):
            for i in range(epochs):
                model(x).sum().backward()
    """,
    "epochs by augmented assignment": """
        epochs += 1
        for epoch in range(epochs):
            model(x).sum().backward()
    """,
    "a loader made in the cell": """
        loader = DataLoader(dataset, batch_size=8)
        for x, y in loader:
            model(x).sum().backward()
    """,
    "a loader re-prepared in the cell": """
        model, opt, loader = nbtrain.prepare(model, opt, loader)
        for x, y in loader:
            model(x).sum().backward()
    """,
    "a loader of unknown length": """
        for x, y in stream:
            model(x).sum().backward()
    """,
    "two loaders zipped": """
        for (x, y), (u, v) in zip(loader, val_loader):
            model(x).sum().backward()
    """,
    "islice": """
        for x, y in itertools.islice(loader, 5):
            model(x).sum().backward()
    """,
    "tqdm (or any wrapper)": """
        for x, y in tqdm(loader):
            model(x).sum().backward()
    """,
    "range with a zero step": """
        for i in range(0, 10, 0):
            model(x).sum().backward()
    """,
    "a comprehension": """
        [model(x).sum().backward() for x, y in loader]
    """,
    "backward inside a larger expression": """
        for x, y in loader:
            done = model(x).sum().backward() or stop
    """,
    "backward with a gradient does not log": """
        for x, y in loader:
            out = model(x)
            out.backward(torch.ones_like(out))
    """,
    "torch.autograd.backward is not Tensor.backward": """
        for x, y in loader:
            torch.autograd.backward(model(x).sum())
    """,
    "backward kept under another name": """
        step = loss.backward
        for x, y in loader:
            step()
            loss.backward()
    """,
    "a for-else around the step": """
        for x, y in loader:
            pass
        else:
            model(x).sum().backward()
    """,
    "async for": """
        async def go():
            async for x in aloader:
                model(x).sum().backward()
    """,
    "the cell's own range": """
        range = my_range
        for i in range(5):
            model(x).sum().backward()
    """,
    "nothing logs a step": """
        for x, y in loader:
            model(x)
    """,
    "zero steps": """
        for i in range(0):
            model(x).sum().backward()
    """,
    "a range longer than any index": """
        for i in range(1_000_000_000_000_000_000_000_000_000_000):
            model(x).sum().backward()
    """,
    "a syntax error": """
        for x in loader
            model(x).sum().backward()
    """,
}


@pytest.mark.parametrize("case", sorted(UNKNOWN_CELLS))
def test_no_total_when_unsure(case):
    assert total(UNKNOWN_CELLS[case]) is None


def test_a_kernel_global_named_range_is_not_the_builtin():
    cell = "for i in range(5):\n    model(x).sum().backward()\n"
    assert total(cell) == 5
    assert total(cell, kernel_globals={"range"}) is None


def test_a_bool_is_not_a_count():
    assert total("for i in range(flag):\n    loss.backward()\n", ints={"flag": True}) is None


LOG_UNKNOWN_CELLS = {
    "an explicit step": "for i, (x, y) in enumerate(loader):\n    nbtrain.log(step=i, loss=1.0)\n",
    "a positional step": "for i in range(5):\n    nbtrain.log(i, loss=1.0)\n",
    "scalars from a dict": "for i in range(5):\n    nbtrain.log(**metrics)\n",
    "log kept under another name": "record = nbtrain.log\nfor i in range(5):\n    record(loss=1.0)\n",
    "log rebound in the cell": "from math import log\nfor i in range(5):\n    log(loss=1.0)\n",
}


@pytest.mark.parametrize("case", sorted(LOG_UNKNOWN_CELLS))
def test_no_total_when_the_cells_own_logging_is_unclear(case):
    counter = StepCounter(LOG, log_functions=frozenset({"log"}))
    assert total(LOG_UNKNOWN_CELLS[case], counter) is None


def test_log_once_per_epoch_counts_epochs():
    cell = "for epoch in range(3):\n    for x, y in loader:\n        loss.backward()\n    nbtrain.log(epoch_loss=1.0)\n"
    assert total(cell, LOGS) == 3


def test_other_log_functions_are_not_steps():
    cell = "for i in range(4):\n    y = torch.log(x)\n    math.log(2.0)\n    nbtrain.log(loss=y)\n"
    assert total(cell, LOGS) == 4


def test_an_unknown_counter_is_refused():
    with pytest.raises(ValueError, match="backward"):
        StepCounter("epochs")


def test_steptotal_imports_nothing_heavy():
    code = "import sys, nbtrain.planning.steptotal\n"
    code += "print(sorted(m for m in ('torch', 'IPython', 'numpy') if m in sys.modules))"
    env = {**os.environ, "NBTRAIN_PREWARM": "0"}
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
