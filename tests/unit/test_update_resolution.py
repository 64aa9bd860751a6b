"""hybridflow.training.resolution (the share of weights an update moves in a 16-bit copy) and
hybridflow.training.loss_scale (float16's dynamic loss scaling)."""

import math

import pytest
import torch

from hybridflow.training.loss_scale import INITIAL_SCALE, LossScale, clipped_step
from hybridflow.training.resolution import MovedFraction, moved_mask, stalled_note


def test_moved_mask_by_hand():
    # 1.0 in bfloat16 has an ulp of 2**-7 = 0.0078125 (half: 0.0039): 1.0 + 1e-5 rounds back to 1.0,
    # 1.0 + 0.005 rounds up to 1.0078125; float16's ulp at 1.0 is 2**-10 (half 0.00049), float32's 2**-23
    before = torch.tensor([1.0, 1.0, 1.0, 0.0])
    after = torch.tensor([1.0 + 1e-5, 1.0 + 0.005, 1.0 + 6e-4, 1e-5])
    # 1.005 and the 0 -> 1e-5 (bfloat16 holds 1e-5 itself); 1 + 6e-4 is past float16's half ulp
    assert moved_mask(before, after, torch.bfloat16).tolist() == [False, True, False, True]
    assert moved_mask(before, after, torch.float16).tolist() == [False, True, True, True]
    assert moved_mask(before, after, torch.float32).all()


def test_moved_fraction_sees_an_update_below_the_resolution():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4096) * 0.05)
    watch = MovedFraction([w], {"engine": torch.bfloat16, "actor": torch.float32})
    watch.before()
    with torch.no_grad():
        w.add_(1e-7)  # far below half a bfloat16 ulp of |w| ~ 0.05 (~1e-4); float32 sees it
    counts = watch.after()
    assert counts["actor"][0] / counts["actor"][1] > 0.95
    assert counts["engine"][0] / counts["engine"][1] < 0.01
    with pytest.raises(RuntimeError, match="before"):
        watch.after()


def test_stalled_note_names_the_copy_and_the_fix():
    dtypes = {"actor": "float32", "engine": "bfloat16"}
    assert stalled_note({"master": 1.0, "actor": 1.0, "engine": 0.5}, dtypes, 1e-5, 0.25) is None
    note = stalled_note({"master": 1.0, "actor": 1.0, "engine": 0.04}, dtypes, 1e-5, 0.25)
    assert "4.0% of the engine's bfloat16 weights" in note and "model.dtype=float16" in note
    assert "trainer.warn_moved_fraction=0.25" in note and "actor's" not in note
    # a step that moved nothing (every advantage 0: no gradient) has nothing rounded away: no line
    assert stalled_note({"master": 0.0, "actor": 0.0, "engine": 0.0}, dtypes, 1e-5, 0.25) is None
    # against what the master moved: half the master moved, the copy all of that half
    assert stalled_note({"master": 0.5, "actor": 0.5, "engine": 0.5}, dtypes, 1e-5, 0.25) is None
    # a float16 copy below the line is told float32 or a larger lr, not float16
    half = stalled_note({"master": 1.0, "actor": 0.02, "engine": 0.02}, {"actor": "float16", "engine": "float16"},
                        1e-6, 0.1)
    assert "below float16's resolution" in half and "model.dtype=float32" in half and "dtype=float16" not in half


def test_loss_scale_backs_off_on_overflow_and_grows_after_good_steps():
    scale = LossScale("float16", growth_interval=2)
    assert scale.enabled and scale.scale == INITIAL_SCALE
    assert scale.accept(math.inf) is False and scale.scale == INITIAL_SCALE / 2 and scale.overflows == 1
    assert scale.accept(1.0) and scale.accept(1.0) and scale.scale == INITIAL_SCALE  # two good steps: doubled
    off = LossScale("bfloat16")
    assert not off.enabled and off.scale == 1.0 and off.accept(math.nan)  # not scaled: the caller refuses


def test_clipped_step_retries_an_overflowed_float16_backward_then_steps_with_the_true_gradient():
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scale = LossScale("float16", initial=4.0)
    model.weight.grad = torch.tensor([[math.inf, 0.0]])  # an overflowed backward
    assert clipped_step(model, opt, scale, 0.0, "test") is None and scale.scale == 2.0
    assert torch.equal(model.weight, torch.ones(1, 2))  # no step taken
    model.weight.grad = torch.tensor([[2.0 * 3.0, 2.0 * 4.0]])  # the backward again, at scale 2
    assert clipped_step(model, opt, scale, 0.0, "test") == pytest.approx(5.0)  # |(3, 4)|, unscaled
    assert torch.allclose(model.weight, torch.tensor([[0.7, 0.6]]))
    plain = LossScale("float32")
    model.weight.grad = torch.tensor([[math.nan, 0.0]])
    with pytest.raises(FloatingPointError, match="gradient norm is nan at test"):
        clipped_step(model, opt, plain, 1.0, "test")


def test_a_float16_backward_that_overflows_at_the_smallest_scale_is_refused_with_the_dtype_fix():
    model = torch.nn.Linear(2, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scale = LossScale("float16", initial=2.0)
    model.weight.grad = torch.tensor([[math.inf, 0.0]])
    assert clipped_step(model, opt, scale, 1.0, "actor update 0") is None and scale.scale == 1.0
    model.weight.grad = torch.tensor([[math.inf, 0.0]])  # the forward overflows whatever the scale
    with pytest.raises(FloatingPointError, match="float16 overflowed even at loss scale 1 .*model.dtype, rollout.dtype"):
        clipped_step(model, opt, scale, 1.0, "actor update 0")
