"""Data loaders sharded for the ranks: training passes read a share, evaluation passes the whole.

A loader is rebuilt on a ``DistributedSampler`` that keeps its batch size, shuffle,
drop_last, collate_fn and workers (over a ``SubsetRandomSampler``'s indices where it had
one; a ``WeightedRandomSampler`` becomes one drawing the rank's share: with replacement on
the rank's own generator, without it the same draw on every rank, each reading its part);
each pass decides when iteration starts what it is (with gradients: this rank's share;
without: the whole dataset, unless prepared with ``evaluation="shard"``). The kernel asks
:func:`batches_per_rank` how long each rank's loader will be. See :func:`nbtrain.prepare`.
A rank's loader draws from the global generator what the user's sampler would, when it
would (a ``RandomSampler``'s seed as each pass starts), and nothing more: the cell's own
draws (``torch.rand``, after or between passes) are one process's.

Example (outside a run a loader comes back as it is, remembering the evaluation choice):
    >>> import torch
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> loader = DataLoader(TensorDataset(torch.zeros(8, 1)), batch_size=4)
    >>> prepare_loader(loader, "shard") is loader, evaluation_of(loader)
    (True, 'shard')
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from nbtrain import frameworks
from nbtrain.rank import api
from nbtrain.rank.auto import ledger

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    _LoaderBase = DataLoader[Any]
else:
    # torch is imported when the first loader is prepared; the mixin below is put in front
    # of its class then (_prepared_loader_class).
    _LoaderBase = object

EVALUATION_CHOICES = ("whole", "shard")
# Set on a loader by ``prepare(loader, evaluation=...)`` where nothing is rebuilt (in the
# kernel): it travels with the loader, so auto mode on the ranks honours it.
EVALUATION_MARK = "_nbtrain_evaluation"


def prepare_loader(loader: Any, evaluation: str | None = None) -> Any:
    """The loader rebuilt on a DistributedSampler (this rank's share), or as is if it cannot be.

    ``evaluation`` ("whole" or "shard", see :func:`prepare`) is what its passes without
    gradients read; None keeps the loader's earlier choice ("whole" if none).
    """
    existing = ledger.cell_registry().prepared_for(loader)
    if existing is not None:
        if evaluation is not None and existing is not loader:
            setattr(existing, EVALUATION_MARK, evaluation)
        return existing
    if evaluation is not None:
        setattr(loader, EVALUATION_MARK, evaluation)
    if not ledger.in_process_group() or ledger.model_wrapper() == "none":
        return loader
    if ledger.one_rank():  # the loader's own order; on a GPU its batches move there
        return loader if api.device().type == "cpu" else _one_rank_loader(loader)
    if _already_distributed(loader):
        return loader
    reason, shuffle = _shardable(loader)
    if reason:
        ledger.cell_registry().notes.append(reason)
        ledger.cell_registry().unsharded.append(id(loader))
        return loader
    prepared = _rebuild_loader(loader, shuffle)
    ledger.cell_registry().remember(loader, prepared)
    return prepared


def evaluation_of(loader: Any) -> str:
    """ "whole" or "shard": what ``loader``'s passes without gradients read once prepared."""
    return getattr(loader, EVALUATION_MARK, "whole")


def _shardable(loader: Any) -> tuple[str, bool]:
    """("", shuffle) when the loader can be rebuilt on a DistributedSampler, else (why not, _)."""
    # deferred: start-up time (torch)
    from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, SequentialSampler, SubsetRandomSampler

    what = f"a DataLoader over {type(loader.dataset).__name__}"
    if isinstance(loader.dataset, IterableDataset):
        return f"{what} was not sharded: an IterableDataset must split its data by nbtrain.rank() itself.", False
    if loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler:
        name = type(loader.batch_sampler).__name__
        return f"{what} was not sharded: its batch_sampler ({name}) is custom, so every rank reads all of it.", False
    sampler = _batching(loader)[0]
    if type(sampler) is SequentialSampler:
        return "", False
    if type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None:
        return "", True
    if type(sampler) is SubsetRandomSampler:  # a train/validation split of one dataset: its indices are shared
        return "", True
    if _weighted(loader) is not None:  # class weights for imbalanced data: each rank draws its share
        return "", True
    name = type(sampler).__name__
    return f"{what} was not sharded: its sampler ({name}) is custom, so every rank reads all of it.", False


def _batching(loader: Any) -> tuple[Any, int | None, bool]:
    """(sampler, batch size, drop_last) as the loader batches: a ``batch_sampler=BatchSampler(...)``
    passed to the DataLoader holds them (the loader's own ``batch_size`` is then None)."""
    given = loader.batch_sampler if loader.batch_size is None else None
    if given is not None:
        return given.sampler, given.batch_size, given.drop_last
    return loader.sampler, loader.batch_size, loader.drop_last


def _subset_indices(loader: Any) -> Any:
    """The indices a ``SubsetRandomSampler`` draws from (what a training pass shares out), or None."""
    # deferred: start-up time (torch)
    from torch.utils.data import SubsetRandomSampler

    sampler = _batching(loader)[0]
    return sampler.indices if type(sampler) is SubsetRandomSampler else None


def _weighted(loader: Any) -> Any:
    """The loader's ``WeightedRandomSampler`` (its draws are shared out), else None."""
    # deferred: start-up time (torch)
    from torch.utils.data import WeightedRandomSampler

    sampler = _batching(loader)[0]
    return sampler if type(sampler) is WeightedRandomSampler else None


def _shared_count(loader: Any) -> int:
    """How many samples a training pass shares out over the ranks: the dataset's, the subset's, or the draws."""
    indices, weighted = _subset_indices(loader), _weighted(loader)
    if weighted is not None:
        return int(weighted.num_samples)
    return len(loader.dataset) if indices is None else len(indices)


def _share(count: int, world_size: int, drop_last: bool) -> Any:
    """A DistributedSampler's share of ``count`` samples for rank 0, to count (nothing drawn)."""
    # deferred: start-up time (torch)
    from torch.utils.data import DistributedSampler

    return DistributedSampler(range(count), num_replicas=world_size, rank=0, shuffle=False, drop_last=drop_last)  # type: ignore[arg-type]  # any sized object


@functools.lru_cache(maxsize=1)
def _subset_shard_class() -> type:
    """A DistributedSampler over a SubsetRandomSampler's indices: its share of them, reshuffled each epoch."""
    # deferred: start-up time (torch)
    from torch.utils.data import DistributedSampler

    class SubsetShard(DistributedSampler):  # type: ignore[type-arg]  # torch's class is generic only in stubs
        def __init__(self, indices: Any, **kwargs: Any) -> None:
            super().__init__(range(len(indices)), **kwargs)  # type: ignore[arg-type]  # any sized object
            self.indices = indices

        def __iter__(self) -> Iterator[Any]:
            return (self.indices[i] for i in super().__iter__())

    SubsetShard.__name__ = SubsetShard.__qualname__ = "DistributedSampler"
    return SubsetShard


@functools.lru_cache(maxsize=1)
def _weighted_shard_class() -> type:
    """A WeightedRandomSampler drawing this rank's share of the draws, on its own generator."""
    # deferred: start-up time (torch)
    from torch.utils.data import WeightedRandomSampler

    class WeightedShard(WeightedRandomSampler):
        def set_epoch(self, epoch: int) -> None:
            """Nothing: the rank's generator draws anew each pass, as the user's sampler did."""

    WeightedShard.__name__ = WeightedShard.__qualname__ = "WeightedRandomSampler"
    return WeightedShard


@functools.lru_cache(maxsize=1)
def _distinct_shard_class() -> type:
    """A WeightedRandomSampler drawing without replacement: every rank makes the same draw, and reads its share."""
    # deferred: start-up time (torch)
    from torch.utils.data import DistributedSampler

    class DistinctShard(DistributedSampler):  # type: ignore[type-arg]  # torch's class is generic only in stubs
        def __init__(self, weights: Any, **kwargs: Any) -> None:
            self.weights = weights
            super().__init__(range(int(kwargs.pop("num_samples"))), **kwargs)  # type: ignore[arg-type]  # sized

        def __iter__(self) -> Iterator[Any]:
            # deferred: start-up time (torch)
            import torch

            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)  # the same on every rank: one draw, shared out
            drawn = torch.multinomial(self.weights, len(self.dataset), False, generator=generator).tolist()  # type: ignore[arg-type]
            return (drawn[i] for i in super().__iter__())

    DistinctShard.__name__ = DistinctShard.__qualname__ = "WeightedRandomSampler"
    return DistinctShard


def _weighted_share(weighted: Any, seed: int, drop_last: bool) -> Any:
    """This rank's sampler for a ``WeightedRandomSampler``'s draws: the same weights and its share of
    ``num_samples``. With replacement, on its own seed (the ranks draw independently, as one process's
    draws are); without, the same draw on every rank, each reading its part (no sample twice)."""
    # deferred: start-up time (torch)
    import torch

    total, weights = int(weighted.num_samples), weighted.weights  # torch keeps them as a double tensor
    if not weighted.replacement:
        shares = {"num_replicas": api.world_size(), "rank": api.rank(), "seed": seed, "drop_last": drop_last}
        return _distinct_shard_class()(weights, num_samples=total, shuffle=False, **shares)
    generator = torch.Generator()
    generator.manual_seed(seed + api.rank())
    share = len(_share(total, api.world_size(), drop_last))
    sampler = _weighted_shard_class()(weights, share, replacement=True, generator=generator)
    sampler.dataset = range(total)  # what the summary counts the share of
    return sampler


def batches_per_rank(loader: Any, world_size: int, wrapper: str, *, evaluation: bool = False) -> int | None:
    """``len(loader)`` as each rank will see it once auto mode prepared it, or None if unsure.

    Called in the kernel, before the run, on the kernel's own loader: it takes the same
    decision as :func:`prepare_loader` (``wrapper`` is the strategy's model wrapper) and
    counts a DistributedSampler's share as torch does (padded, or cut with drop_last), so
    every rank gets the same number. ``evaluation=True`` asks about a pass without
    gradients, which reads the whole loader unless it was prepared with
    ``evaluation="shard"``. Nothing is built that draws from an RNG.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> loader = DataLoader(TensorDataset(torch.zeros(200, 1)), batch_size=16, shuffle=True)
        >>> len(loader), batches_per_rank(loader, 2, "ddp"), batches_per_rank(loader, 2, "none")
        (13, 7, 13)
        >>> batches_per_rank(loader, 2, "ddp", evaluation=True)  # under torch.no_grad(): all of it
        13
    """
    # deferred: start-up time (torch)
    from torch.utils.data import BatchSampler, DataLoader, IterableDataset

    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return None  # an iterable dataset's length is only a hint
    try:
        unchanged = len(loader)
        if wrapper == "none" or world_size < 2 or _already_distributed(loader) or _shardable(loader)[0]:
            return unchanged  # the rank iterates its copy of this very loader
        if evaluation and evaluation_of(loader) == "whole":
            return unchanged
        _, batch_size, drop_last = _batching(loader)
        share = _share(_shared_count(loader), world_size, drop_last)
        if batch_size is None:
            return len(share)
        return len(BatchSampler(share, batch_size, drop_last))
    except (TypeError, ValueError, AttributeError):  # no len(), or a loader torch would refuse
        return None


def samples_per_rank(loader: Any, world_size: int, wrapper: str) -> int | None:
    """The samples a training pass over ``loader`` reads on each rank once auto mode prepared it,
    or None when it is not sharded (or not a map-style DataLoader).

    >>> import torch
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> samples_per_rank(DataLoader(TensorDataset(torch.zeros(9, 1)), batch_size=4), 2, "ddp")
    5
    """
    # deferred: start-up time (torch)
    from torch.utils.data import DataLoader, IterableDataset

    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return None
    if wrapper == "none" or world_size < 2 or _already_distributed(loader) or _shardable(loader)[0]:
        return None
    try:
        return len(_share(_shared_count(loader), world_size, _batching(loader)[2]))
    except (TypeError, ValueError):
        return None


def loader_lengths(objects: Mapping[str, Any], world_size: int, wrapper: str) -> tuple[dict[str, int], dict[str, int]]:
    """Batches per rank of each DataLoader among ``objects``: in passes with gradients, and without.

    The second dict is what an evaluation pass reads (the whole loader, unless it was
    prepared with ``evaluation="shard"``); see :func:`batches_per_rank`.
    """
    training: dict[str, int] = {}
    evaluation: dict[str, int] = {}
    for name, obj in objects.items():
        for lengths, without_grad in ((training, False), (evaluation, True)):
            length = batches_per_rank(obj, world_size, wrapper, evaluation=without_grad)
            if length is not None:
                lengths[name] = length
    return training, evaluation


def _already_distributed(loader: Any) -> bool:
    # deferred: start-up time (torch)
    from torch.utils.data import DistributedSampler

    return isinstance(loader.sampler, DistributedSampler) or isinstance(
        getattr(loader.batch_sampler, "sampler", None), DistributedSampler
    )


class _PassAware(_LoaderBase):
    """A DataLoader on a DistributedSampler that tells training passes from evaluation passes.

    Each ``iter()`` (a ``for`` loop's start) reads the thread's grad mode, one cheap
    call: enabled, a training pass reads this rank's share (``set_epoch`` first, so
    every training pass shuffles anew); disabled, an evaluation pass reads the rank's
    copy of the user's own loader, whole and in its own order, unless the loader
    was prepared with ``evaluation="shard"``. A pass begun with every prepared model in
    eval mode (``model.eval()``) is an evaluation pass too, grad mode aside: a loop that
    turns gradients off inside itself (``with torch.set_grad_enabled(phase == "train")``,
    as torchvision's fine-tuning tutorial does) evaluates. ``len()`` follows the same
    rule, so ``len(loader)`` inside ``torch.no_grad()`` counts the batches that pass reads.
    (A mixin: :func:`_prepared_loader_class` puts it in front of torch's DataLoader.)
    """

    _nbtrain_epoch: int  # training passes so far: the next one's set_epoch
    _nbtrain_whole: Any  # what an evaluation pass reads: the rank's copy of the user's loader
    _nbtrain_passes: dict[str, int]  # passes so far: "train", "whole", "shard"
    _nbtrain_one_rank = False  # every pass reads the user's loader, moved to the device
    _nbtrain_by_mode = False  # an evaluation pass was one by the models' eval mode, gradients on
    _nbtrain_mode_pass_at: int | None = None  # the cell's step count when such a pass began
    _nbtrain_mode_pass_end: int | None = None  # ... and when it ended (None: still going)
    _nbtrain_trained_whole = False  # such a pass trained (a step began in it): grad mode alone decides now

    # Not DataLoader's iterator type: a pass reads the user's own loader, or moves batches.
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self._nbtrain_check_trained()
        kind = self._nbtrain_pass_kind()
        by_mode = kind == "whole" and ledger.torch_module().is_grad_enabled()  # by the models' eval mode
        if by_mode:
            self._nbtrain_by_mode = True
            self._nbtrain_mode_pass_at, self._nbtrain_mode_pass_end = _cell_steps(), None
        if not any(self._nbtrain_passes.values()):
            ledger.cell_registry().first_iterated.append(id(self))  # the summary names loaders in this order
        self._nbtrain_passes[kind] += 1
        batches: Iterator[Any]
        if kind == "whole" or self._nbtrain_one_rank:
            batches = iter(self._nbtrain_whole)
        else:
            if kind == "train":
                sampler: Any = self.sampler  # a DistributedSampler (_rebuild_loader)
                sampler.set_epoch(self._nbtrain_epoch)
                self._nbtrain_epoch += 1
            _draw_as_users_sampler(self._nbtrain_whole)
            batches = super().__iter__()
            if frameworks.keeps_pass_books(self._nbtrain_whole):  # accelerate's accumulate() syncs at a pass's end
                batches = frameworks.in_pass_books(self._nbtrain_whole, batches)
        if by_mode:
            batches = self._nbtrain_mode_pass(batches)
        device = api.device()
        if device.type == "cpu":
            return batches
        return (ledger.to_device(batch, device) for batch in batches)

    def _nbtrain_mode_pass(self, batches: Iterator[Any]) -> Iterator[Any]:
        """A pass begun in eval mode, its step count taken as it ends (all read, or left by a
        ``break``): steps in it mean it trained; steps after it (the next epoch's) do not."""
        try:
            yield from batches
        finally:
            self._nbtrain_mode_pass_end = _cell_steps()

    def __len__(self) -> int:
        if self._nbtrain_one_rank or self._nbtrain_pass_kind() == "whole":
            return len(self._nbtrain_whole)
        return super().__len__()

    def _nbtrain_pass_kind(self) -> str:
        grads = ledger.torch_module().is_grad_enabled()
        if grads and (self._nbtrain_trained_whole or not _models_evaluating()):
            return "train"
        return "shard" if evaluation_of(self) == "shard" else "whole"

    def _nbtrain_check_trained(self) -> None:
        """Whether the last pass begun in eval mode trained after all (the model was left in eval
        mode before a training loop): said in the summary, and grad mode alone decides from now on."""
        began, ended = self._nbtrain_mode_pass_at, self._nbtrain_mode_pass_end
        if began is not None and (_cell_steps() if ended is None else ended) > began:
            self._nbtrain_trained_whole = True
            self._nbtrain_passes["whole"] -= 1  # no evaluation pass: said as what it was
        self._nbtrain_mode_pass_at = None


def _seed_of_global_state() -> int:
    """A shuffling seed every rank agrees on, read from the global generator's state without drawing.

    The ranks start from the kernel's RNG state, so it is the same on every rank; drawing it
    would shift the cell's own draws (``torch.rand``) against one process's, whose sampler
    draws only as each pass starts (:func:`_draw_as_users_sampler` draws that).
    """

    # deferred: start-up time (torch)
    import torch

    state = bytes(torch.get_rng_state().numpy())
    return int.from_bytes(hashlib.blake2b(state, digest_size=8).digest(), "little") >> 1  # int64's range


def _draw_as_users_sampler(loader: Any) -> None:
    """Draw from the global generator what ``loader``'s own sampler draws as a pass starts, and only that.

    One process's ``RandomSampler`` draws its seed at each pass's start (a
    ``SubsetRandomSampler`` its permutation, a ``WeightedRandomSampler`` its draws); the rank's
    DistributedSampler shuffles on its own generator. So that the cell's own draws after the
    loop (``torch.rand``, dropout) are one process's, the user's sampler starts a pass here: its
    first index makes every draw of the pass from the global generator (the work one process
    does), except a ``RandomSampler``'s, whose one draw (its seed) is made as torch makes it,
    sparing its permutation. A sampler with a generator of its own, or one that draws nothing
    (``SequentialSampler``), is left alone.
    """
    # deferred: start-up time (torch)
    import torch
    from torch.utils.data import RandomSampler, SubsetRandomSampler, WeightedRandomSampler

    sampler = _batching(loader)[0]
    if type(sampler) is RandomSampler and sampler.generator is None:
        torch.empty((), dtype=torch.int64).random_()  # RandomSampler.__iter__'s own draw of its seed
    elif type(sampler) in (SubsetRandomSampler, WeightedRandomSampler) and sampler.generator is None:
        next(iter(sampler), None)


def _cell_steps() -> int:
    """The cell's steps so far (the loss logging counts each backward)."""
    context = api.current_context()
    return context.step if context is not None else 0


def _models_evaluating() -> bool:
    """Whether the cell's models that train (prepared, or made in the cell) are all in eval mode
    (and there is one)."""
    # deferred: start-up time
    from nbtrain.rank.auto import celloptimizers, keptmodels, wrapping

    nn = ledger.torch_module().nn
    models = [o for o, _ in ledger.cell_registry().prepared.values() if isinstance(o, nn.Module)]
    made = keptmodels.kept_models(celloptimizers.unstepped_optimizers())
    trained = [m for m in models + made if wrapping.trains(m)]
    return bool(trained) and not any(m.training for m in trained)


@functools.cache
def _prepared_loader_class() -> type:
    """:class:`_PassAware` on torch's DataLoader, named ``DataLoader`` (built once: it imports torch)."""
    # deferred: start-up time (torch)
    from torch.utils.data import DataLoader

    class PreparedDataLoader(_PassAware, DataLoader[Any]):
        pass

    PreparedDataLoader.__name__ = PreparedDataLoader.__qualname__ = "DataLoader"
    return PreparedDataLoader


def _rebuild_loader(loader: Any, shuffle: bool) -> Any:
    # deferred: start-up time (torch)
    from torch.utils.data import DistributedSampler

    user_sampler, batch_size, drop_last = _batching(loader)
    generator = loader.generator if loader.generator is not None else getattr(user_sampler, "generator", None)
    seed = int(generator.initial_seed()) if generator is not None else _seed_of_global_state()
    shares: dict[str, Any] = {"num_replicas": api.world_size(), "rank": api.rank(), "shuffle": shuffle, "seed": seed}
    indices, weighted = _subset_indices(loader), _weighted(loader)
    sampler: Any
    if weighted is not None:
        sampler = _weighted_share(weighted, seed, drop_last)
    elif indices is not None:
        sampler = _subset_shard_class()(indices, drop_last=drop_last, **shares)
    else:
        sampler = DistributedSampler(loader.dataset, drop_last=drop_last, **shares)
    kwargs = {
        "batch_size": batch_size,
        "sampler": sampler,
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "drop_last": drop_last,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": getattr(loader, "pin_memory_device", ""),
        "in_order": getattr(loader, "in_order", True),
    }
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    accepted = inspect.signature(_prepared_loader_class()).parameters
    return _pass_aware(loader, **{k: v for k, v in kwargs.items() if k in accepted})


def _pass_aware(loader: Any, **kwargs: Any) -> Any:
    """A :class:`_PassAware` loader over ``loader``'s dataset (built with ``kwargs``) whose evaluation
    passes read ``loader`` itself, as it chose."""
    new = _prepared_loader_class()(loader.dataset, **kwargs)
    new._nbtrain_epoch = 0
    new._nbtrain_whole = loader
    new._nbtrain_passes = {"train": 0, "whole": 0, "shard": 0}
    setattr(new, EVALUATION_MARK, evaluation_of(loader))
    return new


def _one_rank_loader(loader: Any) -> Any:
    """The only rank's loader on a GPU: the user's own loader (its sampler, order and RNG draws)
    whose batches move to the rank's device, as a sharded loader's do."""
    new = _pass_aware(loader, batch_size=loader.batch_size, drop_last=loader.drop_last)
    new._nbtrain_one_rank = True
    ledger.cell_registry().remember(loader, new)
    return new


def loader_report() -> list[tuple[str, str]]:
    """(name, what its passes read) for each loader auto mode prepared, for the run's summary.

    Example: ``("test_loader", "evaluated whole on every rank (iterated without gradients)")``.
    """
    registry = ledger.cell_registry()
    order = {loader_id: i for i, loader_id in enumerate(registry.first_iterated)}
    named = sorted(registry.loader_names.items(), key=lambda item: order.get(id(item[1]), len(order)))
    return [(name, describe_passes(loader)) for name, loader in named]


def describe_passes(loader: Any) -> str:
    """What a prepared loader's passes so far read, in words."""
    if loader._nbtrain_one_rank:
        return f"its own order, batches moved to {api.device()} (one rank: not sharded)"
    loader._nbtrain_check_trained()
    share = f"{type(loader.sampler).__name__}, {loader.sampler.num_samples} of {len(loader.sampler.dataset)} per rank"
    passes = loader._nbtrain_passes
    parts = []
    if passes["train"]:
        also = " for training" if passes["whole"] or passes["shard"] else ""
        parts.append(f"sharded{also} ({share}{_effective_batch(loader)})")
    if passes["whole"]:
        why = "iterated with the model in eval mode" if loader._nbtrain_by_mode else "iterated without gradients"
        parts.append(f"evaluated whole on every rank ({why})")
    if passes["shard"]:
        parts.append(f"evaluated sharded ({share}; evaluation='shard')")
    if loader._nbtrain_trained_whole:
        parts.append(
            "read whole on every rank in a pass that trained: the model was in eval mode when it began "
            "(call model.train() before a training loop)"
        )
    if not parts:
        return f"not iterated (prepared: {share} when iterated with gradients)"
    return " and ".join(parts)


def _effective_batch(loader: Any) -> str:
    """ "; effective batch 64 = 32 per rank x 2 ranks": what the learning rate usually follows."""
    batch = loader.batch_size
    world = api.world_size()
    if not batch or world < 2:
        return ""
    return f"; effective batch {batch * world} = {batch} per rank x {world} ranks"
