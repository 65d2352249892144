"""--sync-batchnorm on a rank (nbtrain.rank.auto.syncbn): BatchNorm statistics over every rank's batch.

Real ranks (CPU, gloo, 2 processes) through ``nbtrain.start``; the flag through a real
kernel is tested in test_training_options.py.
"""

from __future__ import annotations

import pytest
import torch

import nbtrain
from helpers.procs import finish
from nbtrain.rank.auto import syncbn

pytestmark = pytest.mark.timeout(240)



def test_sync_batchnorm_keeps_parameters_and_state_keys():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2))
    weight, keys = model[1].weight, list(model.state_dict())
    syncbn.convert(model, "cpu")
    assert type(model[1]).__name__ == "SyncBatchNorm" and model[1].weight is weight
    assert list(model.state_dict()) == keys



def test_sync_batchnorm_matches_one_process_with_the_combined_batch(launcher):
    """2 ranks x 8 samples with synced BatchNorm step exactly as one process with 16."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 1))
    x, y = torch.randn(16, 4) * 3 + 1, torch.randn(16, 1)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 1))
    reference.load_state_dict(model.state_dict())

    def fn(model, x, y):
        net = nbtrain.prepare(model)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        share = slice(nbtrain.rank() * 8, (nbtrain.rank() + 1) * 8)
        torch.nn.functional.mse_loss(net(x[share]), y[share]).backward()
        opt.step()
        return {k: v.clone() for k, v in model.state_dict().items()}

    state = finish(nbtrain.start(fn, (model, x, y), devices=2, accelerator="cpu", sync_batchnorm=True))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.nn.functional.mse_loss(reference(x), y).backward()
    ref_opt.step()
    for key, value in reference.state_dict().items():
        assert torch.allclose(state[key].double(), value.double(), atol=1e-5), key
