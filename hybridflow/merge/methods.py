"""Merge methods: pure functions that combine one tensor from N checkpoints.

Every entry of `MERGE_METHODS` has one signature:

    fn(tensors: list[Tensor], *, base: Tensor | None, params: MergeParams, name: str) -> Tensor

`tensors` are the N inputs' copies of one tensor, oldest first and newest last, all fp32
and of one shape; `base` is the base model's copy (fp32, same shape) for the methods that
work on task vectors `tau_i = theta_i - base`, else None; `name` is the tensor's key, used
to derive DARE's per-tensor random seed. The result is fp32 and of the same shape.

The averaging methods (SMA, EMA, WMA, linear) and task arithmetic are linear in the
inputs. `linear_form` gives their weights so the streaming engine can accumulate one input
at a time into one fp32 buffer; the functions here use the same weights and the same order
of operations, so both paths give the same numbers. TIES, DARE and SLERP are not linear and
need all N copies of a tensor at once.

Conventions (see docs/merge.md):
- EMA starts its recursion from the oldest checkpoint: m_1 = theta_1,
  m_k = alpha * theta_k + (1 - alpha) * m_{k-1}. The result m_N gives theta_k (k >= 2) the
  weight alpha * (1 - alpha)^(N - k) and theta_1 the weight (1 - alpha)^(N - 1); the weights
  sum to 1. A larger alpha favours the newest checkpoints.
- WMA gives theta_k the weight k / (1 + 2 + ... + N): the newest is heaviest.
- `lam` (the CLI's --lambda) scales the merged task vector: out = base + lam * merged.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from hybridflow.registry import Registry

MERGE_METHODS: Registry[Callable[..., torch.Tensor]] = Registry(
    "merge method",
    "fn(tensors: list[Tensor], *, base: Tensor | None, params: MergeParams, name: str) -> Tensor",
)

# Methods that work on task vectors theta_i - base and therefore need a base model.
METHODS_NEEDING_BASE = frozenset({"task_arithmetic", "ties", "dare_linear", "dare_ties"})
# Built-in methods that never read the base model (given with them, a base model only serves
# to fold LoRA adapters).
METHODS_WITHOUT_BASE = frozenset({"sma", "ema", "wma", "linear", "slerp"})


@dataclass(frozen=True)
class MergeParams:
    """Hyper-parameters of every method; each method reads the fields it needs.

    alpha: EMA smoothing factor in (0, 1]; the weight of the newest checkpoint.
    weights: one weight per input (oldest first). linear: normalised to sum 1 when
        `normalize`; task_arithmetic / TIES / DARE: multiply each task vector (default 1).
    normalize: linear only; divide `weights` by their sum.
    lam: scale of the merged task vector (task_arithmetic, TIES, DARE).
    density: TIES: fraction of each task vector's entries kept (largest magnitudes);
        DARE: probability of keeping an entry (drop probability p = 1 - density).
    t: SLERP interpolation factor in [0, 1]: 0 gives the first input, 1 the second.
    seed: DARE's seed; the mask of one tensor depends only on (seed, tensor name, input index).
    """

    alpha: Optional[float] = None
    weights: Optional[tuple[float, ...]] = None
    normalize: bool = True
    lam: float = 1.0
    density: Optional[float] = None
    t: Optional[float] = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.alpha is not None and not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha={self.alpha} is outside (0, 1]; EMA needs e.g. alpha=0.2")
        if self.density is not None and not 0.0 < self.density <= 1.0:
            raise ValueError(f"density={self.density} is outside (0, 1]; e.g. density=0.5 keeps half")
        if self.t is not None and not 0.0 <= self.t <= 1.0:
            raise ValueError(f"t={self.t} is outside [0, 1]; t=0 gives the first input, t=1 the second")
        if self.weights is not None:
            object.__setattr__(self, "weights", tuple(float(w) for w in self.weights))
            if not all(math.isfinite(w) for w in self.weights):
                raise ValueError(f"weights={list(self.weights)} contain NaN or Inf")
        if not math.isfinite(self.lam):
            raise ValueError(f"lam={self.lam} is not finite")


# The parameters each built-in method reads; setting another one is refused as a likely mistake.
USED_PARAMS = {
    "sma": (), "ema": ("alpha",), "wma": (), "linear": ("weights", "normalize"),
    "task_arithmetic": ("weights", "lam"), "ties": ("density", "lam", "weights"),
    "dare_linear": ("density", "lam", "weights", "seed"), "dare_ties": ("density", "lam", "weights", "seed"),
    "slerp": ("t",),
}


def check_params(method: str, params: MergeParams, n_inputs: int, has_base: bool) -> None:
    """Refuse a parameter set `method` cannot use, before any tensor is read."""
    if method in USED_PARAMS:
        defaults = MergeParams()
        unused = [f for f in vars(params) if getattr(params, f) != getattr(defaults, f) and f not in USED_PARAMS[method]]
        if unused:
            raise ValueError(f"method {method!r} does not use {unused}; it reads only "
                             f"{list(USED_PARAMS[method]) or 'no parameters'}")
    required = {"ema": ("alpha",), "linear": ("weights",), "ties": ("density",),
                "dare_linear": ("density",), "dare_ties": ("density",), "slerp": ("t",)}
    for field in required.get(method, ()):
        if getattr(params, field) is None:
            flag = {"alpha": "--alpha 0.2", "weights": "--weights W1 W2 ...",
                    "density": "--density 0.5", "t": "--t 0.5"}[field]
            raise ValueError(f"method {method!r} needs {field!r}; give it (CLI: {flag})")
    if params.weights is not None and len(params.weights) != n_inputs:
        raise ValueError(f"{len(params.weights)} weights given for {n_inputs} inputs; give one weight per input")
    if method == "linear" and params.normalize and sum(params.weights) == 0:
        raise ValueError(f"weights={list(params.weights)} sum to 0 and cannot be normalised")
    if method in METHODS_NEEDING_BASE and not has_base:
        raise ValueError(f"method {method!r} merges task vectors theta_i - base and needs a base model (--base)")
    if method == "slerp" and n_inputs != 2:
        raise ValueError(f"slerp interpolates between exactly 2 inputs, got {n_inputs}")
    if n_inputs < 1:
        raise ValueError("no inputs to merge")


# ---------------------------------------------------------------------------- linear family


@dataclass(frozen=True)
class LinearForm:
    """out = Σ_i weights[i] * theta_i, or, when `relative_to_base`,
    out = base + Σ_i weights[i] * (theta_i - base)."""

    weights: tuple[float, ...]
    relative_to_base: bool = False


def sma_weights(n: int) -> list[float]:
    return [1.0 / n] * n


def ema_weights(n: int, alpha: float) -> list[float]:
    # m_1 = theta_1 and m_k = alpha*theta_k + (1-alpha)*m_{k-1} unrolls to these weights.
    return [(1.0 - alpha) ** (n - 1)] + [alpha * (1.0 - alpha) ** (n - k) for k in range(2, n + 1)]


def wma_weights(n: int) -> list[float]:
    total = n * (n + 1) / 2
    return [k / total for k in range(1, n + 1)]


def linear_form(method: str, n: int, params: MergeParams) -> Optional[LinearForm]:
    """The weights of a method that is linear in its inputs, or None for the others."""
    if method == "sma":
        return LinearForm(tuple(sma_weights(n)))
    if method == "ema":
        return LinearForm(tuple(ema_weights(n, params.alpha)))
    if method == "wma":
        return LinearForm(tuple(wma_weights(n)))
    if method == "linear":
        weights = list(params.weights)
        if params.normalize:
            total = sum(weights)
            weights = [w / total for w in weights]
        return LinearForm(tuple(weights))
    if method == "task_arithmetic":
        weights = params.weights or (1.0,) * n
        return LinearForm(tuple(params.lam * w for w in weights), relative_to_base=True)
    return None


def combine_linear(tensors: list[torch.Tensor], base: Optional[torch.Tensor], form: LinearForm) -> torch.Tensor:
    """Apply a LinearForm to tensors held in memory (same arithmetic as the streaming path)."""
    acc = torch.empty_like(tensors[0], dtype=torch.float32)
    for index, (tensor, weight) in enumerate(zip(tensors, form.weights)):
        accumulate(acc, tensor, weight, base if form.relative_to_base else None, first=index == 0)
    if form.relative_to_base:
        acc.add_(base)
    return acc


def accumulate(acc: torch.Tensor, tensor: torch.Tensor, weight: float, base: Optional[torch.Tensor],
               first: bool = False) -> None:
    """acc += weight * tensor, or acc += weight * (tensor - base), in place; with `first`,
    acc is overwritten instead (so it need not be zeroed: same rounding as 0 + w * x).

    `tensor` may be any float dtype: add_ with a bf16/fp16 `tensor` and an fp32 `acc`
    converts element by element inside the kernel, so no fp32 copy of `tensor` is made.
    With a base, the difference is formed first (one fp32 temporary) because
    w*theta - w*base would lose the small task vector to cancellation.
    """
    if first:
        acc.copy_(tensor)
        if base is not None:
            acc.sub_(base)
        acc.mul_(weight)
    elif base is None:
        acc.add_(tensor, alpha=weight)
    else:
        acc.add_(torch.sub(tensor, base), alpha=weight)


def _linear_method(method: str) -> Callable[..., torch.Tensor]:
    def merge(tensors: list[torch.Tensor], *, base: Optional[torch.Tensor], params: MergeParams,
              name: str) -> torch.Tensor:
        form = linear_form(method, len(tensors), params)
        return combine_linear(tensors, base, form)

    merge.__name__ = merge.__qualname__ = method
    merge.__doc__ = f"{method}: see linear_form; linear in the inputs, so it streams."
    return merge


for _method in ("sma", "ema", "wma", "linear", "task_arithmetic"):
    MERGE_METHODS.add(_method, _linear_method(_method))


# ------------------------------------------------------------------------ TIES and DARE


def trim_by_magnitude(task_vector: torch.Tensor, density: float) -> torch.Tensor:
    """Keep the k = round(density * numel) entries of largest |value|, zero the rest (TIES step 1)."""
    k = int(round(density * task_vector.numel()))
    if k >= task_vector.numel():
        return task_vector.clone()
    flat = task_vector.flatten()
    kept = torch.zeros_like(flat)
    if k > 0:
        index = flat.abs().topk(k, sorted=False).indices
        kept[index] = flat[index]
    return kept.view_as(task_vector)


def dare_drop(task_vector: torch.Tensor, density: float, seed: int, name: str, index: int) -> torch.Tensor:
    """Drop each entry with probability p = 1 - density and rescale survivors by 1/(1-p) (DARE)."""
    if density >= 1.0:
        return task_vector.clone()
    generator = torch.Generator().manual_seed(tensor_seed(seed, name, index))
    keep = torch.rand(task_vector.shape, generator=generator) < density
    return task_vector * keep / density


def tensor_seed(seed: int, name: str, index: int) -> int:
    """A 63-bit seed from (seed, tensor name, input index): the same on every run and machine
    (Python's hash() is salted per process, so it is not used)."""
    digest = hashlib.sha256(f"{seed}\0{name}\0{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def disjoint_merge(task_vectors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """TIES steps 2-3: elect a sign per entry from the weighted sum, then average the entries
    whose sign agrees with it: Σ_i w_i tau_i [agree_i] / Σ_i w_i [agree_i] (0 where none agree).
    Zero entries never agree (their sign is 0), so trimmed entries do not dilute the mean."""
    total = torch.zeros_like(task_vectors[0])
    for tau, weight in zip(task_vectors, weights):
        total.add_(tau, alpha=weight)
    elected = torch.sign(total)
    numerator = torch.zeros_like(total)
    denominator = torch.zeros_like(total)
    for tau, weight in zip(task_vectors, weights):
        agree = (torch.sign(tau) == elected) & (tau != 0)
        numerator.add_(torch.where(agree, tau, 0.0), alpha=weight)
        denominator.add_(agree.to(torch.float32), alpha=weight)
    return torch.where(denominator != 0, numerator / denominator.clamp_min(1e-30), 0.0)


def _task_vectors(tensors: list[torch.Tensor], base: torch.Tensor) -> list[torch.Tensor]:
    return [tensor - base for tensor in tensors]


def _weights(params: MergeParams, n: int) -> list[float]:
    return list(params.weights) if params.weights is not None else [1.0] * n


@MERGE_METHODS.register("ties")
def ties(tensors: list[torch.Tensor], *, base: Optional[torch.Tensor], params: MergeParams,
         name: str) -> torch.Tensor:
    """TIES-Merging (Yadav et al. 2023): trim each task vector to its top-density magnitudes,
    elect signs, disjoint mean; out = base + lam * merged."""
    trimmed = [trim_by_magnitude(tau, params.density) for tau in _task_vectors(tensors, base)]
    return base + params.lam * disjoint_merge(trimmed, _weights(params, len(tensors)))


@MERGE_METHODS.register("dare_linear")
def dare_linear(tensors: list[torch.Tensor], *, base: Optional[torch.Tensor], params: MergeParams,
                name: str) -> torch.Tensor:
    """DARE (Yu et al. 2024) then task arithmetic: out = base + lam * Σ_i w_i drop(tau_i)."""
    merged = torch.zeros_like(base)
    for index, (tau, weight) in enumerate(zip(_task_vectors(tensors, base), _weights(params, len(tensors)))):
        merged.add_(dare_drop(tau, params.density, params.seed, name, index), alpha=weight)
    return base + params.lam * merged


@MERGE_METHODS.register("dare_ties")
def dare_ties(tensors: list[torch.Tensor], *, base: Optional[torch.Tensor], params: MergeParams,
              name: str) -> torch.Tensor:
    """DARE's random drop in place of TIES' magnitude trim, then sign election and disjoint mean."""
    dropped = [dare_drop(tau, params.density, params.seed, name, index)
               for index, tau in enumerate(_task_vectors(tensors, base))]
    return base + params.lam * disjoint_merge(dropped, _weights(params, len(tensors)))


# -------------------------------------------------------------------------------- SLERP

# |cos(angle)| above this: the two tensors are (anti-)parallel to fp32 precision and the
# SLERP formula divides by sin(angle) ~ 0, so linear interpolation is used instead.
COLINEAR_COS = 1.0 - 1e-6


@MERGE_METHODS.register("slerp")
def slerp(tensors: list[torch.Tensor], *, base: Optional[torch.Tensor], params: MergeParams,
          name: str) -> torch.Tensor:
    """Spherical interpolation between two tensors, each flattened to one vector:
    out = sin((1-t)Ω)/sin Ω * a + sin(tΩ)/sin Ω * b, with cos Ω = <a, b> / (|a| |b|).
    Falls back to (1-t) a + t b when |cos Ω| > COLINEAR_COS or either tensor is zero."""
    if base is not None:
        raise ValueError("slerp interpolates between its two inputs and takes no base model; drop --base")
    a, b = tensors
    t = params.t
    norm_a, norm_b = a.norm().item(), b.norm().item()
    cos = torch.dot(a.flatten(), b.flatten()).item() / (norm_a * norm_b) if norm_a and norm_b else 1.0
    if not math.isfinite(cos) or abs(cos) > COLINEAR_COS:
        return torch.lerp(a, b, t)
    omega = math.acos(max(-1.0, min(1.0, cos)))
    sin_omega = math.sin(omega)
    return a * (math.sin((1.0 - t) * omega) / sin_omega) + b * (math.sin(t * omega) / sin_omega)
