"""Framework objects that keep weak references, locks or nested pickles travel both ways.

An ignite ``Engine`` keeps ``weakref.ref(engine)`` beside each event handler; skorch's
``NeuralNet.__getstate__`` pickles its module with the standard pickler. Each test runs
a framework's own example, in our words, in a real kernel on 2 CPU ranks, and compares
what the kernel then holds with what the same cells leave without ``%%distributed``.
"""

from __future__ import annotations

import pytest

from kernel_helpers import nbtrain_kernel

pytestmark = pytest.mark.timeout(300)

SETUP = """
import numpy as np
import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
X = torch.randn(64, 4)
y = (X[:, 0] > 0).long()
loader = DataLoader(TensorDataset(X, y), batch_size=8)
"""

IGNITE_CELL = """
from ignite.engine import Events, create_supervised_evaluator, create_supervised_trainer
from ignite.metrics import Accuracy
torch.manual_seed(1)
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
trainer = create_supervised_trainer(model, opt, nn.CrossEntropyLoss())
evaluator = create_supervised_evaluator(model, metrics={"acc": Accuracy()})
accs = []
@trainer.on(Events.EPOCH_COMPLETED)
def record(engine):
    evaluator.run(loader)
    accs.append(evaluator.state.metrics["acc"])
trainer.run(loader, max_epochs=2)
"""

SKORCH_SETUP = """
from skorch import NeuralNetClassifier
class MyModule(nn.Module):
    def __init__(self, hidden=8):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2))
    def forward(self, X):
        return self.net(X)
Xs, ys = X.numpy(), y.numpy()
"""

SKORCH_CELL = """
torch.manual_seed(2)
net = NeuralNetClassifier(MyModule, max_epochs=3, lr=0.1, batch_size=16, train_split=None, verbose=0)
net.fit(Xs, ys)
"""

IGNITE_STATE = "[trainer.state.epoch, trainer.state.iteration, len(accs)]"

TRAINED_MODEL = """
def trained_model(trainer):
    # create_supervised_trainer keeps its model in the closure of the engine's process function
    # (by name: in an auto-mode cell it is the prepared DistributedDataParallel, no nn.Linear).
    update = trainer._process_function
    return update.__closure__[update.__code__.co_freevars.index("model")].cell_contents
"""


@pytest.fixture(scope="module")
def kernel():
    pytest.importorskip("ignite")
    pytest.importorskip("skorch")
    yield from nbtrain_kernel(SETUP, SKORCH_SETUP, TRAINED_MODEL)


def test_an_ignite_trainer_made_on_the_ranks_comes_back_with_its_handlers(kernel):
    """The trainer, its evaluator and the handler between them come back as one process leaves them."""
    kernel.run_ok(IGNITE_CELL)
    plain = kernel.value(IGNITE_STATE)
    out = kernel.run_ok("%%distributed --devices 2 --no-auto\n" + IGNITE_CELL)
    assert "not brought back" not in out.text, out.text
    assert kernel.value(IGNITE_STATE) == plain == [2, 16, 2]
    # The handler came back with the kernel's globals: a further epoch in the kernel records into its accs.
    kernel.run_ok("trainer.run(loader, max_epochs=3)")
    assert kernel.value(IGNITE_STATE) == [3, 24, 3]
    assert 0.0 <= kernel.value("evaluator.run(loader).metrics['acc']") <= 1.0


KERNEL_TRAINER = """
from ignite.engine import Events, create_supervised_trainer
k_model = nn.Linear(4, 2)
k_trainer = create_supervised_trainer(k_model, torch.optim.SGD(k_model.parameters(), lr=0.1), nn.CrossEntropyLoss())
k_seen = []
@k_trainer.on(Events.ITERATION_COMPLETED)
def k_count(engine):
    engine.state.counted = getattr(engine.state, "counted", 0) + 1
    k_seen.append(engine.state.iteration)
k_before = k_model.weight.detach().clone()
"""


def test_an_ignite_trainer_made_in_the_kernel_runs_on_the_ranks_and_its_state_comes_back(kernel):
    kernel.run_ok(KERNEL_TRAINER)
    out = kernel.run_ok("%%distributed --devices 2 --no-auto\nk_trainer.run(loader, max_epochs=2)\n")
    assert "not brought back" not in out.text, out.text
    assert kernel.value("[k_trainer.state.epoch, k_trainer.state.iteration, k_trainer.state.counted]") == [2, 16, 16]
    assert kernel.value("not torch.equal(trained_model(k_trainer).weight, k_before)")  # rank 0's weights


def test_the_kernels_model_and_list_that_a_kernel_trainers_functions_use_are_the_ones_trained(kernel):
    kernel.run_ok(KERNEL_TRAINER)
    kernel.run_ok("%%distributed --devices 2 --no-auto\nk_trainer.run(loader, max_epochs=2)\n")
    assert kernel.value("[trained_model(k_trainer) is k_model, len(k_seen)]") == [True, 16]


@pytest.mark.parametrize("mode", ["--no-auto", ""])
def test_a_skorch_net_of_a_notebook_module_fits_on_the_ranks_and_predicts_in_the_kernel(kernel, mode):
    """skorch pickles its module with the standard pickler: the notebook's class travels by value."""
    kernel.run_ok(SKORCH_CELL + "plain = [len(net.history), net.predict(Xs).tolist()]\n")
    out = kernel.run_ok(f"%%distributed --devices 2 {mode}\n" + SKORCH_CELL)
    assert "not brought back" not in out.text, out.text
    assert kernel.value("len(net.history)") == kernel.value("plain[0]") == 3
    assert kernel.value("[type(net.module_).__name__, net.predict(Xs).shape[0]]") == ["MyModule", 64]
    assert kernel.value("isinstance(net.module_, MyModule)")


HF_SETUP = """
from transformers import Trainer, TrainingArguments
class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 2)
    def forward(self, x, labels=None):
        logits = self.layer(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}
class Pairs(torch.utils.data.Dataset):
    def __len__(self):
        return 16
    def __getitem__(self, i):
        return {"x": X[i], "labels": y[i]}
"""

HF_CELL = """
hf_args = TrainingArguments(
    output_dir={output!r}, num_train_epochs=2, per_device_train_batch_size=4, use_cpu=True,
    report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
)
hf_trainer = Trainer(model=Tiny(), args=hf_args, train_dataset=Pairs())
hf_trainer.train()
"""


def test_a_transformers_trainer_made_on_the_ranks_comes_back_and_evaluates_in_the_kernel(kernel, tmp_path):
    """The Trainer keeps weak references (its callbacks' handler): it came back "not brought back" before."""
    pytest.importorskip("transformers")
    cell = HF_SETUP + HF_CELL.format(output=str(tmp_path))
    kernel.run_ok(cell)
    plain = kernel.value("hf_trainer.state.global_step")
    out = kernel.run_ok("%%distributed --devices 2 --no-auto\n" + cell)
    assert "not brought back" not in out.text, out.text
    # transformers shares the 16 examples over the 2 ranks itself: rank 0 took half the steps.
    assert kernel.value("hf_trainer.state.global_step") == plain // 2 == 4
    assert kernel.value("'eval_loss' in hf_trainer.evaluate(Pairs())")


def test_a_skorch_net_fitted_in_the_kernel_goes_to_the_ranks_and_trains_on(kernel):
    """The way out: the kernel's pickle of the net holds skorch's own pickle of the notebook's module; partial_fit
    trains max_epochs more, and the net, whose fingerprint is skorch's pickle too, is seen changed."""
    kernel.run_ok(SKORCH_CELL)
    kernel.run_ok("plain_net = __import__('copy').deepcopy(net)")  # the same cell without the magic, on a copy
    kernel.run_ok("plain_net.partial_fit(Xs, ys)")
    out = kernel.run_ok("%%distributed --devices 2 --no-auto\nnet.partial_fit(Xs, ys)\n")
    assert "not brought back" not in out.text, out.text
    assert kernel.value("[len(net.history), len(plain_net.history), type(net.module_).__name__]") == [6, 6, "MyModule"]
    assert kernel.value("net.predict(Xs).shape[0]") == 64


ACCELERATED_NET = """
from accelerate import Accelerator
from skorch.hf import AccelerateMixin
class AcceleratedNet(AccelerateMixin, NeuralNetClassifier):
    pass
def accelerated(module):
    torch.manual_seed(2)
    return AcceleratedNet(module, accelerator=Accelerator(cpu=True), device=None, criterion=nn.CrossEntropyLoss,
                          max_epochs=3, lr=0.1, batch_size=16, train_split=None, verbose=0)
"""
# Each rank's weights after the fit, a sum: the ranks trained together if they agree.
RANK_WEIGHTS = "print('weights', round(float(sum(p.sum() for p in {net}.module_.parameters())), 5))\n"
BATCHES = "[len(h['batches']) for h in {net}.history]"


def _ranks_agree(text: str) -> None:
    weights = [line.split("weights ")[1] for line in text.splitlines() if "weights " in line]
    assert len(weights) == 2 and weights[0] == weights[1], text


def test_a_skorch_accelerate_net_built_in_the_cell_fits_over_the_ranks_and_predicts_in_the_kernel(kernel):
    """accelerate prepared skorch's criterion, a loss with no parameters, and DDP refused it on CPU ranks."""
    kernel.run_ok(ACCELERATED_NET)
    cell = "anet = accelerated(MyModule)\nanet.fit(Xs, ys)\n"
    kernel.run_ok(cell + "plain = [" + BATCHES.format(net="anet") + ", anet.predict(Xs).shape]\n")
    assert kernel.value("plain") == [[4, 4, 4], [64]]
    out = kernel.run_ok("%%distributed --devices 2\n" + cell + RANK_WEIGHTS.format(net="anet"))
    assert "trained alone" not in out.text and "not brought back" not in out.text, out.text
    assert "skorch with accelerate distributed the training over the ranks" in out.text, out.text
    _ranks_agree(out.text)
    assert kernel.value(BATCHES.format(net="anet")) == [2, 2, 2]  # each rank read half of each epoch
    assert kernel.value("[type(anet.module_).__name__, anet.predict(Xs).shape, anet.accelerator.num_processes]") == [
        "MyModule",
        [64],
        1,
    ]


def test_a_skorch_accelerate_net_built_in_the_kernel_trains_the_kernels_module_over_the_ranks(kernel):
    """A NeuralNet pickles itself (its own __getstate__, its module encoded in bytes): reach looks inside
    it through its attributes, so the kernel's net is refilled and its module_ is the kernel's kmodule, trained."""
    kernel.run_ok(
        ACCELERATED_NET + "kmodule = MyModule()\nknet = accelerated(kmodule)\nk0 = kmodule.net[0].weight.clone()"
    )
    # skorch's own unpickling turns device=None into "cpu", which AccelerateMixin then refuses (in one process too).
    cell = "knet.set_params(device=None)\nknet.fit(Xs, ys)\n"
    out = kernel.run_ok("%%distributed --devices 2\n" + cell + RANK_WEIGHTS.format(net="knet"))
    assert "trained alone" not in out.text and "not brought back" not in out.text, out.text
    _ranks_agree(out.text)
    assert kernel.value(BATCHES.format(net="knet")) == [2, 2, 2]
    assert kernel.value("[knet.module_ is kmodule, bool((kmodule.net[0].weight != k0).any())]") == [True, True]
    assert kernel.value("knet.predict(Xs).shape") == [64]


def test_a_plain_skorch_net_under_auto_mode_trains_over_the_ranks(kernel):
    """The module is averaged (the ranks agree) and the net comes back; each rank should read half of each epoch."""
    kernel.run_ok(SKORCH_CELL + "plain = " + BATCHES.format(net="net") + "\n")
    out = kernel.run_ok("%%distributed --devices 2\n" + SKORCH_CELL + RANK_WEIGHTS.format(net="net"))
    assert "trained alone" not in out.text and "not brought back" not in out.text, out.text
    _ranks_agree(out.text)
    assert kernel.value("plain") == [4, 4, 4]
    assert kernel.value(BATCHES.format(net="net")) == [2, 2, 2], out.text
    assert kernel.value("[isinstance(net.module_, MyModule), net.predict(Xs).shape]") == [True, [64]]


IGNITE_LOOP = """
from ignite.engine import Engine, Events
torch.manual_seed(3)
model = nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
def train_step(engine, batch):
    model.train()
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    optimizer.step()
    return loss.item()
trainer = Engine(train_step)
evaluator = Engine(lambda engine, batch: (model(batch[0]), batch[1]))
w0 = model.weight.detach().clone()
"""


def test_an_ignite_engine_whose_function_uses_the_notebooks_model_trains_it_over_the_ranks(kernel):
    """The process function is the notebook's: its globals are the cell's names, prepared in the namespace."""
    kernel.run_ok(IGNITE_LOOP + "trainer.run(loader, max_epochs=2)\nplain = [trainer.state.iteration]\n")
    assert kernel.value("plain") == [16]
    kernel.run_ok(IGNITE_LOOP)
    out = kernel.run_ok(
        "%%distributed --devices 2\ntrainer.run(loader, max_epochs=2)\n"
        "print('weights', round(float(model.weight.sum()), 5))\n"
    )
    assert "trained alone" not in out.text and "not brought back" not in out.text, out.text
    _ranks_agree(out.text)
    assert kernel.value("[trainer.state.epoch, trainer.state.iteration]") == [2, 2 * 8 // 2]  # half the batches
    assert kernel.value("bool((model.weight != w0).any())")  # the kernel's own model, trained
    assert kernel.value("len(evaluator.run(loader).output)") == 2


def test_a_kernel_trainer_whose_closure_holds_the_model_trains_it_over_the_ranks_under_auto_mode(kernel):
    kernel.run_ok(KERNEL_TRAINER)
    out = kernel.run_ok(
        "%%distributed --devices 2\nk_trainer.run(loader, max_epochs=2)\n"
        "print('weights', round(float(trained_model(k_trainer).weight.sum()), 5))\n"
    )
    assert "trained alone" not in out.text and "not brought back" not in out.text, out.text
    _ranks_agree(out.text)
    assert kernel.value("[trained_model(k_trainer) is k_model, len(k_seen), k_trainer.state.iteration]") == [
        True,
        8,
        8,
    ]
