"""Modules prepared on real ranks (nbtrain.rank.wrapping): DDP's check of the first backward, what is a wrapper.

What needs a process group runs on two real ranks through nbtrain.start; rank functions
are nested or module-level so they travel by value.
"""

from __future__ import annotations

import torch
from torch import nn

import nbtrain
from helpers.procs import collect
from nbtrain import events
from nbtrain.errors import RankError
from nbtrain.rank import wrapping


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
    from nbtrain import events

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
