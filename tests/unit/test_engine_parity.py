"""The first-batch engine-parity guard (hybridflow/resharding/parity.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hybridflow.config import compose
from hybridflow.resharding.parity import (
    FLOAT32_TOLERANCE,
    EngineParityError,
    FirstBatchParity,
    check_engine_parity,
    parity_tolerance,
)


def test_default_tolerance_follows_the_engines_dtypes_and_the_depth():
    assert parity_tolerance(None, ("float32", "float32"), 30) == FLOAT32_TOLERANCE
    # 16 bits on a side: 2e-3 per decoder layer, at least 1e-2, for each such side
    assert parity_tolerance(None, ("float32", "bfloat16"), 4) == 1e-2
    assert parity_tolerance(None, ("bfloat16", "bfloat16"), 2) == 2e-2
    assert parity_tolerance(None, ("bfloat16", "float32"), 30) == pytest.approx(0.06)
    assert parity_tolerance(None, ("bfloat16", "bfloat16"), 30) == pytest.approx(0.12)
    # measured on SmolLM2-135M (30 layers), same weights: mean gaps of 0.023 (bf16 actor, fp32 engine) and
    # 0.032 (both bf16) pass; the 4-layer tiny model's 1.3e-3 passes; dropout left on (0.084) and a
    # corrupted tensor (far above) do not, at either depth
    for gap, layers in ((0.023, 30), (0.032, 30), (1.3e-3, 4)):
        assert gap < parity_tolerance(None, ("bfloat16", "float32"), layers)
    assert 0.084 > parity_tolerance(None, ("bfloat16", "float32"), 30) > parity_tolerance(None, ("bfloat16",), 4)
    assert parity_tolerance(0.2, ("float32", "float32"), 30) == 0.2


def test_a_gap_above_tolerance_names_the_architecture_the_gap_and_the_key():
    fp32 = dict(architecture="GPT2LMHeadModel", dtypes=("float32", "float32"), layers=2)
    check_engine_parity(2e-7, tolerance=1e-3, **fp32)
    with pytest.raises(EngineParityError, match=r"by 0.084 .*float32/float32 at 2 layers.* of GPT2LMHeadModel.*"
                                                r"trainer.engine_parity_tolerance above 0.084"):
        check_engine_parity(0.084, tolerance=1e-3, **fp32)
    with pytest.raises(EngineParityError, match="by nan"):
        check_engine_parity(math.nan, tolerance=1e-3, **fp32)


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


def test_the_probe_is_a_statistic_over_tokens_not_its_worst_token():
    """SmolLM2-135M, bf16 actor against a float32 engine holding the same weights: a worst token of
    0.134 with a mean of 0.023 passes at 30 layers; a uniform 0.1 gap (a wrong weight) does not."""
    from hybridflow.resharding.verify import gap_statistics, probe_passes, probe_tolerance

    tolerance = probe_tolerance("bfloat16", "float32", 30)
    rounding = torch.tensor([0.134, 0.073, 0.037, 0.031, 0.024] + [0.005] * 27)
    stats = gap_statistics(rounding)
    assert stats["max"] == pytest.approx(0.134) and stats["mean"] < 0.03 and probe_passes(stats, tolerance)
    assert not probe_passes(gap_statistics(torch.full((32,), 0.1)), tolerance)
    assert not probe_passes(gap_statistics(torch.tensor([0.0] * 28 + [1.0] * 4)), tolerance)  # a 90th percentile of 1
    assert not probe_passes(gap_statistics(rounding), probe_tolerance("float32", "float32", 30))


def test_each_16_bit_engine_adds_its_own_rounding_to_the_tolerance():
    """SmolLM2 with both engines in bfloat16 (an Intel Xeon with AMX, 2026-11-25): the first sync's probe
    read a mean of 0.0622, a 90th percentile of 0.162 and a worst token of 0.317 over its 24 tokens, the
    same weights; one 16-bit side's tolerance (0.06) stopped the run there. Both sides: 2 x 0.06."""
    from hybridflow.resharding.verify import gap_statistics, probe_passes, probe_tolerance

    one, both = probe_tolerance("bfloat16", "float32", 30), probe_tolerance("bfloat16", "bfloat16", 30)
    assert one == pytest.approx(0.06) and both == pytest.approx(0.12) and probe_tolerance("float32", "float32", 30) == 1e-3
    measured = {"mean": 0.0622, "q90": 0.162, "max": 0.317}
    assert not probe_passes(measured, one) and probe_passes(measured, both)
    assert not probe_passes(gap_statistics(torch.full((24,), 0.15)), both)  # a gap on every token: not rounding


@pytest.mark.parametrize("checksums", ["off", "match", "differ"])
def test_a_failed_probe_says_which_question_failed(checksums):
    """Weights (exact: the checksums, run when the engine can show them) or arithmetic (the probe)."""
    from hybridflow.config.schema import WeightSyncConfig
    from hybridflow.resharding.sync import WeightSync
    from hybridflow.resharding.verify import WeightSyncError

    sync = WeightSync(None, None, WeightSyncConfig(checksum_every_steps=0 if checksums == "off" else 5,
                                                   probe_tolerance=0.06), None, "bfloat16")

    def verify():
        if checksums == "differ":
            raise WeightSyncError("weight sync verification failed for 1 of 272 vLLM parameters: model.norm.weight")
        return {"weight_sync/verified_tensors": 272.0}

    sync.verify_checksums = verify
    stats = {"mean": 0.2, "q90": 0.5, "max": 0.9}
    expected = {"off": r"by 0.2 on average, 0.5 at the 90th percentile and 0.9 at most over 32 probe tokens .*"
                       r"Set weight_sync.checksum_every_steps=1",
                "match": r"holds exactly the actor's weights.*compute different models at this precision.*"
                         r"weight_sync.probe_tolerance above 0.2",
                "differ": r"verification failed for 1 of 272 vLLM parameters: model.norm.weight"}[checksums]
    with pytest.raises(WeightSyncError, match=expected):
        sync._probe_failed(0, stats, 0.06, 32)
