"""tqdm.notebook's bars on the ranks (nbtrain.rank.machinery.progressbars): text lines in a real kernel's cell."""

from __future__ import annotations

import pytest

from kernel_helpers import NotebookKernel

pytestmark = pytest.mark.timeout(240)


def test_a_notebook_progress_bar_on_two_ranks_prints_as_text_and_the_kernel_keeps_its_own_class():
    pytest.importorskip("tqdm")
    pytest.importorskip("ipywidgets")
    with NotebookKernel() as kernel:
        kernel.run_ok("%load_ext nbtrain\nfrom tqdm.notebook import tqdm\nnotebook_bar = tqdm")
        cell = (
            "%%distributed --devices 2 --accelerator cpu\n"
            "from tqdm.notebook import tqdm, tnrange\n"
            "for _ in tqdm(range(30), desc='epoch', display=False):\n"
            "    pass\n"
            "for _ in tnrange(4, desc='eval'):\n"
            "    pass\n"
        )
        err = kernel.run_ok(cell).stderr
        for rank in (0, 1):
            assert f"[rank {rank}] epoch: 100%" in err and "30/30" in err, err
            assert f"[rank {rank}] eval: 100%" in err, err
        assert kernel.value("tqdm is notebook_bar and tqdm.__module__ == 'tqdm.notebook'")  # bound by the cell
        again = kernel.run_ok(cell).stderr  # standby ranks, which imported tqdm.notebook ahead
        assert "[rank 1] eval: 100%" in again and "[rank 0] epoch: 100%" in again, again
