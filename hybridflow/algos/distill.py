"""Distillation signals: what a teacher's scores of the student's own samples add to each token's advantage.

Every entry of `DISTILLATION_SIGNALS` has one keyword-only signature (see the registry) and returns
`(signal, stats)`: a (B, R) per-token signal, 0 outside the mask, and floats.

  reverse_kl  On-policy distillation with the per-token reverse KL as the reward (Agarwal et al. 2024,
              GKD with λ = 1 and the reverse KL; Qwen3's on-policy distillation; the Thinking Machines
              post "On-Policy Distillation", 2025): the student samples y, the teacher scores the same
              tokens, and signal_t = log π_teacher(y_t | y_<t) − log π_student(y_t | y_<t). Each token's
              signal is its own (no discount, no sum over later tokens: the estimate of −KL(π_student ‖
              π_teacher) at that position), so a token the teacher finds likelier than the student does
              is pushed up. The recipe adds `coef · signal` to the reward's advantage and trains it with
              the policy loss, whose ratio against π_old and clipping correct samples drawn by older
              weights, as for any advantage (docs/distillation.md).

The losses over the teacher's top-k tokens (`topk_divergence`, the `topk` objective of
hybridflow/training/objectives/distill.py) compare the two distributions at each sampled position instead of
one token's log-probs: the teacher's k likeliest tokens, both distributions renormalised over those k, and
the generalised Jensen-Shannon divergence of GKD (Agarwal et al. 2024, eq. 1) with TRL's convention for β:
β = 0 is the forward KL(teacher ‖ student), β = 1 the reverse KL(student ‖ teacher), between them
β KL(teacher ‖ m) + (1 − β) KL(student ‖ m) with the mixture m = β teacher + (1 − β) student.

The student's log-probs are the proximal policy's (π_old: the sampler's or the actor's recomputed ones,
whichever the update clips against), at the sampling temperature; the teacher's at the same temperature
(workers/teacher.py), so the two distributions are compared as sampled.
"""

from __future__ import annotations

import torch

from hybridflow.algos.masked import check_mask, masked_mean
from hybridflow.registry import Registry

DISTILLATION_SIGNALS: Registry = Registry(
    "distillation signal",
    signature="fn(*, teacher_log_probs, student_log_probs, response_mask) -> (signal (B, R), stats: dict[str, float])",
)


@DISTILLATION_SIGNALS.register("reverse_kl")
def reverse_kl(*, teacher_log_probs: torch.Tensor, student_log_probs: torch.Tensor, response_mask: torch.Tensor
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """signal_t = log π_teacher(y_t) − log π_student(y_t) on the sampled tokens, 0 elsewhere; stats: the
    per-token reverse KL estimate (the mean of −signal), and each side's mean log-prob."""
    check_mask(response_mask, teacher_log_probs, name="response_mask")
    if teacher_log_probs.shape != student_log_probs.shape:
        raise ValueError(f"reverse_kl: teacher log-probs {tuple(teacher_log_probs.shape)} and student log-probs "
                         f"{tuple(student_log_probs.shape)} must have one shape (B, R)")
    signal = (teacher_log_probs.float() - student_log_probs.float()) * response_mask
    return signal, {"reverse_kl": float(masked_mean(-signal, response_mask)),
                    "teacher_log_prob_mean": float(masked_mean(teacher_log_probs.float(), response_mask)),
                    "student_log_prob_mean": float(masked_mean(student_log_probs.float(), response_mask))}


def generalized_jsd(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, beta: float) -> torch.Tensor:
    """GKD's generalised JSD over the last dimension of two log-distributions (…, k) -> (…), in TRL's
    convention: β = 0 the forward KL(teacher ‖ student), β = 1 the reverse KL(student ‖ teacher)."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"generalized_jsd: beta={beta} must be in [0, 1] (0: forward KL, 1: reverse KL)")
    student_p, teacher_p = student_log_probs.exp(), teacher_log_probs.exp()
    if beta == 0.0:
        return (teacher_p * (teacher_log_probs - student_log_probs)).sum(-1)
    if beta == 1.0:
        return (student_p * (student_log_probs - teacher_log_probs)).sum(-1)
    beta_t = torch.tensor(beta, dtype=student_log_probs.dtype, device=student_log_probs.device)
    mixture = torch.logsumexp(torch.stack([teacher_log_probs + beta_t.log(), student_log_probs + (-beta_t).log1p()]),
                              dim=0)
    return beta * (teacher_p * (teacher_log_probs - mixture)).sum(-1) + \
        (1 - beta) * (student_p * (student_log_probs - mixture)).sum(-1)


def topk_divergence(*, student_log_probs_at_topk: torch.Tensor, teacher_topk_log_probs: torch.Tensor,
                    response_mask: torch.Tensor, beta: float) -> torch.Tensor:
    """(B, R) per-token generalised JSD between the student and the teacher over the teacher's top-k tokens:
    each side's log-probs at those k tokens (B, R, k), renormalised over them, 0 outside the mask."""
    check_mask(response_mask, student_log_probs_at_topk[..., 0], name="response_mask")
    student = student_log_probs_at_topk.float().log_softmax(-1)
    teacher = teacher_topk_log_probs.float().log_softmax(-1)
    return generalized_jsd(student, teacher, beta) * response_mask


def distillation_signal(name: str, **kwargs) -> tuple[torch.Tensor, dict[str, float]]:
    """The registered signal `name` (teacher.signal) computed on `kwargs`."""
    return DISTILLATION_SIGNALS.get(name)(**kwargs)
