"""The reference: frozen log-probs of the initial policy, for the KL penalty or KL loss.

A separate copy of the starting model, sharded with FSDP2 like the actor but never updated.
(With a LoRA actor the reference is the actor with its adapter disabled instead — see
hybridflow.training.adapter_reference — and this role is not started.)
"""

from __future__ import annotations

import time

import torch

from hybridflow.batch import Batch
from hybridflow.controller import Dispatch, WorkerContext, register
from hybridflow.training.fsdp import fp32_output_head, load_model, shard_model
from hybridflow.training.packing import choose_packing
from hybridflow.training.shared_prompts import choose_sharing
from hybridflow.training.sequences import log_probs_and_entropy, pair_log_probs
from hybridflow.training.ulysses import split_sequences


class ReferenceWorker:
    # the key that sets `sequence_parallel_size`, named where it is refused: the reference is the actor's
    # starting model and splits its rows as the actor does
    sequence_parallel_key = "actor.sequence_parallel_size"

    def __init__(self, ctx: WorkerContext, *, model_path: str, dtype: str, keep_dropout: bool,
                 samples_per_micro_batch: int, temperature: float, trust_remote_code: bool,
                 pack_sequences: bool | None = None, tokens_per_micro_batch: int | None = None,
                 fp32_lm_head: bool = False, share_prompts: bool | None = None,
                 sequence_parallel_size: int = 1) -> None:
        """Values from the config, built by recipes/roles.py: `model.dtype` (frozen, so the parameters
        are held in the compute dtype: no master copy), `model.keep_dropout`,
        `actor.samples_per_micro_batch`, `rollout.temperature`, `model.trust_remote_code`, `model.pack_sequences`,
        `actor.tokens_per_micro_batch`, `actor.fp32_lm_head` (the reference scores as the actor does),
        `model.share_prompts`, and `sequence_parallel_key`'s value: each packed row split over that many
        ranks (hybridflow/training/ulysses.py; the role's replicas span them)."""
        self.ctx, self.model_path, self.dtype, self.keep_dropout = ctx, model_path, dtype, keep_dropout
        self.samples_per_micro_batch, self.temperature = samples_per_micro_batch, temperature
        self.trust_remote_code, self.pack_sequences = trust_remote_code, pack_sequences
        self.tokens_per_micro_batch, self.fp32_lm_head = tokens_per_micro_batch, fp32_lm_head
        self.share_prompts, self.sequence_parallel_size = share_prompts, sequence_parallel_size
        self.model = None

    @register(Dispatch.ONE_TO_ALL)
    def start(self) -> None:
        model = load_model(self.model_path, self.dtype, trust_remote_code=self.trust_remote_code,
                           keep_dropout=self.keep_dropout,
                           on_meta=self.ctx.world_size > 1 and self.ctx.rank != 0)
        model.requires_grad_(False)
        packed = choose_packing(model, self.pack_sequences)
        choose_sharing(model, self.share_prompts, packed)
        split_sequences(model, packed, self.sequence_parallel_size, self.ctx, self.pack_sequences,
                        self.sequence_parallel_key)
        self.model = shard_model(model, self.ctx.device)
        if self.fp32_lm_head:
            fp32_output_head(self.model)

    @register(Dispatch.DP_SPLIT)
    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        """`ref_log_probs` (B, R), 0 outside `response_mask`; the pass's seconds in meta."""
        return self.scored(batch, "ref_log_probs", "timing/reference_forward_s")

    def scored(self, batch: Batch, key: str, timing_key: str) -> Batch:
        """The frozen model's log-probs of the batch's response tokens as `key` (B, R), 0 outside
        `response_mask`, and the pass's seconds as `timing_key` in meta."""
        start = time.perf_counter()
        log_probs, _ = log_probs_and_entropy(self.model, batch.to(self.ctx.device), self.samples_per_micro_batch,
                                             self.temperature, self.tokens_per_micro_batch, with_entropy=False)
        return Batch(tensors={key: log_probs.cpu()}, meta={timing_key: time.perf_counter() - start})

    @register(Dispatch.DP_SPLIT)
    def compute_ref_pair_log_probs(self, pairs: Batch, per_token: bool = False) -> Batch:
        """`ref_chosen_log_probs` / `ref_rejected_log_probs` (B,) of a pair batch (recipe=dpo): each
        response's summed log-probability at temperature 1, or its mean per token with `per_token`."""
        return pair_log_probs(self.model, pairs.to(self.ctx.device), self.samples_per_micro_batch,
                              self.tokens_per_micro_batch, per_token, prefix="ref_")

    @register(Dispatch.ONE_TO_ALL)
    def load_state_from(self, weights: dict[str, torch.Tensor]) -> None:
        """Replace the reference weights (e.g. with an EMA of the actor, from a merge hook)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.model, weights, options=StateDictOptions(full_state_dict=True))

    @register(Dispatch.RANK_ZERO)
    def full_state_dict(self) -> dict:
        """Collective: the full (unsharded) weights on the CPU; rank 0's copy is returned."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
