"""On-policy distillation over the teacher's top-k tokens (teacher.objective=topk; docs/distillation.md): at
each sampled response position the student's distribution is pulled toward the teacher's, both renormalised
over the teacher's k likeliest tokens, by GKD's generalised JSD (hybridflow.algos.distill `topk_divergence`;
β = 0 forward KL, β = 1 reverse KL). A supervised loss on the student's own samples: no advantage, no ratio,
one pass over each batch (its samples are the current policy's)."""

from __future__ import annotations

import torch

from hybridflow.algos import aggregate_loss, masked_mean, topk_divergence
from hybridflow.batch import Batch
from hybridflow.training.objectives.base import Objective
from hybridflow.training.sequences import loss_mask, response_log_probs_at


class TopKDistillObjective(Objective):
    """`beta`: GKD's β (teacher.beta); `temperature`: the sampler's, at which the teacher's top-k log-probs
    were computed (workers/teacher.py `compute_teacher_topk`). Needs the teacher's `teacher_topk_ids` and
    `teacher_topk_log_probs` (B, R, k)."""

    epochs = 1
    fix = "or check the teacher's top-k log-probs for NaN"

    def __init__(self, beta: float, temperature: float = 1.0) -> None:
        self.beta, self.temperature = beta, temperature
        self.needs = (*Objective.needs, "teacher_topk_ids", "teacher_topk_log_probs")

    def loss(self, model: torch.nn.Module, micro: Batch, counts: dict[str, float]) -> tuple[torch.Tensor, dict]:
        mask = loss_mask(micro)
        student = response_log_probs_at(model, micro, micro["teacher_topk_ids"], self.temperature)
        divergence = topk_divergence(student_log_probs_at_topk=student, teacher_topk_log_probs=micro["teacher_topk_log_probs"],
                                     response_mask=mask, beta=self.beta)
        loss = aggregate_loss(divergence, mask, "token-mean", global_token_count=counts["global_token_count"])
        covered = student.detach().exp().sum(-1)  # the student's probability mass on the teacher's top k
        return loss, {"distill/topk_divergence": masked_mean(divergence.detach(), mask),
                      "distill/student_topk_mass": masked_mean(covered, mask)}
