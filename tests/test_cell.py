"""A ``%%distributed`` cell on a rank (nbtrain.rank.cell), run in this process as rank 0 of 1.

The result is read back by the kernel's side (nbtrain.kernel.namespace.decode_result), as
the engine does after carrying it across; what rank 0 leaves out is said in ``skipped``.
"""

from __future__ import annotations

import random
import traceback
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from nbtrain.kernel import namespace as ns
from nbtrain.messages import events, records
from nbtrain.rank import api
from nbtrain.rank import cell as rank_cell
from nbtrain.rank.cell import CellSpec, run_cell

FILENAME = "<cell test_cell>"


def spec(code: str, *names: str, **options: Any) -> CellSpec:
    return CellSpec(code=code, filename=FILENAME, names=names, auto=False, log_loss=False, **options)


def run(code: str, kernel: dict[str, Any], **options: Any) -> tuple[records.CellResult, dict[str, Any]]:
    """Run ``code`` with every name of ``kernel`` shipped; the result and its decoded outcome."""
    shipped = dict(kernel)
    result = run_cell(spec(code, *sorted(kernel), **options), dict(kernel))
    assert result is not None
    return result, ns.decode_result(result, shipped, {"__name__": "__main__", **kernel})


def test_names_the_cell_binds_come_back_and_untouched_ones_do_not():
    result, outcome = run("y = x + 1\nz = [x]\n", {"x": 1, "unused": {"a": 1}})
    assert outcome["bound"] == {"y": 2, "z": [1]}
    assert outcome["changed"] == {} and outcome["display"] is None
    assert result.deleted == [] and result.skipped == []


def test_objects_the_cell_changes_in_place_come_back_as_changes():
    history, settings = [1], {"lr": 0.1}
    _, outcome = run("history.append(2)\nlr = settings['lr']\n", {"history": history, "settings": settings})
    assert outcome["contents"] == {"history": [1, 2]} and outcome["bound"] == {"lr": 0.1}  # what it holds now
    assert outcome["changed"] == {}  # nothing had to travel whole


def test_deleted_kernel_names_are_listed():
    result, outcome = run("del tmp\n", {"tmp": 1, "keep": 2})
    assert result.deleted == ["tmp"] and "tmp" not in outcome["bound"]


def test_a_rebound_name_travels_as_a_binding_not_a_change():
    _, outcome = run("items.append(3)\nitems = 'rebound'\n", {"items": [1]})
    assert outcome["bound"] == {"items": "rebound"} and outcome["changed"] == {}


def test_the_last_expression_is_the_cells_value_when_asked():
    _, outcome = run("x = 2\nx * 21\n", {}, display_last=True)
    assert outcome["display"] == (42,)
    _, outcome = run("x = 2\nx * 21\n", {})
    assert outcome["display"] is None


def test_a_value_that_cannot_go_back_is_skipped_and_named_with_why():
    result, outcome = run("import random\nstream = (i for i in range(3))\nfine = 1\n", {})
    assert outcome["bound"] == {"random": random, "fine": 1}
    assert [(name, kind) for name, kind, _ in result.skipped] == [("stream", "generator")]
    assert "cannot pickle 'generator' object" in result.skipped[0][2]  # pickle's own words, first line only
    assert "\n" not in result.skipped[0][2]


def test_an_unpicklable_cell_value_is_skipped_as_the_cells_value():
    result, outcome = run("(i for i in range(3))\n", {}, display_last=True)
    assert outcome["display"] is None
    assert [(name, kind) for name, kind, _ in result.skipped] == [("the cell's value", "generator")]


def test_a_failing_cell_raises_with_its_own_line_in_the_traceback():
    with pytest.raises(ZeroDivisionError) as caught:
        run_cell(spec("x = 1\ny = x / 0\n"), {})
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert (frames[-1].filename, frames[-1].lineno) == (FILENAME, 2)


def test_a_function_defined_in_the_cell_comes_back_as_a_function_of_the_kernels_globals():
    shipped = {"factor": 3}
    result = run_cell(spec("def scaled(v):\n    return v * factor\n", "factor"), dict(shipped))
    assert result is not None
    kernel_ns = {"__name__": "__main__", "factor": 10}
    scaled = ns.decode_result(result, shipped, kernel_ns)["bound"]["scaled"]
    assert scaled.__globals__ is kernel_ns and scaled(2) == 20


def test_the_cell_starts_from_the_kernels_random_state():
    random.seed(1)
    torch.manual_seed(1)
    state = records.rng_states()
    expected = (random.random(), torch.rand(1).item())
    _, outcome = run(
        "values = (random.random(), torch.rand(1).item())\n", {"random": random, "torch": torch}, rng=state
    )
    assert outcome["bound"]["values"] == expected
    assert outcome["rng"] is not None  # where the rank's generators ended, for the kernel to continue


def test_modules_and_optimizers_come_back_as_full_states():
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    code = "loss = model(torch.ones(1, 2)).sum()\nloss.backward()\nopt.step()\nmodel.eval()\n"
    _, outcome = run(code, {"model": model, "opt": opt, "torch": torch})
    state, modes, params = outcome["modules"]["model"]
    assert set(state) == {"weight", "bias"} and modes == [("", False)]
    assert [(path, flag) for path, flag, _ in params] == [("weight", True), ("bias", True)]
    assert all(torch.equal(grad, p.grad) for (_, _, grad), p in zip(params, model.parameters(), strict=True))
    assert set(outcome["optimizers"]["opt"]["state"]) == {0, 1}  # momentum buffers of both parameters


def test_a_backward_alone_or_a_freeze_alone_brings_the_parameters_state_back():
    model = nn.Linear(2, 1)
    _, outcome = run("model(torch.ones(1, 2)).sum().backward()\n", {"model": model, "torch": torch})
    assert [grad.tolist() for _, _, grad in outcome["modules"]["model"][2]] == [[[1.0, 1.0]], [1.0]]
    _, outcome = run("model.bias.requires_grad_(False)\nmodel.weight.grad = None\n", {"model": model, "torch": torch})
    (_, weight_flag, weight_grad), (_, bias_flag, bias_grad) = outcome["modules"]["model"][2]
    assert (weight_flag, weight_grad, bias_flag, bias_grad.tolist()) == (True, None, False, [1.0])


def test_a_module_and_optimizer_the_cell_only_reads_do_not_come_back():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    _, outcome = run(
        "with torch.no_grad():\n    out = model(torch.ones(1, 2))\n", {"model": model, "opt": opt, "torch": torch}
    )
    assert outcome["modules"] == {} and outcome["optimizers"] == {} and set(outcome["bound"]) == {"out"}


def test_a_tensor_changed_in_place_comes_back_and_an_untouched_one_does_not():
    changed, untouched = torch.zeros(2), torch.zeros(2)
    _, outcome = run("changed += 1\n", {"changed": changed, "untouched": untouched})
    assert set(outcome["tensors"]) == {"changed"} and outcome["tensors"]["changed"].tolist() == [1.0, 1.0]


@pytest.fixture
def rank_one() -> Iterator[list[object]]:
    messages: list[object] = []
    api._set_context(api.RankContext(3, 1, 1, 1, "cpu", None, send=messages.append))
    try:
        yield messages
    finally:
        api._set_context(None)


def test_a_rank_other_than_0_sends_nothing_back_but_its_last_metrics(rank_one):
    code = "import nbtrain\nnbtrain.log(loss=0.25)\nresult = 1\n"
    assert run_cell(spec(code), {}) is None
    assert [type(m) for m in rank_one] == [events.Metrics]  # flushed before the namespace-out


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (1, "static"),
        ("s", "static"),
        (len, "static"),
        (nn.Linear(1, 1), "module"),
        (torch.zeros(1), "tensor"),
        ([1], "plain"),
        ({}, "plain"),
    ],
)
def test_each_shipped_value_is_classified_by_how_it_comes_back(value, kind):
    assert rank_cell._kind(value) == kind


def test_optimizers_schedulers_and_loaders_are_classified_too():
    opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1)
    loader = torch.utils.data.DataLoader([1, 2])
    assert [rank_cell._kind(v) for v in (opt, scheduler, loader)] == ["optimizer", "scheduler", "loader"]
