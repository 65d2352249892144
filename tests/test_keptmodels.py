"""A model the cell makes and trains itself is kept one over the ranks (a real kernel, 2 CPU ranks).

No DDP wraps a model a cell's function makes (a k-fold loop's ``run_training(fold)``), so
nbtrain averages its gradients before each step and shards the loader made with it: the
result is the one a single process gets from the two ranks' batches together, and the one
DDP gets; LBFGS's closure is averaged too; ranks that made the model differently train
rank 0's.
"""

from __future__ import annotations

import pytest

from kernel_helpers import REGRESSION_SETUP, nbtrain_kernel

pytestmark = pytest.mark.timeout(300)

FIT = """
import nbtrain
def fit(
    wrap=lambda *made: made, make=torch.optim.SGD, batch=16, norm=False, seed=lambda: 4, clip=None, clipper=None,
    **options,
):
    torch.manual_seed(seed())
    middle = nn.BatchNorm1d(16) if norm else nn.Identity()
    net = nn.Sequential(nn.Linear(8, 16), middle, nn.Tanh(), nn.Linear(16, 1)).double()  # LBFGS amplifies rounding
    opt = make(net.parameters(), **options)
    dl = DataLoader(TensorDataset(X, Y), batch_size=batch)  # in order: rank r reads samples r, r + 2, ...
    net, opt, dl = wrap(net, opt, dl)
    losses = []
    for epoch in range(2):
        for x, y in dl:
            x, y = x.double(), y.double()
            def closure():
                opt.zero_grad(); loss = loss_fn(net(x), y); loss.backward()
                if clip:  # reads the averaged gradients, as under DDP
                    (clipper or torch.nn.utils.clip_grad_norm_)(net.parameters(), clip)
                return loss
            losses.append(float(opt.step(closure)))
    model = getattr(net, "module", net)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses
"""

SCALED = """
def fit_scaled(wrap=lambda *made: made):
    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    dl = DataLoader(TensorDataset(X.double(), Y.double()), batch_size=16, shuffle=True)
    net, opt, dl = wrap(net, opt, dl)
    for x, y in dl:
        opt.zero_grad()
        scaler.scale(loss_fn(net(x), y)).backward()
        scaler.unscale_(opt)  # gradient clipping reads them unscaled
        nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        scaler.step(opt); scaler.update()
    model = getattr(net, "module", net)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
"""

SAME = "all(torch.allclose(a[k].double(), b[k].double(), atol=1e-6) for k in a)"


@pytest.fixture(scope="module")
def kernel():
    yield from nbtrain_kernel(REGRESSION_SETUP, FIT, SCALED)


OPTIMIZERS = ["torch.optim.SGD, lr=0.05, momentum=0.9", "torch.optim.LBFGS, lr=0.1, max_iter=5"]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_two_ranks_train_a_functions_model_as_one_process_trains_on_both_ranks_batches(kernel, optimizer):
    """Rank r reads samples r, r + 2, ... of each 32: the two ranks' batches of 16 together are one
    batch of 32, and averaged gradients (and, for LBFGS, losses) are that batch's."""
    kernel.run_ok(f"alone, alone_losses = fit(make={optimizer}, batch=32)")
    out = kernel.run_ok(f"%%distributed --devices 2\nkept, kept_losses = fit(make={optimizer})\n")
    assert "(made in the cell: gradients averaged before each step)" in out.stdout, out.stdout
    assert "sharded (DistributedSampler, 128 of 256 per rank" in out.stdout, out.stdout
    assert kernel.value(SAME.replace("a[", "kept[").replace("b[", "alone[").replace("in a)", "in kept)"))
    assert kernel.value("len(kept_losses) == len(alone_losses) == 16")


def test_clipping_reads_the_averaged_gradients_as_under_ddp(kernel):
    kernel.run_ok("%%distributed --devices 2\nclipped_ddp, _ = fit(nbtrain.prepare, lr=0.05, clip=0.05)\n")
    kernel.run_ok("%%distributed --devices 2\nclipped, _ = fit(lr=0.05, clip=0.05)\n")
    kernel.run_ok("%%distributed --devices 2\nunclipped, _ = fit(lr=0.05)\n")
    assert kernel.value(SAME.replace("a[", "clipped[").replace("b[", "clipped_ddp[").replace("in a)", "in clipped)"))
    assert not kernel.value(SAME.replace("a[", "clipped[").replace("b[", "unclipped[").replace("in a)", "in clipped)"))
    # Imported by name in the kernel, as scripts do: the same.
    kernel.run_ok("from torch.nn.utils import clip_grad_norm_")
    kernel.run_ok("%%distributed --devices 2\nby_name, _ = fit(lr=0.05, clip=0.05, clipper=clip_grad_norm_)\n")
    assert kernel.value(SAME.replace("a[", "by_name[").replace("b[", "clipped_ddp[").replace("in a)", "in by_name)"))
    # The cell's averaging clip was given back as the cell ended: the kernel keeps torch's own.
    assert kernel.value("clip_grad_norm_ is torch.nn.utils.clip_grad.clip_grad_norm_")


def test_a_model_with_batch_norm_trains_as_ddp_trains_it_and_the_ranks_start_from_rank_0s(kernel):
    """BatchNorm's running statistics are rank 0's, as under DDP; a model each rank seeded by its
    rank is rank 0's from the first step on."""
    options = "make=torch.optim.SGD, lr=0.05, momentum=0.9, norm=True"
    kernel.run_ok(f"%%distributed --devices 2\nwith_ddp, _ = fit(nbtrain.prepare, {options})\n")
    kernel.run_ok(f"%%distributed --devices 2\nkept, _ = fit({options})\n")
    assert kernel.value(SAME.replace("a[", "kept[").replace("b[", "with_ddp[").replace("in a)", "in kept)"))
    kernel.run_ok(
        "%%distributed --devices 2\n"
        f"mixed, _ = fit({options}, seed=nbtrain.rank)\n"
        "total = float(sum(v.double().sum() for v in mixed.values()))\n"
        "agree = nbtrain.all_reduce(total, op='max') == nbtrain.all_reduce(total, op='min')\n"
    )
    assert kernel.value("agree")
    kernel.run_ok(f"%%distributed --devices 2\nseeded_0, _ = fit({options}, seed=lambda: 0)\n")  # rank 0's seed
    assert kernel.value(SAME.replace("a[", "mixed[").replace("b[", "seeded_0[").replace("in a)", "in mixed)"))


def test_under_a_grad_scaler_the_gradients_are_averaged_before_it_unscales_and_clips_them(kernel):
    """Clipping reads the unscaled gradients, and the scaler skips a step where one is infinite:
    both must see the averaged gradients, as under DDP, so every rank decides alike."""
    kernel.run_ok("%%distributed --devices 2\nscaled_ddp = fit_scaled(nbtrain.prepare)\n")
    out = kernel.run_ok("%%distributed --devices 2\nscaled = fit_scaled()\n")
    assert "(made in the cell: gradients averaged before each step)" in out.stdout, out.stdout
    assert kernel.value(SAME.replace("a[", "scaled[").replace("b[", "scaled_ddp[").replace("in a)", "in scaled)"))


def test_a_kept_model_in_eval_mode_predicts_on_the_whole_loader_even_with_gradients_on(kernel):
    """``model.eval()`` then a prediction loop without ``torch.no_grad()``: an evaluation pass,
    as for a model auto mode prepared, so every rank predicts every sample."""
    kernel.run_ok(
        "%%distributed --devices 2\n"
        "torch.manual_seed(1)\n"
        "net_e = nn.Linear(8, 1); opt_e = torch.optim.SGD(net_e.parameters(), lr=0.05)\n"
        "net_e.eval()  # a score before training, its optimizer not stepped yet\n"
        "baseline = sum(len(net_e(x)) for x, _ in DataLoader(TensorDataset(X, Y), batch_size=64))\n"
        "net_e.train()\n"
        "trained_on = 0\n"
        "for x, y in DataLoader(TensorDataset(X, Y), batch_size=16, shuffle=True):\n"
        "    opt_e.zero_grad(); loss_fn(net_e(x), y).backward(); opt_e.step(); trained_on += len(x)\n"
        "net_e.eval()\n"
        "predicted = sum(len(net_e(x)) for x, _ in DataLoader(TensorDataset(X, Y), batch_size=64))\n"
    )
    assert kernel.value("[baseline, trained_on, predicted]") == [256, 128, 256]


def test_a_trainer_made_in_the_cell_trains_its_model_as_one_and_is_named_by_its_attribute(kernel):
    """A trainer object made in the cell makes its optimizer in ``__init__`` and its loader in
    ``fit()``: the model is found through ``self`` and named as the cell reaches it."""
    kernel.run_ok(
        "class Trainer:\n"
        "    def __init__(self, model):\n"
        "        self.model, self.optimizer = model, torch.optim.SGD(model.parameters(), lr=0.05)\n"
        "    def fit(self):\n"
        "        self.seen = 0\n"
        "        for x, y in DataLoader(TensorDataset(X, Y), batch_size=16, shuffle=True):\n"
        "            self.optimizer.zero_grad(); loss_fn(self.model(x), y).backward(); self.optimizer.step()\n"
        "            self.seen += len(x)\n"
        "        return self\n"
    )
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "torch.manual_seed(nbtrain.rank())  # each rank makes another model: rank 0's is trained\n"
        "trainer = Trainer(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))).fit()\n"
        "total = float(sum(t.double().sum() for t in trainer.model.state_dict().values()))\n"
        "agree = nbtrain.all_reduce(total, op='max') == nbtrain.all_reduce(total, op='min')\n"
    )
    assert "Auto-prepared: trainer.model (made in the cell: gradients averaged before each step)." in out.stdout
    assert kernel.value("[trainer.seen, agree]") == [128, True]


def test_a_gradient_one_rank_has_is_averaged_on_both_and_one_no_rank_has_stays_none(kernel):
    """A branch only rank 1 runs gives its layer a gradient on rank 1 alone: both ranks hold the average
    (half of rank 1's) as the backward ends, and step it; a layer no rank used keeps no gradient, so no
    step moves it."""
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "torch.manual_seed(0)\n"
        "class Branches(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.a, self.b, self.unused = nn.Linear(8, 1), nn.Linear(8, 1), nn.Linear(8, 1)\n"
        "    def forward(self, x):\n"
        "        return self.a(x) + (self.b(x) if nbtrain.rank() == 1 else 0)\n"
        "branches = Branches(); opt_b = torch.optim.SGD(branches.parameters(), lr=0.1, weight_decay=0.1)\n"
        "loss = loss_fn(branches(X[:32]), Y[:32]); opt_b.zero_grad()\n"
        "local_b = torch.autograd.grad(loss, [branches.b.weight], retain_graph=True, allow_unused=True)[0]\n"
        "loss.backward()  # this rank's own gradient above (autograd.grad writes none), the average here\n"
        "after_backward = branches.b.weight.grad.abs().sum().item()\n"
        "unused_before = branches.unused.weight.detach().clone()\n"
        "opt_b.step()\n"
        "total = float(sum(t.double().sum() for t in branches.state_dict().values()))\n"
        "agree = nbtrain.all_reduce(total, op='max') == nbtrain.all_reduce(total, op='min')\n"
        "unused_kept = branches.unused.weight.grad is None and torch.equal(branches.unused.weight, unused_before)\n"
        "b_grad = nbtrain.all_reduce(branches.b.weight.grad.abs().sum().item(), op='max')\n"
        "rank1_b = nbtrain.all_reduce(0.0 if local_b is None else local_b.abs().sum().item(), op='max')\n"
    )
    assert kernel.value("[agree, unused_kept, local_b is None]") == [True, True, True], out.stdout  # rank 0's
    assert kernel.value("abs(b_grad - rank1_b / 2) < 1e-6 and abs(after_backward - rank1_b / 2) < 1e-6")


ACCUMULATING = """torch.set_num_threads(1)
torch.manual_seed(3)
acc_net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
acc_opt = torch.optim.SGD(acc_net.parameters(), lr=0.05, momentum=0.9)
for i, (x, y) in enumerate(DataLoader(TensorDataset(X, Y), batch_size={batch})):
    (loss_fn(acc_net(x), y) / 2).backward()  # two micro-batches a step
    if i % 2 == 1:
        acc_opt.step(); acc_opt.zero_grad()
    if i == {at}:
        raise RuntimeError("the cell fails between a backward and its step")
"""


@pytest.mark.parametrize("at", [0, 2, 4])
def test_a_cell_raising_between_a_backward_and_its_step_brings_back_the_whole_batchs_gradients(kernel, at):
    """Under gradient accumulation a kept model's gradients are averaged as each backward ends, as DDP's
    are: a cell raising after a micro-batch's backward (before the first step too) leaves the kernel's
    model holding the gradients of the two ranks' batches together, as one process holds them on that
    union batch (not rank 0's own)."""
    failed = kernel.run(ACCUMULATING.format(batch=32, at=at))
    assert failed.error is not None and failed.error["evalue"] == "the cell fails between a backward and its step"
    kernel.run_ok("one_process = [p.grad.clone() for p in acc_net.parameters()]")
    out = kernel.run("%%distributed --devices 2 --accelerator cpu\n" + ACCUMULATING.format(batch=16, at=at))
    assert out.error is not None and out.error["ename"] == "RankError", out.text
    assert "The kernel holds rank 0's state at the failing line" in "\n".join(out.error["traceback"])
    gap = "max(float((p.grad - q).abs().max()) for p, q in zip(acc_net.parameters(), one_process))"
    assert kernel.value(gap) < 1e-6, out.text
    assert kernel.value("float(one_process[0].abs().max())") > 1e-3  # gradients there to compare
