"""The teacher: a frozen model of its own (teacher.path) that scores the student's samples for on-policy
distillation (recipe=distill; hybridflow/algos/distill.py).

It is the reference's shape with another model: sharded with FSDP2, never updated, scoring the sampled
tokens with the same packing, token budgets and temperature as the reference, in its own dtype
(teacher.dtype, or model.dtype). Its tokenizer is the student's (refused before start otherwise,
hybridflow/checks/preflight.py), so its log-prob of token y_t is of the very token the student sampled.
"""

from __future__ import annotations

import time

import torch

from hybridflow.batch import Batch
from hybridflow.controller import Dispatch, register
from hybridflow.training.packing import runs_packed
from hybridflow.training.sequences import micro_batch_rows, response_topk
from hybridflow.training.shared_prompts import shares_prompts
from workers.reference import ReferenceWorker


class TeacherWorker(ReferenceWorker):
    sequence_parallel_key = "teacher.sequence_parallel_size"  # its own model: its own heads, its own groups

    @register(Dispatch.DP_SPLIT)
    def compute_teacher_log_probs(self, batch: Batch) -> Batch:
        """`teacher_log_probs` (B, R), 0 outside `response_mask`; the pass's seconds in meta."""
        return self.scored(batch, "teacher_log_probs", "timing/teacher_forward_s")

    @register(Dispatch.DP_SPLIT)
    @torch.no_grad()
    def compute_teacher_topk(self, batch: Batch, k: int) -> Batch:
        """`teacher_topk_ids` and `teacher_topk_log_probs` (B, R, k): the teacher's k likeliest tokens at each
        response position and their log-probs at the sampling temperature (teacher.objective=topk), computed
        a micro-batch at a time; the pass's seconds in meta."""
        start = time.perf_counter()
        self.model.eval()
        batch = batch.to(self.ctx.device)
        ids, log_probs = [], []
        for rows in micro_batch_rows(batch, self.samples_per_micro_batch, self.tokens_per_micro_batch,
                                     runs_packed(self.model), shares_prompts(self.model)):
            micro_ids, micro_log_probs = response_topk(self.model, batch.index(rows), k, self.temperature)
            ids.append((rows, micro_ids.cpu()))
            log_probs.append(micro_log_probs.cpu())
        order = torch.tensor([row for rows, _ in ids for row in rows]).argsort()
        return Batch(tensors={"teacher_topk_ids": torch.cat([i for _, i in ids])[order],
                              "teacher_topk_log_probs": torch.cat(log_probs)[order]},
                     meta={"timing/teacher_forward_s": time.perf_counter() - start})
