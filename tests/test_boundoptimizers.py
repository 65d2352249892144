"""Optimizers prepared on real ranks (nbtrain.rank.auto.boundoptimizers): bound to FSDP2's parameters and state."""

from __future__ import annotations

import torch
from torch import nn

import nbtrain
from helpers.procs import finish
from nbtrain.rank.auto import boundoptimizers


def test_fsdp_shards_parameters_and_rebinds_the_optimizer_with_its_state(launcher):
    def fn():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()  # state made before sharding must follow the parameters
        model, opt = nbtrain.prepare(model, opt)
        w = model[0].weight
        for _ in range(2):
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
        state = opt.state[opt.param_groups[0]["params"][0]]
        return {
            "param": type(w).__name__,
            "local": tuple(w.to_local().shape),
            "full": tuple(w.shape),
            "opt_params_are_model_params": all(
                any(p is q for q in model.parameters()) for p in opt.param_groups[0]["params"]
            ),
            "step": float(state["step"]),
            "exp_avg": type(state["exp_avg"]).__name__,
        }

    result = finish(nbtrain.start(fn, devices=2, strategy="fsdp"))
    assert result["param"] == "DTensor" and result["local"] == (4, 4) and result["full"] == (8, 4)
    assert result["opt_params_are_model_params"]
    assert result["step"] == 3.0 and result["exp_avg"] == "DTensor"


def test_ddp_sharded_makes_a_zero_redundancy_optimizer_of_the_same_class_and_settings(launcher):
    def fn():
        torch.manual_seed(0)
        model = nbtrain.prepare(nn.Linear(4, 2))
        opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
        sharded = boundoptimizers.prepare_optimizer(opt)
        model(torch.ones(2, 4)).sum().backward()
        sharded.step()
        return {
            "type": type(sharded).__name__,
            "inner": type(sharded.optim).__name__,
            "settings": (sharded.param_groups[0]["lr"], sharded.param_groups[0]["betas"]),
            "same_groups": sharded.param_groups is opt.param_groups,  # an LR scheduler's changes reach it
        }

    result = finish(nbtrain.start(fn, devices=2, strategy="ddp_sharded"))
    assert (result["type"], result["inner"]) == ("ZeroRedundancyOptimizer", "Adam")
    assert result["settings"] == (0.01, (0.8, 0.9)) and result["same_groups"]
