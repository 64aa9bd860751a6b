"""The first-batch engine-parity guard (hybridflow/resharding/parity.py)."""

from __future__ import annotations

import json
import math

import pytest

from hybridflow.config import compose
from hybridflow.resharding.parity import (
    FLOAT32_TOLERANCE,
    HALF_TOLERANCE,
    EngineParityError,
    FirstBatchParity,
    check_engine_parity,
    parity_tolerance,
)


def test_default_tolerance_follows_the_engines_dtypes():
    assert parity_tolerance(None, ("float32", "float32")) == FLOAT32_TOLERANCE
    assert parity_tolerance(None, ("float32", "bfloat16")) == parity_tolerance(None, ("bfloat16", "bfloat16")) == HALF_TOLERANCE
    assert parity_tolerance(0.2, ("float32", "float32")) == 0.2


def test_a_gap_above_tolerance_names_the_architecture_the_gap_and_the_key():
    check_engine_parity(2e-7, tolerance=1e-3, architecture="GPT2LMHeadModel", dtypes=("float32", "float32"))
    with pytest.raises(EngineParityError, match=r"by 0.084 .* of GPT2LMHeadModel.*trainer.engine_parity_tolerance above 0.084"):
        check_engine_parity(0.084, tolerance=1e-3, architecture="GPT2LMHeadModel", dtypes=("float32", "float32"))
    with pytest.raises(EngineParityError, match="by nan"):
        check_engine_parity(math.nan, tolerance=1e-3, architecture="X", dtypes=("float32", "float32"))


def test_only_the_first_reported_gap_is_checked(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    parity = FirstBatchParity.from_config(compose([]), tmp_path)
    parity.check({"reward/score": 0.0})  # a critic warm-up step: no gap yet, nothing checked
    with pytest.raises(EngineParityError, match="GPT2LMHeadModel"):
        parity.check({"rollout/log_prob_diff": 0.08})
    parity.check({"rollout/log_prob_diff": 0.08})  # checked once: later gaps are not this guard's
    accepted = FirstBatchParity.from_config(compose(["trainer.engine_parity_tolerance=0.1"]), tmp_path)
    accepted.check({"rollout/log_prob_diff": 0.08})


def test_tolerance_must_be_positive():
    with pytest.raises(ValueError, match="trainer.engine_parity_tolerance=0"):
        compose(["trainer.engine_parity_tolerance=0"])
