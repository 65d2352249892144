"""Training cells from a grammar of what notebooks do: seeded, deterministic, each rule small.

A :class:`Case` is one choice per rule (its first option is the rule's absence or plain form);
:func:`render` turns it into the cells a notebook would hold: setup cells, the training cell
(under a ``%%distributed`` line or none) and maybe a second cell. The batch size is the kernel's
``BS``: the 2-rank reference runs the same cells with ``BS`` twice as large and an unshuffled
loader, so that each of its batches is the union of what the two ranks read at that step
(DistributedSampler deals indices alternately: rank 0 reads 0, 2, 4, ..., rank 1 reads 1, 3, 5, ...).

>>> case = generate(7)
>>> case == generate(7) and render(case, "").train == render(case, "").train
True
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

# rule -> options; the first option is the rule's absence (what shrinking falls back to).
RULES: dict[str, tuple[str, ...]] = {
    "holder": ("name", "dict", "list", "nb_trainer", "mod_trainer"),
    "trainer_where": ("before", "cell"),
    "model_where": ("before", "cell"),
    "model_kind": ("mlp", "tied", "bn"),
    "opt": ("sgd", "momentum", "adam", "adamw"),
    "opt_where": ("before", "cell"),
    "groups": ("one", "two", "add_group"),
    "sched": ("none", "steplr", "lambdalr"),
    "scaler": ("none", "gradscaler"),
    "clip": ("none", "clip"),
    "accum": ("1", "2"),
    "loader_where": ("before", "cell"),
    "alias": ("none", "param", "buffer", "submodule"),
    "freeze": ("none", "bias"),
    "values": ("none", "counter"),
    "tensors": ("none", "mutated"),
    "rng": ("none", "draws"),
    "fn": ("inline", "notebook_fn"),
    "save": ("none", "torch_save"),
    "fail": ("none", "raises"),
    "second": ("none", "again", "eval"),
    "epochs": ("1", "2"),
    "shuffle": ("no", "yes"),
    "via": ("name", "holder"),
    "dropout": ("none", "dropout"),
    "wrapper": ("none", "namespace"),
    "stop": ("none", "interrupt"),
    "sized": ("none", "onecycle"),  # a OneCycleLR sized from len(loader) before the cell
    "model_class": ("sequential", "nb_class", "mod_class"),  # an nn.Module class of the notebook, or of models.py
    "ema": ("none", "averaged"),  # an AveragedModel updated after each step
    "best": ("none", "keep_best"),  # a validation pass at each epoch's end keeping the best state, loaded at the end
    "trainer_builds": ("in_run", "in_init"),  # a trainer makes its optimizer and loader in run(), or in __init__
    "dataset": ("tensors", "nb_class"),  # a TensorDataset, or a Dataset class of the notebook's
    # An accelerate Accelerator(cpu=True) built and prepare()d in the kernel; the loop calls accelerator.backward
    # (and, with accum=2, runs in accelerator.accumulate(model)).
    "framework": ("none", "accelerate"),
}
TRAINERS = ("nb_trainer", "mod_trainer")
# Rules a trainer's run() decides itself (it makes its optimizer and loader, as minGPT's does).
TRAINER_OWNS = (
    "opt_where",
    "groups",
    "sched",
    "scaler",
    "accum",
    "loader_where",
    "fn",
    "tensors",
    "sized",
    "ema",
    "best",
    "framework",
)


@dataclass(frozen=True)
class Case:
    """One generated case: its seed and one option per rule (``choices`` in RULES' order)."""

    seed: int
    choices: tuple[tuple[str, str], ...]

    def get(self, rule: str) -> str:
        return dict(self.choices)[rule]

    def with_choice(self, rule: str, option: str) -> Case:
        return normalize(replace(self, choices=tuple((r, option if r == rule else o) for r, o in self.choices)))

    def present(self) -> list[str]:
        """The rules whose option is not their absence, as ``rule=option``."""
        return [f"{rule}={option}" for rule, option in self.choices if option != RULES[rule][0]]


@dataclass(frozen=True)
class Cells:
    """What a notebook holds for one case: setup cells, the training cell, maybe a second cell."""

    setup: tuple[str, ...]
    train: str
    second: str | None


def generate(seed: int) -> Case:
    """The case of ``seed``: each rule absent with probability 1/2, else one of its other options; made consistent."""
    draw = random.Random(seed)
    picks = tuple(
        (rule, options[0] if draw.random() < 0.5 else draw.choice(options[1:])) for rule, options in RULES.items()
    )
    return normalize(Case(seed, picks))


def normalize(case: Case) -> Case:
    """Options a case cannot hold set back to their absence (so equal cells have equal choices)."""
    chosen = dict(case.choices)
    trainer = chosen["holder"] in TRAINERS
    if trainer:
        for rule in TRAINER_OWNS:
            chosen[rule] = RULES[rule][0]
        if chosen["model_where"] == "cell":
            chosen["trainer_where"] = "cell"
    else:
        chosen.update(trainer_where="before", trainer_builds="in_run")
    if chosen["framework"] != "none":  # prepared in the kernel: the model, optimizer and loader are there already
        chosen.update(model_where="before", opt_where="before", loader_where="before", scaler="none")
    if chosen["model_where"] == "cell":
        chosen["opt_where"] = "cell" if not trainer else chosen["opt_where"]
    if chosen["holder"] not in ("dict", "list") and chosen["wrapper"] == "none" or trainer:
        chosen["via"] = "name"
    if chosen["sized"] != "none":  # sized before the cell: the model, optimizer and loader are there already
        chosen.update(model_where="before", opt_where="before", loader_where="before", sched="none")
    if chosen["alias"] == "buffer" and chosen["model_kind"] != "bn":
        chosen["alias"] = "none"
    if chosen["groups"] == "add_group" and chosen["opt_where"] == "before" and chosen["freeze"] != "none":
        chosen["freeze"] = "none"
    if trainer or chosen["fail"] != "none":  # a trainer's loop is its own; a cell stops or raises, not both
        chosen["stop"] = "none"
    return replace(case, choices=tuple((rule, chosen[rule]) for rule in RULES))


DATA = """import copy, random, types, torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
torch.set_num_threads(1)
torch.manual_seed(0); random.seed(0)
X = torch.randn(32, 8)
Y = X @ torch.randn(8, 1) + 0.1 * torch.randn(32, 1)
data = TensorDataset(X, Y)
loss_fn = nn.MSELoss()
LR = 0.05"""

# A stop from outside at the loop's line that calls it (rule ``stop``): under %%distributed rank 0 interrupts
# the kernel, which asks every rank to stop at an optimizer step (the step every rank has taken: each waits
# here until the launcher chose that step, so none runs ahead), and the ranks end at the next step's start; in the
# kernel itself, the reference, KeyboardInterrupt at that same point, the next optimizer step's start.
STOP = """import os, signal, time

def stop_point(_kernel=os.getpid()):
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    from nbtrain.system import stepboard
    from nbtrain.rank import api
    from nbtrain.rank.machinery import stepcheck
    if api.current_context() is None:
        def interrupt(*_):
            hook.remove()
            raise KeyboardInterrupt
        hook = register_optimizer_step_pre_hook(interrupt)
        return
    if api.rank() == 0:
        os.kill(_kernel, signal.SIGINT)
    deadline = time.monotonic() + 30
    while stepcheck._counter.board.stop_step() in (stepboard.NO_STOP, stepboard.PENDING) and time.monotonic() <
    deadline:
        time.sleep(0.005)"""

# The trainer class, as a module beside the notebook (train_utils.py) or pasted in a notebook cell.
TRAINER = '''import torch
from torch.utils.data import DataLoader


def make_optimizer(kind, params, lr):
    """The optimizer ``kind`` names over ``params``."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if kind == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return (torch.optim.Adam if kind == "adam" else torch.optim.AdamW)(params, lr=lr)


class Trainer:
    """Holds a model; run() trains it with an optimizer and loader it makes (as minGPT's Trainer does)
    or, with build_at_init, ones __init__ made."""

    def __init__(self, model, dataset, batch_size, opt="sgd", lr=0.05, clip=None, epochs=1, shuffle=False,
                 fail_at=None, build_at_init=False):
        self.model, self.dataset, self.batch_size = model, dataset, batch_size
        self.opt, self.lr, self.clip, self.epochs, self.shuffle, self.fail_at = opt, lr, clip, epochs, shuffle, fail_at
        self.optimizer = self.loader = None
        self.build_at_init = build_at_init
        if build_at_init:  # as most hand-written trainers do: made once, kept for every run()
            self.build()
        self.iter_num = 0

    def build(self):
        self.optimizer = make_optimizer(self.opt, self.model.parameters(), self.lr)
        self.loader = DataLoader(self.dataset, batch_size=self.batch_size, shuffle=self.shuffle)

    def run(self):
        model = self.model
        if not self.build_at_init:
            self.build()
        model.train()
        for _ in range(self.epochs):
            for x, y in self.loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                self.optimizer.zero_grad()
                loss.backward()
                if self.clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), self.clip)
                self.optimizer.step()
                self.iter_num += 1
                if self.fail_at == self.iter_num:
                    raise RuntimeError("the run fails part-way")
'''

# The model's class (rule ``model_class``), as a module beside the notebook (models.py) or pasted in a
# notebook cell: its layers in a Sequential, a forward of its own, a plain attribute the forward updates.
NET = '''import torch.nn as nn


class Net(nn.Module):
    """An MLP with an optional BatchNorm and Dropout; ``calls`` counts its forwards."""

    def __init__(self, norm=False, drop=False):
        super().__init__()
        norms = [nn.BatchNorm1d(8)] if norm else []
        drops = [nn.Dropout(0.2)] if drop else []
        self.body = nn.Sequential(
            nn.Linear(8, 8), *norms, nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), *drops, nn.Linear(8, 1)
        )
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.body(x)
'''

# The dataset as a class of the notebook's (rule ``dataset``), in place of the TensorDataset.
DATASET = '''from torch.utils.data import Dataset


class PairData(Dataset):
    """(x, y) pairs read from two tensors."""

    def __init__(self, inputs, targets):
        self.inputs, self.targets = inputs, targets

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, index):
        return self.inputs[index], self.targets[index]


data = PairData(X, Y)'''

OPTIMIZERS = {
    "sgd": "torch.optim.SGD({params}, lr=LR)",
    "momentum": "torch.optim.SGD({params}, lr=LR, momentum=0.9)",
    "adam": "torch.optim.Adam({params}, lr=LR)",
    "adamw": "torch.optim.AdamW({params}, lr=LR)",
}
SCHEDULERS = {
    "steplr": "sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)",
    "lambdalr": "sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))",
    # Sized for two runs of the training cell (a second cell may run it again).
    "onecycle": "sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=2 * {epochs} * len(loader))",
}


# An Accelerator built in the kernel (rule ``framework``), which prepares the kernel's model, optimizer and loader:
# one process, so nothing is wrapped or sharded (auto mode prepares them in the cell). A scheduler is left unprepared:
# a prepared one steps once per process at each step, as accelerate sizes schedules for one process's step count.
ACCELERATE = """from accelerate import Accelerator
accelerator = Accelerator(cpu=True, gradient_accumulation_steps={steps})
model, opt, loader = accelerator.prepare(model, opt, loader)"""


def _scheduled(case: Case) -> bool:
    return case.get("sched") != "none" or case.get("sized") != "none"


def _layers(case: Case) -> str:
    """The expression of the model's Sequential of layers."""
    return "model" if case.get("model_class") == "sequential" else "model.body"


def _model(case: Case) -> list[str]:
    kind, dropout = case.get("model_kind"), case.get("dropout") == "dropout"
    if case.get("model_class") == "sequential":
        norm = "nn.BatchNorm1d(8), " if kind == "bn" else ""
        drop = "nn.Dropout(0.2), " if dropout else ""
        layers = f"nn.Linear(8, 8), {norm}nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), {drop}nn.Linear(8, 1)"
        made = f"model = nn.Sequential({layers})"
    else:
        made = f"model = Net(norm={kind == 'bn'}, drop={dropout})"
    lines = ["torch.manual_seed(1)", made]
    layers = _layers(case)
    if kind == "tied":
        lines.append(f"{layers}[2].weight = {layers}[0].weight  # tied, as GPT-2's head and embedding")
    alias = case.get("alias")
    if alias != "none":
        lines.append(
            {
                "param": f"first_weight = {layers}[0].weight",
                "buffer": f"running_mean = {layers}[1].running_mean",
                "submodule": f"first_layer = {layers}[0]",
            }[alias]
        )
    holder = case.get("holder")
    if holder == "dict":
        lines.append('held = {"net": model}')
    elif holder == "list":
        lines.append("held = [model]")
    if case.get("wrapper") == "namespace":
        lines.append("ns = types.SimpleNamespace(model=model, note='a notebook namespace holding the model')")
    return lines


def _optimizer(case: Case) -> list[str]:
    make = OPTIMIZERS[case.get("opt")]
    groups = case.get("groups")
    if groups == "one":
        lines = ["opt = " + make.format(params="model.parameters()")]
    elif groups == "two":
        lines = [
            "weights = [p for n, p in model.named_parameters() if n.endswith('weight')]",
            "others = [p for n, p in model.named_parameters() if not n.endswith('weight')]",
            "opt = " + make.format(params="[{'params': weights}, {'params': others, 'lr': LR / 2}]"),
        ]
    else:
        lines = [
            "opt = " + make.format(params=f"{_layers(case)}[0].parameters()"),
            (
                "opt.add_param_group({'params': [p for p in model.parameters()"
                f" if all(p is not q for q in {_layers(case)}[0].parameters())]}})"
            ),
        ]
    if case.get("sched") != "none":
        lines.append(SCHEDULERS[case.get("sched")])
    if case.get("scaler") != "none":
        lines.append('scaler = torch.amp.GradScaler("cpu", enabled=False)')
    if case.get("ema") != "none":
        lines.append("ema = torch.optim.swa_utils.AveragedModel(model)")
    return lines


def _loader(case: Case, shuffle: bool) -> list[str]:
    return [f"loader = DataLoader(data, batch_size=BS, shuffle={shuffle})"]


def _state(case: Case) -> list[str]:
    lines = []
    if case.get("values") == "counter":
        lines.append("step = 0\nlosses = []")
    if case.get("tensors") == "mutated":
        lines.append("scale = torch.ones(2)\nticks = torch.zeros(())")
    if case.get("fn") == "notebook_fn":
        lines.append("def compute_loss(x, y):\n    return loss_fn(model(x), y)")
    return lines


def _net(case: Case) -> str:
    """How the loop reaches the model: by its name, or through what else holds it."""
    if case.get("via") == "name":
        return "model"
    if case.get("wrapper") == "namespace":
        return "ns.model"
    return 'held["net"]' if case.get("holder") == "dict" else "held[0]"


def _step(case: Case) -> list[str]:
    accum = int(case.get("accum"))
    accelerate = case.get("framework") == "accelerate"
    loss = "compute_loss(x, y)" if case.get("fn") == "notebook_fn" else f"loss_fn({_net(case)}(x), y)"
    # accelerate's backward divides the loss by its gradient_accumulation_steps itself.
    lines = [f"loss = {loss}" + (f" / {accum}" if accum > 1 and not accelerate else "")]
    scaler = case.get("scaler") != "none"
    lines.append(
        "scaler.scale(loss).backward()" if scaler else "accelerator.backward(loss)" if accelerate else "loss.backward()"
    )
    update = []
    if case.get("clip") == "clip":
        update += ["scaler.unscale_(opt)"] if scaler else []
        update.append("nn.utils.clip_grad_norm_(model.parameters(), 0.5)")
    update += ["scaler.step(opt)", "scaler.update()"] if scaler else ["opt.step()"]
    if case.get("ema") != "none":
        update.append("ema.update_parameters(model)")
    update.append("opt.zero_grad()")
    if _scheduled(case):
        update.append("sched.step()")
    if accum > 1 and accelerate:
        # accelerate's own accumulation: the prepared optimizer's step and zero_grad do nothing until
        # accelerator.sync_gradients, so they run at every micro-batch; what is not prepared waits for it.
        lines += [
            line if line in ("opt.step()", "opt.zero_grad()") else f"if accelerator.sync_gradients:\n    {line}"
            for line in update
        ]
        lines = ["with accelerator.accumulate(model):"] + ["    " + line.replace("\n", "\n    ") for line in lines]
    elif accum > 1:
        lines.append(f"if (i + 1) % {accum} == 0:")
        lines += ["    " + line for line in update]
    else:
        lines += update
    if case.get("values") == "counter":
        lines += ["step += 1", "losses.append(loss.item())"]
    if case.get("tensors") == "mutated":
        lines.append("ticks += 1")
    if case.get("fail") == "raises":
        lines.append('if epoch == 0 and i == 2:\n    raise RuntimeError("the cell fails part-way")')
    if case.get("stop") == "interrupt":
        lines.append("if epoch == 0 and i == 2:\n    stop_point()")
    return lines


def _loop_cell(case: Case, shuffle: bool) -> list[str]:
    lines = []
    if case.get("model_where") == "cell":
        lines += _model(case)
    if case.get("freeze") == "bias":
        lines.append(f"{_layers(case)}[0].bias.requires_grad_(False)")
    if case.get("opt_where") == "cell":
        lines += _optimizer(case)
    if case.get("loader_where") == "cell":
        lines += _loader(case, shuffle)
    if case.get("rng") == "draws":
        lines.append("noise = torch.rand(2)\npick = random.random()")
    if case.get("tensors") == "mutated":
        lines.append("scale.mul_(0.5)")
    best = case.get("best") != "none"
    if best:
        lines.append('best_val, best_state = float("inf"), None')
    lines.append(f"for epoch in range({case.get('epochs')}):")
    lines.append("    for i, (x, y) in enumerate(loader):")
    lines += ["        " + line.replace("\n", "\n        ") for line in _step(case)]
    if best:
        lines += ["    " + line for line in KEEP_BEST.splitlines()]
        lines.append("model.load_state_dict(best_state)")
    return lines


# A validation pass at each epoch's end keeping the best weights (rule ``best``), as early stopping does.
KEEP_BEST = """model.eval()
with torch.no_grad():
    val = loss_fn(model(X), Y).item()
model.train()
if val < best_val:
    best_val, best_state = val, copy.deepcopy(model.state_dict())"""


def _trainer(case: Case, shuffle: bool) -> str:
    clip = "0.5" if case.get("clip") == "clip" else "None"
    fail = "3" if case.get("fail") == "raises" else "None"
    return (
        f"trainer = Trainer(model, data, batch_size=BS, opt={case.get('opt')!r}, lr=LR, clip={clip}, "
        f"epochs={case.get('epochs')}, shuffle={shuffle}, fail_at={fail}"
        + (", build_at_init=True)" if case.get("trainer_builds") == "in_init" else ")")
    )


def _trainer_cell(case: Case, shuffle: bool) -> list[str]:
    lines = []
    if case.get("model_where") == "cell":
        lines += _model(case)
    if case.get("freeze") == "bias":
        lines.append(f"{_layers(case)}[0].bias.requires_grad_(False)")
    if case.get("rng") == "draws":
        lines.append("noise = torch.rand(2)\npick = random.random()")
    if case.get("trainer_where") == "cell":
        lines.append(_trainer(case, shuffle))
    lines.append("trainer.run()")
    if case.get("values") == "counter":
        lines.append("step = trainer.iter_num")
    return lines


def render(case: Case, magic: str, shuffle: bool | None = None) -> Cells:
    """The cells of ``case``; ``magic`` is the training cell's first line ("" for none)."""
    shuffle = case.get("shuffle") == "yes" if shuffle is None else shuffle
    trainer = case.get("holder") in TRAINERS
    setup = [DATA] + ([DATASET] if case.get("dataset") != "tensors" else [])
    setup += [STOP] if case.get("stop") != "none" else []
    if case.get("model_class") == "mod_class":
        setup.append("from models import Net")
    elif case.get("model_class") == "nb_class":
        setup.append(NET)
    if case.get("holder") == "mod_trainer":
        setup.append("from train_utils import Trainer")
    elif case.get("holder") == "nb_trainer":
        setup.append(TRAINER)
    before: list[str] = []
    if case.get("model_where") == "before":
        before += _model(case)
    if not trainer and case.get("opt_where") == "before":
        before += _optimizer(case)
    if not trainer and case.get("loader_where") == "before":
        before += _loader(case, shuffle)
    if case.get("sized") != "none":
        before.append(SCHEDULERS[case.get("sized")].format(epochs=case.get("epochs")))
    if case.get("framework") == "accelerate":
        before.append(ACCELERATE.format(steps=case.get("accum")))
    if trainer and case.get("trainer_where") == "before":
        before.append(_trainer(case, shuffle))
    before += _state(case)
    if before:
        setup.append("\n".join(before))
    # A rank sets its own thread count (2 for one rank on 2 cores): the reference's is 1, and
    # BatchNorm's sums differ in the last bits with the thread count.
    body = ["torch.set_num_threads(1)"]
    body += _trainer_cell(case, shuffle) if trainer else _loop_cell(case, shuffle)
    if case.get("save") == "torch_save":
        body.append(f'torch.save({"trainer.model" if trainer else "model"}.state_dict(), "ckpt.pt")')
    train = (magic + "\n" if magic else "") + "\n".join(body) + "\n"
    second = {"none": None, "again": train, "eval": "with torch.no_grad():\n    pred = model(X[:4])\n"}[
        case.get("second")
    ]
    return Cells(tuple(setup), train, second)


def text(case: Case, magic: str = "%%distributed --devices 2 --accelerator cpu") -> str:
    """The case's cells as a notebook would show them (the training cell under ``magic``)."""
    cells = render(case, magic)
    parts = [f"# [setup {n}]\n{cell}" for n, cell in enumerate(cells.setup, 1)]
    parts.append(f"# [training cell]\n{cells.train}")
    if cells.second:
        parts.append(f"# [second cell]\n{cells.second}")
    return "\n".join(parts)
