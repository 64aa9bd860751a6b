"""The critic: a value head on a causal LM backbone, trained with the clipped value loss.

The model is the backbone with a one-output token-classification head (transformers'
`AutoModelForTokenClassification`, num_labels=1), initialised from the actor's starting
model; the head starts random. The value of response position t is read where the logits
predicting token t sit (position P-1+t): the state before token t is generated.
"""

from __future__ import annotations

import time

import torch

from hybridflow.algos import clipped_value_loss, micro_batch_stat
from hybridflow.batch import Batch
from hybridflow.config.schema import CriticConfig
from hybridflow.controller import Dispatch, WorkerContext, register
from hybridflow.training.fsdp import (
    accumulating,
    all_reduce_mean_dict,
    all_reduce_sum,
    build_optimizer,
    load_model,
    read_floats,
    shard_model,
)
from hybridflow.training.loss_scale import LossScale, clipped_step
from hybridflow.training.packing import choose_packing, pack, runs_packed
from hybridflow.training.shared_prompts import choose_sharing, shares_prompts
from hybridflow.training.state import TrainingStateMixin
from hybridflow.training.sequences import (
    loss_mask,
    micro_batch_rows,
    micro_batches,
    mini_batches,
    pad_response_width,
    trimmed_inputs,
)


def _values(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Values (B, R) at the positions that predict each response token (0 past every response)."""
    packed = pack(batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"],
                  share=shares_prompts(model)) if runs_packed(model) else None
    if packed is not None:  # real tokens only (hybridflow.training.packing)
        return packed.scatter(model(**packed.model_kwargs()).logits[0, packed.predicting, 0].float())
    inputs, prompt_len, width = trimmed_inputs(batch)  # all-padding columns cost compute and change nothing
    logits = model(**inputs).logits  # (B, p+r, 1)
    values = logits[:, prompt_len - 1 : prompt_len - 1 + width, 0].float()
    return pad_response_width(values, batch["response_ids"].shape[1])


class CriticWorker(TrainingStateMixin):
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
        choose_sharing(model, self.share_prompts, choose_packing(model, self.pack_sequences))
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
            values[torch.tensor(rows, device=values.device)] = _values(self.model, micro) * loss_mask(micro)
        return Batch(tensors={"values": values.cpu()},
                     meta={"timing/critic_forward_s": time.perf_counter() - start})

    @register(Dispatch.DP_SPLIT)
    def update_critic(self, batch: Batch) -> dict:
        """Clipped value-loss updates on `returns`, with `values` as the old values."""
        start = time.perf_counter()
        self.model.train()
        batch = batch.to(self.ctx.device)
        world = self.ctx.world_size
        rows = self.cfg.samples_per_mini_batch // world if self.cfg.samples_per_mini_batch else len(batch)
        generator = torch.Generator().manual_seed(self.seed * 7919 + self.updates)
        totals, n = {}, 0
        for _ in range(self.cfg.epochs_per_step):
            for mini in mini_batches(batch, rows, generator, shares_prompts(self.model)):
                for k, v in self._mini_batch(mini, world).items():
                    totals[k] = totals.get(k, 0.0) + v
                n += 1
        self.scheduler.step()
        self.updates += 1
        stats = {f"critic/{k}": v / n for k, v in totals.items()}
        stats["timing/critic_update_s"] = time.perf_counter() - start
        return all_reduce_mean_dict(stats)

    def _mini_batch(self, mini: Batch, world: int) -> dict:
        mask = loss_mask(mini)  # values are learned where the policy acts: on sampled tokens
        counts = {"global_token_count": all_reduce_sum(int(mask.sum())),
                  "global_sequence_count": all_reduce_sum(int(mask.any(1).sum()))}
        grad_norm = None
        while grad_norm is None:  # float16: a backward that overflowed runs again at half the loss scale
            weighted = self._accumulate(mini, world, counts)
            grad_norm = clipped_step(self.model, self.optimizer, self.loss_scale, self.cfg.optim.max_grad_norm,
                                     f"critic update {self.updates}; lower critic.optim.lr")
        weighted["grad_norm"] = grad_norm
        return weighted

    def _accumulate(self, mini: Batch, world: int, counts: dict) -> dict:
        """Zero the gradients, then every micro-batch's forward and backward (the loss times the loss scale)."""
        self.optimizer.zero_grad(set_to_none=True)
        weighted: dict = {}
        tokens = loss_mask(mini).sum().clamp(min=1)
        micros = micro_batches(mini, self.cfg.samples_per_micro_batch, self.cfg.tokens_per_micro_batch,
                               packed=runs_packed(self.model), share=shares_prompts(self.model))
        for micro in accumulating(self.model, micros):
            loss, stats = clipped_value_loss(
                values=_values(self.model, micro), old_values=micro["values"], returns=micro["returns"],
                response_mask=loss_mask(micro), clip_range=self.cfg.value_clip_range,
                aggregation=self.cfg.loss_aggregation, **counts)
            (loss * (world * self.loss_scale.scale)).backward()
            share = loss_mask(micro).sum() / tokens
            for k, v in stats.items():  # loss parts add up, means weigh by tokens: no split changes them
                weighted[k] = weighted.get(k, 0.0) + micro_batch_stat(k, v, share, world)
        read_floats(weighted)  # the one wait for the device in this mini-batch's micro-batches
        return weighted
