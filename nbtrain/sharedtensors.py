"""Pickling with tensor storages in shared memory instead of inside the pickle.

Both directions use it: the kernel's objects on their way to the ranks, and rank 0's
result on its way back. Storages are written once into an anonymous shared-memory file
(``memfd_create``) whose descriptor travels beside the pickle over a Unix socket. Why:

- a 1 GB state_dict costs one memory copy, not a pickle, a pipe and an unpickle;
- nothing is ever named in /dev/shm, so a process killed at any moment leaves nothing
  behind: the memory is freed when the last descriptor and mapping go away;
- readers map the file copy-on-write (MAP_PRIVATE), so N ranks share one physical copy
  of the kernel's data, yet a rank writing to its copy never changes another rank's
  (``mp.spawn`` shares storages outright, and every rank then steps the same weights).

Example:
    >>> import torch
    >>> data, fd = dumps({"w": torch.arange(4.0)})
    >>> loads(data, fd)["w"].tolist()
    [0.0, 1.0, 2.0, 3.0]
"""

from __future__ import annotations

import importlib
import io
import mmap
import os
import pickle
import types
from typing import Any

import cloudpickle
import torch

_TAG = "nbtrain-storage"
_ALIGNMENT = 64
# Above this size the copy into shared memory uses every core: a rank normally runs with
# cores / ranks threads, but when rank 0 sends its result the other ranks are done.
_PARALLEL_COPY_BYTES = 64 << 20


class _StoragePickler(cloudpickle.Pickler):
    """cloudpickle, except that tensor storages become references into one shared file."""

    def __init__(self, file: io.BytesIO):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.storages: list[tuple[torch.UntypedStorage, int]] = []
        self.total_bytes = 0
        self._seen: dict[tuple[str, int, int], int] = {}

    def reducer_override(self, obj: Any) -> Any:
        # cloudpickle pickles modules by reference only when their type is exactly
        # ModuleType; module subclasses such as ``torch.classes`` would fail by value.
        if isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType:
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.storage.TypedStorage):
            untyped, dtype = obj._untyped_storage, obj.dtype
        elif isinstance(obj, torch.UntypedStorage):
            untyped, dtype = obj, None
        else:
            return None
        if untyped.device.type == "meta":
            return None  # nothing to copy; torch pickles meta storages by shape alone
        key = (str(untyped.device), untyped.data_ptr(), untyped.nbytes())
        if key not in self._seen:  # views of one storage stay views after the trip
            self._seen[key] = len(self.storages)
            self.storages.append((untyped, self.total_bytes))
            self.total_bytes += -(-untyped.nbytes() // _ALIGNMENT) * _ALIGNMENT
        index = self._seen[key]
        _, offset = self.storages[index]
        return (_TAG, index, offset, untyped.nbytes(), dtype, untyped.device.type)


class _StorageUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, mapping: mmap.mmap | None, map_location: str | None):
        super().__init__(file)
        self._mapping = mapping
        self._map_location = map_location
        self._loaded: dict[int, torch.UntypedStorage] = {}

    def persistent_load(self, pid: Any) -> Any:
        tag, index, offset, nbytes, dtype, device_type = pid
        if tag != _TAG:  # pragma: no cover - only our own pickles reach here
            raise pickle.UnpicklingError(f"unknown persistent id {tag!r}")
        if index not in self._loaded:
            self._loaded[index] = self._storage_at(offset, nbytes, device_type)
        untyped = self._loaded[index]
        if dtype is None:
            return untyped
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)

    def _storage_at(self, offset: int, nbytes: int, device_type: str) -> torch.UntypedStorage:
        if nbytes == 0 or self._mapping is None:
            storage = torch.UntypedStorage(nbytes)
        else:
            # The storage holds a reference to the mapping: it lives as long as any tensor.
            storage = torch.frombuffer(
                self._mapping, dtype=torch.uint8, count=nbytes, offset=offset
            ).untyped_storage()
        target = self._map_location or "cpu"
        if device_type != "cpu" and target != "cpu":
            storage = storage.to(device=torch.device(target))
        return storage


def dumps(obj: Any) -> tuple[bytes, int | None]:
    """Pickle ``obj`` with cloudpickle; tensor storages go to a new shared-memory file.

    Returns the pickle and the file's descriptor (None when ``obj`` holds no tensor).
    The caller owns the descriptor and must close it once it has been sent.
    """
    buffer = io.BytesIO()
    pickler = _StoragePickler(buffer)
    pickler.dump(obj)
    fd = _write_storages(pickler.storages, pickler.total_bytes) if pickler.storages else None
    return buffer.getvalue(), fd


def loads(data: bytes, fd: int | None, *, map_location: str | None = None) -> Any:
    """Unpickle what :func:`dumps` made. Storages map the shared file copy-on-write.

    ``map_location``: where storages that came from a GPU go ("cpu" when None). The
    descriptor is not closed here; the mapping stays valid after the caller closes it.
    """
    mapping = None
    if fd is not None and os.fstat(fd).st_size > 0:
        mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    return _StorageUnpickler(io.BytesIO(data), mapping, map_location).load()


def _write_storages(storages: list[tuple[torch.UntypedStorage, int]], total_bytes: int) -> int:
    fd = os.memfd_create("nbtrain-tensors", os.MFD_CLOEXEC)
    threads = torch.get_num_threads()
    try:
        if total_bytes >= _PARALLEL_COPY_BYTES:
            torch.set_num_threads(max(threads, len(os.sched_getaffinity(0))))
        os.ftruncate(fd, max(total_bytes, 1))
        with mmap.mmap(fd, max(total_bytes, 1), access=mmap.ACCESS_WRITE) as mapping:
            for storage, offset in storages:
                _copy_storage(storage, mapping, offset)
    except BaseException:
        os.close(fd)
        raise
    finally:
        torch.set_num_threads(threads)
    return fd


def _copy_storage(storage: torch.UntypedStorage, mapping: mmap.mmap, offset: int) -> None:
    nbytes = storage.nbytes()
    if nbytes == 0:
        return
    if storage.device.type != "cpu":
        storage = storage.cpu()  # results cross processes on the CPU, as Fabric does
    source = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))
    target = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)
    target.copy_(source)
    del target  # release the buffer export, or the mapping cannot close
