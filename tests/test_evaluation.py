"""Evaluation code written the single-device way prints the true numbers (a real kernel, 2 ranks).

The notebook below is the PyTorch MNIST example's shape: a small CNN, ``train()`` and
``test()`` functions written for one device, driven from a ``%%distributed`` cell, on
synthetic digits (a class template plus noise). ``test()`` runs under ``torch.no_grad()``
and divides by ``len(test_loader.dataset)``: every rank must read the whole test set for
that to be the true accuracy. Each test starts from the same weights and RNG state.
"""

from __future__ import annotations

import re

import pytest

from kernel_helpers import NotebookKernel, nbtrain_kernel

pytestmark = pytest.mark.timeout(300)

NOTEBOOK = """
import copy
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
import nbtrain

torch.manual_seed(0)
templates = torch.randn(10, 1, 12, 12)

def synthetic_digits(n, seed):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    return TensorDataset(templates[labels] + 1.0 * torch.randn(n, 1, 12, 12, generator=g), labels)

train_set, test_set = synthetic_digits(768, 1), synthetic_digits(256, 2)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout = nn.Dropout(0.25)
        self.fc1 = nn.Linear(16 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(self.dropout(torch.flatten(x, 1))))
        return F.log_softmax(self.fc2(x), dim=1)

def train(model, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        if batch_idx % 10 == 0:
            seen = f"{batch_idx * len(data)}/{len(train_loader.dataset)}"
            print(f"Train Epoch: {epoch} [{seen}]  Loss: {loss.item():.6f}")

def test(model, test_loader):
    model.eval()
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += output.argmax(dim=1).eq(target).sum().item()
    test_loss /= len(test_loader.dataset)
    n = len(test_loader.dataset)
    print(f"Test set: Average loss: {test_loss:.4f}, Accuracy: {correct}/{n} ({100. * correct / n:.0f}%)")
    return correct

def test_sharded(model, test_loader):
    # test() for nbtrain.prepare(test_loader, evaluation="shard"): each rank scores its share
    model.eval()
    test_loss, correct, seen = 0.0, 0, 0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += output.argmax(dim=1).eq(target).sum().item()
            seen += len(target)
    test_loss, correct, seen = (nbtrain.all_reduce(v) for v in (test_loss, correct, seen))
    print(f"Test set: Average loss: {test_loss / seen:.4f}, Accuracy: {correct}/{seen} ({100. * correct / seen:.0f}%)")
    return correct

initial = Net().state_dict()

def reset():
    # the same weights, optimizer, schedule, loaders and RNG state for every run
    global model, optimizer, scheduler, train_loader, test_loader
    torch.manual_seed(1)
    model = Net()
    model.load_state_dict(initial)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    train_loader = DataLoader(train_set, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(7))
    test_loader = DataLoader(test_set, batch_size=64)
"""

MNIST_CELL = """%%distributed --devices 2 --accelerator cpu
for epoch in range(1, 3):
    train(model, train_loader, optimizer, epoch)
    test(model, test_loader)
    scheduler.step()
"""

SUMMARY = (
    "train_loader: sharded (DistributedSampler, 384 of 768 per rank; effective batch 64 = 32 per rank x 2 ranks); "
    "test_loader: evaluated whole on every rank (iterated without gradients)."
)
TEST_LINE = re.compile(
    r"^(?:\[rank (\d)\] )?Test set: Average loss: ([\d.]+), Accuracy: (\d+)/(\d+) \(\d+%\)$", re.MULTILINE
)


@pytest.fixture(scope="module")
def kernel():
    yield from nbtrain_kernel(NOTEBOOK)


def printed_tests(text: str) -> list[tuple[int | None, float, int, int]]:
    """(rank or None for the kernel, average loss, correct, total) of each "Test set" line."""
    return [
        (None if r == "" else int(r), float(loss), int(correct), int(n))
        for r, loss, correct, n in TEST_LINE.findall(text)
    ]


def kernel_evaluation(kernel: NotebookKernel, loader: str = "test_loader") -> tuple[float, int, int]:
    """The kernel's own test() of the model the run brought back."""
    [(_, loss, correct, n)] = printed_tests(kernel.run_ok(f"test(model, {loader})").stdout)
    return loss, correct, n


def test_the_accuracy_printed_on_the_ranks_is_the_kernels_own_evaluation(kernel):
    kernel.run_ok("reset()")
    out = kernel.run_ok(MNIST_CELL)
    lines = printed_tests(out.stdout)
    assert [rank for rank, *_ in lines] == [0, 1, 0, 1] or sorted(r for r, *_ in lines) == [0, 0, 1, 1], out.stdout
    last = {rank: (loss, correct, n) for rank, loss, correct, n in lines}  # each rank's last epoch
    loss, correct, n = kernel_evaluation(kernel)
    assert n == 256 and last[0][1:] == last[1][1:] == (correct, 256), (out.stdout, correct)
    assert last[0][0] == pytest.approx(loss, abs=2e-4)
    assert correct > 0.7 * 256  # it learned; a rank that read half the test set could score at most 128
    assert SUMMARY in out.stdout, out.stdout
    assert "Updated in the kernel: model, optimizer, scheduler" in out.stdout
    # train()'s progress line counts to len(train_loader.dataset), the whole: named; test()'s is right
    expected = (
        "len(train_loader.dataset) in train() is 768, the size of train_loader's dataset, of which each rank's "
        "training pass reads 384: "
    )
    assert expected in out.stdout and "in test()" not in out.stdout, out.stdout
    assert kernel.value("scheduler.last_epoch") == 2
    kernel.run_ok("whole_weights = copy.deepcopy(model.state_dict())")


def test_under_fsdp_too_and_an_evaluation_loop_may_end_the_cell(kernel):
    # FSDP2 keeps the root's gathered weights after a forward without gradients; the
    # run still brings back the full, trained weights
    kernel.run_ok("reset()")
    out = kernel.run_ok(MNIST_CELL.replace("--accelerator cpu", "--accelerator cpu --strategy fsdp --timeout 100"))
    last = {rank: (loss, correct, n) for rank, loss, correct, n in printed_tests(out.stdout)}
    loss, correct, _ = kernel_evaluation(kernel)
    assert last[0][1:] == last[1][1:] == (correct, 256), out.stdout
    assert last[0][0] == pytest.approx(loss, abs=2e-4)
    assert "test_loader: evaluated whole on every rank (iterated without gradients)." in out.stdout


def test_sharded_evaluation_with_all_reduce_prints_the_same_number_and_trains_the_same(kernel):
    kernel.run_ok("reset()\ntest_loader = nbtrain.prepare(test_loader, evaluation='shard')")
    out = kernel.run_ok(MNIST_CELL.replace("test(model, test_loader)", "test_sharded(model, test_loader)"))
    last = {rank: (loss, correct, n) for rank, loss, correct, n in printed_tests(out.stdout)}
    loss, correct, _ = kernel_evaluation(kernel)
    assert last[0][1:] == last[1][1:] == (correct, 256), out.stdout
    assert last[0][0] == pytest.approx(loss, abs=2e-4)
    assert "test_loader: evaluated sharded (DistributedSampler, 128 of 256 per rank; evaluation='shard')" in out.stdout
    # where an evaluation pass reads from does not change what the training passes do
    assert kernel.value("all(torch.equal(v, whole_weights[k]) for k, v in model.state_dict().items())")


def test_training_passes_are_what_a_torchrun_script_does(kernel):
    """The same training written torchrun-style (its own DistributedSampler + set_epoch, DDP).

    Auto mode draws nothing from the ranks' shared RNG as it prepares ``test_loader`` (an
    unshuffled loader's sampler draws nothing in one process either), so the script, which
    draws nothing either, sees the same dropout masks.
    """
    kernel.run_ok("reset()")
    out = kernel.run_ok(
        "%%distributed --devices 2 --accelerator cpu\n"
        "from torch.nn.parallel import DistributedDataParallel\n"
        "from torch.utils.data import DistributedSampler\n"
        "sampler = DistributedSampler(train_set, shuffle=True, seed=7)\n"
        "own_loader = DataLoader(train_set, batch_size=32, sampler=sampler, generator=train_loader.generator)\n"
        "ddp_model = DistributedDataParallel(model)\n"
        "for epoch in range(1, 3):\n"
        "    sampler.set_epoch(epoch - 1)\n"
        "    train(ddp_model, own_loader, optimizer, epoch)\n"
        "    test(ddp_model, test_loader)\n"
        "    scheduler.step()\n"
        "del ddp_model, own_loader, sampler\n"
    )
    assert "Auto-prepared" not in out.stdout  # auto mode stepped aside
    assert kernel.value("all(torch.equal(v, whole_weights[k]) for k, v in model.state_dict().items())")


def test_one_loader_for_training_and_evaluation_in_one_cell(kernel):
    kernel.run_ok("reset()")
    out = kernel.run_ok(
        "%%distributed --devices 2 --accelerator cpu\n"
        "for epoch in range(1, 3):\n"
        "    train(model, train_loader, optimizer, epoch)\n"
        "    test(model, train_loader)  # accuracy on the training set, from the same loader\n"
    )
    last = {rank: (loss, correct, n) for rank, loss, correct, n in printed_tests(out.stdout)}
    _, correct, n = kernel_evaluation(kernel, "train_loader")
    assert n == 768 and last[0][1:] == last[1][1:] == (correct, 768), out.stdout
    assert (
        "train_loader: sharded for training (DistributedSampler, 384 of 768 per rank; "
        "effective batch 64 = 32 per rank x 2 ranks) and "
        "evaluated whole on every rank (iterated without gradients)." in out.stdout
    )
    # the epochs of the training passes are as if nothing else had read the loader
    kernel.run_ok("reset()")
    kernel.run_ok(MNIST_CELL.replace("    test(model, test_loader)\n", "").replace("    scheduler.step()\n", ""))
    kernel.run_ok("train_only = copy.deepcopy(model.state_dict())\nreset()")
    kernel.run_ok(MNIST_CELL.replace("test_loader", "train_loader").replace("    scheduler.step()\n", ""))
    # test() under no_grad draws nothing from the RNGs training uses (the loader has its own generator)
    assert kernel.value("all(torch.equal(v, train_only[k]) for k, v in model.state_dict().items())")


def test_progress_total_of_a_cell_mixing_training_and_evaluation_loops(kernel):
    kernel.run_ok("reset()")
    kernel.run_ok(
        "%%distributed --devices 2 --accelerator cpu\n"
        "for epoch in range(2):\n"
        "    for data, target in train_loader:\n"
        "        loss = F.nll_loss(model(data), target)\n"
        "        optimizer.zero_grad(); loss.backward(); optimizer.step()\n"
        "        nbtrain.log(loss=loss)\n"
        "    with torch.no_grad():\n"
        "        for data, target in test_loader:\n"
        "            nbtrain.log(test_loss=F.nll_loss(model(data), target))\n"
    )
    run = "__import__('nbtrain.kernel.cellrun').kernel.cellrun.last_run"
    # 2 epochs x (12 training batches per rank + the 4 batches of the whole test set)
    assert kernel.value(f"{run}.total_steps") == 2 * (384 // 32 + 256 // 64)
    assert kernel.value(f"[row[0] for row in {run}.metrics[0]][-1]") == 32


PHASES = """
dataloaders = {"train": train_loader, "val": test_loader}
dataset_sizes = {phase: len(loader.dataset) for phase, loader in dataloaders.items()}

def train_model(model, criterion, optimizer, num_epochs):
    # torchvision's fine-tuning tutorial's shape: gradients turned on and off inside the loop
    best_acc = 0.0
    for epoch in range(num_epochs):
        for phase in ["train", "val"]:
            model.train() if phase == "train" else model.eval()
            corrects, seen = 0, 0
            for inputs, labels in dataloaders[phase]:
                optimizer.zero_grad()
                with torch.set_grad_enabled(phase == "train"):
                    outputs = model(inputs)
                    loss = criterion(outputs, labels)
                    if phase == "train":
                        loss.backward()
                        optimizer.step()
                corrects += (outputs.argmax(1) == labels).sum().item()
                seen += len(labels)
            acc = corrects / dataset_sizes[phase]
            print(f"{phase} acc {acc:.4f} seen {seen}")
            if phase == "val" and acc > best_acc:
                best_acc = acc
    return model
"""


def test_a_loop_that_turns_gradients_off_inside_evaluates_whole_with_the_model_in_eval_mode(kernel):
    """A pass begun with the model in eval mode reads the whole loader, gradients on or not; a size
    taken from a dataset that training passes shard is named."""
    kernel.run_ok("reset()\n" + PHASES)
    cell = "%%distributed --devices 2 --accelerator cpu\nmodel = train_model(model, F.nll_loss, optimizer, 1)"
    out = kernel.run_ok(cell)
    val = re.findall(r"^\[rank (\d)\] val acc ([\d.]+) seen (\d+)$", out.stdout, re.MULTILINE)
    assert sorted(rank for rank, _, _ in val) == ["0", "1"], out.stdout
    assert {seen for _, _, seen in val} == {"256"}  # every rank scored the whole test set
    assert len({acc for _, acc, _ in val}) == 1  # so every rank has the same accuracy (and best model)
    (_, correct, n) = kernel_evaluation(kernel)
    assert float(val[0][1]) == pytest.approx(correct / n, abs=1e-4)
    assert "dataloaders['val']: evaluated whole on every rank (iterated with the model in eval mode)" in out.stdout
    assert re.search(r"^\[rank 0\] train acc [\d.]+ seen 384$", out.stdout, re.MULTILINE), out.stdout
    expected = (
        "dataset_sizes['train'] is 768, the size of dataloaders['train']'s dataset, of which each rank's training "
        "pass reads 384: a total over that pass divided by dataset_sizes['train'] is the rank's part, not the whole"
    )
    assert expected in out.stdout, out.stdout
    assert "dataset_sizes['val'] is" not in out.stdout  # read whole: its size is the right divisor


def test_a_training_loop_begun_with_the_model_left_in_eval_mode_is_named_and_then_sharded(kernel):
    """model.eval() in an earlier cell, a loop that never calls model.train(): its first pass reads the
    whole loader (it looked like an evaluation); once it trained, the summary says so and passes shard."""
    kernel.run_ok("reset()\nmodel.eval()")
    out = kernel.run_ok(
        "%%distributed --devices 2 --accelerator cpu\n"
        "read = []\n"
        "for epoch in range(2):\n"
        "    read.append(0)\n"
        "    for data, target in train_loader:\n"
        "        optimizer.zero_grad(); F.nll_loss(model(data), target).backward(); optimizer.step()\n"
        "        read[-1] += len(target)\n"
    )
    assert kernel.value("read") == [768, 384], out.stdout  # whole, then this rank's share
    expected = (
        "train_loader: sharded (DistributedSampler, 384 of 768 per rank; effective batch 64 = 32 per rank x 2 ranks)"
        " and read whole on every rank in a pass that trained: the model was in eval mode when it began "
        "(call model.train() before a training loop)."
    )
    assert expected in out.stdout, out.stdout


def test_an_evaluation_in_eval_mode_after_each_epoch_reads_the_whole_loader_every_epoch(kernel):
    """model.eval() and a loop without torch.no_grad() after each training epoch: every such pass is an
    evaluation pass; the training steps between them are not steps of the evaluation."""
    kernel.run_ok("reset()")
    out = kernel.run_ok(
        "%%distributed --devices 2 --accelerator cpu\n"
        "scored = []\n"
        "for epoch in range(3):\n"
        "    model.train()\n"
        "    for data, target in train_loader:\n"
        "        optimizer.zero_grad(); F.nll_loss(model(data), target).backward(); optimizer.step()\n"
        "    model.eval()\n"
        "    scored.append(sum(len(target) for _, target in test_loader))\n"
    )
    assert kernel.value("scored") == [256, 256, 256], out.stdout
    assert "test_loader: evaluated whole on every rank (iterated with the model in eval mode)." in out.stdout
    assert "in a pass that trained" not in out.stdout, out.stdout
