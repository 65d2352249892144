"""nbtrain.messages.sharedtensors in one process: what a rank gets when it loads the kernel's objects."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest
import torch

from helpers import procs
from nbtrain.messages import sharedtensors


@pytest.fixture
def shm_unchanged():
    before = procs.shm_entries()
    yield
    assert procs.shm_entries() == before, "sharedtensors created a /dev/shm entry"


@pytest.fixture(params=["file", "read"])
def roundtrip(request):
    """Both ways tensors travel: a shared-memory file, and a read of the sender's memory."""
    return lambda obj: procs.roundtrip(obj, request.param)


def test_tensors_travel_in_an_anonymous_memfd(shm_unchanged):
    data, fd = sharedtensors.dumps_to_shared_memory({"w": torch.arange(1000.0)})
    try:
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:nbtrain-tensors")
        assert len(data) < 1000, "the storage went into the pickle instead of the memfd"
        assert torch.equal(sharedtensors.loads(data, fd)["w"], torch.arange(1000.0))
    finally:
        os.close(fd)


def test_no_tensor_means_no_file(shm_unchanged):
    data, fd = sharedtensors.dumps_to_shared_memory({"a": [1, 2], "f": lambda x: x + 1})
    assert fd is None
    loaded = sharedtensors.loads(data, None)
    assert loaded["a"] == [1, 2] and loaded["f"](1) == 2


def test_views_stay_views_of_one_storage(shm_unchanged, roundtrip):
    base = torch.arange(20.0)
    obj = {"base": base, "slice": base[2:7], "strided": base[::3], "matrix": base.view(4, 5).t()}
    out = roundtrip(obj)
    for name, tensor in obj.items():
        assert torch.equal(out[name], tensor), name
        assert out[name].storage_offset() == tensor.storage_offset(), name
        assert out[name].stride() == tensor.stride(), name
        assert out[name].untyped_storage().data_ptr() == out["base"].untyped_storage().data_ptr(), name
    out["base"][3] = -1.0  # one storage: every view sees the write
    assert out["slice"][1] == -1.0 and out["strided"][1] == -1.0 and out["matrix"][3, 0] == -1.0
    assert base[3] == 3.0, "the original changed"


def test_parameters_keep_requires_grad(shm_unchanged, roundtrip):
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    out = roundtrip({"model": model, "frozen": frozen, "plain": torch.zeros(2)})
    assert isinstance(out["model"].weight, torch.nn.Parameter) and out["model"].weight.requires_grad
    assert isinstance(out["model"].bias, torch.nn.Parameter) and not out["model"].bias.requires_grad
    assert isinstance(out["frozen"], torch.nn.Parameter) and not out["frozen"].requires_grad
    assert not isinstance(out["plain"], torch.nn.Parameter)
    assert torch.equal(out["model"].weight, model.weight)
    out["model"](torch.ones(1, 3)).sum().backward()  # trains like the original
    assert out["model"].weight.grad is not None


def test_gradients_go_to_the_ranks_and_come_back_only_by_their_own_way(shm_unchanged):
    """Kernel -> ranks: a parameter's (and a leaf tensor's) ``.grad`` travels with it, tied weights
    still one parameter; rank 0 -> kernel sends gradients apart (nbtrain.rank.cell), so its pickle has none."""
    model = torch.nn.Linear(3, 2)
    model(torch.ones(4, 3)).sum().backward()
    leaf = torch.zeros(2, requires_grad=True)
    (leaf * 3).sum().backward()
    data, fd = sharedtensors.dumps_to_shared_memory({"model": model, "leaf": leaf, "tied": [model.weight]})
    try:
        out = sharedtensors.loads(data, fd)
    finally:
        os.close(fd)
    assert torch.equal(out["model"].weight.grad, model.weight.grad) and torch.equal(out["leaf"].grad, leaf.grad)
    assert out["tied"][0] is out["model"].weight and isinstance(out["model"].weight, torch.nn.Parameter)
    out["model"].weight.grad.add_(1.0)  # the rank's gradients are its own copy
    assert torch.equal(model.weight.grad, torch.full((2, 3), 4.0))
    back = procs.roundtrip({"model": model}, "read")
    assert back["model"].weight.grad is None


def test_each_load_is_a_private_copy_on_write_copy(shm_unchanged):
    """Two ranks load the same file: one writing to its tensor never changes the other's."""
    original = torch.arange(4096.0)
    data, fd = sharedtensors.dumps_to_shared_memory({"w": original})
    try:
        first = sharedtensors.loads(data, fd)["w"]
        second = sharedtensors.loads(data, fd)["w"]
        first.mul_(-1)
        first[0] = 99.0
        assert torch.equal(second, original), "a write reached another loader's copy"
        assert torch.equal(sharedtensors.loads(data, fd)["w"], original), "a write reached the file"
        assert first.data_ptr() != second.data_ptr()
    finally:
        os.close(fd)
    assert torch.equal(original, torch.arange(4096.0))


def test_loaded_tensors_outlive_the_descriptor(shm_unchanged):
    data, fd = sharedtensors.dumps_to_shared_memory(torch.arange(10, dtype=torch.int64))
    loaded = sharedtensors.loads(data, fd)
    os.close(fd)
    assert loaded.tolist() == list(range(10))
    loaded += 1
    assert loaded.tolist() == list(range(1, 11))


def test_empty_tensors(shm_unchanged, roundtrip):
    obj = {"empty": torch.empty(0), "rows": torch.zeros(0, 3), "ints": torch.tensor([], dtype=torch.int64)}
    out = roundtrip(obj)
    for name, tensor in obj.items():
        assert out[name].shape == tensor.shape and out[name].dtype == tensor.dtype, name
    mixed = roundtrip({"empty": torch.empty(0), "full": torch.arange(5.0)})
    assert mixed["empty"].numel() == 0 and mixed["full"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(7, dtype=torch.int8),
        torch.tensor([True, False, True]),
        torch.arange(6, dtype=torch.float16).reshape(2, 3),
        torch.arange(5, dtype=torch.bfloat16),
        torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64),
        torch.tensor(3.5, dtype=torch.float64),  # 0-d
    ],
    ids=lambda t: str(t.dtype),
)
def test_dtypes_and_shapes_round_trip(shm_unchanged, roundtrip, tensor):
    out = roundtrip({"t": tensor})["t"]
    assert out.dtype == tensor.dtype and out.shape == tensor.shape and torch.equal(out, tensor)


def test_storages_are_aligned_in_the_file(shm_unchanged, roundtrip):
    parts = [torch.ones(n, dtype=torch.uint8) for n in (1, 3, 65, 7)]
    out = roundtrip(parts)
    for tensor, expected in zip(out, parts, strict=False):
        assert tensor.data_ptr() % 64 == 0
        assert torch.equal(tensor, expected)


def test_a_state_dict_with_shared_weights_keeps_them_shared(shm_unchanged, roundtrip):
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied
    out = roundtrip(model)
    assert out[1].weight is out[0].weight
    assert torch.equal(out[0].weight, model[0].weight)


def test_a_large_layout_is_read_in_pieces_by_several_threads(shm_unchanged):
    big = {"a": torch.arange(40 << 20, dtype=torch.int32), "b": torch.arange(3.0), "c": torch.ones(9 << 20)}
    out = procs.roundtrip(big, "read")
    for name, tensor in big.items():
        assert torch.equal(out[name], tensor), name


@pytest.mark.parametrize("piece", [1000, 64, 1 << 20])
def test_a_layout_read_in_spans_that_split_storages_loads_whole(shm_unchanged, piece):
    """The cluster agent's way: pieces of any size, cutting storages and padding anywhere."""
    obj = {"a": torch.arange(1000, dtype=torch.int32), "b": torch.arange(3.0), "c": torch.ones(77, dtype=torch.uint8)}
    pickled = sharedtensors.dumps_in_place(obj)
    mapping = sharedtensors.private_memory(pickled.total_bytes)
    buffer = ctypes.create_string_buffer(piece)
    for start in range(0, pickled.total_bytes, piece):
        length = min(piece, pickled.total_bytes - start)
        sharedtensors.read_span_from_process(os.getpid(), pickled.regions, start, length, ctypes.addressof(buffer))
        mapping[start : start + length] = buffer.raw[:length]
    out = sharedtensors.loads_mapped(pickled.data, mapping)
    for name, tensor in obj.items():
        assert torch.equal(out[name], tensor), name


def test_reading_a_process_that_is_gone_raises_oserror(shm_unchanged):
    pickled = sharedtensors.dumps_in_place({"w": torch.arange(10.0)})
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)
    with pytest.raises(OSError):
        sharedtensors.read_from_process(child.pid, pickled.regions, pickled.total_bytes)
