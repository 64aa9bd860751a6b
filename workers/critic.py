"""The critic: a value head on a causal LM backbone, trained with the clipped value loss.

The model is the backbone with a one-output token-classification head (transformers'
`AutoModelForTokenClassification`, num_labels=1), initialised from the actor's starting
model; the head starts random. The value of response position t is read where the logits
predicting token t sit (position P-1+t): the state before token t is generated
(hybridflow.training.sequences.response_values). Its update is an objective (`ValueObjective`) run by
the loop the actor's updates run by too (hybridflow.training.loop).
"""

from __future__ import annotations

import time

import torch

from hybridflow.batch import Batch
from hybridflow.config.schema import CriticConfig
from hybridflow.controller import Dispatch, WorkerContext, register
from hybridflow.training.fsdp import build_optimizer, load_model, shard_model
from hybridflow.training.loop import TrainingLoopMixin
from hybridflow.training.loss_scale import LossScale
from hybridflow.training.objectives import ValueObjective
from hybridflow.training.packing import choose_packing, runs_packed
from hybridflow.training.shared_prompts import choose_sharing, shares_prompts
from hybridflow.training.state import TrainingStateMixin
from hybridflow.training.sequences import loss_mask, micro_batch_rows, response_values
from hybridflow.training.ulysses import split_sequences


class CriticWorker(TrainingStateMixin, TrainingLoopMixin):
    shuffle_seed_stride = 7919  # its mini-batches drawn apart from the actor's (hybridflow.training.loop)

    def __init__(self, ctx: WorkerContext, critic: CriticConfig, *, model_path: str, dtype: str, master_dtype: str,
                 keep_dropout: bool, total_steps: int, trust_remote_code: bool, seed: int,
                 pack_sequences: bool | None = None, share_prompts: bool | None = None) -> None:
        """`critic`: the `critic` config node; the rest as for the actor (recipes/roles.py)."""
        self.ctx, self.cfg = ctx, critic
        self.model_path, self.dtype, self.total_steps = model_path, dtype, total_steps
        self.master_dtype, self.keep_dropout = master_dtype, keep_dropout
        self.trust_remote_code, self.seed, self.pack_sequences = trust_remote_code, seed, pack_sequences
        self.share_prompts = share_prompts
        self.model = self.optimizer = self.scheduler = None
        self.updates = 0
        self.loss_scale = LossScale(dtype)  # float16: dynamic loss scaling (hybridflow.training.loss_scale)

    @register(Dispatch.ONE_TO_ALL)
    def start(self) -> None:
        torch.manual_seed(self.seed + 1)
        model = load_model(self.model_path, self.master_dtype, value_head=True, trust_remote_code=self.trust_remote_code,
                           keep_dropout=self.keep_dropout,
                           on_meta=self.ctx.world_size > 1 and self.ctx.rank != 0)
        packed = choose_packing(model, self.pack_sequences)
        choose_sharing(model, self.share_prompts, packed)
        split_sequences(model, packed, self.cfg.sequence_parallel_size, self.ctx, self.pack_sequences,
                        "critic.sequence_parallel_size")
        self.model = shard_model(model, self.ctx.device, compute_dtype=self.dtype)
        self.optimizer, self.scheduler = build_optimizer(self.model, self.cfg.optim, self.total_steps)

    @register(Dispatch.DP_SPLIT)
    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        start = time.perf_counter()
        self.model.eval()
        batch = batch.to(self.ctx.device)
        values = torch.zeros(batch["response_ids"].shape, dtype=torch.float32, device=batch["response_ids"].device)
        for rows in micro_batch_rows(batch, self.cfg.samples_per_micro_batch, self.cfg.tokens_per_micro_batch,
                                     packed=runs_packed(self.model), share=shares_prompts(self.model)):
            micro = batch.index(rows)
            values[torch.tensor(rows, device=values.device)] = response_values(self.model, micro) * loss_mask(micro)
        return Batch(tensors={"values": values.cpu()},
                     meta={"timing/critic_forward_s": time.perf_counter() - start})

    @register(Dispatch.DP_SPLIT)
    def update_critic(self, batch: Batch) -> dict:
        """Clipped value-loss updates on `returns`, with `values` as the old values (`ValueObjective`).
        Returns `critic/*` averaged over mini-batches and ranks (hybridflow.training.loop)."""
        start = time.perf_counter()
        stats = self.run_objective(batch, ValueObjective(self.cfg.value_clip_range, self.cfg.loss_aggregation),
                                   "critic")
        stats["timing/critic_update_s"] = time.perf_counter() - start
        return stats
