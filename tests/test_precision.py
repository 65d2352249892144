"""Precision on a rank (nbtrain.rank.auto.precision): true precisions cast, mixed ones autocast, 16-mixed scales.

Real ranks (CPU, gloo, 2 processes) through ``nbtrain.start`` where a run is needed; the
flag through a real kernel is tested in test_training_options.py.
"""

from __future__ import annotations

import pytest
import torch

import nbtrain
from helpers.procs import finish
from nbtrain.rank.auto import precision

pytestmark = pytest.mark.timeout(240)



def test_true_precision_casts_inputs_and_gives_float32_outputs():
    model = precision.apply(torch.nn.Linear(3, 2), "bf16-true", torch.device("cpu"))
    out = model(torch.randn(4, 3))
    assert model.weight.dtype == torch.bfloat16 and out.dtype == torch.float32


def test_mixed_precision_runs_forward_under_autocast_and_keeps_weights():
    model = precision.apply(torch.nn.Linear(3, 2), "bf16-mixed", torch.device("cpu"))
    out = model(torch.randn(4, 3))
    assert model.weight.dtype == torch.float32 and out.dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")  # left after the forward


def test_loss_scaling_unscales_every_optimizer_and_skips_an_overflowed_step(launcher):
    """The 16-mixed mechanism on CPU's GradScaler, on real ranks (it patches the rank's torch).

    The optimizers are built after the scaling is installed and never handed to it (as in
    a cell that builds its optimizer after ``prepare``); one is a ZeroRedundancyOptimizer,
    whose own step runs an inner optimizer's. Each matches an unscaled reference; a step
    with an infinite loss leaves the weights as they were and halves the scale.
    """

    def fn():
        from torch.distributed.optim import ZeroRedundancyOptimizer

        from nbtrain.rank.auto import precision as rank_precision

        torch.manual_seed(0)
        x, models = torch.randn(8, 3), [torch.nn.Linear(3, 1) for _ in range(3)]
        for copy in models[1:]:
            copy.load_state_dict(models[0].state_dict())

        def train(model, opt):
            for _ in range(3):
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()

        train(models[2], torch.optim.Adam(models[2].parameters(), lr=0.1))  # the reference, before scaling
        scaling = rank_precision.scale_losses("cpu")
        adam = torch.optim.Adam(models[0].parameters(), lr=0.1)
        train(models[0], adam)
        train(models[1], ZeroRedundancyOptimizer(models[1].parameters(), optimizer_class=torch.optim.Adam, lr=0.1))
        matches = [torch.allclose(m.weight, models[2].weight, atol=1e-6) for m in models[:2]]
        before, scale = models[0].weight.detach().clone(), scaling.scaler.get_scale()
        adam.zero_grad()
        (models[0](x).pow(2).mean() * float("inf")).backward()
        adam.step()
        return matches, torch.equal(before, models[0].weight), scaling.skipped_steps, scaling.scaler.get_scale() / scale

    matches, unchanged, skipped, scale_ratio = finish(nbtrain.start(fn, devices=2, accelerator="cpu"))
    assert matches == [True, True] and unchanged and skipped == 1 and scale_ratio == 0.5



def _train_losses(precision_name: str) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    x, y = torch.randn(256, 16), torch.randn(256, 1)

    def fn(model, x, y):
        net = nbtrain.prepare(model)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        share = slice(nbtrain.rank() * 128, (nbtrain.rank() + 1) * 128)
        losses = []
        for _ in range(40):
            loss = torch.nn.functional.mse_loss(net(x[share]).float(), y[share])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    return finish(nbtrain.start(fn, (model, x, y), devices=2, accelerator="cpu", precision=precision_name))


def test_bf16_mixed_tracks_32_true(launcher):
    """bf16 autocast keeps 8 bits of mantissa: each step's loss within 3% of fp32's, same descent."""
    full, mixed = _train_losses("32-true"), _train_losses("bf16-mixed")
    assert mixed[-1] < 0.9 * mixed[0]
    worst = max(abs(a - b) / a for a, b in zip(full, mixed, strict=True))
    assert worst < 0.03, f"bf16-mixed loss strayed {worst:.1%} from 32-true's"
