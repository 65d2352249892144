"""Framework trainers in a ``%%distributed`` cell train together on 2 CPU ranks and come back usable.

Real transformers, accelerate and Lightning, tiny models built in code, nothing downloaded. For
each, a framework object built in the cell and one built in the kernel before it: the ranks
trained together (each read its share: half the steps of one process; no "trained alone"), the
kernel's own model holds the trained weights, and the framework object works in the kernel as
one process's (its world is one process again).
"""

from __future__ import annotations

import pytest

from kernel_helpers import nbtrain_kernel

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(300)

SETUP = """
import tempfile, torch
torch.manual_seed(0)
X = torch.randn(64, 4); Y = X @ torch.randn(4, 1)
pairs = torch.utils.data.TensorDataset(X, Y)
out = tempfile.mkdtemp()
"""

HF = """
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=32, num_labels=2)
class Tokens(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(1, 64, (n, 12), generator=g)
        self.labels = (self.ids[:, 0] > 32).long()
    def __len__(self): return len(self.ids)
    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(12, dtype=torch.long), "labels": self.labels[i]}
train, valid = Tokens(64), Tokens(32)
def arguments(save="no"):
    return TrainingArguments(output_dir=out, per_device_train_batch_size=8, num_train_epochs=2, use_cpu=True,
                             report_to=[], save_strategy=save, logging_steps=2, disable_tqdm=True)
"""

LIGHTNING = """
import lightning as L
class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
    def training_step(self, batch, i):
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss
    def test_step(self, batch, i):
        self.log("test_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(pairs, batch_size=8)
quiet = dict(accelerator="cpu", default_root_dir=out, enable_progress_bar=False, logger=False,
             enable_checkpointing=False, enable_model_summary=False)
"""


@pytest.fixture(scope="module")
def kernel():
    yield from nbtrain_kernel(SETUP)


LOSSES = "[row[2]['loss'] for row in __import__('nbtrain.kernel.cellrun').kernel.cellrun.last_run.metrics[0]]"


def _together(text: str, framework: str) -> None:
    assert "trained alone" not in text, text
    assert f"{framework} distributed the training over the ranks" in text, text


def test_a_transformers_trainer_built_in_the_cell_trains_over_the_ranks_and_evaluates_in_the_kernel(kernel):
    kernel.run_ok(HF)
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "model = BertForSequenceClassification(config)\n"
        "args = arguments(save='epoch')\n"
        "trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=valid)\n"
        "trainer.train()\n"
    )
    _together(out.text, "transformers' Trainer")
    assert kernel.value("trainer.state.global_step") == 2 * 64 // (8 * 2)  # each rank read half of each epoch
    assert len(kernel.value(LOSSES)) == 8  # the live view charted the loss of each of its steps
    assert kernel.value("[args.world_size, trainer.accelerator.num_processes]") == [1, 1]
    assert kernel.value("trainer.model is model and trainer.model_wrapped is model")
    # Its checkpoints, written by rank 0 alone, load in the kernel: the last one holds the kernel's weights.
    assert kernel.value("sorted(d for d in __import__('os').listdir(out) if d.startswith('checkpoint'))") == [
        "checkpoint-4",
        "checkpoint-8",
    ]
    assert kernel.value(
        "all(torch.equal(p, q) for p, q in zip(model.parameters(), BertForSequenceClassification.from_pretrained("
        "out + '/checkpoint-8').parameters()))"
    )
    # The kernel's trainer evaluates the trained model as a Trainer built there would.
    assert kernel.value(
        "abs(trainer.evaluate()['eval_loss'] - Trainer(model=model, args=arguments(), eval_dataset=valid)"
        ".evaluate()['eval_loss']) < 1e-6"
    )


def test_a_transformers_trainer_built_in_the_kernel_trains_its_model_over_the_ranks(kernel):
    kernel.run_ok(HF)
    kernel.run_ok(
        "kmodel = BertForSequenceClassification(config)\n"
        "ktrainer = Trainer(model=kmodel, args=arguments(), train_dataset=train, eval_dataset=valid)\n"
        "before = kmodel.classifier.weight.clone()\n"
    )
    out = kernel.run_ok("%%distributed --devices 2\nprint('world', ktrainer.args.world_size)\nktrainer.train()\n")
    _together(out.text, "transformers' Trainer")
    assert "[rank 1] world 2" in out.text
    assert kernel.value("ktrainer.state.global_step") == 2 * 64 // (8 * 2)
    assert kernel.value("bool((kmodel.classifier.weight != before).any()) and ktrainer.model is kmodel")
    assert kernel.value("ktrainer.args.world_size") == 1
    assert kernel.value("isinstance(ktrainer.evaluate()['eval_loss'], float)")


def test_an_accelerator_prepared_in_the_kernel_has_the_ranks_world_in_the_cell_and_one_process_after(kernel):
    kernel.run_ok(
        "from accelerate import Accelerator\n"
        "acc = Accelerator(cpu=True)\n"
        "net = torch.nn.Linear(4, 1); opt = torch.optim.SGD(net.parameters(), lr=0.1)\n"
        "net, opt, aloader = acc.prepare(net, opt, torch.utils.data.DataLoader(pairs, batch_size=8))\n"
        "before = net.weight.clone()\n"
    )
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "print('world', acc.num_processes, len(aloader))\n"
        "for x, y in aloader:\n"
        "    acc.backward(torch.nn.functional.mse_loss(net(x), y)); opt.step(); opt.zero_grad()\n"
    )
    assert "[rank 1] world 2 4" in out.text, out.text  # the rank's world; its half of the 8 batches
    assert "trained alone" not in out.text
    assert kernel.value("[acc.num_processes, acc.distributed_type.value, type(net).__name__]") == [1, "NO", "Linear"]
    assert kernel.value("bool((net.weight != before).any())")


def test_an_accelerator_built_in_the_cell_prepares_for_the_ranks_and_is_one_process_in_the_kernel(kernel):
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "from accelerate import Accelerator\n"
        "acc2 = Accelerator(cpu=True)\n"
        "net2 = torch.nn.Linear(4, 1); opt2 = torch.optim.SGD(net2.parameters(), lr=0.1)\n"
        "net2, opt2, loader2 = acc2.prepare(net2, opt2, torch.utils.data.DataLoader(pairs, batch_size=8))\n"
        "print('prepared', acc2.num_processes, type(net2).__name__, len(loader2))\n"
        "for x, y in loader2:\n"
        "    acc2.backward(torch.nn.functional.mse_loss(net2(x), y)); opt2.step(); opt2.zero_grad()\n"
    )
    _together(out.text, "accelerate")
    assert "[rank 1] prepared 2 DistributedDataParallel 4" in out.text, out.text
    assert kernel.value("[acc2.num_processes, acc2.distributed_type.value, type(net2).__name__]") == [1, "NO", "Linear"]


def test_a_lightning_trainer_for_one_device_built_in_the_cell_gets_the_ranks_and_tests_in_the_kernel(kernel):
    pytest.importorskip("lightning")  # not part of Colab's runtime (.ci/colab-test runs this file)
    kernel.run_ok(LIGHTNING + "model = Regressor()\n")
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "trainer = L.Trainer(max_epochs=2, devices=1, **quiet)\n"
        "trainer.fit(model, loader)\n"
        "print('rank', trainer.global_rank, 'of', trainer.world_size)\n"
    )
    _together(out.text, "Lightning")
    assert "[rank 1] rank 1 of 2" in out.text
    assert "Trainer(devices=1) was built for one device: it trained on the cell's 2 ranks" in out.text
    assert kernel.value("trainer.global_step") == 2 * 64 // (8 * 2)
    assert len(kernel.value(LOSSES)) == 8  # its training_step's loss, charted live
    assert kernel.value("[trainer.world_size, type(trainer.strategy).__name__]") == [1, "SingleDeviceStrategy"]
    assert kernel.value("trainer.lightning_module is model and 'train_loss' in trainer.callback_metrics")
    assert kernel.value("isinstance(trainer.test(model, loader, verbose=False)[0]['test_loss'], float)")
    assert out.text.count("GPU available") == 1  # Lightning's own lines, once (rank 0's)
    # Training again in the kernel is one process's: a whole epoch of 8 batches more.
    kernel.run_ok("trainer.fit_loop.max_epochs = 3\ntrainer.fit(model, loader)\n")
    assert kernel.value("trainer.global_step") == 8 + 64 // 8


def test_a_lightning_trainer_built_in_the_kernel_trains_over_the_ranks_and_is_one_process_after(kernel):
    pytest.importorskip("lightning")  # not part of Colab's runtime (.ci/colab-test runs this file)
    kernel.run_ok(LIGHTNING + "kmodel2 = Regressor()\ntk = L.Trainer(max_epochs=1, devices=1, **quiet)\n")
    out = kernel.run_ok("%%distributed --devices 2\ntk.fit(kmodel2, loader)\nprint('world', tk.world_size)\n")
    _together(out.text, "Lightning")
    assert "[rank 1] world 2" in out.text
    assert kernel.value("tk.global_step") == 64 // (8 * 2)
    assert kernel.value("[tk.world_size, tk.lightning_module is kmodel2]") == [1, True]


def test_lightning_fabric_for_one_device_set_up_in_the_cell_trains_over_the_ranks(kernel):
    pytest.importorskip("lightning")  # not part of Colab's runtime (.ci/colab-test runs this file)
    kernel.run_ok(LIGHTNING)
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "fabric = L.Fabric(accelerator='cpu', devices=1)\n"
        "fnet = fabric.setup_module(torch.nn.Linear(4, 1))\n"
        "fopt = fabric.setup_optimizers(torch.optim.SGD(fnet.parameters(), lr=0.1))\n"
        "for x, y in fabric.setup_dataloaders(loader):\n"
        "    fabric.backward(torch.nn.functional.mse_loss(fnet(x), y)); fopt.step(); fopt.zero_grad()\n"
        "print('fabric', fabric.global_rank, fabric.world_size)\n"
    )
    _together(out.text, "Lightning")
    assert "[rank 1] fabric 1 2" in out.text, out.text
    assert kernel.value("fabric.world_size") == 1


def test_ignites_idist_in_the_cell_distributes_the_training_and_the_kernel_gets_the_model(kernel):
    pytest.importorskip("ignite")
    out = kernel.run_ok(
        "%%distributed --devices 2\n"
        "import ignite.distributed as idist\n"
        "from ignite.engine import create_supervised_trainer\n"
        "imodel = idist.auto_model(torch.nn.Linear(4, 1))\n"
        "iopt = idist.auto_optim(torch.optim.SGD(imodel.parameters(), lr=0.1))\n"
        "iloader = idist.auto_dataloader(pairs, batch_size=16)  # 16 in all: 8 a rank\n"
        "engine = create_supervised_trainer(imodel, iopt, torch.nn.functional.mse_loss)\n"
        "engine.run(iloader, max_epochs=2)\n"
        "print('idist', idist.get_world_size(), type(imodel).__name__)\n"
    )
    _together(out.text, "ignite's idist")
    assert "[rank 1] idist 2 DistributedDataParallel" in out.text
    assert kernel.value("[engine.state.iteration, type(imodel).__name__]") == [2 * 64 // 16, "Linear"]


ACCUMULATE = """
from accelerate import Accelerator
acc3 = Accelerator(cpu=True, gradient_accumulation_steps=2)
torch.manual_seed(0)
net3 = torch.nn.Linear(4, 1); opt3 = torch.optim.SGD(net3.parameters(), lr=0.1)
data3 = torch.utils.data.TensorDataset(X[:48], Y[:48])
net3, opt3, loader3 = acc3.prepare(net3, opt3, torch.utils.data.DataLoader(data3, batch_size={batch}))
syncs = []
"""
# Two epochs of 3 batches each (a rank's share of 6, or one process's batches of twice the size): accumulating 2,
# accelerate syncs at the 2nd batch and at each pass's last, which its loader marks.
ACCUMULATE_LOOP = """
for epoch in range(2):
    for x, y in loader3:
        with acc3.accumulate(net3):
            acc3.backward(torch.nn.functional.mse_loss(net3(x), y)); opt3.step(); opt3.zero_grad()
            syncs.append(acc3.sync_gradients)
"""


def test_accelerates_gradient_accumulation_on_a_loader_prepared_in_the_kernel_ends_with_each_pass(kernel):
    kernel.run_ok(ACCUMULATE.format(batch=16) + ACCUMULATE_LOOP + "plain = [syncs, net3.weight.tolist()]\n")
    assert kernel.value("plain[0]") == [False, True, True] * 2
    kernel.run_ok(ACCUMULATE.format(batch=8))
    out = kernel.run_ok("%%distributed --devices 2\n" + ACCUMULATE_LOOP + "print('pass', len(loader3))\n")
    assert "trained alone" not in out.text and "[rank 1] pass 3" in out.text, out.text
    assert kernel.value("syncs") == [False, True, True] * 2
    # The union of the ranks' batches is one process's batch: the same steps, the same weights.
    assert kernel.value("max(abs(a - b) for a, b in zip(net3.weight.flatten().tolist(), plain[1][0])) < 1e-6")
