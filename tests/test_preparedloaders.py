"""Loaders prepared on real ranks (nbtrain.rank.auto.preparedloaders): shares, lengths, training and evaluation passes.

What needs a process group runs on two or three real ranks through nbtrain.start.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

import nbtrain
from helpers.procs import finish
from nbtrain.rank.auto import preparedloaders


def test_batches_per_rank_in_the_kernel_match_the_prepared_loaders_on_the_ranks(launcher):
    from torch.utils.data import (
        BatchSampler,
        DistributedSampler,
        IterableDataset,
        RandomSampler,
        SequentialSampler,
        SubsetRandomSampler,
        WeightedRandomSampler,
    )

    ten = TensorDataset(torch.arange(10.0))
    made = [
        DataLoader(ten, batch_size=3, shuffle=True),  # 4 samples a rank (two are padding): 2 batches
        DataLoader(ten, batch_size=3, drop_last=True),  # 3 samples a rank, 1 full batch
        DataLoader(ten, batch_size=2),
        DataLoader(ten, batch_size=None),  # no batching: one item at a time
        DataLoader(TensorDataset(torch.arange(12.0)), batch_size=4),
        DataLoader(ten, batch_size=2, sampler=WeightedRandomSampler([1.0] * 10, 7)),  # 3 of the 7 draws: 2
        DataLoader(ten, batch_size=2, sampler=WeightedRandomSampler([1.0] * 10, 7, replacement=False)),  # 3 of 7: 2
        DataLoader(ten, batch_size=2, sampler=DistributedSampler(ten, num_replicas=5, rank=0)),  # the user's own
        DataLoader(ten, batch_sampler=BatchSampler(SequentialSampler(ten), 3, drop_last=False)),  # batches of 3
        DataLoader(ten, batch_sampler=BatchSampler(RandomSampler(ten), 3, drop_last=True)),  # 3 a rank, 1 batch
        DataLoader(ten, batch_size=2, sampler=SubsetRandomSampler([0, 2, 4, 6, 8, 9, 1])),  # 3 of 7 a rank: 2
    ]

    def fn(made):
        import torch.distributed as dist

        lengths = [len(nbtrain.prepare(loader)) for loader in made]
        every_rank = [None] * nbtrain.world_size()
        dist.all_gather_object(every_rank, lengths)
        return every_rank

    on_ranks = finish(nbtrain.start(fn, (made,), devices=3))
    in_kernel = [preparedloaders.batches_per_rank(loader, 3, "ddp") for loader in made]
    assert on_ranks == [in_kernel] * 3
    assert in_kernel == [2, 1, 2, 4, 1, 2, 2, 1, 2, 1, 2]
    assert [preparedloaders.batches_per_rank(loader, 3, "none") for loader in made] == [len(x) for x in made]

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

        def __len__(self):
            return 4

    assert preparedloaders.batches_per_rank(DataLoader(Stream()), 3, "ddp") is None  # each rank reads what it reads
    assert preparedloaders.batches_per_rank([1, 2, 3], 3, "ddp") is None  # not a DataLoader


def test_a_loader_given_a_batch_sampler_is_sharded_in_its_batches(launcher):
    """``DataLoader(dataset, batch_sampler=BatchSampler(...))``: batch size and drop_last are the batch sampler's."""
    from torch.utils.data import BatchSampler, RandomSampler

    data = TensorDataset(torch.arange(12.0).unsqueeze(1), torch.arange(12))
    loader = DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), 4, drop_last=False))

    def fn(loader):
        with torch.enable_grad():
            return [(tuple(x.shape), y.tolist()) for x, y in nbtrain.prepare(loader)]

    batches = finish(nbtrain.start(fn, (loader,), devices=2))  # rank 0's
    assert [shape for shape, _ in batches] == [(4, 1), (2, 1)]  # rank 0's 6 of 12, in batches of 4
    assert len({i for _, ids in batches for i in ids}) == 6


def test_a_train_validation_split_by_subset_samplers_shares_out_the_training_indices(launcher):
    """``SubsetRandomSampler(train_idx)`` beside ``SubsetRandomSampler(val_idx)`` on one dataset:
    a training pass gives each rank its share of the training indices (reshuffled each epoch);
    a pass without gradients reads all the validation indices on every rank."""
    from torch.utils.data import SubsetRandomSampler

    data = TensorDataset(torch.arange(20))
    train_idx, val_idx = list(range(0, 20, 2)), [1, 3, 5]
    train = DataLoader(data, batch_size=2, sampler=SubsetRandomSampler(train_idx))
    val = DataLoader(data, batch_size=2, sampler=SubsetRandomSampler(val_idx))

    def fn(train, val):
        import torch.distributed as dist

        train, val = nbtrain.prepare(train, val)
        with torch.enable_grad():
            epochs = [[i for (b,) in train for i in b.tolist()] for _ in range(2)]
        with torch.no_grad():
            checked = sorted(i for (b,) in val for i in b.tolist())
        every_rank = [None] * nbtrain.world_size()
        dist.all_gather_object(every_rank, (epochs, checked, len(train)))
        return every_rank

    (epochs0, checked0, n0), (epochs1, checked1, n1) = finish(nbtrain.start(fn, (train, val), devices=2))
    for first, second in zip(epochs0, epochs1, strict=True):
        assert sorted(first + second) == train_idx  # each training index once, over the two ranks
    assert epochs0[0] != epochs0[1]  # another order the next epoch
    assert checked0 == checked1 == val_idx
    assert n0 == n1 == preparedloaders.batches_per_rank(train, 2, "ddp") == 3


def test_a_weighted_sampler_for_imbalanced_classes_gives_each_rank_its_share_of_the_draws(launcher):
    """``WeightedRandomSampler(weights, num_samples)`` (inverse class frequencies): each rank draws
    its share of ``num_samples`` on its own generator, so the ranks' draws differ and, together,
    are as balanced as one process's."""
    from torch.utils.data import WeightedRandomSampler

    labels = torch.tensor([1] * 40 + [0] * 360)  # a 1:9 imbalance
    weights = torch.where(labels == 1, 1 / 40, 1 / 360).double()
    data = TensorDataset(torch.arange(400), labels)
    loader = DataLoader(data, batch_size=25, sampler=WeightedRandomSampler(weights, 400))

    def fn(loader):
        import torch.distributed as dist

        with torch.enable_grad():
            drawn = [(i.tolist(), y.tolist()) for i, y in nbtrain.prepare(loader)]
        every_rank = [None] * nbtrain.world_size()
        dist.all_gather_object(every_rank, drawn)
        return every_rank

    first, second = finish(nbtrain.start(fn, (loader,), devices=2))
    assert len(first) == len(second) == preparedloaders.batches_per_rank(loader, 2, "ddp") == 8  # 200 draws a rank
    assert [i for b, _ in first for i in b] != [i for b, _ in second for i in b]
    minority = sum(y for _, ys in first + second for y in ys) / 400
    assert 0.35 < minority < 0.65, minority  # about half, where the data has a tenth


# -- training passes and evaluation passes -----------------------------------------------------


def test_training_passes_read_a_share_and_passes_without_gradients_read_everything(launcher):
    def fn():
        import torch.distributed as dist

        data = TensorDataset(torch.arange(10.0))
        loader = nbtrain.prepare(DataLoader(data, batch_size=3, shuffle=True))
        ordered = nbtrain.prepare(DataLoader(data, batch_size=4), evaluation="whole")

        def items(batches):
            return [int(v) for (x,) in batches for v in x]

        seen = {"share": [items(loader) for _ in range(2)], "len_share": len(loader)}
        with torch.no_grad():
            seen["no_grad"], seen["len_no_grad"] = items(ordered), len(ordered)
            seen["shuffled_whole"] = sorted(items(loader))
        with torch.inference_mode():
            seen["inference"] = items(ordered)
        seen["third_share"] = items(loader)  # epoch 2: evaluation passes did not advance it
        shards = [None] * nbtrain.world_size()
        dist.all_gather_object(shards, seen["share"][0])
        seen["shards"] = shards
        seen["report"] = preparedloaders.describe_passes(loader), preparedloaders.describe_passes(ordered)
        return seen

    seen = finish(nbtrain.start(fn, devices=2))
    first, second = seen["share"]
    assert len(first) == 5 and first != second  # half of it, reshuffled by set_epoch
    assert sorted(seen["shards"][0] + seen["shards"][1]) == list(range(10))
    assert seen["len_share"] == 2 and seen["len_no_grad"] == 3  # 5 of 10 in batches of 3; 10 in 4s
    assert seen["no_grad"] == seen["inference"] == list(range(10))  # whole, in the loader's own order
    assert seen["shuffled_whole"] == list(range(10))
    training_and_evaluation = (
        "sharded for training (DistributedSampler, 5 of 10 per rank; effective batch 6 = 3 per rank x 2 ranks) and "
        "evaluated whole on every rank (iterated without gradients)"
    )
    assert seen["report"] == (training_and_evaluation, "evaluated whole on every rank (iterated without gradients)")


def test_evaluation_shard_keeps_evaluation_passes_sharded_and_all_reduce_adds_them_up(launcher):
    def fn():
        data = TensorDataset(torch.arange(12.0))
        loader = nbtrain.prepare(DataLoader(data, batch_size=4), evaluation="shard")
        with torch.no_grad():
            values = [float(v) for (x,) in loader for v in x]
        probe = torch.tensor([float(nbtrain.rank()), 1.0])
        return {
            "values": values,
            "sum": nbtrain.all_reduce(sum(values)),
            "count": nbtrain.all_reduce(len(values)),
            "mean": nbtrain.all_reduce(nbtrain.rank() + 1, op="mean"),
            "max": nbtrain.all_reduce(nbtrain.rank(), op="max"),
            "min": nbtrain.all_reduce(0.5 + nbtrain.rank(), op="min"),
            "tensor": nbtrain.all_reduce(probe).tolist(),
            "probe_unchanged": probe.tolist() == [float(nbtrain.rank()), 1.0],
            "report": preparedloaders.describe_passes(loader),
        }

    result = finish(nbtrain.start(fn, devices=2))
    assert result["values"] == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]  # rank 0's share, in order
    assert result["sum"] == sum(range(12)) and result["count"] == 12 and type(result["count"]) is int
    assert result["mean"] == 1.5 and result["max"] == 1 and result["min"] == 0.5
    assert result["tensor"] == [1.0, 2.0] and result["probe_unchanged"]
    assert result["report"] == "evaluated sharded (DistributedSampler, 6 of 12 per rank; evaluation='shard')"


def test_a_weighted_sampler_drawing_without_replacement_is_shared_out_as_parts_of_one_draw(launcher):
    """``WeightedRandomSampler(weights, k, replacement=False)``: each epoch one draw of k distinct
    samples, the same on every rank, of which each rank reads its part; another draw the next epoch."""
    from torch.utils.data import WeightedRandomSampler

    weights = torch.linspace(0.1, 1.0, 40).double()
    sampler = WeightedRandomSampler(weights, 20, replacement=False)
    loader = DataLoader(TensorDataset(torch.arange(40)), batch_size=5, sampler=sampler)

    def fn(loader):
        import torch.distributed as dist

        prepared = nbtrain.prepare(loader)
        with torch.enable_grad():
            epochs = [[i for (b,) in prepared for i in b.tolist()] for _ in range(2)]
        every_rank = [None] * nbtrain.world_size()
        dist.all_gather_object(every_rank, (epochs, type(prepared.sampler).__name__))
        return every_rank

    (first, name), (second, _) = finish(nbtrain.start(fn, (loader,), devices=2))
    assert name == "WeightedRandomSampler"
    for mine, theirs in zip(first, second, strict=True):
        assert len(mine) == len(theirs) == 10 == 5 * preparedloaders.batches_per_rank(loader, 2, "ddp")
        assert len(set(mine + theirs)) == 20  # 20 distinct samples between them: no sample drawn twice
    assert sorted(first[0] + second[0]) != sorted(first[1] + second[1])  # another draw the next epoch


# A shuffling loader's cell, and its draws before and after the loop: run under %%distributed and in the kernel.
DRAWS = """{magic}
torch.set_num_threads(1)
torch.manual_seed(3)
first = torch.rand(2)
for epoch in range(2):
    for x, y in {loader}:
        loss_fn({model}(x), y).backward()
        {opt}.step()
        {opt}.zero_grad()
last = torch.rand(2)
"""


def test_the_cells_own_draws_are_one_processs_around_a_shuffling_loader(kernel):
    """One process's shuffling loader draws its seed from the global generator as each pass starts,
    an unshuffled one draws none; the ranks' loaders shuffle on a seed of their own yet draw the
    same from the global generator, at the same points: the cell's ``torch.rand`` after the loop is
    one process's, bit for bit (a subset sampler's and a sequential one's too)."""
    kernel.run_ok(
        "import copy, torch, torch.nn as nn\n"
        "from torch.utils.data import DataLoader, TensorDataset, SubsetRandomSampler\n"
        "torch.manual_seed(0)\n"
        "data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))\n"
        "loss_fn = nn.MSELoss()\n"
        "model = nn.Linear(4, 1)\n"
        "reference = copy.deepcopy(model)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
        "reference_opt = torch.optim.SGD(reference.parameters(), lr=0.01)\n"
        "loaders = {'shuffled': DataLoader(data, batch_size=4, shuffle=True),\n"
        "           'subset': DataLoader(data, batch_size=4, sampler=SubsetRandomSampler(range(0, 32, 2))),\n"
        "           'sequential': DataLoader(data, batch_size=4)}\n"
    )
    for name in ("shuffled", "subset", "sequential"):
        kernel.run_ok(f"loader = loaders[{name!r}]")
        magic = "%%distributed --devices 2 --accelerator cpu"
        out = kernel.run_ok(DRAWS.format(magic=magic, loader="loader", model="model", opt="opt"))
        kernel.run_ok("ranks = (first, last)")
        kernel.run_ok(DRAWS.format(magic="", loader="loader", model="reference", opt="reference_opt"))
        assert kernel.value("torch.equal(ranks[0], first) and torch.equal(ranks[1], last)"), (name, out.text)
