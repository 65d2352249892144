"""Numbers the notebook sized from ``len(loader)`` before a cell (nbtrain.kernel.lengths), on real torch objects."""

from __future__ import annotations

import functools

import torch
from torch.utils.data import DataLoader, TensorDataset

from nbtrain.kernel import lengths


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.zeros(64, 1)), batch_size=8, shuffle=True)  # 8 batches


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def test_a_one_cycle_schedule_sized_from_the_loader_is_named_with_its_fix():
    train = _loader()
    sched = torch.optim.lr_scheduler.OneCycleLR(_optimizer(), max_lr=0.1, total_steps=2 * len(train))
    expected = (
        "sched expects 16 steps; each rank runs 8 (2 x len(train): 8 batches in the kernel, 4 on each rank): "
        "create sched inside the %%distributed cell, where len(train) is each rank's"
    )
    assert lengths.derived_lengths({"sched": sched, "train": train}, 2, "ddp") == [expected]


def test_a_step_count_in_a_closure_or_a_plain_int_is_found_too():
    train = _loader()
    total_steps = len(train)

    def warmup(step: int) -> float:
        return 1 - step / total_steps

    sched = torch.optim.lr_scheduler.LambdaLR(_optimizer(), warmup)
    found = lengths.derived_lengths({"sched": sched, "train": train, "total_steps": total_steps}, 2, "ddp")
    assert [sentence.split(";")[0] for sentence in found] == ["sched expects 8 steps", "total_steps is 8 steps"]
    assert found[1].endswith("compute total_steps inside the %%distributed cell, where len(train) is each rank's")


def test_nothing_is_said_when_the_loader_is_not_sharded_or_the_cell_rebuilds_the_schedule():
    train = _loader()
    sched = torch.optim.lr_scheduler.LambdaLR(_optimizer(), functools.partial(lambda s, num_steps: 1.0, num_steps=8))
    assert lengths.derived_lengths({"sched": sched, "train": train}, 1, "ddp") == []  # one rank: nothing sharded
    assert lengths.derived_lengths({"sched": sched, "train": train}, 2, "none") == []  # not auto: loader unchanged
    rebound = lengths.rebound_names("sched = make(opt, len(train))\n")
    assert lengths.derived_lengths({"sched": sched, "train": train}, 2, "ddp", rebound) == []


def test_expected_steps_reads_only_what_it_knows():
    assert lengths.expected_steps(torch.optim.lr_scheduler.StepLR(_optimizer(), 10)) is None  # no length held
    assert lengths.expected_steps(42) is None and lengths.expected_steps(object()) is None


def test_a_length_taken_of_a_sharded_loaders_dataset_in_the_cell_is_named():
    train = _loader()
    [said] = lengths.dataset_lengths("acc = correct / len(train.dataset)\n", {"train": train}, 2, "ddp")
    assert said.startswith("len(train.dataset) is 64, the size of train's dataset, of which each rank's training pass")
    assert lengths.dataset_lengths("n = len(train.dataset)", {"train": train}, 1, "ddp") == []  # one rank: whole
    assert lengths.dataset_lengths("n = len(train)", {"train": train}, 2, "ddp") == []  # the rank's own length
