"""Preference losses: offline optimisation on (prompt, chosen, rejected) pairs.

Every entry of `PREFERENCE_LOSSES` takes, per pair, the policy's and the reference's log-probability
of the chosen and of the rejected response (B,) each, and returns `(loss, stats)`: the mean loss
over the pairs, and 0-dim tensors under the names TRL's DPOTrainer logs: `rewards/chosen`,
`rewards/rejected`, `rewards/margins`, `rewards/accuracies` (the implicit reward of a response is
beta x (log pi - log pi_ref)) and `logps/chosen`, `logps/rejected` (the policy's log-probs).
`LENGTH_NORMALISED` losses take each response's mean log-probability per token instead of its sum
(the caller divides by the response's tokens), as their papers do. The reference-free mode of the
reference-tied losses (TRL's `reference_free=True`) is these formulas with the reference log-probs
given as 0 (the caller's choice, `dpo.reference_free`).

  sigmoid   DPO (Rafailov et al. 2023, eq. 7): -log sigmoid(beta x h), h = (log pi_c - log ref_c) -
            (log pi_r - log ref_r). With `label_smoothing` = eps > 0 the conservative DPO of
            Mitchell 2023: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h).
  robust    Robust DPO (Chowdhury et al. 2024, eq. 8): the same two terms, the second subtracted,
            over (1 - 2 eps): unbiased under preference labels flipped with probability eps.
  hinge     SLiC's calibration loss (Zhao et al. 2023, eq. 1) on DPO's h, as TRL computes it:
            relu(1 - beta x h), beta the reciprocal of the margin.
  ipo       IPO (Azar et al. 2023, eq. 17): (h - 1 / (2 beta))^2 on mean per-token log-probs.
  simpo     SimPO (Meng et al. 2024, eq. 6): reference-free, -log sigmoid(beta (mean log pi_c -
            mean log pi_r) - gamma), `gamma` the target margin (`simpo_gamma`); the reference
            log-probs are ignored and its rewards are beta x mean log pi.

The formulas follow the papers, in the form TRL's DPOTrainer and CPOTrainer compute them. Each
function's default `beta` is its paper's (hybridflow/config/dpo.py `PREFERENCE_LOSS_BETAS`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridflow.registry import Registry

PREFERENCE_LOSSES: Registry = Registry(
    "preference loss",
    signature=(
        "fn(*, chosen_log_probs, rejected_log_probs, ref_chosen_log_probs, ref_rejected_log_probs, beta=0.1, "
        "label_smoothing=0.0, simpo_gamma=0.5) -> (loss scalar, stats: dict[str, 0-dim tensor]); (B,) inputs"
    ),
)
LENGTH_NORMALISED = frozenset({"ipo", "simpo"})


def _check(beta: float, label_smoothing: float, *tensors: torch.Tensor) -> None:
    if beta <= 0:
        raise ValueError(f"beta={beta} must be > 0 (the strength of the KL tie to the reference)")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 0.5): the assumed share of flipped labels")
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(f"the log-probs must be four (B,) tensors, one value per pair; got shapes {sorted(shapes)}")


def _stats(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, chosen_log_probs: torch.Tensor,
           rejected_log_probs: torch.Tensor) -> dict:
    """TRL's names: the implicit rewards' means, margin and accuracy, and the policy's mean log-probs."""
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {"rewards/chosen": chosen_rewards.mean(), "rewards/rejected": rejected_rewards.mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "logps/chosen": chosen_log_probs.detach().mean(), "logps/rejected": rejected_log_probs.detach().mean()}


def _implicit_rewards(chosen, rejected, ref_chosen, ref_rejected, beta, label_smoothing):
    """Checked inputs -> (beta x h, chosen rewards, rejected rewards), each (B,)."""
    _check(beta, label_smoothing, chosen, rejected, ref_chosen, ref_rejected)
    chosen_rewards = beta * (chosen - ref_chosen.detach())
    rejected_rewards = beta * (rejected - ref_rejected.detach())
    return chosen_rewards - rejected_rewards, chosen_rewards, rejected_rewards


def _smoothed(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-(1 - eps) log sigmoid(x) - eps log sigmoid(-x): the logistic loss with labels flipped at rate eps."""
    return -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing


@PREFERENCE_LOSSES.register("sigmoid")
def sigmoid(*, chosen_log_probs, rejected_log_probs, ref_chosen_log_probs, ref_rejected_log_probs, beta=0.1,
            label_smoothing=0.0, simpo_gamma=0.5):
    """DPO, conservative with label_smoothing > 0."""
    logits, chosen_rewards, rejected_rewards = _implicit_rewards(
        chosen_log_probs, rejected_log_probs, ref_chosen_log_probs, ref_rejected_log_probs, beta, label_smoothing)
    losses = _smoothed(logits, label_smoothing)
    return losses.mean(), _stats(chosen_rewards, rejected_rewards, chosen_log_probs, rejected_log_probs)


@PREFERENCE_LOSSES.register("robust")
def robust(*, chosen_log_probs, rejected_log_probs, ref_chosen_log_probs, ref_rejected_log_probs, beta=0.1,
           label_smoothing=0.0, simpo_gamma=0.5):
    """Robust DPO: unbiased under labels flipped with probability label_smoothing."""
    logits, chosen_rewards, rejected_rewards = _implicit_rewards(
        chosen_log_probs, rejected_log_probs, ref_chosen_log_probs, ref_rejected_log_probs, beta, label_smoothing)
    losses = (-F.logsigmoid(logits) * (1 - label_smoothing) + F.logsigmoid(-logits) * label_smoothing) / (
        1 - 2 * label_smoothing)
    return losses.mean(), _stats(chosen_rewards, rejected_rewards, chosen_log_probs, rejected_log_probs)


@PREFERENCE_LOSSES.register("hinge")
def hinge(*, chosen_log_probs, rejected_log_probs, ref_chosen_log_probs, ref_rejected_log_probs, beta=0.1,
          label_smoothing=0.0, simpo_gamma=0.5):
    """SLiC's hinge on DPO's log-ratio difference: relu(1 - beta h)."""
    logits, chosen_rewards, rejected_rewards = _implicit_rewards(
        chosen_log_probs, rejected_log_probs, ref_chosen_log_probs, ref_rejected_log_probs, beta, label_smoothing)
    losses = torch.relu(1 - logits)
    return losses.mean(), _stats(chosen_rewards, rejected_rewards, chosen_log_probs, rejected_log_probs)


@PREFERENCE_LOSSES.register("ipo")
def ipo(*, chosen_log_probs, rejected_log_probs, ref_chosen_log_probs, ref_rejected_log_probs, beta=0.1,
        label_smoothing=0.0, simpo_gamma=0.5):
    """IPO on mean per-token log-probs: (h - 1 / (2 beta))^2."""
    scaled, chosen_rewards, rejected_rewards = _implicit_rewards(
        chosen_log_probs, rejected_log_probs, ref_chosen_log_probs, ref_rejected_log_probs, beta, label_smoothing)
    losses = (scaled / beta - 1 / (2 * beta)) ** 2
    return losses.mean(), _stats(chosen_rewards, rejected_rewards, chosen_log_probs, rejected_log_probs)


@PREFERENCE_LOSSES.register("simpo")
def simpo(*, chosen_log_probs, rejected_log_probs, ref_chosen_log_probs, ref_rejected_log_probs, beta=2.0,
          label_smoothing=0.0, simpo_gamma=0.5):
    """SimPO: reference-free, on mean per-token log-probs, with a target margin simpo_gamma."""
    _check(beta, label_smoothing, chosen_log_probs, rejected_log_probs, ref_chosen_log_probs, ref_rejected_log_probs)
    losses = _smoothed(beta * (chosen_log_probs - rejected_log_probs) - simpo_gamma, label_smoothing)
    return losses.mean(), _stats(beta * chosen_log_probs, beta * rejected_log_probs, chosen_log_probs, rejected_log_probs)


def compute_preference_loss(name: str, **kwargs):
    """`PREFERENCE_LOSSES.get(name)(**kwargs)`: the one place a preference loss is picked by name."""
    return PREFERENCE_LOSSES.get(name)(**kwargs)
