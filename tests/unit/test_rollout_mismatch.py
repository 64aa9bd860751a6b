"""Rollout–training mismatch (issue 73): `mismatch_metrics` and the `rollout_correction` presets by
hand and against slow loops written from the formulas alone; the presets' config (`algorithm.rollout_correction`)
and where the step applies them, fresh and stale alike."""

import math
import re

import pytest
import torch

from hybridflow.algos.mismatch import MISMATCH_KEYS, mismatch_metrics
from hybridflow.algos.rollout_correction import ROLLOUT_CORRECTIONS, correction_band, rollout_correction, token_band
from hybridflow.config import compose
from hybridflow.config.schema import ROLLOUT_CORRECTION_PRESETS

LN = math.log


# ---- the mismatch metrics ---------------------------------------------------------------------------


def test_mismatch_metrics_by_hand():
    # Two sequences; Δ = log π - log μ per token, the last column of row 1 is padding.
    # row 0: Δ = [ln 2, 0, -ln 4]   row 1: Δ = [ln 0.5, ln 1.5, (pad)]
    mu = torch.full((2, 3), LN(0.2))
    pi = mu + torch.tensor([[LN(2), 0.0, -LN(4)], [LN(0.5), LN(1.5), 99.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    m = mismatch_metrics(trainer_log_probs=pi, sampler_log_probs=mu, response_mask=mask, band_low=0.45, band_high=2.1)
    deltas = [LN(2), 0.0, -LN(4), LN(0.5), LN(1.5)]
    assert m["abs_diff_mean"] == pytest.approx(sum(abs(d) for d in deltas) / 5)
    assert m["abs_diff_max"] == pytest.approx(LN(4))  # the padding's 99 is never read
    # ratios 2, 1, 0.25, 0.5, 1.5: only 0.25 is outside [0.45, 2.1]
    assert m["outside_band_fraction"] == pytest.approx(1 / 5)
    assert m["k1_kl"] == pytest.approx(-sum(deltas) / 5)
    assert m["k3_kl"] == pytest.approx(sum(math.exp(d) - 1 - d for d in deltas) / 5)
    # S_0 = ln 2 - ln 4 = -ln 2, S_1 = ln 0.5 + ln 1.5 = ln 0.75
    assert m["seq_log_ratio_mean"] == pytest.approx((-LN(2) + LN(0.75)) / 2)
    assert m["seq_log_ratio_abs_max"] == pytest.approx(LN(2))


def slow_mismatch(pi, mu, mask, low, high):
    deltas, sums = [], []
    for i in range(pi.shape[0]):
        row = [float(pi[i, t] - mu[i, t]) for t in range(pi.shape[1]) if mask[i, t]]
        deltas += row
        if row:
            sums.append(sum(row))
    n = len(deltas)
    return {"abs_diff_mean": sum(abs(d) for d in deltas) / n, "abs_diff_max": max(abs(d) for d in deltas),
            "outside_band_fraction": sum(not low <= math.exp(d) <= high for d in deltas) / n,
            "k1_kl": -sum(deltas) / n, "k3_kl": sum(math.expm1(d) - d for d in deltas) / n,
            "seq_log_ratio_mean": sum(sums) / len(sums), "seq_log_ratio_abs_max": max(abs(s) for s in sums)}


@pytest.mark.parametrize("seed", range(4))
def test_mismatch_metrics_equal_a_slow_loop(seed):
    g = torch.Generator().manual_seed(seed)
    shape = (int(torch.randint(1, 7, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g)))
    mu = -torch.rand(shape, generator=g) * 3
    pi = mu + torch.randn(shape, generator=g) * 0.5
    mask = torch.rand(shape, generator=g) > 0.3
    mask[0, 0] = True
    m = mismatch_metrics(trainer_log_probs=pi, sampler_log_probs=mu, response_mask=mask, band_low=0.7, band_high=1.4)
    slow = slow_mismatch(pi, mu, mask, 0.7, 1.4)
    assert set(m) == set(MISMATCH_KEYS)
    for key in MISMATCH_KEYS:
        assert m[key] == pytest.approx(slow[key], rel=1e-5, abs=1e-6), key


def test_no_trained_token_gives_zeros_and_equal_log_probs_no_mismatch():
    x = torch.randn(2, 3)
    none = mismatch_metrics(trainer_log_probs=x, sampler_log_probs=x, response_mask=torch.zeros(2, 3, dtype=torch.bool),
                            band_low=0.5, band_high=2)
    same = mismatch_metrics(trainer_log_probs=x, sampler_log_probs=x, response_mask=torch.ones(2, 3, dtype=torch.bool),
                            band_low=0.5, band_high=2)
    assert set(none.values()) == {0.0} and set(same.values()) == {0.0}


# ---- the presets ------------------------------------------------------------------------------------


def test_each_preset_by_hand():
    # π_old/μ per token: row 0 = [2, 0.25] (product 0.5, geometric mean sqrt(0.5) ≈ 0.707), row 1 = [1.1, (pad)]
    old = torch.tensor([[LN(0.4), LN(0.1)], [LN(0.55), 0.0]])
    mu = torch.tensor([[LN(0.2), LN(0.4)], [LN(0.5), -5.0]])
    mask = torch.tensor([[True, True], [True, False]])

    def weights(preset, cap=1.5, low=None, high=None):
        w, stats = rollout_correction(preset, old_log_probs=old, sampler_log_probs=mu, response_mask=mask, cap=cap,
                                      low=low, high=high)
        return w, stats

    w, s = weights("token_tis")  # min(ρ, 1.5): [1.5, 0.25], [1.1, 0]
    torch.testing.assert_close(w, torch.tensor([[1.5, 0.25], [1.1, 0.0]]))
    assert s["clipped_fraction"] == pytest.approx(1 / 3) and s["masked_fraction"] == 0.0
    assert s["weight_mean"] == pytest.approx((1.5 + 0.25 + 1.1) / 3)
    w, s = weights("seq_tis", cap=1.05)  # products 0.5 and 1.1 -> min(·, 1.05): 0.5 on row 0, 1.05 on row 1
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.5], [1.05, 0.0]]))
    assert s["clipped_fraction"] == pytest.approx(1 / 3)
    w, s = weights("token_mis")  # band [0.5, 2]: 2 kept as 2, 0.25 masked, 1.1 kept
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.0], [1.1, 0.0]]))
    assert s["masked_fraction"] == pytest.approx(1 / 3)
    w, s = weights("seq_mis", low=0.6, high=2.0)  # row 0's product 0.5 < 0.6: both tokens masked
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0], [1.1, 0.0]]))
    assert s["masked_fraction"] == pytest.approx(2 / 3)
    w, s = weights("geo_mask", low=0.7, high=1.2)  # geometric means 0.707 and 1.1: both inside
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    w, s = weights("geo_mask")  # default band [0.999, 1.001]: both outside
    torch.testing.assert_close(w, torch.zeros(2, 2))
    assert s["masked_fraction"] == 1.0
    w, s = weights("icepop", low=0.5, high=1.5)  # ratio 2 outside, 0.25 outside, 1.1 inside: weight 1
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0], [1.0, 0.0]]))
    w, _ = weights("none")
    torch.testing.assert_close(w, mask.float())


def slow_preset(preset, delta, mask, cap, low, high):
    """Each preset from its formula, one token at a time (hybridflow/algos/rollout_correction.py's table)."""
    out = torch.zeros_like(delta)
    for i in range(delta.shape[0]):
        kept = [t for t in range(delta.shape[1]) if mask[i, t]]
        log_product = max(-20.0, min(20.0, sum(float(delta[i, t]) for t in kept)))
        geometric = math.exp(max(-20.0, min(20.0, sum(float(delta[i, t]) for t in kept) / max(len(kept), 1))))
        for t in kept:
            rho = math.exp(max(-20.0, min(20.0, float(delta[i, t]))))
            product = math.exp(log_product)
            out[i, t] = {"none": 1.0, "token_tis": min(rho, cap), "seq_tis": min(product, cap),
                         "token_mis": rho if low <= rho <= high else 0.0,
                         "seq_mis": product if low <= product <= high else 0.0,
                         "geo_mask": 1.0 if low <= geometric <= high else 0.0,
                         "icepop": 1.0 if low <= rho <= high else 0.0}[preset]
    return out


@pytest.mark.parametrize("preset", sorted(set(ROLLOUT_CORRECTION_PRESETS) - {"auto"}))
@pytest.mark.parametrize("seed", range(3))
def test_every_preset_equals_its_slow_loop_on_random_tensors(preset, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (int(torch.randint(1, 8, (1,), generator=g)), int(torch.randint(1, 10, (1,), generator=g)))
    mu = -torch.rand(shape, generator=g) * 4
    old = mu + torch.randn(shape, generator=g) * 0.4
    mask = torch.rand(shape, generator=g) > 0.25
    low, high = (0.9995, 1.0005) if preset == "geo_mask" and seed == 0 else (0.7, 1.6)
    w, stats = rollout_correction(preset, old_log_probs=old, sampler_log_probs=mu, response_mask=mask, cap=1.3,
                                  low=low, high=high)
    expected = slow_preset(preset, (old - mu).double(), mask, 1.3, low, high).float()
    torch.testing.assert_close(w, expected, rtol=1e-5, atol=1e-6)
    masked = sum(bool(mask[i, t]) and expected[i, t] == 0 for i in range(shape[0]) for t in range(shape[1]))
    if preset in ("token_mis", "seq_mis", "geo_mask", "icepop"):
        assert stats["masked_fraction"] == pytest.approx(masked / max(int(mask.sum()), 1))
    assert not w.requires_grad


def test_the_registry_holds_every_preset_of_the_schema_and_the_default_bands():
    assert sorted(ROLLOUT_CORRECTIONS.names()) == sorted(set(ROLLOUT_CORRECTION_PRESETS) - {"auto"})
    assert correction_band("geo_mask", None, None) == (0.999, 1.001)
    assert correction_band("icepop", None, 4.0) == (0.5, 4.0)
    assert token_band("token_tis", 2.0, None, None) == (0.5, 2.0) and token_band("icepop", 2.0, 0.8, None) == (0.8, 5.0)


# ---- the config and the step ------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.behavior_is_cap=3"], "algorithm.behavior_is_cap=3.0 is invalid: was folded into "
                                      "algorithm.rollout_correction"),
    (["algorithm.rollout_correction=tis"], "algorithm.rollout_correction='tis' is invalid: must be one of"),
    (["algorithm.rollout_correction=seq_mis", "trainer.old_log_probs=sampler"],
     "algorithm.rollout_correction='seq_mis' is invalid: corrects from the sampler's log-probs"),
    (["algorithm.rollout_correction=token_tis", "algorithm.rollout_correction_low=0.5"],
     "algorithm.rollout_correction_low=0.5 is invalid: only token_mis, seq_mis, geo_mask and icepop read a band"),
    (["algorithm.rollout_correction=icepop", "algorithm.rollout_correction_high=0.9"],
     "algorithm.rollout_correction_high=0.9 is invalid: must be >= 1"),
    (["algorithm.rollout_correction_cap=0.5"], "algorithm.rollout_correction_cap=0.5 is invalid"),
    (["algorithm.mismatch_warn_kl=0"], "algorithm.mismatch_warn_kl=0.0 is invalid"),
])
def test_a_rollout_correction_config_that_cannot_run_is_refused_naming_the_key(overrides, message):
    with pytest.raises(Exception, match=re.escape(message)):
        compose(["recipe=grpo", *overrides])


def samples():
    from hybridflow.batch import Batch

    mask = torch.tensor([[True, True], [True, False], [True, True], [True, True]])
    return Batch({"response_mask": mask, "sequence_rewards": torch.tensor([1.0, 0.0, 0.5, 0.0]),
                  "group_ids": torch.tensor([0, 0, 1, 1]), "old_log_probs": torch.full((4, 2), LN(0.5)),
                  "sampler_log_probs": torch.full((4, 2), LN(0.45))})


def test_a_preset_recomputes_pi_old_and_weights_a_fresh_batch():
    from hybridflow.batch_keys import clips_against_sampler, proximal_key
    from recipes.ppo import add_advantages, applied_correction

    default = compose(["recipe=grpo"])
    assert clips_against_sampler(default) and applied_correction(default, "sampler_log_probs") == "none"
    icepop = compose(["recipe=grpo", "algorithm.rollout_correction=icepop", "algorithm.rollout_correction_high=1.05"])
    assert not clips_against_sampler(icepop)  # auto chooses the actor's π_old: the preset needs it
    proximal = proximal_key(clips_against_sampler(icepop))
    batch, metrics = add_advantages(samples(), icepop, 0.0, proximal)
    # ratio 0.5 / 0.45 = 1.11 > 1.05: every trained token masked, at staleness 0
    torch.testing.assert_close(batch["behavior_weights"], torch.zeros(4, 2))
    assert metrics["rollout_correction/masked_fraction"] == 1.0
    seq_tis = compose(["recipe=grpo", "algorithm.rollout_correction=seq_tis", "trainer.old_log_probs=actor"])
    batch, metrics = add_advantages(samples(), seq_tis, 0.0, "old_log_probs")
    one_token, two_tokens = 0.5 / 0.45, (0.5 / 0.45) ** 2  # products over each row's trained tokens, under C = 2
    torch.testing.assert_close(batch["behavior_weights"][:2], torch.tensor([[two_tokens, two_tokens], [one_token, 0.0]]))
    # rollout_correction=auto on a synchronous run that recomputes π_old: no weights, the loss as before
    actor = compose(["recipe=grpo", "trainer.old_log_probs=actor"])
    assert "behavior_weights" not in add_advantages(samples(), actor, 0.0, "old_log_probs")[0]


def test_the_step_reports_the_mismatch_of_the_batch_and_says_so_on_the_console(capsys):
    from types import SimpleNamespace

    from recipes.ppo import step_metrics

    config = compose(["recipe=grpo", "trainer.old_log_probs=actor", "algorithm.mismatch_warn_kl=0.001"])
    batch = samples()
    batch.tensors["behavior_version"] = torch.zeros(4, dtype=torch.long)
    r = SimpleNamespace(config=config, clip_against_sampler=False, mismatch_band=(0.5, 2.0))
    metrics = step_metrics(r, batch, 0, False, True, {"timing/generate_s": 1.0})
    delta = LN(0.5 / 0.45)
    assert metrics["rollout_mismatch/abs_diff_mean"] == pytest.approx(delta)
    assert metrics["rollout_mismatch/seq_log_ratio_abs_max"] == pytest.approx(2 * delta)
    assert metrics["rollout_mismatch/k3_kl"] == pytest.approx(math.expm1(delta) - delta)  # 0.0054 > 0.001
    assert "algorithm.mismatch_warn_kl=0.001" in capsys.readouterr().out
