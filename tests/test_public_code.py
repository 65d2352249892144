"""Public training code pasted into a notebook, cell by cell, runs unchanged on 2 CPU ranks.

Each test reproduces a pattern of well-known training scripts, written here in our own
words, in a real kernel: process-group functions imported by name in a plain cell, a model
and optimizer held by a trainer object, schedules and progress totals sized from
``len(loader)`` before the ``%%distributed`` cell.
"""

from __future__ import annotations

import pytest

from kernel_helpers import NotebookKernel, nbtrain_kernel

pytestmark = pytest.mark.timeout(300)

SETUP = """
import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
X = torch.randn(256, 8)
Y = X @ torch.randn(8, 1)
dataset = TensorDataset(X, Y)
loader = DataLoader(dataset, batch_size=16, shuffle=True)
loss_fn = nn.MSELoss()
"""


@pytest.fixture(scope="module")
def kernel():
    yield from nbtrain_kernel(SETUP)


def test_process_group_functions_imported_by_name_in_a_plain_cell_are_harmless_on_the_ranks(kernel):
    kernel.run_ok(
        "from torch.distributed import init_process_group, destroy_process_group as teardown\n"
        "import torch.distributed as dist\n"
        "def setup_ddp():\n"
        "    init_process_group(backend='gloo')\n"
        "kernel_init = init_process_group\n"
    )
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "init_process_group(backend='gloo')\n"
        "setup_ddp()\n"
        "ranks = [None, None]\n"
        "dist.all_gather_object(ranks, dist.get_rank())\n"
        "teardown()\n"
        "assert dist.is_initialized()  # the run's own group stays\n"
        "from torch.distributed import init_process_group as imported_here\n"
    )
    assert "ValueError" not in out.text
    assert kernel.value("ranks") == [0, 1]
    # In the kernel the names are still torch's own functions, the one imported on the ranks too.
    assert kernel.value("init_process_group is kernel_init is torch.distributed.distributed_c10d.init_process_group")
    assert kernel.value("imported_here is kernel_init")
    assert kernel.value("teardown is torch.distributed.distributed_c10d.destroy_process_group")


def _torch_optimizers() -> list[str]:
    import torch

    return sorted(
        name
        for name, value in vars(torch.optim).items()
        if isinstance(value, type) and issubclass(value, torch.optim.Optimizer) and value is not torch.optim.Optimizer
    )


OPTIMIZER_SETUP = """
import copy
def make_run(name):
    torch.manual_seed(0)
    if name == 'SparseAdam':  # sparse gradients only
        net, inputs = nn.Embedding(10, 3, sparse=True), torch.arange(4)
    else:  # Muon trains 2-D weights only
        net, inputs = nn.Linear(3, 2, bias=name != 'Muon'), torch.randn(4, 3)
    return net, inputs
def closure_for(o):
    def closure():
        o.zero_grad()
        loss = net(inputs).pow(2).sum()
        loss.backward()
        return loss
    return closure
def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return a == b
"""


@pytest.mark.parametrize("name", _torch_optimizers())
def test_every_torch_optimizer_round_trips_to_the_ranks_and_back(kernel, name):
    kernel.run_ok(
        OPTIMIZER_SETUP + f"net, inputs = make_run({name!r})\n"
        f"opt = torch.optim.{name}(net.parameters(), lr=0.01)\n"
        "opt.step(closure_for(opt))  # state made in the kernel travels too\n"
    )
    kernel.run_ok(
        "%%distributed --devices 2\n"
        "opt.step(closure_for(opt))\n"
        "opt.step(closure_for(opt))\n"
        "rank0_state = copy.deepcopy(opt.state_dict())\n"
        "fresh = type(opt)(net.parameters(), lr=0.01)  # made on the ranks, sent back whole\n"
        "fresh.step(closure_for(fresh))\n"
    )
    assert kernel.value("same(opt.state_dict(), rank0_state)")
    # The optimizer made on the ranks is bound to the kernel's own parameters and steps there.
    assert kernel.value(
        "type(fresh) is type(opt) and all(p is q for p, q in zip(fresh.param_groups[0]['params'], net.parameters()))"
    )
    kernel.run_ok("fresh.step(closure_for(fresh)); opt.step(closure_for(opt))")
    if name == "LBFGS":
        assert kernel.value("fresh._params is fresh.param_groups[0]['params'] and opt._params[0] is net.weight")


TRAINER = """
class Trainer:  # a trainer object holding model, optimizer and loader, as public demos do
    def __init__(self, model, optimizer, loader):
        self.model, self.optimizer, self.loader = model, optimizer, loader
        self.steps = 0
    def run(self, epochs):
        for _ in range(epochs):
            for x, y in self.loader:
                loss = loss_fn(self.model(x), y)
                self.optimizer.zero_grad(); loss.backward(); self.optimizer.step()
                self.steps += 1
torch.manual_seed(1)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), loader)
w0 = [p.detach().clone() for p in model.parameters()]
ids = id(trainer), id(trainer.optimizer), id(trainer.loader)
"""


def test_a_model_held_by_a_trainer_object_is_prepared_and_comes_back_into_the_same_objects(kernel):
    kernel.run_ok(TRAINER)
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "trainer.run(2)\n"
        "import torch.distributed as dist\n"
        "kind = type(trainer.model).__name__\n"
        "sums = [None, None]\n"
        "dist.all_gather_object(sums, [float(p.sum()) for p in trainer.model.parameters()])\n"
        "rank0_weights = [p.detach().clone() for p in trainer.model.parameters()]\n"
    )
    assert kernel.value("kind") == "DistributedDataParallel"
    sums = kernel.value("sums")
    assert sums[0] == sums[1]  # the gradients were averaged: both ranks hold the same weights
    assert kernel.value("trainer.steps") == 2 * 256 // 2 // 16  # each rank read its share
    assert kernel.value("(id(trainer), id(trainer.optimizer), id(trainer.loader)) == ids")
    assert kernel.value("trainer.model is model and type(model).__name__ == 'Sequential'")
    assert kernel.value("all(torch.equal(p, q) for p, q in zip(model.parameters(), rank0_weights))")
    assert kernel.value("all(not torch.equal(p, q) for p, q in zip(model.parameters(), w0))")
    assert kernel.value("len(trainer.optimizer.state) == 4")  # Adam's state came back into the same optimizer
    assert "trainer.model (DistributedDataParallel)" in out.stdout
    assert "trainer.loader: sharded" in out.stdout


def test_models_in_dicts_dataclasses_and_tuples_are_prepared_or_named_with_why_not(kernel):
    kernel.run_ok(
        "from dataclasses import dataclass\n"
        "torch.manual_seed(2)\n"
        "models = {'g': nn.Linear(8, 8), 'd': nn.Linear(8, 1)}\n"
        "@dataclass\n"
        "class Setup:\n"
        "    net: nn.Module\n"
        "    opt: torch.optim.Optimizer\n"
        "head = nn.Linear(8, 1)\n"
        "setup = Setup(head, torch.optim.SGD(head.parameters(), lr=0.1))\n"
        "frozen = (nn.Linear(8, 1),)\n"
        "g0 = models['g'].weight.detach().clone()\n"
    )
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "kinds = [type(models['g']).__name__, type(setup.net).__name__, type(frozen[0]).__name__]\n"
        "for x, y in loader:\n"
        "    loss = loss_fn(models['d'](models['g'](x)), y) + loss_fn(setup.net(x), y) + loss_fn(frozen[0](x), y)\n"
        "    setup.opt.zero_grad(); loss.backward(); setup.opt.step()\n"
        "    with torch.no_grad():\n"
        "        for m in models.values():\n"
        "            for p in m.parameters():\n"
        "                p -= 0.01 * p.grad\n"
        "g_rank0 = models['g'].weight.detach().clone()\n"
    )
    assert kernel.value("kinds") == ["DistributedDataParallel", "DistributedDataParallel", "Linear"]
    assert kernel.value("torch.equal(models['g'].weight, g_rank0) and not torch.equal(g0, g_rank0)")
    assert kernel.value("setup.net is head and type(models['g']).__name__ == 'Linear'")
    assert "models['g'] (DistributedDataParallel)" in out.stdout
    assert "frozen[0]: not prepared (a tuple cannot hold another object; each rank trains its own copy" in out.stdout


SCHEDULES = """
def linear_warmup_schedule(optimizer, num_warmup_steps, num_training_steps):
    # A schedule builder in the style of the public ones: a closure holding num_training_steps.
    def factor(step):
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        return max(0.0, (num_training_steps - step) / max(1, num_training_steps - num_warmup_steps))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
epochs = 2
train_loader = DataLoader(dataset, batch_size=16, shuffle=True)
num_training_steps = epochs * len(train_loader)
model4 = nn.Linear(8, 1)
opt4 = torch.optim.AdamW(model4.parameters(), lr=0.01)
lr_scheduler = linear_warmup_schedule(opt4, num_warmup_steps=2, num_training_steps=num_training_steps)
side = torch.optim.SGD(nn.Linear(8, 1).parameters(), lr=0.1)
one_cycle = torch.optim.lr_scheduler.OneCycleLR(side, max_lr=0.1, epochs=epochs, steps_per_epoch=len(train_loader))
"""

SCHEDULED_CELL = """%%distributed --devices 2
steps_done = 0
for epoch in range(epochs):
    for x, y in train_loader:
        loss = loss_fn(model4(x), y)
        loss.backward()
        opt4.step(); lr_scheduler.step(); opt4.zero_grad()
        side.step(); one_cycle.step()
        steps_done += 1
print(f'{steps_done}/{num_training_steps} steps')
"""


def test_schedules_sized_from_len_loader_before_the_cell_are_named_with_what_each_rank_runs(kernel):
    kernel.run_ok(SCHEDULES)
    out = kernel.run_ok(SCHEDULED_CELL)
    assert (
        "lr_scheduler expects 32 steps; each rank runs 16 (2 x len(train_loader): 16 batches in the kernel, "
        "8 on each rank): create lr_scheduler inside the %%distributed cell, where len(train_loader) is each rank's."
    ) in out.stdout
    assert "one_cycle expects 32 steps; each rank runs 16" in out.stdout
    assert "num_training_steps is 32 steps; each rank runs 16" in out.stdout
    assert "[rank 0] 16/32 steps" in out.stdout  # what the sentences say, as the cell sees it
    assert kernel.value("lr_scheduler.last_epoch") == 16 and kernel.value("opt4.param_groups[0]['lr']") > 0
    # The fix the sentence names: built inside the cell, the schedule ends where the ranks end.
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "lr_scheduler = linear_warmup_schedule(opt4, num_warmup_steps=2,\n"
        "                                      num_training_steps=epochs * len(train_loader))\n"
        + SCHEDULED_CELL.split("\n", 1)[1]
    )
    assert "lr_scheduler expects" not in out.stdout
    assert kernel.value("lr_scheduler.last_epoch") == 16 and kernel.value("opt4.param_groups[0]['lr']") == 0.0
    assert kernel.value("lr_scheduler.optimizer is opt4")


def test_a_progress_bars_total_is_a_step_count_too():
    tqdm = pytest.importorskip("tqdm")
    from nbtrain.kernel import lengths

    bar = tqdm.tqdm(total=240, disable=True)
    assert lengths.expected_steps(bar) == 240


def test_auto_mode_steps_aside_for_a_cell_that_wraps_the_trainers_model_itself(kernel):
    kernel.run_ok(TRAINER + "from torch.distributed import init_process_group, destroy_process_group\n")
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "init_process_group('gloo')\n"
        "trainer.model = DDP(trainer.model)\n"
        "kind = type(trainer.model).__name__\n"
        "trainer.run(1)\n"
        "trainer.model = trainer.model.module\n"
        "rank0_weights = [p.detach().clone() for p in trainer.model.parameters()]\n"
        "destroy_process_group()\n"
    )
    assert "Auto-prepared" not in out.stdout and "not prepared" not in out.stdout
    assert kernel.value("kind") == "DistributedDataParallel"  # the cell's own wrapper, around the unprepared model
    assert kernel.value("trainer.steps") == 256 // 16  # its loader was not sharded: the cell did not ask
    assert kernel.value("trainer.model is model and id(trainer) == ids[0]")
    assert kernel.value("all(torch.equal(p, q) for p, q in zip(model.parameters(), rank0_weights))")


def test_a_cell_using_accelerate_trains_on_each_ranks_whole_share_and_comes_back(kernel):
    """Accelerate's ``prepare`` wraps the model and shards the loader itself: auto mode steps aside
    (on top of its sharding, each rank read half its share)."""
    pytest.importorskip("accelerate")
    kernel.run_ok(
        "acc_model = nn.Linear(8, 1)\n"
        "acc_opt = torch.optim.SGD(acc_model.parameters(), lr=0.01)\n"
        "acc_loader = DataLoader(dataset, batch_size=16, shuffle=True)\n"
    )
    out = kernel.run_ok(
        "%%distributed --devices 2 --accelerator cpu\n"
        "from accelerate import Accelerator\n"
        "accelerator = Accelerator(cpu=True)\n"
        "model_, opt_, loader_ = accelerator.prepare(acc_model, acc_opt, acc_loader)\n"
        "seen = 0\n"
        "for x, y in loader_:\n"
        "    opt_.zero_grad()\n"
        "    accelerator.backward(loss_fn(model_(x), y))\n"
        "    opt_.step()\n"
        "    seen += len(x)\n"
        "wrapped = type(model_).__name__\n"
        "rank0_weight = acc_model.weight.detach().clone()\n"
    )
    assert "Auto-prepared" not in out.stdout, out.stdout
    assert kernel.value("seen") == 256 // 2  # rank 0's half of the data set, not a quarter
    assert kernel.value("wrapped") == "DistributedDataParallel"  # accelerate's own wrapper
    assert kernel.value("torch.equal(acc_model.weight, rank0_weight)")  # the kernel's model has rank 0's weights


def test_an_optimizer_that_keeps_its_own_attributes_and_wraps_another_round_trips(kernel):
    """Third-party optimizers keep settings and a wrapped optimizer as plain attributes."""
    kernel.run_ok(
        "class Lookahead(torch.optim.Optimizer):\n"
        "    def __init__(self, inner, k=3, alpha=0.5):\n"
        "        self.inner, self.k, self.alpha, self.calls = inner, k, alpha, 0\n"
        "        self.slow = [p.detach().clone() for g in inner.param_groups for p in g['params']]\n"
        "        self.param_groups, self.defaults, self.state = inner.param_groups, inner.defaults, inner.state\n"
        "        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}\n"
        "    def step(self, closure=None):\n"
        "        loss = self.inner.step(closure)\n"
        "        self.calls += 1\n"
        "        if self.calls % self.k == 0:\n"
        "            fast = [p for g in self.param_groups for p in g['params']]\n"
        "            with torch.no_grad():\n"
        "                for s, p in zip(self.slow, fast):\n"
        "                    s += self.alpha * (p - s); p.copy_(s)\n"
        "        return loss\n"
        "torch.manual_seed(3)\n"
        "net5 = nn.Linear(8, 1)\n"
        "look = Lookahead(torch.optim.SGD(net5.parameters(), lr=0.05, momentum=0.9))\n"
        "slow_before = look.slow\n"
    )
    kernel.run_ok(
        "%%distributed --devices 2\n"
        "for x, y in loader:\n"
        "    loss = loss_fn(net5(x), y)\n"
        "    look.zero_grad(); loss.backward(); look.step()\n"
        "rank0_slow = [s.clone() for s in look.slow]\n"
        "calls_on_rank0 = look.calls\n"
    )
    assert kernel.value("calls_on_rank0") == 8
    # Its own attributes came back too: the counter, and the slow weights into the same tensors.
    assert kernel.value("look.calls") == 8
    assert kernel.value("look.slow is slow_before and all(map(torch.equal, look.slow, rank0_slow))")
    assert kernel.value("look.k == 3 and look.inner.param_groups[0]['params'][0] is net5.weight")
    kernel.run_ok("look.zero_grad(); loss_fn(net5(X), Y).backward(); look.step()")  # still steps in the kernel


WRAPPING_OPTIMIZERS = """
import copy
class SAM(torch.optim.Optimizer):  # sharpness-aware: two backwards a step, a base optimizer steps
    def __init__(self, params, base_optimizer, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups
    @torch.no_grad()
    def first_step(self, zero_grad=False):
        norm = torch.stack([p.grad.norm() for g in self.param_groups for p in g['params']]).norm()
        for g in self.param_groups:
            for p in g['params']:
                self.state[p]['e_w'] = e_w = p.grad * g['rho'] / (norm + 1e-12)
                p.add_(e_w)
        if zero_grad: self.zero_grad()
    @torch.no_grad()
    def second_step(self, zero_grad=False):
        for g in self.param_groups:
            for p in g['params']:
                p.sub_(self.state[p]['e_w'])
        self.base_optimizer.step()
        if zero_grad: self.zero_grad()
class BareLookahead(torch.optim.Optimizer):  # never calls Optimizer.__init__, as many copies of it do
    def __init__(self, base, k=3, alpha=0.5):
        self.base, self.k, self.alpha, self.count = base, k, alpha, 0
        self.param_groups, self.state, self.defaults = base.param_groups, base.state, base.defaults
        self.slow = [p.detach().clone() for g in base.param_groups for p in g['params']]
    def step(self, closure=None):
        self.base.step(); self.count += 1
        if self.count % self.k == 0:
            with torch.no_grad():
                for s, p in zip(self.slow, [p for g in self.param_groups for p in g['params']]):
                    s += self.alpha * (p - s); p.copy_(s)
    def zero_grad(self, set_to_none=True):
        self.base.zero_grad(set_to_none)
batches = [(X[i:i + 32], Y[i:i + 32]) for i in range(0, 256, 32)]
def sam_epoch(net, opt):
    for x, y in batches:
        loss_fn(net(x), y).backward(); opt.first_step(zero_grad=True)
        loss_fn(net(x), y).backward(); opt.second_step(zero_grad=True)
def lookahead_epoch(net, opt):
    for x, y in batches:
        opt.zero_grad(); loss_fn(net(x), y).backward(); opt.step()
torch.manual_seed(5)
sam_net = nn.Linear(8, 1); sam_ref = copy.deepcopy(sam_net)
sam_opt = SAM(sam_net.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
sam_ref_opt = SAM(sam_ref.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
look_net = nn.Linear(8, 1); look_ref = copy.deepcopy(look_net)
look_opt = BareLookahead(torch.optim.Adam(look_net.parameters(), lr=1e-2))
look_ref_opt = BareLookahead(torch.optim.Adam(look_ref.parameters(), lr=1e-2))
"""


def test_optimizers_that_wrap_another_come_back_with_its_momentum_and_train_on_as_in_the_kernel(kernel):
    """SAM and a Lookahead step through an inner optimizer that shares their groups (and a Lookahead that
    never called ``Optimizer.__init__``): two cells on one rank train exactly as two runs in the kernel."""
    kernel.run_ok(WRAPPING_OPTIMIZERS)
    for _ in range(2):
        kernel.run_ok("%%distributed --devices 1\nsam_epoch(sam_net, sam_opt)\nlookahead_epoch(look_net, look_opt)\n")
        kernel.run_ok("sam_epoch(sam_ref, sam_ref_opt)\nlookahead_epoch(look_ref, look_ref_opt)\n")
    # The inner optimizers' momentum came back (the second cell started from it), so the weights agree.
    assert kernel.value("torch.equal(sam_net.weight, sam_ref.weight) and torch.equal(look_net.weight, look_ref.weight)")
    assert kernel.value("len(sam_opt.base_optimizer.state) == 2 and look_opt.count == 16")
    # Still one set of groups and one state, shared with the inner optimizer: a changed lr reaches it.
    assert kernel.value("sam_opt.param_groups is sam_opt.base_optimizer.param_groups")
    assert kernel.value("look_opt.state is look_opt.base.state and look_opt.param_groups is look_opt.base.param_groups")


def test_lbfgs_steps_on_the_ranks_without_auto_mode_too(kernel):
    kernel.run_ok(
        OPTIMIZER_SETUP + "net, inputs = make_run('LBFGS')\nopt = torch.optim.LBFGS(net.parameters(), lr=0.1)\n"
    )
    kernel.run_ok("%%distributed --devices 2 --no-auto\nloss = opt.step(closure_for(opt))\n")
    assert kernel.value("opt.state_dict()['state'][0]['n_iter']") > 0
    assert kernel.value("opt._params[0] is net.weight")


def test_a_holder_that_refuses_the_prepared_model_is_named_with_why(kernel):
    kernel.run_ok(
        "from dataclasses import dataclass\n"
        "@dataclass(frozen=True)\n"
        "class Frozen:\n"
        "    net: nn.Module\n"
        "fixed = Frozen(nn.Linear(8, 1))\n"
    )
    out = kernel.run_ok("%%distributed --devices 2\nfor x, y in loader:\n    loss_fn(fixed.net(x), y).backward()\n")
    expected = "fixed.net: not prepared (its holder refused it: cannot assign to field 'net'; each rank trains"
    assert expected in out.stdout


def test_a_model_with_weight_norm_and_spectral_norm_trains_on_the_ranks_and_comes_back(kernel):
    """torch's parametrized modules refuse to be pickled; their state travels as an ordinary module's."""
    kernel.run_ok(
        "from torch.nn.utils.parametrizations import weight_norm, spectral_norm\n"
        "torch.manual_seed(4)\n"
        "normed = nn.Sequential(weight_norm(nn.Linear(8, 16)), nn.ReLU(), spectral_norm(nn.Linear(16, 1)))\n"
        "normed_opt = torch.optim.Adam(normed.parameters(), lr=1e-2)\n"
        "direction = normed[0].parametrizations.weight.original1\n"
        "direction_before = direction.detach().clone()\n"
    )
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "for x, y in loader:\n"
        "    loss = loss_fn(normed(x), y)\n"
        "    normed_opt.zero_grad(); loss.backward(); normed_opt.step()\n"
        "rank0_state = {k: v.clone() for k, v in normed.state_dict().items()}\n"
        "parametrized = type(normed[0]).__name__  # indexing the DDP-wrapped Sequential, as in the kernel\n"
        "layers = (len(normed), [type(layer).__name__ for layer in normed], bool(normed))\n"
    )
    assert "normed (DistributedDataParallel)" in out.stdout, out.stdout
    assert kernel.value("parametrized") == "ParametrizedLinear"
    assert kernel.value("layers") == [3, ["ParametrizedLinear", "ReLU", "ParametrizedLinear"], True]
    # The kernel's own tensors hold rank 0's trained state; the parametrization still works.
    assert kernel.value("normed[0].parametrizations.weight.original1 is direction")
    assert kernel.value("not torch.equal(direction, direction_before)")
    assert kernel.value("all(torch.equal(v, rank0_state[k]) for k, v in normed.state_dict().items())")
    assert kernel.value("normed(X).shape == (256, 1) and len(normed_opt.state) == 5")


def test_a_module_dict_model_reads_as_itself_when_wrapped(kernel):
    kernel.run_ok(
        "torch.manual_seed(8)\n"
        "parts = nn.ModuleDict({'enc': nn.Linear(8, 4), 'head': nn.Linear(4, 1)})\n"
        "parts_opt = torch.optim.SGD(parts.parameters(), lr=0.05)\n"
    )
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "for x, y in loader:\n"
        "    loss = loss_fn(parts['head'](torch.relu(parts['enc'](x))), y)\n"
        "    parts_opt.zero_grad(); loss.backward(); parts_opt.step()\n"
        "seen = [list(parts), 'enc' in parts, 'nope' in parts, len(parts), sorted(parts.keys())]\n"
    )
    assert "parts (DistributedDataParallel)" in out.stdout, out.stdout
    assert kernel.value("seen") == [["enc", "head"], True, False, 2, ["enc", "head"]]


def test_an_averaged_model_is_moved_not_wrapped_and_its_average_comes_back(kernel):
    """An EMA copy (torch's AveragedModel) is averaged from the model, not trained: no DDP for it."""
    kernel.run_ok(
        "from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn\n"
        "torch.manual_seed(5)\n"
        "student = nn.Linear(8, 1)\n"
        "student_opt = torch.optim.SGD(student.parameters(), lr=0.05)\n"
        "ema = AveragedModel(student, multi_avg_fn=get_ema_multi_avg_fn(0.9))\n"
    )
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "for x, y in loader:\n"
        "    loss = loss_fn(student(x), y)\n"
        "    student_opt.zero_grad(); loss.backward(); student_opt.step()\n"
        "    ema.update_parameters(student)\n"
        "ema_type = type(ema).__name__\n"
        "rank0_ema = ema.module.weight.detach().clone()\n"
    )
    assert "student (DistributedDataParallel)" in out.stdout, out.stdout
    assert "ema (DistributedDataParallel)" not in out.stdout, out.stdout
    assert kernel.value("ema_type") == "AveragedModel"
    assert kernel.value("ema.n_averaged.item()") == 8  # rank 0's 8 steps of 16 x 2 ranks
    assert kernel.value("torch.equal(ema.module.weight, rank0_ema)")
    assert kernel.value("not torch.equal(ema.module.weight, student.weight)")


def test_a_compiled_model_trains_on_the_ranks_and_torch_compiles_own_globals_stay_there(kernel):
    """``model = torch.compile(model)`` before the training cell, as recent tutorials do: the ranks
    compile and train it; the globals torch.compile puts beside the compiled code (the compiled
    function, the modules it reads) belong to the rank and are neither sent back nor warned about."""
    kernel.run_ok(
        "class Small(nn.Module):  # defined in the notebook: its forward's globals are the notebook's\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.weight = nn.Parameter(torch.randn(1, 8) / 8)\n"
        "    def forward(self, x):\n"
        "        return torch.relu(x) @ self.weight.T + nn.functional.linear(x, self.weight)\n"
        "torch.manual_seed(9)\n"
        "cnet = torch.compile(Small())\n"
        "copt = torch.optim.SGD(cnet.parameters(), lr=0.05)\n"
        "cnet_before = cnet.weight.detach().clone()\n"
    )
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "for x, y in loader:\n"
        "    loss = loss_fn(cnet(x), y)\n"
        "    copt.zero_grad(); loss.backward(); copt.step()\n"
        "rank0_weight = cnet.weight.detach().clone()\n"
    )
    assert "cnet (DistributedDataParallel)" in out.stdout, out.stdout
    assert "__compiled_fn" not in out.stdout + out.stderr and "__import" not in out.stdout, out.stdout
    assert "not brought back" not in out.stderr, out.stderr
    assert kernel.value("type(cnet).__name__") == "OptimizedModule"
    assert kernel.value("torch.equal(cnet.weight, rank0_weight) and not torch.equal(cnet.weight, cnet_before)")
    compilers = "[n for n in globals() if n.startswith(('__compiled_fn', '__import', '__builtins_dict'))]"
    assert kernel.value(compilers) == []


@pytest.mark.parametrize("devices", [1, 2])
def test_code_written_for_a_ddp_model_runs_on_one_rank_and_on_two(kernel, devices, tmp_path):
    """Gradient accumulation with ``model.no_sync()``, saving ``model.module``'s state, saving
    the whole model and ``copy.deepcopy(model)``: on two ranks the model is DDP's, on one it
    is unwrapped, and the same cell works on both; what it saves or copies is the model."""
    kernel.run_ok(
        "import contextlib, copy, nbtrain\n"
        "torch.manual_seed(6)\n"
        "net6 = nn.Linear(8, 1)\n"
        "opt6 = torch.optim.SGD(net6.parameters(), lr=0.05)\n"
    )
    out = kernel.run_ok(
        f"%%distributed --devices {devices}\n"
        "for i, (x, y) in enumerate(loader):\n"
        "    accumulate = i % 2 == 0\n"
        "    with net6.no_sync() if accumulate else contextlib.nullcontext():\n"
        "        loss_fn(net6(x), y).backward()\n"
        "    if not accumulate:\n"
        "        opt6.step(); opt6.zero_grad()\n"
        "best = copy.deepcopy(net6)\n"
        "if nbtrain.rank() == 0:\n"
        f"    torch.save(net6.module.state_dict(), {str(tmp_path / 'state.pt')!r})\n"
        f"    torch.save(net6, {str(tmp_path / 'whole.pt')!r})\n"
        "kind = type(net6).__name__\n"
    )
    assert kernel.value("kind") == ("Linear" if devices == 1 else "DistributedDataParallel"), out.stdout
    assert kernel.value("type(best) is nn.Linear and torch.equal(best.weight, net6.weight)")
    whole = f"torch.load({str(tmp_path / 'whole.pt')!r}, weights_only=False)"
    assert kernel.value(f"type({whole}) is nn.Linear and torch.equal({whole}.weight, net6.weight)")
    state = f"torch.load({str(tmp_path / 'state.pt')!r})"
    assert kernel.value(f"torch.equal({state}['weight'], net6.weight)")


def test_a_model_made_in_the_cell_is_kept_one_over_the_ranks_and_its_loader_sharded(kernel):
    """Auto mode prepares what the kernel had; a model, optimizer and loader built in the training
    cell are kept one model over the ranks (gradients averaged before each step) and the loader
    sharded, as the same objects made in an earlier cell would be."""
    made_here = (
        "torch.manual_seed(7)\n"
        "net7 = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 1))\n"
        "opt7 = torch.optim.SGD(net7.parameters(), lr=0.05)\n"
        "loader7 = DataLoader(dataset, batch_size=16)\n"
        "frozen7 = nn.Linear(8, 8)  # made here, never stepped: nothing to say about it\n"
    )
    loop = (
        "batches = 0\n"
        "for x, y in loader7:\n"
        "    loss = loss_fn(net7(x), y)\n"
        "    opt7.zero_grad(); loss.backward(); opt7.step(); batches += 1\n"
    )
    out = kernel.run_ok("%%distributed --devices 2\n" + made_here + loop)
    assert "Auto-prepared: net7 (made in the cell: gradients averaged before each step)." in out.stdout, out.stdout
    assert "loader7: sharded (DistributedSampler, 128 of 256 per rank" in out.stdout, out.stdout
    assert "frozen7 (" not in out.stdout and "nbtrain note" not in out.stderr, out.stderr
    assert kernel.value("batches") == 8  # 128 of the 256 samples on rank 0
    kernel.run_ok("kept7 = {k: v.clone() for k, v in net7.state_dict().items()}")
    prepared = made_here + "import nbtrain\nnet7, opt7, loader7 = nbtrain.prepare(net7, opt7, loader7)\n"
    out = kernel.run_ok("%%distributed --devices 2\n" + prepared + loop + "kind = type(net7).__name__\n")
    assert kernel.value("batches") == 8 and kernel.value("kind") == "DistributedDataParallel"
    assert kernel.value("all(torch.allclose(v, net7.state_dict()[k], atol=1e-6) for k, v in kept7.items())")
    # One rank has nothing to average: nothing is kept there.
    out = kernel.run_ok("%%distributed --devices 1\n" + made_here + loop)
    assert "gradients averaged" not in out.stdout and kernel.value("batches") == 16, out.stdout


@pytest.mark.parametrize("devices", [1, 2])
def test_the_notebooks_data_parallel_trains_one_process_per_device_and_comes_back_as_itself(kernel, devices, tmp_path):
    """``model = nn.DataParallel(model)``, as code written for several GPUs in one process
    does: on the ranks its model is DDP's (one process per device, gradients averaged) or,
    on one rank, the DataParallel drives that rank's device alone; what the cell saves has
    the DataParallel's keys, and the kernel's own DataParallel gets the trained weights."""
    kernel.run_ok(
        "import nbtrain, torch.distributed as dist\n"
        "torch.manual_seed(8)\n"
        "dp8 = nn.DataParallel(nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 1)))\n"
        "opt8 = torch.optim.SGD(dp8.parameters(), lr=0.05)\n"
        "dp8_id, before8 = id(dp8), dp8.module[0].weight.detach().clone()\n"
    )
    out = kernel.run_ok(
        f"%%distributed --devices {devices}\n"
        "for x, y in loader:\n"
        "    loss = loss_fn(dp8(x), y)\n"
        "    opt8.zero_grad(); loss.backward(); opt8.step()\n"
        "mine = dp8.module[0].weight.detach().clone()\n"
        "rank0s = mine.clone()\n"
        "if dist.is_initialized(): dist.broadcast(rank0s, 0)\n"
        "same_as_rank0 = torch.equal(mine, rank0s)\n"
        "keys8 = list(dp8.state_dict())\n"
        f"torch.save(dp8, {str(tmp_path / 'dp8.pt')!r}) if nbtrain.rank() == 0 else None\n"
    )
    kept = "on the rank's one device" if devices == 1 else "set aside: one process per device"
    assert f"its DataParallel {kept}" in out.stdout, out.stdout
    assert kernel.value("same_as_rank0")  # on two ranks: DDP averaged their gradients
    assert kernel.value("keys8[0]") == "module.0.weight"
    assert kernel.value("id(dp8) == dp8_id and type(dp8) is nn.DataParallel")
    assert kernel.value("torch.equal(dp8.module[0].weight, mine) and not torch.equal(before8, mine)")
    saved = f"torch.load({str(tmp_path / 'dp8.pt')!r}, weights_only=False)"
    assert kernel.value(f"type({saved}) is nn.DataParallel and torch.equal({saved}.module[0].weight, mine)")



# -- a trainer whose class lives in a module beside the notebook (minGPT's demo, a project's train_utils.py) --

TRAIN_UTILS = '''
import torch
from torch.utils.data import DataLoader


class Trainer:
    """Makes its optimizer and loader in run(), as minGPT's Trainer does."""

    def __init__(self, config, model, train_dataset):
        self.config, self.model, self.train_dataset = config, model, train_dataset
        self.optimizer = None
        self.iter_num = 0

    def run(self):
        model, config = self.model, self.config
        self.optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate, momentum=0.9)
        loader = DataLoader(self.train_dataset, batch_size=config.batch_size, shuffle=False)
        model.train()
        for _ in range(config.epochs):
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
                self.iter_num += 1


class Holder:
    """Holds the model and an optimizer made before the cell, in slots."""

    __slots__ = ("model", "optimizer", "steps")

    def __init__(self, model, optimizer):
        self.model, self.optimizer, self.steps = model, optimizer, 0


class TiedNet(torch.nn.Module):
    """Its head's weight is its embedding's, as GPT-2's and nanoGPT's are."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Linear(4, 4, bias=False)
        self.head = torch.nn.Linear(4, 4, bias=False)
        self.head.weight = self.emb.weight
        self.out = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.head(torch.tanh(self.emb(x)))))
'''

BESIDE_SETUP = """
import types, torch
from torch.utils.data import TensorDataset
from train_utils import Trainer
def setup(batch_size):
    global model, config, dataset, trainer, kernel_ids
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    X = torch.randn(32, 4)
    dataset = TensorDataset(X, X.sum(1, keepdim=True))
    config = types.SimpleNamespace(batch_size=batch_size, learning_rate=0.05, epochs=2)
    trainer = Trainer(config, model, dataset)
    kernel_ids = id(trainer), id(model), id(config), id(dataset)
setup(8)
trainer.run()  # the one-process reference: batches of 8
reference = [p.detach().clone() for p in model.parameters()]
reference_momentum = [trainer.optimizer.state[p]['momentum_buffer'].clone() for p in model.parameters()]
"""

# What one process leaves: the same objects under the same names, the optimizer keyed by the model's parameters.
SAME_GRAPH = (
    "trainer.model is model and trainer.config is config and trainer.train_dataset is dataset"
    " and (id(trainer), id(model), id(config), id(dataset)) == kernel_ids"
    " and all(p is q for p, q in zip(trainer.optimizer.param_groups[0]['params'], model.parameters()))"
    " and all(p in trainer.optimizer.state for p in model.parameters())"
)


@pytest.fixture(scope="module")
def beside(tmp_path_factory):
    """A kernel whose working directory holds train_utils.py, as a project's notebook folder does."""
    folder = tmp_path_factory.mktemp("project")
    (folder / "train_utils.py").write_text(TRAIN_UTILS)
    kernel = NotebookKernel(cwd=str(folder))
    try:
        kernel.run_ok("%load_ext nbtrain")
        kernel.run_ok(BESIDE_SETUP)
        yield kernel
    finally:
        kernel.shutdown()


@pytest.mark.parametrize("devices", [1, 2])
def test_a_trainer_of_a_module_beside_the_notebook_trains_the_kernels_own_model(beside, devices):
    """minGPT's pattern: ``trainer = Trainer(config, model, dataset)`` before, ``trainer.run()`` in the cell.

    Afterwards the kernel holds what one process would: ``trainer.model is model``, trained as
    one process trains it on the union of the ranks' batches (two ranks of 4 are one batch of 8:
    no shuffle, a mean loss), the optimizer made in the cell stepping the kernel's parameters.
    """
    beside.run_ok(f"setup({8 // devices})")
    out = beside.run_ok(f"%%distributed --devices {devices} --accelerator cpu\ntrainer.run()\n")
    assert beside.value(SAME_GRAPH), out.stdout
    assert beside.value("trainer.iter_num") == 32 // 8 * 2
    close = "torch.equal" if devices == 1 else "(lambda a, b: torch.allclose(a, b, atol=1e-6))"
    assert beside.value(f"all({close}(p, q) for p, q in zip(model.parameters(), reference))"), out.stdout
    assert beside.value(
        f"all({close}(trainer.optimizer.state[p]['momentum_buffer'], m)"
        " for p, m in zip(model.parameters(), reference_momentum))"
    )


NEIGHBOURS = """
from torch.utils.data import DataLoader
from train_utils import Holder, TiedNet
def build(batch_size):
    global model, opt, models, holder, w, loader, feed, config, before_ids
    torch.manual_seed(1)
    model = TiedNet()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    models = {'net': model}
    holder = Holder(model, opt)
    w = model.emb.weight
    X = torch.randn(32, 4)
    loader = DataLoader(TensorDataset(X, X.sum(1, keepdim=True)), batch_size=batch_size, shuffle=False)
    feed = types.SimpleNamespace(loader=loader)
    config = types.SimpleNamespace(batch_size=batch_size, learning_rate=0.05, epochs=1)
    before_ids = [id(o) for o in (model, opt, models, holder, w, config)]
"""

NEIGHBOUR_CELL = """
for _ in range(2):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(models['net'](x), y)
        holder.optimizer.zero_grad(); loss.backward(); holder.optimizer.step()
        holder.steps += 1
    models['net'].epochs_done = _ + 1  # an attribute of the model itself
tied_norm = float(w.norm())  # the name kept for the tied weight, used in the cell
"""

NEIGHBOUR_GRAPH = (
    "models['net'] is model and holder.model is model and holder.optimizer is opt and w is model.emb.weight"
    " and model.head.weight is model.emb.weight"
    " and [id(o) for o in (model, opt, models, holder, w, config)] == before_ids"
    " and all(p is q for p, q in zip(opt.param_groups[0]['params'], model.parameters()))"
    " and all(p in opt.state for p in model.parameters())"
)


def _as_one_process(kernel, devices, cell, expression, build="build"):
    """Run ``cell`` in the kernel itself on batches of 8, then on ``devices`` ranks of 8 // devices each:
    ``expression``'s values must agree (exactly on one rank, within float rounding on two)."""
    kernel.run_ok(f"{build}(8)\n" + cell + f"\nreference = [t.detach().clone() for t in {expression}]")
    kernel.run_ok(f"{build}({8 // devices})")
    out = kernel.run_ok(f"%%distributed --devices {devices} --accelerator cpu\n" + cell)
    close = "torch.equal" if devices == 1 else "(lambda a, b: torch.allclose(a, b, atol=1e-6))"
    assert kernel.value(f"all({close}(a, b) for a, b in zip({expression}, reference))"), out.stdout
    return out


@pytest.mark.parametrize("devices", [1, 2])
def test_a_model_in_a_dict_by_name_in_slots_with_tied_weights_and_a_name_for_a_parameter_stays_one_object(
    beside, devices
):
    """Every place that held the model, its tied weight or its optimizer holds it after the cell,
    trained as one process would train it; the optimizer's state is keyed by the live parameters."""
    beside.run_ok(NEIGHBOURS)
    moments = "[opt.state[p]['exp_avg'] for p in model.parameters()]"
    out = _as_one_process(beside, devices, NEIGHBOUR_CELL, f"list(model.parameters()) + {moments}")
    assert beside.value(NEIGHBOUR_GRAPH), out.stdout
    assert beside.value("holder.steps") == 2 * 32 // 8 and beside.value("model.epochs_done") == 2


@pytest.mark.parametrize("devices", [1, 2])
def test_a_trainer_of_a_module_made_in_the_cell_holds_the_kernels_model_and_config(beside, devices):
    """``Trainer(config, model, dataset)`` made in the cell: it comes back holding the kernel's own
    objects, and the kernel's model is trained as one process trains it."""
    beside.run_ok(NEIGHBOURS)
    cell = "made = Trainer(config, model, loader.dataset)\nmade.run()\n"
    out = _as_one_process(beside, devices, cell, "list(model.parameters())")
    assert beside.value(
        "made.model is model and made.config is config and made.train_dataset is loader.dataset"
        " and all(p in made.optimizer.state for p in model.parameters())"
    ), out.stdout
    assert beside.value("made.iter_num") == 32 // 8


@pytest.mark.parametrize("devices", [1, 2])
def test_a_cell_using_the_model_by_name_and_through_its_trainer_trains_one_averaged_model(beside, devices):
    """``model`` prepared by its name and ``trainer.model`` holding it: both places hold the one
    prepared model on the ranks, so the trainer's steps average the gradients as the name's would."""
    cell = "trainer.run()\nfinal = float(model(dataset.tensors[0]).sum())\n"
    out = _as_one_process(beside, devices, cell, "list(model.parameters())", build="setup")
    assert beside.value(SAME_GRAPH), out.stdout
    prepared = out.stdout.partition("Auto-prepared: ")[2].partition(". ")[0]
    assert prepared.startswith("model") and "trainer.model" not in prepared, out.stdout  # named once


@pytest.mark.parametrize("devices", [1, 2])
def test_a_loader_used_by_name_and_through_a_holder_reads_one_share_at_both_places(beside, devices):
    """``len(loader)`` by name and ``feed.loader`` iterated: both places hold the one sharded loader."""
    beside.run_ok(NEIGHBOURS)
    cell = NEIGHBOUR_CELL.replace("for x, y in loader:", "for x, y in feed.loader:") + "batches = len(loader)\n"
    out = _as_one_process(beside, devices, cell, "list(model.parameters())")
    assert beside.value("holder.steps") == 2 * 32 // 8 and beside.value("feed.loader is loader"), out.stdout
