"""Modules prepared on real ranks (nbtrain.rank.auto.wrapping): DDP's check of the first backward, what is a wrapper.

What needs a process group runs on two real ranks through nbtrain.start; rank functions
are nested or module-level so they travel by value.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nbtrain
from helpers.procs import collect
from nbtrain.errors import RankError
from nbtrain.messages import events
from nbtrain.rank.auto import wrapping


class _TwoHeads(nn.Module):
    """A model whose forward skips ``spare``: a parameter with no gradient in any step."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.spare = nn.Linear(4, 2)

    def forward(self, x):
        return self.body(x)


def _train_three_steps():
    import sys

    torch.manual_seed(0)
    model = nbtrain.prepare(_TwoHeads())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"stepped {step}", flush=True)
    sys.stderr.flush()
    return model.find_unused_parameters


def _stderr_of(seen):
    from nbtrain.messages import events

    return "".join(e.text for e in seen if isinstance(e, events.Output) and e.stream == "stderr")


def test_ddp_looks_for_no_unused_parameters_and_warns_nothing(launcher):
    def fn():
        torch.manual_seed(0)
        model = nbtrain.prepare(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
        for _ in range(3):
            model(torch.randn(8, 4)).pow(2).mean().backward()
        return model.find_unused_parameters

    result, failure, seen = collect(nbtrain.start(fn, devices=2))
    assert failure is None and result is False
    assert "find_unused_parameters" not in _stderr_of(seen)  # DDP's hint about the flag never shows


def test_unused_parameters_fail_the_first_step_naming_them_and_the_fix(launcher):
    _result, failure, seen = collect(nbtrain.start(_train_three_steps, devices=2))
    assert isinstance(failure, RankError) and failure.exc_type == "UnusedParametersError", failure
    message = failure.exc_message
    assert "_TwoHeads has 2 of its 4 trainable parameters that got no gradient in the first step: " in message
    assert "spare.weight, spare.bias" in message and "body." not in message
    assert "--strategy ddp_find_unused_parameters_true" in message and "find_unused_parameters=True" in message
    printed = "".join(e.text for e in seen if isinstance(e, events.Output))
    assert "stepped" not in printed  # raised by the first backward, before the optimizer stepped


def test_ddp_find_unused_parameters_true_strategy_trains_such_a_model(launcher):
    run = nbtrain.start(_train_three_steps, devices=2, strategy="ddp_find_unused_parameters_true")
    result, failure, seen = collect(run)
    assert failure is None and result is True, failure
    printed = "".join(e.text for e in seen if isinstance(e, events.Output))
    assert printed.count("stepped 2") == 2


def test_a_dataparallel_wrapper_reads_through_to_the_model_and_maps_back_to_it():
    model = torch.nn.Linear(2, 1)
    model.n_classes = 1
    wrapped = wrapping.transparent_dp_class()(model)
    assert type(wrapped).__name__ == "DataParallel" and wrapping.is_wrapped(wrapped)
    assert wrapped.n_classes == 1 and wrapped.weight is model.weight  # the model's own attributes
    wrapped.n_classes = 3  # set through the wrapper: lands on the model
    assert model.n_classes == 3
    assert list(wrapped.state_dict()) == ["weight", "bias"]  # the model's keys, no "module." prefix
    assert wrapping.original_of(wrapped) is model and not wrapping.is_wrapped(model)
    assert wrapping.original_of("not a model") == "not a model"


def test_a_one_rank_model_s_hook_moves_inputs_made_elsewhere_to_its_device():
    """The forward pre-hook a one-rank GPU model gets (its device bound once), tried on the meta device."""
    import functools

    model = nn.Linear(2, 1).to("meta")
    hook = functools.partial(wrapping._inputs_to_device, torch.device("meta"))
    model.register_forward_pre_hook(hook, with_kwargs=True)
    assert model(torch.ones(1, 2)).device.type == "meta"  # moved
    on_device = torch.ones(1, 2, device="meta")
    assert wrapping._inputs_to_device(torch.device("meta"), model, (on_device,), {}) is None  # nothing to move


# A fine-tuning cell's notebook: a model, its optimizer and an unshuffled loader of batch BS per rank;
# the reference (the same cell in the kernel) reads the union of the two ranks' batches: batch 2 * BS.
FINE_TUNING = """
import copy, torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
torch.set_num_threads(1)
torch.manual_seed(0)
X = torch.randn(32, 8)
Y = X @ torch.randn(8, 1)
loss_fn = nn.MSELoss()
torch.manual_seed(1)
model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
reference = copy.deepcopy(model)
first_bias = model[0].bias.detach().clone()
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
reference_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
loader = DataLoader(TensorDataset(X, Y), batch_size=4)
reference_loader = DataLoader(TensorDataset(X, Y), batch_size=8)
"""

# Freeze the first layer's bias before the loop, then (a schedule) unfreeze it and freeze the head part-way.
SCHEDULE = """{magic}
torch.set_num_threads(1)
{model}[0].bias.requires_grad_(False)
for epoch in range(3):
    if epoch == 1:
        {model}[0].bias.requires_grad_(True)
        {model}[4].requires_grad_(False)
    for x, y in {loader}:
        loss_fn({model}(x), y).backward()
        {opt}.step()
        {opt}.zero_grad()
"""


def test_freezing_and_unfreezing_after_the_wrap_trains_what_one_process_trains(kernel):
    """Auto mode wrapped the model in DDP before the cell's first line; the cell then freezes a
    parameter and, part-way, unfreezes it and freezes another. One process trains what requires
    grad at each step: so do the ranks (no "Expected to have finished reduction"), and the
    weights come back as one process's on the union batch."""
    kernel.run_ok(FINE_TUNING)
    magic = "%%distributed --devices 2 --accelerator cpu"
    out = kernel.run_ok(SCHEDULE.format(magic=magic, model="model", loader="loader", opt="opt"))
    kernel.run_ok(SCHEDULE.format(magic="", model="reference", loader="reference_loader", opt="reference_opt"))
    pairs = "zip(model.parameters(), reference.parameters())"
    assert kernel.value(f"[torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in {pairs}]") == [True] * 6, out.text
    assert kernel.value("not torch.equal(model[0].bias, first_bias)"), out.text  # unfrozen part-way, it trained
    assert kernel.value("[p.requires_grad for p in model.parameters()]") == [True] * 4 + [False] * 2


def test_the_trainable_check_reads_each_parameter_once_per_forward():
    """The per-step cost of following freezes: one ``requires_grad`` read per parameter, counted."""
    reads = []

    class Counted:
        def __init__(self, flag):
            self.flag = flag

        @property
        def requires_grad(self):
            reads.append(1)
            return self.flag

    parameters = [Counted(True), Counted(False), Counted(True)]
    assert wrapping._trainable_flags(parameters) == [True, False, True]
    assert len(reads) == 3


BACKBONE = """
torch.manual_seed(2)
backbone, head = nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 1)
backbone.requires_grad_(False)  # frozen in the kernel: auto mode wraps no such model
reference_backbone, reference_head = copy.deepcopy(backbone), copy.deepcopy(head)
first_backbone = backbone[0].weight.detach().clone()
pair_opt = torch.optim.SGD([*backbone.parameters(), *head.parameters()], lr=0.05)
reference_pair_opt = torch.optim.SGD([*reference_backbone.parameters(), *reference_head.parameters()], lr=0.05)
"""

UNFREEZE = """{magic}
torch.set_num_threads(1)
for epoch in range(2):
    if epoch == 1:
        {backbone}.requires_grad_(True)  # unfrozen part-way, as a fine-tuning schedule does
    for x, y in {loader}:
        loss_fn({head}({backbone}(x)), y).backward()
        nn.utils.clip_grad_norm_([*{backbone}.parameters(), *{head}.parameters()], 0.5)
        {opt}.step()
        {opt}.zero_grad()
"""


def test_a_backbone_frozen_before_the_cell_and_unfrozen_in_it_trains_as_one_process_trains_it(kernel):
    """A backbone frozen in the kernel is left unwrapped (DDP wraps nothing without a trainable
    parameter); unfrozen part-way through the cell, its gradients are averaged before they are
    clipped and stepped, so its weights come back as one process's on the union batch."""
    kernel.run_ok(FINE_TUNING + BACKBONE)
    magic = "%%distributed --devices 2 --accelerator cpu"
    names = {"backbone": "backbone", "head": "head", "opt": "pair_opt", "loader": "loader"}
    out = kernel.run_ok(UNFREEZE.format(magic=magic, **names))
    kernel.run_ok(UNFREEZE.format(magic="", **{k: f"reference_{v}" for k, v in names.items()}))
    both = "[*{0}backbone.parameters(), *{0}head.parameters()]"
    pairs = f"zip({both.format('')}, {both.format('reference_')})"
    assert kernel.value(f"[torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in {pairs}]") == [True] * 4, out.text
    assert kernel.value("not torch.equal(backbone[0].weight, first_backbone)"), out.text  # it trained


UNFREEZE_AND_RAISE = """{magic}
torch.set_num_threads(1)
{backbone}.requires_grad_(True)  # unfrozen in the cell
for i, (x, y) in enumerate({loader}):
    (loss_fn({head}({backbone}(x)), y) / 2).backward()  # two micro-batches a step
    if i % 2 == 1:
        {opt}.step()
        {opt}.zero_grad()
    if i == {at}:
        raise RuntimeError("the cell fails between a backward and its step")
"""


@pytest.mark.parametrize("at", [0, 2])
def test_a_backbone_unfrozen_in_the_cell_holds_the_whole_batchs_gradients_at_a_raise(kernel, at):
    """A frozen backbone, left unwrapped, that the cell unfreezes has its gradients averaged as each
    backward ends (its first forward with gradients after the unfreezing watches them): a cell raising
    between a micro-batch's backward and its step leaves the kernel's backbone with the union batch's."""
    kernel.run_ok(FINE_TUNING + BACKBONE)
    names = {"backbone": "backbone", "head": "head", "opt": "pair_opt", "loader": "loader"}
    reference = {k: f"reference_{v}" for k, v in names.items()}
    failed = kernel.run(UNFREEZE_AND_RAISE.format(magic="", at=at, **reference))
    assert failed.error is not None and failed.error["evalue"] == "the cell fails between a backward and its step"
    out = kernel.run(UNFREEZE_AND_RAISE.format(magic="%%distributed --devices 2 --accelerator cpu", at=at, **names))
    assert out.error is not None and out.error["ename"] == "RankError", out.text
    both = "[*{0}backbone.parameters(), *{0}head.parameters()]"
    pairs = f"zip({both.format('')}, {both.format('reference_')})"
    assert kernel.value(f"[torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6) for a, b in {pairs}]") == [True] * 4
    assert kernel.value("float(reference_backbone[0].weight.grad.abs().max())") > 1e-3
