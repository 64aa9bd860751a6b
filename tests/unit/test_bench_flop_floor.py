"""bench/flop_floor.py: the FLOP count of one GRPO step, checked by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "flop_floor.py"
_spec = importlib.util.spec_from_file_location("bench_flop_floor", _PATH)
flop_floor = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = flop_floor  # dataclasses look their module up there
_spec.loader.exec_module(flop_floor)


def test_grpo_step_flops_by_hand():
    # N = 1,000 parameters; 2 prompts of 3 tokens, 4 samples each: 8 samples x 3 = 24 prompt tokens,
    # 6 distinct prompt tokens; 8 samples x 5 = 40 response tokens -> 64 trained tokens.
    tokens = flop_floor.StepTokens(prompt_tokens=24, unique_prompt_tokens=6, response_tokens=40)
    assert tokens.trained_tokens == 64 and tokens.shared_tokens == 46
    shared = flop_floor.grpo_step_flops(1000, tokens, extra_forward_passes=1)
    assert shared["training"] == 6 * 1000 * 46 and shared["extra_forwards"] == 2 * 1000 * 46  # each prompt once
    parts = flop_floor.grpo_step_flops(1000, tokens, extra_forward_passes=1, prompts_once=False)
    assert parts["training"] == 6 * 1000 * 64  # 384,000: forward 2N + backward 4N per token
    assert parts["generation"] == 2 * 1000 * (40 + 6)  # 92,000: each generated token, each prompt prefilled once
    assert parts["extra_forwards"] == 2 * 1000 * 64  # 128,000: one reference forward over every token
    assert parts["total"] == 384_000 + 92_000 + 128_000
    assert flop_floor.floor_seconds(parts["total"], 604_000.0) == pytest.approx(1.0)


def test_on_policy_step_has_no_extra_forward():
    tokens = flop_floor.StepTokens(prompt_tokens=10, unique_prompt_tokens=5, response_tokens=10)
    assert flop_floor.grpo_step_flops(10, tokens)["extra_forwards"] == 0.0


@pytest.mark.parametrize("params, extra", [(0, 0), (10, -1)])
def test_bad_arguments_are_refused(params, extra):
    tokens = flop_floor.StepTokens(1, 1, 1)
    with pytest.raises(ValueError):
        flop_floor.grpo_step_flops(params, tokens, extra)
