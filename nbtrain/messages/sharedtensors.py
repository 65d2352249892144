"""Pickling with tensor storages outside the pickle, so large tensors cost one memory copy.

Two ways across, one layout: storages are laid out back to back (64-byte aligned) and the
pickle refers to each by its offset in that layout.

- **Kernel -> ranks** (:func:`dumps_to_shared_memory` / :func:`loads`): storages are written
  once into an anonymous shared-memory file (``memfd_create``) whose descriptor travels beside the
  pickle over a Unix socket. Readers map it copy-on-write (MAP_PRIVATE), so N ranks share
  one physical copy of the kernel's data, yet a rank writing to its copy never changes
  another rank's (``mp.spawn`` shares storages outright, and every rank then steps the
  same weights).
- **Rank 0 -> kernel** (:func:`dumps_in_place` / :func:`read_from_process`): the storages
  stay where they are in rank 0, which waits; the kernel copies them straight out of its
  memory (``process_vm_readv``) into its own. That is one copy, where a shared file costs
  the writer its copy plus shared-memory page allocation, which on some machines is
  slower than the copy itself. Where reading another process is forbidden (a sandbox), rank
  0 writes the same layout into a shared-memory file instead (:meth:`InPlace.write_file`).
  ``NBTRAIN_RESULT_TRANSFER=file`` asks for that way too. The launcher releases the ranks
  only once the kernel has copied, all together, so their exits do not compete with the copy.

Nothing is ever named in /dev/shm, so a process killed at any moment leaves nothing behind.

Example:
    >>> import torch
    >>> data, fd = dumps_to_shared_memory({"w": torch.arange(4.0)})
    >>> loads(data, fd)["w"].tolist()
    [0.0, 1.0, 2.0, 3.0]
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import io
import mmap
import os
import pickle
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from nbtrain.messages import codepickle
from nbtrain.system import processes

_TAG = "nbtrain-storage"
_ALIGNMENT = 64
# Above this size the copy into shared memory uses every core: a rank normally runs with
# cores / ranks threads, but when rank 0 sends its result the other ranks are done.
_PARALLEL_COPY_BYTES = 64 << 20
# Reads from another process (and discards) go in pieces of at most this size, over threads.
_READ_PIECE_BYTES = 32 << 20
_MAX_THREADS = 8
Regions = tuple[tuple[int, int, int], ...]  # (address, bytes, offset in the layout) of each storage


class _StoragePickler(codepickle.Pickler):
    """cloudpickle, except that tensor storages become references into one storage layout.

    ``grads``: a parameter (or leaf tensor) carries its ``.grad`` across, which torch's own
    pickling drops: gradients a notebook accumulated before a cell (a backward in one cell,
    the step in the next) are in the ranks, as they are in the kernel for one process.
    """

    def __init__(self, file: io.BytesIO, *, grads: bool = False):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.storages: list[tuple[torch.UntypedStorage, int]] = []
        self.total_bytes = 0
        self._seen: dict[tuple[str, int, int], int] = {}
        self._grads = grads

    def reducer_override(self, obj: Any) -> Any:
        # cloudpickle pickles modules by reference only when their type is exactly
        # ModuleType; module subclasses such as ``torch.classes`` would fail by value.
        if isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType:
            return importlib.import_module, (obj.__name__,)
        if self._grads and type(obj) in _WITH_GRADS and obj.grad is not None:
            rebuild, args = obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)  # torch's own: (its rebuild, its arguments)
            return rebuilt_with_grad, (rebuild, args, obj.grad)
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


_WITH_GRADS = (torch.nn.Parameter, torch.Tensor)  # exactly these types: a subclass (DTensor) pickles its own way


def rebuilt_with_grad(rebuild: Any, args: tuple[Any, ...], grad: Any) -> Any:
    """A tensor torch's ``rebuild(*args)`` makes, its ``.grad`` set to ``grad`` (unpickling)."""
    tensor = rebuild(*args)
    tensor.grad = grad
    return tensor


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
            storage = torch.frombuffer(self._mapping, dtype=torch.uint8, count=nbytes, offset=offset).untyped_storage()
        target = self._map_location or "cpu"
        if device_type != "cpu" and target != "cpu":
            storage = storage.to(device=torch.device(target))
        return storage


def dumps_to_shared_memory(obj: Any) -> tuple[bytes, int | None]:
    """Pickle ``obj`` with cloudpickle; tensor storages go to a new shared-memory file, and a
    parameter's ``.grad`` goes with it (the kernel's gradients go into the ranks).

    Returns the pickle and the file's descriptor (None when ``obj`` holds no tensor).
    The caller owns the descriptor and must close it once it has been sent.
    """
    buffer = io.BytesIO()
    pickler = _StoragePickler(buffer, grads=True)
    pickler.dump(obj)
    fd = _write_storages(pickler.storages, pickler.total_bytes) if pickler.storages else None
    return buffer.getvalue(), fd


def loads(data: bytes, fd: int | None, *, map_location: str | None = None) -> Any:
    """Unpickle what :func:`dumps_to_shared_memory` made. Storages map the shared file copy-on-write.

    ``map_location``: where storages that came from a GPU go ("cpu" when None). The
    descriptor is not closed here; the mapping stays valid after the caller closes it.
    """
    mapping = None
    if fd is not None and os.fstat(fd).st_size > 0:
        mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    return loads_mapped(data, mapping, map_location=map_location)


def loads_mapped(data: bytes, mapping: mmap.mmap | None, *, map_location: str | None = None) -> Any:
    """Unpickle with storages taken from ``mapping``, which holds the storage layout.

    The tensors are views of ``mapping`` and keep it alive.
    """
    return _StorageUnpickler(io.BytesIO(data), mapping, map_location).load()


@dataclass
class InPlace:
    """A pickle whose storages stay in this process until a reader has copied them.

    ``regions``: (address in this process, nbytes, offset in the layout) per storage; empty
    when ``obj`` holds no tensor, and ``data`` is then a plain pickle.
    Keep this object alive until the reader is done: it holds the storages.
    """

    data: bytes
    regions: Regions
    total_bytes: int
    _storages: list[tuple[torch.UntypedStorage, int]] = field(repr=False, default_factory=list)

    def write_file(self) -> int:
        """The same layout in a new shared-memory file, for readers that cannot read us."""
        return _write_storages(self._storages, self.total_bytes)

    def discard_before_exit(self) -> None:
        """Give a large layout's pages back to the system on several cores at once.

        Only for a process that exits right after: the storages read as zeros from here on.
        An exiting process frees its memory on one core, ~0.1 s per GiB on a small VM, and
        the kernel waits for that; threads share the work out first.
        """
        if self.total_bytes < _PARALLEL_COPY_BYTES:
            return
        page = mmap.PAGESIZE
        pieces = []
        for address, nbytes, _ in self.regions:
            start, end = -(-address // page) * page, (address + nbytes) // page * page
            pieces += [(at, min(_READ_PIECE_BYTES, end - at)) for at in range(start, end, _READ_PIECE_BYTES)]
        with ThreadPoolExecutor(_thread_count(len(pieces)), thread_name_prefix="nbtrain-discard") as pool:
            list(pool.map(lambda piece: _discard_pages(*piece), pieces))


def dumps_in_place(obj: Any) -> InPlace:
    """Pickle ``obj`` with cloudpickle, leaving its tensor storages where they are.

    Storages on a GPU are copied to host memory first; a reader gets every storage from
    :func:`read_from_process` (or from :meth:`InPlace.write_file` where it cannot).
    """
    buffer = io.BytesIO()
    pickler = _StoragePickler(buffer)
    pickler.dump(obj)
    storages = [(s if s.device.type == "cpu" else s.cpu(), offset) for s, offset in pickler.storages]
    regions = tuple((s.data_ptr(), s.nbytes(), offset) for s, offset in storages)
    return InPlace(buffer.getvalue(), regions, pickler.total_bytes, storages)


def read_from_process(pid: int, regions: Regions, total_bytes: int) -> mmap.mmap:
    """Copy the storages :func:`dumps_in_place` left in process ``pid`` into a new mapping.

    The mapping is private anonymous memory of this process (in huge pages when free ones
    are at hand); large layouts are read by several threads at once. Raises OSError when ``pid``
    cannot be read (see :func:`nbtrain.system.processes.read_memory`).
    """
    mapping = private_memory(total_bytes)
    anchor = ctypes.c_char.from_buffer(mapping)
    base = ctypes.addressof(anchor)
    del anchor  # a live buffer export would keep the mapping from ever closing
    pieces = [
        (base + offset + start, address + start, min(_READ_PIECE_BYTES, nbytes - start))
        for address, nbytes, offset in regions
        for start in range(0, nbytes, _READ_PIECE_BYTES)
    ]
    threads = _thread_count(len(pieces))
    if total_bytes < _PARALLEL_COPY_BYTES or threads <= 1:
        for local, remote, nbytes in pieces:
            processes.read_memory(pid, local, remote, nbytes)
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="nbtrain-result-read") as pool:
            list(pool.map(lambda piece: processes.read_memory(pid, *piece), pieces))  # re-raises the first failure
    return mapping


def read_span_from_process(pid: int, regions: Regions, start: int, length: int, into: int) -> None:
    """Copy bytes ``[start, start + length)`` of the layout left in process ``pid`` to address ``into``.

    The cluster agent reads rank 0's result piece by piece into one small buffer. Bytes no
    storage covers (alignment padding) are left as they were. Raises OSError like
    :func:`read_from_process`.
    """
    end = start + length
    for address, nbytes, offset in regions:
        low, high = max(offset, start), min(offset + nbytes, end)
        if low < high:
            processes.read_memory(pid, into + low - start, address + low - offset, high - low)


def _thread_count(pieces: int) -> int:
    return max(1, min(pieces, _MAX_THREADS, len(os.sched_getaffinity(0))))


def _discard_pages(address: int, length: int) -> None:
    madvise = processes.libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))
    madvise(address, length, mmap.MADV_DONTNEED)  # a failure only means exit frees it instead


def private_memory(nbytes: int) -> mmap.mmap:
    """Fresh memory of this process for a layout arriving in pieces (what :func:`loads_mapped` reads),
    in transparent huge pages when that is cheap.

    Page faults are most of the cost of copying into fresh memory, and a 2 MiB page takes
    one fault where 4 KiB pages take 512: a fresh 1 GiB fills ~4x faster. But where Linux
    compacts memory on demand to find huge pages (the usual "madvise" defrag setting), a
    fault may stall instead; so huge pages are asked for only when free blocks of that
    size already cover twice the layout.
    """
    mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= _PARALLEL_COPY_BYTES and hasattr(mmap, "MADV_HUGEPAGE") and free_huge_page_bytes() >= 2 * nbytes:
        with contextlib.suppress(OSError):  # transparent huge pages switched off: normal pages
            mapping.madvise(mmap.MADV_HUGEPAGE)
    return mapping


def free_huge_page_bytes() -> int:
    """Bytes of free memory in blocks of at least one huge page (0 where unknown).

    Read from /proc/buddyinfo: per zone, the count of free blocks of each order.
    """
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            huge = int(f.read())
        with open("/proc/buddyinfo") as f:
            lines = f.read().splitlines()
    except (OSError, ValueError):
        return 0
    # "Node 0, zone Normal c0 c1 ...": counts of free blocks by order
    blocks = ((mmap.PAGESIZE << order, count) for line in lines for order, count in enumerate(line.split()[4:]))
    return sum(int(count) * block for block, count in blocks if block >= huge and count.isdigit())


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
    # Tensors cross processes on the CPU, as Fabric's do: a GPU's bytes are copied straight
    # into the shared file, with no host copy between (one copy instead of two).
    source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))
    target = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)
    target.copy_(source)
    del target  # release the buffer export, or the mapping cannot close
