"""Learning-rate schedules against hand-worked values (hybridflow/training/schedules.py)."""

import math

import pytest
import torch

from hybridflow.config.schema import OptimConfig
from hybridflow.training.fsdp import build_optimizer
from hybridflow.training.schedules import lr_factor


def wsd(step, **kw):
    return lr_factor(step, schedule="wsd", **{"warmup_steps": 2, "total_steps": 10, "decay_steps": 4, **kw})


def test_wsd_by_hand():
    # warmup 2: (0+1)/2, (1+1)/2; stable until total - decay = 6; then (10 - step) / 4 down to 0
    assert [wsd(s) for s in range(12)] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    # to min_lr_ratio 0.2: 0.2 + 0.8 * (10 - step) / 4 -> step 8: 0.2 + 0.8 * 0.5 = 0.6
    assert wsd(8, min_lr_ratio=0.2) == pytest.approx(0.6)
    assert wsd(11, min_lr_ratio=0.2) == pytest.approx(0.2)


def test_constant_and_cosine_by_hand():
    assert [lr_factor(s, schedule="constant", warmup_steps=4, total_steps=10) for s in (0, 3, 4, 99)] == \
        [0.25, 1.0, 1.0, 1.0]
    # cosine, no warmup, total 10: step 5 is halfway: 0.1 + 0.9 * (1 + cos(pi/2)) / 2 = 0.55
    assert lr_factor(5, schedule="cosine", warmup_steps=0, total_steps=10, min_lr_ratio=0.1) == pytest.approx(0.55)
    assert lr_factor(10, schedule="cosine", warmup_steps=0, total_steps=10, min_lr_ratio=0.1) == pytest.approx(0.1)
    assert lr_factor(2, schedule="cosine", warmup_steps=0, total_steps=10) == \
        pytest.approx(0.5 * (1 + math.cos(math.pi * 0.2)))


def test_unknown_schedule_names_the_known_ones():
    with pytest.raises(ValueError, match="wsd"):
        lr_factor(0, schedule="linear", warmup_steps=0, total_steps=10)


def test_build_optimizer_follows_lr_factor():
    model = torch.nn.Linear(2, 2)
    optim = OptimConfig(lr=0.1, warmup_steps=2, lr_schedule="wsd", decay_steps=4)
    optimizer, scheduler = build_optimizer(model, optim, total_steps=10)
    seen = []
    for _ in range(11):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.1 * wsd(s) for s in range(11)])
