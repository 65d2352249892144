"""Every rank saving one path writes it whole (a real kernel, 2 CPU ranks).

Code written for one device saves "the best model" by path and reads it back, saves its
predictions with ``np.save`` and its plot with ``savefig``; on the ranks the same line runs
on each at about the same time. Each rank here writes its own numbers, so a file of pieces
of both, or a torn one, shows.
"""

from __future__ import annotations

import os

import pytest
import torch

from kernel_helpers import nbtrain_kernel

pytestmark = pytest.mark.timeout(300)

SETUP = """
import os, torch, torch.nn as nn, torch.distributed as dist, nbtrain
net = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
"""

# Each round every rank fills the weights with its own number and saves the same path at once
# (a barrier first), then loads it back at once: a torn file fails to load, a mixed one holds both.
SAVE_AT_ONCE = """%%distributed --devices 2 --no-auto
torn, mixed = [], 0
for round_ in range(40):
    for layer in net:
        layer.weight.data.fill_(nbtrain.rank() + 1.0)
    dist.barrier()
    torch.save(net.state_dict(), {path!r})
    try:
        loaded = torch.load({path!r})
    except Exception as error:
        torn.append(str(error)[:80])
        continue
    mixed += len({{v for key, w in loaded.items() if key.endswith('weight') for v in w.unique().tolist()}}) > 1
print('torn', len(torn), torn[:1], 'mixed', mixed)
"""


# The same for numpy's and matplotlib's saves: arrays of each rank's own length and value,
# figures of each rank's own curve.
SAVE_ARRAYS_AND_FIGURES = """%%distributed --devices 2 --no-auto
import numpy as np, matplotlib
matplotlib.use("agg")
import matplotlib.pyplot as plt
bad_arrays, bad_figures = [], []
for round_ in range(40):
    values = np.full(100_000 * (nbtrain.rank() + 1), nbtrain.rank() + 1.0)
    dist.barrier()
    np.save({stem!r}, values)  # numpy adds .npy
    try:
        got = np.load({stem!r} + ".npy")
        if len(np.unique(got)) != 1 or len(got) != 100_000 * int(got[0]):
            bad_arrays.append("a mix of both ranks' arrays")
    except Exception as error:
        bad_arrays.append(str(error)[:80])
    figure = plt.figure()
    plt.plot(np.arange(500) * (nbtrain.rank() + 1))
    dist.barrier()
    plt.savefig({figure!r}, dpi=150)
    plt.close(figure)
    try:
        plt.imread({figure!r})
    except Exception as error:
        bad_figures.append(str(error)[:80])
print('arrays', len(bad_arrays), bad_arrays[:1], 'figures', len(bad_figures), bad_figures[:1])
"""


@pytest.fixture(scope="module")
def kernel():
    yield from nbtrain_kernel(SETUP)


def test_every_rank_saving_and_loading_one_path_at_once_reads_a_whole_file_of_one_rank(kernel, tmp_path):
    path = str(tmp_path / "best.pt")
    out = kernel.run_ok(SAVE_AT_ONCE.format(path=path))
    assert "[rank 0] torn 0 [] mixed 0" in out.stdout, out.stdout
    assert "[rank 1] torn 0 [] mixed 0" in out.stdout, out.stdout
    # The file the kernel finds is one rank's whole save, and no partial file is left beside it.
    weights = {v for key, w in torch.load(path).items() if key.endswith("weight") for v in w.unique().tolist()}
    assert weights in ({1.0}, {2.0})
    assert os.listdir(tmp_path) == ["best.pt"]


def test_the_saved_file_is_made_as_torch_makes_it_and_save_errors_read_as_torchs(kernel, tmp_path):
    kernel.run_ok(f"torch.save({{'x': 1}}, {str(tmp_path / 'kernel.pt')!r})")
    link = tmp_path / "latest.pt"
    link.symlink_to(tmp_path / "target.pt")
    missing = str(tmp_path / "no-such-dir" / "x.pt")
    out = kernel.run(
        "%%distributed --devices 2\n"
        f"torch.save({{'x': nbtrain.rank()}}, {str(tmp_path / 'ranks.pt')!r})\n"
        f"torch.save({{'x': 1}}, {str(link)!r})\n"
        "import io; buffer = io.BytesIO(); torch.save({'x': 1}, buffer)\n"
        "torch.save({'x': 1}, '/dev/null')  # written to, never replaced\n"
        "dist.barrier()  # every save above done: the failure below stops the other rank\n"
        f"torch.save({{'x': 1}}, {missing!r})\n"
    )
    # A missing directory fails as torch's own save fails there, naming the user's path.
    assert out.error is not None and out.error["ename"] == "RankError", out.text
    assert "Parent directory" in out.error["evalue"] and "no-such-dir" in out.error["evalue"], out.error
    mode = os.stat(tmp_path / "kernel.pt").st_mode
    assert os.stat(tmp_path / "ranks.pt").st_mode == mode  # the umask's permissions, not a temporary file's
    assert link.is_symlink() and torch.load(link) == {"x": 1}  # the link kept, the file it points to written
    assert sorted(os.listdir(tmp_path)) == ["kernel.pt", "latest.pt", "ranks.pt", "target.pt"]
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")


def test_a_partial_file_a_killed_rank_left_is_removed_by_the_next_save_of_the_path(kernel, tmp_path):
    """A rank stopped in the middle of a save dies before it can tidy up: its hidden partial
    file stays beside the intact checkpoint, until a save of that path clears it."""
    import socket
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()  # a process of this machine that no longer exists
    host = socket.gethostname().replace("-", "_")
    left = tmp_path / f".best.pt.{host}-{gone.pid}-0.nbtrain-partial"
    left.write_bytes(b"half a checkpoint")
    live = tmp_path / f".best.pt.{host}-{os.getpid()}-0.nbtrain-partial"  # a live process's: kept
    live.write_bytes(b"being written")
    kernel.run_ok(f"%%distributed --devices 2\ntorch.save({{'x': 1}}, {str(tmp_path / 'best.pt')!r})\n")
    assert sorted(os.listdir(tmp_path)) == sorted(["best.pt", live.name])


def test_numpy_arrays_and_figures_every_rank_saves_to_one_path_are_whole(kernel, tmp_path):
    stem, figure = str(tmp_path / "predictions"), str(tmp_path / "loss.png")
    out = kernel.run_ok(SAVE_ARRAYS_AND_FIGURES.format(stem=stem, figure=figure))
    assert "[rank 0] arrays 0 [] figures 0 []" in out.stdout, out.stdout
    assert "[rank 1] arrays 0 [] figures 0 []" in out.stdout, out.stdout
    assert sorted(os.listdir(tmp_path)) == ["loss.png", "predictions.npy"]  # no partial file left
    kernel.run_ok(f"np.save({str(tmp_path / 'kernel.npy')!r}, np.zeros(3))")
    assert os.stat(tmp_path / "predictions.npy").st_mode == os.stat(tmp_path / "kernel.npy").st_mode
