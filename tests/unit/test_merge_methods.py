"""Merge methods against hand-worked examples (derivations in the comments)."""

import math

import pytest
import torch

from hybridflow.merge.methods import (
    MERGE_METHODS,
    MergeParams,
    check_params,
    dare_drop,
    disjoint_merge,
    ema_weights,
    tensor_seed,
    trim_by_magnitude,
    wma_weights,
)


def run(method, tensors, base=None, name="w", **params):
    tensors = [torch.tensor(t, dtype=torch.float32) for t in tensors]
    base = torch.tensor(base, dtype=torch.float32) if base is not None else None
    return MERGE_METHODS.get(method)(tensors, base=base, params=MergeParams(**params), name=name)


def test_sma_hand_worked():
    # ([1, 2] + [3, 4] + [5, 9]) / 3 = [9, 15] / 3 = [3, 5]
    assert run("sma", [[1, 2], [3, 4], [5, 9]]).tolist() == pytest.approx([3, 5])


def test_ema_hand_worked_and_recursion():
    # alpha = 0.5, theta = 4, 8, 16: m1 = 4, m2 = .5*8 + .5*4 = 6, m3 = .5*16 + .5*6 = 11.
    # Weights: theta_1 (1-a)^2 = .25, theta_2 a(1-a) = .25, theta_3 a = .5; .25*4 + .25*8 + .5*16 = 11.
    assert ema_weights(3, 0.5) == pytest.approx([0.25, 0.25, 0.5])
    assert run("ema", [[4], [8], [16]], alpha=0.5).tolist() == pytest.approx([11])
    # alpha = 1 keeps only the newest; weights always sum to 1.
    assert ema_weights(4, 1.0) == [0.0, 0.0, 0.0, 1.0]
    assert sum(ema_weights(7, 0.3)) == pytest.approx(1.0)


def test_wma_hand_worked():
    # weights 1/6, 2/6, 3/6: 6/6 + 12*2/6 + 18*3/6 = 1 + 4 + 9 = 14
    assert wma_weights(3) == pytest.approx([1 / 6, 2 / 6, 3 / 6])
    assert run("wma", [[6], [12], [18]]).tolist() == pytest.approx([14])


def test_linear_hand_worked():
    # weights [1, 3] normalise to [.25, .75]: .25*4 + .75*8 = 7; unnormalised: 4 + 24 = 28
    assert run("linear", [[4], [8]], weights=[1, 3]).tolist() == pytest.approx([7])
    assert run("linear", [[4], [8]], weights=[1, 3], normalize=False).tolist() == pytest.approx([28])


def test_task_arithmetic_hand_worked():
    # base [1, 1]; tau_1 = [2, 0] - base = [1, -1], tau_2 = [3, 1] - base = [2, 0];
    # sum [3, -1]; lam = .5 -> [1.5, -.5]; out = base + that = [2.5, .5]
    assert run("task_arithmetic", [[2, 0], [3, 1]], base=[1, 1], lam=0.5).tolist() == pytest.approx([2.5, 0.5])


def test_trim_by_magnitude_keeps_largest():
    # density .5 of 4 entries keeps k = 2: |3| and |2|
    assert trim_by_magnitude(torch.tensor([3.0, -1.0, 2.0, 0.5]), 0.5).tolist() == [3, 0, 2, 0]
    assert trim_by_magnitude(torch.tensor([1.0, 2.0]), 1.0).tolist() == [1, 2]


def test_ties_hand_worked():
    # base = 1 everywhere; task vectors
    #   tau_1 = [ 3, -1,  2,  .5] -> trimmed (k=2) [ 3, 0, 2, 0]
    #   tau_2 = [-4,  2,  1,  .1] -> trimmed       [-4, 2, 0, 0]
    #   tau_3 = [ 1, .5,  3, -.2] -> trimmed       [ 1, 0, 3, 0]
    # sum of trimmed [0, 2, 5, 0] -> elected signs [0, +, +, 0]
    # disjoint mean: entry 0 sign 0 -> 0; entry 1 only tau_2 agrees -> 2;
    #   entry 2 tau_1 and tau_3 agree -> (2 + 3)/2 = 2.5; entry 3 -> 0
    # out = base + lam * merged = [1, 3, 3.5, 1] (lam 1), [1, 5, 6, 1] (lam 2)
    taus = [[3, -1, 2, 0.5], [-4, 2, 1, 0.1], [1, 0.5, 3, -0.2]]
    thetas = [[1 + x for x in tau] for tau in taus]
    out = run("ties", thetas, base=[1, 1, 1, 1], density=0.5)
    assert out.tolist() == pytest.approx([1, 3, 3.5, 1])
    out = run("ties", thetas, base=[1, 1, 1, 1], density=0.5, lam=2.0)
    assert out.tolist() == pytest.approx([1, 5, 6, 1])


def test_disjoint_merge_weighted():
    # weights [1, 3]: sum 1*[2, -1] + 3*[4, 1] = [14, 2] -> signs [+, +];
    # entry 0: (1*2 + 3*4)/(1 + 3) = 3.5; entry 1: only tau_2 agrees -> 3*1/3 = 1
    merged = disjoint_merge([torch.tensor([2.0, -1.0]), torch.tensor([4.0, 1.0])], [1.0, 3.0])
    assert merged.tolist() == pytest.approx([3.5, 1.0])


def test_dare_drop_rescales_and_is_seeded_per_name():
    tau = torch.linspace(1, 2, 10_000)
    dropped = dare_drop(tau, 0.3, seed=7, name="layer.weight", index=0)
    kept = dropped != 0
    # survivors are tau / (1 - p) = tau / density; the kept fraction is close to density
    assert torch.allclose(dropped[kept], tau[kept] / 0.3)
    assert abs(kept.float().mean().item() - 0.3) < 0.03
    assert torch.equal(dropped, dare_drop(tau, 0.3, seed=7, name="layer.weight", index=0))
    assert not torch.equal(dropped, dare_drop(tau, 0.3, seed=7, name="other.weight", index=0))
    assert not torch.equal(dropped, dare_drop(tau, 0.3, seed=7, name="layer.weight", index=1))
    assert tensor_seed(7, "a", 0) == tensor_seed(7, "a", 0) != tensor_seed(8, "a", 0)


def test_dare_linear_hand_worked():
    # base [0, 0]; tau_1 = [2, 4], density .5: entries kept where rand < .5, times 1/.5 = 2.
    generator = torch.Generator().manual_seed(tensor_seed(0, "w", 0))
    keep = torch.rand(2, generator=generator) < 0.5
    expected = torch.where(keep, torch.tensor([4.0, 8.0]), 0.0)
    assert torch.equal(run("dare_linear", [[2, 4]], base=[0, 0], density=0.5), expected)
    # density 1 drops nothing: task arithmetic
    assert run("dare_linear", [[2, 0], [3, 1]], base=[1, 1], density=1.0, lam=0.5).tolist() == pytest.approx([2.5, 0.5])


def test_dare_ties_density_one_is_sign_elected_mean():
    # no drop; tau_1 = [1, -1], tau_2 = [3, 2]: sum [4, 1] -> [+, +]; entry 0 mean(1, 3) = 2; entry 1: 2
    assert run("dare_ties", [[1, -1], [3, 2]], base=[0, 0], density=1.0).tolist() == pytest.approx([2, 2])


def test_slerp_hand_worked():
    # a = [1, 0], b = [0, 1]: cos = 0, angle pi/2, t = .5: sin(pi/4)/sin(pi/2) = sqrt(2)/2 each
    h = math.sqrt(0.5)
    assert run("slerp", [[1, 0], [0, 1]], t=0.5).tolist() == pytest.approx([h, h])
    # a = [2, 0] keeps its norm in the formula: [2 h, h]
    assert run("slerp", [[2, 0], [0, 1]], t=0.5).tolist() == pytest.approx([2 * h, h])
    # t = 0 and t = 1 give the ends
    assert run("slerp", [[1, 2], [3, -1]], t=0.0).tolist() == pytest.approx([1, 2])
    assert run("slerp", [[1, 2], [3, -1]], t=1.0).tolist() == pytest.approx([3, -1])
    # colinear: falls back to lerp: .75*[1, 2] + .25*[2, 4] = [1.25, 2.5]
    assert run("slerp", [[1, 2], [2, 4]], t=0.25).tolist() == pytest.approx([1.25, 2.5])
    # a zero tensor: lerp as well
    assert run("slerp", [[0, 0], [2, 4]], t=0.5).tolist() == pytest.approx([1, 2])


def test_slerp_matches_a_slow_float64_reference_on_random_tensors():
    torch.manual_seed(0)
    for shape in [(3,), (4, 5), (2, 3, 4)]:
        a, b = torch.randn(shape), torch.randn(shape)
        ad, bd = a.double().flatten(), b.double().flatten()
        omega = math.acos(float(ad @ bd / (ad.norm() * bd.norm())))
        expected = (math.sin(0.3 * omega) * ad + math.sin(0.7 * omega) * bd) / math.sin(omega)
        out = MERGE_METHODS.get("slerp")([a, b], base=None, params=MergeParams(t=0.7), name="x")
        assert torch.allclose(out.double().flatten(), expected, atol=1e-5)


def test_methods_do_not_modify_their_inputs():
    torch.manual_seed(0)
    tensors = [torch.randn(5, 4) for _ in range(3)]
    base = torch.randn(5, 4)
    copies = [t.clone() for t in tensors] + [base.clone()]
    for method in ("sma", "task_arithmetic", "ties", "dare_linear", "dare_ties"):
        params = MergeParams(density=0.5)
        MERGE_METHODS.get(method)(tensors, base=base if method != "sma" else None, params=params, name="x")
    assert all(torch.equal(a, b) for a, b in zip(tensors + [base], copies))


def test_registry_lists_methods_and_refuses_unknown():
    assert set(MERGE_METHODS.names()) == {"sma", "ema", "wma", "linear", "task_arithmetic", "ties",
                                          "dare_linear", "dare_ties", "slerp"}
    with pytest.raises(KeyError, match="registered: dare_linear, dare_ties, ema"):
        MERGE_METHODS.get("average")
    with pytest.raises(KeyError, match="already registered"):
        MERGE_METHODS.add("sma", lambda *a, **k: None)


@pytest.mark.parametrize("method, params, n, has_base, message", [
    ("ema", {}, 2, False, "needs 'alpha'"),
    ("linear", {}, 2, False, "needs 'weights'"),
    ("linear", {"weights": [1, 2, 3]}, 2, False, "3 weights given for 2 inputs"),
    ("linear", {"weights": [1, -1]}, 2, False, "sum to 0"),
    ("ties", {"density": 0.5}, 2, False, "needs a base model"),
    ("ties", {}, 2, True, "needs 'density'"),
    ("slerp", {"t": 0.5}, 3, False, "exactly 2 inputs"),
    ("wma", {"alpha": 0.5}, 2, False, r"'wma' does not use \['alpha'\]"),
    ("sma", {"lam": 2.0}, 2, False, "does not use"),
])
def test_check_params_refuses(method, params, n, has_base, message):
    with pytest.raises(ValueError, match=message):
        check_params(method, MergeParams(**params), n, has_base)


@pytest.mark.parametrize("field, value", [("alpha", 0.0), ("alpha", 1.5), ("density", 0.0), ("t", 1.1)])
def test_params_out_of_range(field, value):
    with pytest.raises(ValueError, match=field):
        MergeParams(**{field: value})
