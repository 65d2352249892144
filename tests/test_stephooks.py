"""The cell's one pair of optimizer step hooks (nbtrain.rank.auto.stephooks): registered for a cell, removed after
it."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from kernel_helpers import REGRESSION_SETUP, nbtrain_kernel
from nbtrain.rank.auto import stephooks


def test_one_pre_hook_and_one_post_hook_while_the_stack_is_open():
    before, after = len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with contextlib.ExitStack() as stack:
        stephooks.hook_steps(stack)
        assert (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)) == (before + 1, after + 1)
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()  # outside a run every step has nothing to do: the step is torch's own
    assert (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)) == (before, after)


def test_every_step_is_named_and_resolves():
    names = [name for name, _ in stephooks.BEFORE]
    assert names == ["first step", "averaged gradients", "loss scaling", "stop check"]
    assert all(callable(step) for step in stephooks._resolved(stephooks.BEFORE + stephooks.AFTER))


PROBE = '''
seen = []


def first(optimizer, args, kwargs):
    seen.append("first")


def changed():
    seen.append("the changed closure ran")


def second(optimizer, args, kwargs):
    seen.append("second")
    return args, {**kwargs, "closure": changed}


def third(optimizer, args, kwargs):
    seen.append(("third", kwargs.get("closure") is changed))
'''


def test_the_steps_run_in_their_order_and_a_changed_closure_reaches_the_later_ones(tmp_path, monkeypatch):
    (tmp_path / "stepprobe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import stepprobe

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = [("a", "stepprobe:first"), ("b", "stepprobe:second"), ("c", "stepprobe:third")]
    with contextlib.ExitStack() as stack:
        stephooks.hook_steps(stack, steps)
        optimizer.step()
    assert stepprobe.seen == ["first", "second", ("third", True), "the changed closure ran"]


ONE_STEP = """%%distributed --devices 2
import torch.distributed as dist
torch.manual_seed(nbtrain.rank())  # each rank makes a different model: rank 0's is broadcast at the first step
net = nn.Linear(8, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.5)
x = X[nbtrain.rank() :: 2][:16]  # each rank its own batch: the step is the same only if averaged
loss_fn(net(x), Y[nbtrain.rank() :: 2][:16]).backward()
opt.step()
both = [torch.zeros_like(net.weight) for _ in range(2)]
dist.all_gather(both, net.weight.detach())
same_after_one_step = bool(torch.equal(both[0], both[1]))
"""


@pytest.mark.timeout(300)
def test_on_real_ranks_the_first_step_keeps_a_cell_made_model_before_its_gradients_are_averaged():
    """'first step' (rank 0's weights broadcast, the model kept) comes before 'averaged gradients' (its
    gradients averaged): the first step itself is averaged, so both ranks hold one model after it."""
    for kernel in nbtrain_kernel(REGRESSION_SETUP, "import nbtrain"):
        kernel.run_ok(ONE_STEP)
        assert kernel.value("same_after_one_step") is True
