#!/usr/bin/env python
"""How a payload's GPU tensors reach a rank's GPU: the engine's way against others, one fresh process each.

A kernel's CUDA model and optimizer travel to a rank through a shared-memory file
(``nbtrain.messages.sharedtensors``): the kernel copies each storage from its GPU into the file, the
rank maps the file and copies each storage to its GPU as it unpickles. On an H200 the
rank's side took 0.18-0.23 s for a ResNet-18 and its momentum (~90 MB), where ``model.cuda()``
of the same model takes ~0.01 s; this takes that apart. Each way is one fresh process that
creates its CUDA context and runs one matmul first (as a standby rank has), builds the model
on the GPU, takes one SGD step (the momentum buffers), pickles both as a kernel does, then
loads the pickle its way and checks every tensor against the original:

- ``engine``: ``sharedtensors.loads(..., map_location="cuda")``, storage by storage;
- ``prefaulted``: the same, the file's pages touched first (are page faults the cost?);
- ``anonymous``: the same, the file's bytes copied into this process' own memory first
  (is a shared file's memory slow to copy from?);
- ``pinned``: each storage through one page-locked buffer, copied without waiting;
- ``registered``: the mapping page-locked in place (``cudaHostRegister``), copies without waiting;
- ``one copy``: the whole layout in one copy, then each storage copied on the GPU;
- ``model.cuda()``: the same tensors, from ordinary memory, as ``.cuda()`` copies them;
- ``cuda ipc``: no host copy at all: the "kernel" passes CUDA IPC handles of its storages
  (``torch.multiprocessing``'s own reduction) to a second fresh process, which opens them and
  copies each on the GPU (a rank on the kernel's own GPU could; "kernel pickled" is then the
  handles' making).

Run from the repository root on a machine with a CUDA GPU (``bash .ci/gpu`` runs it); ``--cpu``
runs the ways that need no GPU with CPU copies, to check the script itself. The ``engine`` way also
times a re-run's kernel side: pickling again into a new file, against writing over the last
file's pages (mapped anew, then kept mapped): what a kept payload file would save::

    python3 benchmarks/gpu_payload.py          # about 30 s
    python3 benchmarks/gpu_payload.py --cpu
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = r"""
import io, json, mmap, os, sys, time
import torch
from nbtrain.messages import sharedtensors
way, device = sys.argv[1], sys.argv[2]
cuda = device == "cuda"

def sync():
    if cuda:
        torch.cuda.synchronize()

if cuda:  # what a standby rank has done before a payload arrives
    torch.zeros(1, device=device).add_(1); (torch.ones(64, 64, device=device) @ torch.ones(64, 64, device=device))
sync()
try:
    import torchvision
    model = torchvision.models.resnet18(num_classes=10)
except ImportError:
    model = torch.nn.Sequential(*[torch.nn.Conv2d(64, 64, 3, 1, 1) for _ in range(12)])
model = model.to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
for p in model.parameters():
    p.grad = torch.ones_like(p)
opt.step()
tensors = [p.detach() for p in model.parameters()] + [opt.state[p]["momentum_buffer"] for p in model.parameters()]
sums = [t.double().sum().item() for t in tensors]
if way == "cuda ipc":  # the process that opens the handles: one of its own, as a rank is
    import pickle, subprocess
    from torch.multiprocessing.reductions import reduce_tensor
    opener = subprocess.Popen([sys.executable, "-c", sys.argv[3]], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    sync(); t0 = time.perf_counter()
    handles = [reduce_tensor(t)[1] for t in tensors]
    pickled = time.perf_counter() - t0
    out, _ = opener.communicate(pickle.dumps((handles, sums)), timeout=50)
    figures = json.loads(out.decode().strip().splitlines()[-1])
    print(json.dumps({**figures, "pickled": pickled, "megabytes": sum(t.nbytes for t in tensors) / 2**20,
                      "storages": len(tensors)}))
    raise SystemExit(0)
sync(); t0 = time.perf_counter()
data, fd = sharedtensors.dumps_to_shared_memory(tensors)
sync(); pickled = time.perf_counter() - t0
size = os.fstat(fd).st_size
kernel_side = {}
if way == "engine":  # a re-run's kernel side: a new file again, against the last file's pages written over
    sync(); t0 = time.perf_counter()
    again, again_fd = sharedtensors.dumps_to_shared_memory(tensors)
    sync(); kernel_side["again"] = time.perf_counter() - t0
    kept = mmap.mmap(again_fd, 0, access=mmap.ACCESS_WRITE)
    for attempt in ("mapped", "kept"):  # the first maps the file's pages into this process; the second finds them
        sync(); t0 = time.perf_counter()
        pickler = sharedtensors._StoragePickler(io.BytesIO(), grads=True)
        pickler.dump(tensors)
        for storage, offset in pickler.storages:
            sharedtensors._copy_storage(storage, kept, offset)
        sync(); kernel_side[attempt] = time.perf_counter() - t0
    kept.close(); os.close(again_fd)
mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
keep = []  # staging buffers, alive until the copies are done


class Unpickler(sharedtensors._StorageUnpickler):
    def _storage_at(self, offset, nbytes, device_type):
        source = torch.frombuffer(self._mapping, dtype=torch.uint8, count=nbytes, offset=offset)
        if way == "pinned":
            staged = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).copy_(source)
            keep.append(staged)
            return staged.to(device, non_blocking=True).untyped_storage()
        if way == "registered":
            return source.to(device, non_blocking=True).untyped_storage()
        return whole[offset:offset + nbytes].clone().untyped_storage()  # "one copy"


before = 0.0
t0 = time.perf_counter()
if way == "prefaulted":
    view = memoryview(mapping)
    sum(view[i] for i in range(0, size, mmap.PAGESIZE)); del view
elif way == "anonymous":
    own = mmap.mmap(-1, size); own.write(mapping); mapping = own
elif way == "model.cuda()":
    plain = [t.to("cpu", copy=True) for t in tensors]
before = time.perf_counter() - t0
t0 = time.perf_counter()
if way in ("engine", "prefaulted", "anonymous"):
    loaded = sharedtensors.loads_mapped(data, mapping, map_location=device)
elif way == "model.cuda()":
    loaded = [t.to(device, copy=True) for t in plain]
else:
    if way == "registered":
        base = torch.frombuffer(mapping, dtype=torch.uint8)
        assert torch.cuda.cudart().cudaHostRegister(base.data_ptr(), size, 0) == 0, "cudaHostRegister failed"
    if way == "one copy":
        whole = torch.frombuffer(mapping, dtype=torch.uint8).to(device)
    loaded = Unpickler(io.BytesIO(data), mapping, device).load()
sync()
load = time.perf_counter() - t0
if way == "registered":
    torch.cuda.cudart().cudaHostUnregister(base.data_ptr())
assert all(t.device.type == device for t in loaded), [t.device for t in loaded]
assert [t.double().sum().item() for t in loaded] == sums, "a tensor changed on its way"
print(json.dumps({"pickled": pickled, "before": before, "load": load, "megabytes": size / 2**20,
                  "storages": len(tensors), **kernel_side}))
"""

# "cuda ipc": the second process, warmed as a standby rank is before the handles arrive.
OPENER = r"""
import json, pickle, sys, time
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor
torch.zeros(1, device="cuda").add_(1); (torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda"))
torch.cuda.synchronize()
handles, sums = pickle.loads(sys.stdin.buffer.read())
t0 = time.perf_counter()
opened = [rebuild_cuda_tensor(*handle) for handle in handles]
torch.cuda.synchronize(); mid = time.perf_counter()
loaded = [t.clone() for t in opened]
torch.cuda.synchronize(); load = time.perf_counter() - t0
assert [t.double().sum().item() for t in loaded] == sums, "a tensor changed on its way"
print(json.dumps({"load": load, "before": 0.0, "opened": mid - t0}))
"""

WAYS = ("engine", "prefaulted", "anonymous", "pinned", "registered", "one copy", "model.cuda()", "cuda ipc")
GPU_ONLY = ("pinned", "registered", "cuda ipc")


def probe(way: str, device: str) -> dict[str, float] | str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-c", PROBE, way, device, OPENER]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, check=False)
    if done.returncode != 0:
        return done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="CPU copies only: check the script without a GPU")
    device = "cpu" if parser.parse_args().cpu else "cuda"
    print(f"{'way':14} {'load':>7} {'before it':>9} {'kernel pickled':>14}  (s; one process each)", flush=True)
    for way in WAYS:
        if device == "cpu" and way in GPU_ONLY:
            continue
        run = probe(way, device)
        if isinstance(run, str):
            print(f"{way:14} failed: {run[-300:]}", flush=True)
            continue
        print(f"{way:14} {run['load']:7.3f} {run['before']:9.3f} {run['pickled']:14.3f}"
              f"  ({run['megabytes']:.0f} MB in {run['storages']:.0f} tensors"
              + (f"; the handles opened in {run['opened']:.3f} s" if "opened" in run else "") + ")", flush=True)
        if "again" in run:  # a re-run's kernel side, where a new file's pages are most of the cost
            print(f"{'':14} kernel pickled again: a new file {run['again']:.3f} s; into the last file "
                  f"{run['mapped']:.3f} s, kept mapped {run['kept']:.3f} s", flush=True)


if __name__ == "__main__":
    main()
