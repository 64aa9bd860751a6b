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


def test_k3_forms_the_ratio_from_the_clamped_log_ratio_and_subtracts_the_unclamped_one():
    # one token with Δ = -25: ρ = exp(clamp(-25, ±20)) = exp(-20), and k3 = (ρ - 1) - Δ = (exp(-20) - 1) + 25
    m = mismatch_metrics(trainer_log_probs=torch.tensor([[-25.0]], dtype=torch.float64),
                         sampler_log_probs=torch.zeros(1, 1, dtype=torch.float64),
                         response_mask=torch.ones(1, 1, dtype=torch.bool), band_low=0.5, band_high=2.0)
    assert m["k3_kl"] == pytest.approx((math.exp(-20) - 1) + 25, rel=1e-12)
    assert m["k1_kl"] == 25.0 and m["outside_band_fraction"] == 1.0


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
    w, s = weights("geo_mask")  # default band [1/1.001, 1.001]: both outside
    torch.testing.assert_close(w, torch.zeros(2, 2))
    assert s["masked_fraction"] == 1.0
    w, s = weights("icepop", low=0.5, high=1.5)  # ratio 2 outside, 0.25 outside, 1.1 inside: weight ρ = 1.1
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0], [1.1, 0.0]]))
    assert s["masked_fraction"] == pytest.approx(2 / 3)
    w, s = weights("token_mask", low=0.5, high=1.5)  # the same mask, weight 1 inside (verl's rollout_rs=token)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0], [1.0, 0.0]]))
    assert s["masked_fraction"] == pytest.approx(2 / 3)
    w, _ = weights("none")
    torch.testing.assert_close(w, mask.float())


def test_icepop_weighs_by_the_ratio_and_geo_masks_lower_edge_is_the_reciprocal_of_its_upper():
    # IcePop (Ring-1T): M(k) = k for k in [α, β] = [0.5, 5], else 0. ρ = 4.992 is inside: weight 4.992, not 1;
    # ρ = 5.01 is past β: 0. token_mask (verl's rollout_rs=token, band [0.5, 2]) masks both: 4.992 > 2.
    old = torch.tensor([[LN(4.992), LN(5.01)]], dtype=torch.float64)
    mu = torch.zeros_like(old)
    mask = torch.ones_like(old, dtype=torch.bool)
    w, _ = rollout_correction("icepop", old_log_probs=old, sampler_log_probs=mu, response_mask=mask, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[4.992, 0.0]], dtype=torch.float64), rtol=1e-12, atol=0)
    w, _ = rollout_correction("token_mask", old_log_probs=old, sampler_log_probs=mu, response_mask=mask, cap=2.0)
    torch.testing.assert_close(w, torch.zeros_like(old), rtol=0, atol=0)
    # verl's geometric band: upper 1.001 and lower = 1 / upper = 0.999000999..., not 0.999
    assert correction_band("geo_mask", None, None) == (1 / 1.001, 1.001)
    # geometric mean 0.9990005: above 0.999 but below 1/1.001, so verl masks the sequence and so do we
    g = torch.tensor([[LN(0.9990005)]], dtype=torch.float64)
    w, s = rollout_correction("geo_mask", old_log_probs=g, sampler_log_probs=torch.zeros_like(g),
                              response_mask=torch.ones_like(g, dtype=torch.bool), cap=2.0)
    assert float(w) == 0.0 and s["masked_fraction"] == 1.0


# Reference formulas, written from verl's rollout correction (verl/trainer/ppo/rollout_corr_helper.py:
# rollout_is=token/sequence, rollout_rs=token/sequence/geometric) and the IcePop paper (Ring-1T), one row at
# a time in Python floats (float64), independent of hybridflow/algos/rollout_correction.py. `row` is the
# list of Δ_t = log π_old - log μ over the row's trained tokens; each returns one weight per entry of `row`.
SAFETY_BOUND = 20.0  # verl clamps every log-ratio to ±20 before exp


def _safe_exp(log_ratio):
    return math.exp(min(max(log_ratio, -SAFETY_BOUND), SAFETY_BOUND))


def verl_token_is(row, cap, lo, hi):  # rollout_is=token, truncated: min(ρ_t, C)
    return [min(_safe_exp(d), cap) for d in row]


def verl_sequence_is(row, cap, lo, hi):  # rollout_is=sequence, truncated: min(exp(clamp(Σ_t Δ_t)), C)
    return [min(_safe_exp(sum(row)), cap)] * len(row)


def verl_token_is_rs(row, cap, lo, hi):  # rollout_is=token + rollout_rs=token: ρ_t · 1[lo <= ρ_t <= hi]
    return [_safe_exp(d) * (lo <= _safe_exp(d) <= hi) for d in row]


def verl_sequence_is_rs(row, cap, lo, hi):  # rollout_is=sequence + rollout_rs=sequence
    rho = _safe_exp(sum(row))
    return [rho * (lo <= rho <= hi)] * len(row)


def verl_geometric_rs(row, cap, lo, hi):  # rollout_rs=geometric, no IS weight: 1[lo <= exp(mean_t Δ_t) <= hi]
    geometric = _safe_exp(sum(row) / len(row)) if row else 1.0
    return [float(lo <= geometric <= hi)] * len(row)


def icepop_paper(row, cap, alpha, beta):  # Ring-1T's IcePop: M(k) = k if α <= k <= β else 0, k = ρ_t
    return [k if alpha <= k <= beta else 0.0 for k in map(_safe_exp, row)]


def verl_token_rs(row, cap, lo, hi):  # rollout_rs=token, no IS weight: 1[lo <= ρ_t <= hi]
    return [float(lo <= _safe_exp(d) <= hi) for d in row]


REFERENCE = {"none": lambda row, cap, lo, hi: [1.0] * len(row), "token_tis": verl_token_is,
             "seq_tis": verl_sequence_is, "token_mis": verl_token_is_rs, "seq_mis": verl_sequence_is_rs,
             "geo_mask": verl_geometric_rs, "icepop": icepop_paper, "token_mask": verl_token_rs}
# the default bands, from the sources: verl's rollout_rs threshold 2 with lower = 1 / upper (token, sequence),
# its geometric preset's 1.001 with lower = 1 / upper, IcePop's α = 0.5, β = 5
REFERENCE_BANDS = {"token_mis": (1 / 2, 2.0), "seq_mis": (1 / 2, 2.0), "geo_mask": (1 / 1.001, 1.001),
                   "icepop": (0.5, 5.0), "token_mask": (1 / 2, 2.0)}


def reference_weights(preset, delta, mask, cap, lo, hi):
    """(B, T) float64: REFERENCE[preset] on each row's trained tokens, 0 elsewhere."""
    out = torch.zeros(delta.shape, dtype=torch.float64)
    for i in range(delta.shape[0]):
        kept = [t for t in range(delta.shape[1]) if mask[i, t]]
        for t, w in zip(kept, REFERENCE[preset]([float(delta[i, t]) for t in kept], cap, lo, hi)):
            out[i, t] = w
    return out


def ragged_batch(seed, spread=3.0):
    """old, sampler (B, T) float64 and a random response mask: row 0 empty, row 1 full, row 2 a sequence whose
    engines agree to ~1e-4 (inside the narrow geometric band), Δ ~ normal · spread plus a few ±25 (clamped to
    ±20), row 1 holding -25 first and +25 last."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = int(torch.randint(3, 9, (1,), generator=g)), int(torch.randint(1, 13, (1,), generator=g))
    mask = torch.rand(rows, cols, generator=g) > 0.3
    mask[0], mask[1], mask[2, 0] = False, True, True
    delta = torch.randn(rows, cols, generator=g, dtype=torch.float64) * spread
    delta[2] *= 1e-4 / spread
    extreme = torch.rand(rows, cols, generator=g) < 0.1
    extreme[2] = False
    delta = torch.where(extreme, 25.0 * torch.sign(torch.randn(rows, cols, generator=g, dtype=torch.float64)), delta)
    delta[1, 0], delta[1, -1] = -25.0, 25.0  # on every seed a ratio past each end of the ±20 clamp
    sampler = -torch.rand(rows, cols, generator=g, dtype=torch.float64) * 4
    return sampler + delta, sampler, mask


PRESETS = sorted(set(ROLLOUT_CORRECTION_PRESETS) - {"auto"})


@pytest.mark.parametrize("band", ["default", (0.3, 3.0)])
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("seed", range(4))
def test_every_preset_equals_verl_and_icepop_formulas_in_float64(preset, seed, band):
    old, sampler, mask = ragged_batch(seed)
    cap = 2.0  # verl's rollout_is_threshold default
    low, high = (None, None) if band == "default" else band
    ref_low, ref_high = REFERENCE_BANDS.get(preset, (0.0, math.inf)) if band == "default" else band
    w, stats = rollout_correction(preset, old_log_probs=old, sampler_log_probs=sampler, response_mask=mask, cap=cap,
                                  low=low, high=high)
    expected = reference_weights(preset, old - sampler, mask, cap, ref_low, ref_high)
    assert w.dtype == torch.float64 and not w.requires_grad
    torch.testing.assert_close(w, expected, rtol=1e-9, atol=0)  # exact zeros where the reference has them
    trained = max(int(mask.sum()), 1)
    masked = int((mask & (expected == 0)).sum()) if preset in ("token_mis", "seq_mis", "geo_mask", "icepop",
                                                                 "token_mask") else 0
    assert stats["masked_fraction"] == pytest.approx(masked / trained)
    if preset in ("token_tis", "seq_tis"):
        assert stats["clipped_fraction"] == pytest.approx(int((mask & (expected == cap)).sum()) / trained)
    if preset == "icepop":  # IcePop is token_mis with IcePop's band
        same, _ = rollout_correction("token_mis", old_log_probs=old, sampler_log_probs=sampler, response_mask=mask,
                                     cap=cap, low=ref_low, high=ref_high)
        torch.testing.assert_close(w, same, rtol=0, atol=0)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("seed", range(3))
def test_every_preset_in_float32_is_the_reference_within_float32_rounding(preset, seed):
    old, sampler, mask = ragged_batch(seed, spread=0.4)
    low, high = (0.9995, 1.0005) if preset == "geo_mask" and seed == 0 else (0.7, 1.6)
    w, _ = rollout_correction(preset, old_log_probs=old.float(), sampler_log_probs=sampler.float(), response_mask=mask,
                              cap=1.3, low=low, high=high)
    expected = reference_weights(preset, (old.float() - sampler.float()).double(), mask, 1.3, low, high)
    assert w.dtype == torch.float32
    torch.testing.assert_close(w, expected.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype, weights_dtype", [(torch.float64, torch.float64), (torch.float32, torch.float32),
                                                  (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("preset", PRESETS)
def test_weights_are_computed_in_the_log_probs_precision_at_least_float32(preset, dtype, weights_dtype):
    log_probs = torch.full((2, 3), -1.0, dtype=dtype)
    w, _ = rollout_correction(preset, old_log_probs=log_probs, sampler_log_probs=log_probs,
                              response_mask=torch.ones(2, 3, dtype=torch.bool), cap=2.0)
    assert w.dtype == weights_dtype


def test_the_registry_holds_every_preset_of_the_schema_and_the_default_bands():
    assert sorted(ROLLOUT_CORRECTIONS.names()) == PRESETS
    assert correction_band("geo_mask", None, None) == (1 / 1.001, 1.001)
    assert correction_band("icepop", None, 4.0) == (0.5, 4.0)
    assert correction_band("token_mask", None, None) == (0.5, 2.0)
    assert token_band("token_tis", 2.0, None, None) == (0.5, 2.0) and token_band("icepop", 2.0, 0.8, None) == (0.8, 5.0)
    assert token_band("token_mask", 3.0, None, 1.5) == (0.5, 1.5)


# ---- the config and the step ------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.behavior_is_cap=3"], "algorithm.behavior_is_cap=3.0 is invalid: was folded into "
                                      "algorithm.rollout_correction"),
    (["algorithm.rollout_correction=tis"], "algorithm.rollout_correction='tis' is invalid: must be one of"),
    (["algorithm.rollout_correction=seq_mis", "trainer.old_log_probs=sampler"],
     "algorithm.rollout_correction='seq_mis' is invalid: corrects from the sampler's log-probs"),
    (["algorithm.rollout_correction=token_tis", "algorithm.rollout_correction_low=0.5"],
     "algorithm.rollout_correction_low=0.5 is invalid: only token_mis, seq_mis, geo_mask, icepop and "
     "token_mask read a band"),
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
