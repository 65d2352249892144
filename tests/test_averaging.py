"""The one gradient averager (nbtrain.rank.auto.averaging): averaged as each backward ends.

In one process, real autograd: a watched parameter's target averages once at the end of each
backward that wrote into its gradient, targets in the order they were made, nothing for
``torch.autograd.grad`` or a forward without gradients, nothing once the stack closed. In a
real kernel on 2 CPU ranks: how many all-reduces a step of a model nbtrain averages takes, with
and without gradient accumulation (one per backward, none more at the step), and the step's
weights still one process's.
"""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch

from kernel_helpers import REGRESSION_SETUP, nbtrain_kernel
from nbtrain.rank.auto import averaging

pytestmark = pytest.mark.timeout(300)


def _watched(stack: ExitStack, calls: list[str], *names: str) -> list[torch.nn.Parameter]:
    params = []
    for name in names:
        param = torch.nn.Parameter(torch.ones(3))
        target = averaging.Target("kept", lambda param=param: [param], average=lambda _, name=name: calls.append(name))
        averaging.watch_backwards(target)
        stack.callback(averaging.unwatch_backwards, target)
        params.append(param)
    return params


def test_each_target_a_backward_wrote_into_averages_once_at_its_end_in_the_order_they_were_made():
    calls: list[str] = []
    with ExitStack() as stack:
        first, second = _watched(stack, calls, "first", "second")
        (second * 2 + first * 3).sum().backward()  # autograd reaches `second`'s gradient first
        assert calls == ["first", "second"]
        loss = (first * second).sum()
        loss.backward(retain_graph=True)
        loss.backward()  # twice before a step: each backward averages what it added
        assert calls == ["first", "second"] * 3
        (second * 5).sum().backward()  # only `second`'s gradient written
        assert calls[-1:] == ["second"] and len(calls) == 7
        torch.autograd.backward((first * 2).sum())
        assert calls[-1:] == ["first"] and len(calls) == 8
    (first * second).sum().backward()  # the stack closed: nothing watched any more
    assert len(calls) == 8


def test_a_backward_that_writes_no_gradient_averages_nothing():
    calls: list[str] = []
    with ExitStack() as stack:
        (param,) = _watched(stack, calls, "model")
        torch.autograd.grad((param * 2).sum(), [param])  # gradients returned, no .grad written
        with torch.no_grad():
            (param * 2).sum()  # an evaluation forward: no backward at all
        other = torch.nn.Parameter(torch.ones(3))
        (other * 2).sum().backward()  # another model's backward
    assert calls == [] and param.grad is None


def test_a_parameter_is_watched_once_it_requires_grad_and_once_only():
    calls: list[str] = []
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    with ExitStack() as stack:
        by = averaging.Target("unfrozen", lambda: [frozen], average=lambda _: calls.append("unfrozen"))
        stack.callback(averaging.unwatch_backwards, by)
        averaging.watch_backwards(by)  # nothing to hook while it is frozen
        frozen.requires_grad_(True)
        averaging.watch_backwards(by)
        averaging.watch_backwards(by)  # watched already: one hook
        (frozen * 2).sum().backward()
        assert calls == ["unfrozen"]
        averaging.unwatch_backwards(by)  # its model found averaged otherwise (DDP's forward ran)
        (frozen * 2).sum().backward()
        assert calls == ["unfrozen"]
        averaging.watch_backwards(by)  # watched again
        (frozen * 2).sum().backward()
        assert calls == ["unfrozen"] * 2
    assert by.watched == set()  # the cell ended: a later one watches it afresh
    (frozen * 2).sum().backward()
    assert calls == ["unfrozen"] * 2


@pytest.fixture(scope="module")
def kernel():
    yield from nbtrain_kernel(REGRESSION_SETUP)


COUNTED = """%%distributed --devices 2 --accelerator cpu
import torch.distributed as dist
own_all_reduce = dist.all_reduce
per_step = [0]
def counting(*args, **kwargs):
    per_step[-1] += 1
    return own_all_reduce(*args, **kwargs)
dist.all_reduce = counting  # every all-reduce nbtrain's averaging makes, counted per optimizer step
try:
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for i, (x, y) in enumerate(DataLoader(TensorDataset(X, Y), batch_size={batch})):
        (loss_fn(net(x), y) / {accum}).backward()
        if i % {accum} == {accum} - 1:
            opt.step(); opt.zero_grad(); per_step.append(0)
finally:
    dist.all_reduce = own_all_reduce
counts = per_step[1:-1]  # past the first step (it keeps the model: rank 0's weights broadcast)
weights = [p.detach().clone() for p in net.parameters()]
"""

ONE_PROCESS = COUNTED.split("\n", 1)[1].replace("own_all_reduce(*args, **kwargs)", "None")


@pytest.mark.parametrize("accum", [1, 2])
def test_a_kept_models_step_takes_one_all_reduce_per_backward_and_none_at_the_step(kernel, accum):
    """Without accumulation one all-reduce per step, as before (at the backward's end, the step adds
    none); with two micro-batches a step, two: one per backward, as DDP without ``no_sync``. The
    weights are one process's on the two ranks' batches together."""
    out = kernel.run_ok(COUNTED.format(batch=16, accum=accum))
    counts = kernel.value("counts")
    assert len(counts) == 256 // 2 // 16 // accum - 1 and set(counts) == {accum}, (counts, out.text)
    kernel.run_ok("ranks_weights = weights\n" + ONE_PROCESS.format(batch=32, accum=accum))
    assert kernel.value("max(float((a - b).abs().max()) for a, b in zip(ranks_weights, weights))") < 1e-6
