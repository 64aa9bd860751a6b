"""The teacher: a frozen model of its own (teacher.path) that scores the student's samples for on-policy
distillation (recipe=distill; hybridflow/algos/distill.py).

It is the reference's shape with another model: sharded with FSDP2, never updated, scoring the sampled
tokens with the same packing, token budgets and temperature as the reference, in its own dtype
(teacher.dtype, or model.dtype). Its tokenizer is the student's (refused before start otherwise,
hybridflow/preflight.py), so its log-prob of token y_t is of the very token the student sampled.
"""

from __future__ import annotations

from hybridflow.batch import Batch
from hybridflow.controller import Dispatch, register
from workers.reference import ReferenceWorker


class TeacherWorker(ReferenceWorker):
    @register(Dispatch.DP_SPLIT)
    def compute_teacher_log_probs(self, batch: Batch) -> Batch:
        """`teacher_log_probs` (B, R), 0 outside `response_mask`; the pass's seconds in meta."""
        return self.scored(batch, "teacher_log_probs", "timing/teacher_forward_s")
