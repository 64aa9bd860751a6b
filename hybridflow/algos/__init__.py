"""Pure tensor math of RL post-training: advantages, policy/value losses, KL, entropy, aggregation.

One registry per kind (see `hybridflow.registry.Registry`), one signature per registry:
`ADVANTAGE_ESTIMATORS`, `POLICY_LOSSES`, `LOSS_AGGREGATIONS`, `KL_ESTIMATORS`,
`KL_CONTROLLERS`, `DISTILLATION_SIGNALS`. Tensors are batch-first (B, T) over response tokens; `response_mask` is
bool with True = a real response token. docs/algorithms.md lists every registered name.

The losses computed once per micro-batch (policy, KL, value) return their statistics as 0-dim
tensors on the loss's device: reading one (`float()`) makes the host wait for a GPU, so the
workers read a mini-batch's statistics together, once (`hybridflow.training.fsdp.read_floats`);
a loss registered from outside may return floats as well. Statistics computed once per step
(advantages, the KL penalty, behaviour weights) are floats.
"""

from hybridflow.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    check_estimator,
    compute_advantages,
    discounted_returns,
    gae_advantages,
    group_statistics,
)
from hybridflow.algos.aggregation import (
    LOSS_AGGREGATIONS,
    LOSS_PART_STATS,
    aggregate_loss,
    micro_batch_stat,
)
from hybridflow.algos.distill import DISTILLATION_SIGNALS, distillation_signal, generalized_jsd, topk_divergence
from hybridflow.algos.entropy import (
    entropy_bonus,
    entropy_from_logits,
    log_probs_from_logits,
    tempered_log_softmax_at,
    token_log_probs_and_entropy,
)
from hybridflow.algos.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_loss,
)
from hybridflow.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten
from hybridflow.algos.policy_loss import (
    POLICY_LOSSES,
    clipped_surrogate,
    compute_policy_loss,
    vanishes_at_zero_advantage,
)
from hybridflow.algos.value_loss import clipped_value_loss

__all__ = [
    "token_log_probs_and_entropy",
    "ADVANTAGE_ESTIMATORS",
    "DISTILLATION_SIGNALS",
    "distillation_signal",
    "generalized_jsd",
    "topk_divergence",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "LOSS_PART_STATS",
    "aggregate_loss",
    "micro_batch_stat",
    "apply_kl_penalty",
    "build_kl_controller",
    "check_estimator",
    "clipped_surrogate",
    "clipped_value_loss",
    "compute_advantages",
    "compute_policy_loss",
    "discounted_returns",
    "entropy_bonus",
    "entropy_from_logits",
    "gae_advantages",
    "group_statistics",
    "kl_loss",
    "log_probs_from_logits",
    "tempered_log_softmax_at",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "vanishes_at_zero_advantage",
]
