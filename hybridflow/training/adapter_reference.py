"""The reference of a LoRA run: the trained model with its adapter disabled, which is the starting
model, so a LoRA run starts no reference role (recipes/ppo.py, recipes/dpo.py ask the actor).

A worker that mixes this in has `ctx`, `cfg` (its role's config node: `samples_per_micro_batch`,
`tokens_per_micro_batch`), `temperature` (the sampler's) and `model`; the calls raise without a
LoRA adapter, where the reference role computes the same figures (workers/reference.py).
"""

from __future__ import annotations

import time

import torch

from hybridflow.batch import Batch
from hybridflow.controller import Dispatch, register
from hybridflow.training.sequences import log_probs_and_entropy, pair_log_probs


class AdapterReferenceMixin:
    @register(Dispatch.DP_SPLIT)
    @torch.no_grad()
    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        """`ref_log_probs` (B, R) with the adapter disabled, 0 outside `response_mask`; the pass's seconds in meta."""
        start = time.perf_counter()
        with self._adapter_disabled("compute_ref_log_probs"):
            log_probs, _ = log_probs_and_entropy(self.model, batch.to(self.ctx.device), self.cfg.samples_per_micro_batch,
                                                 self.temperature, self.cfg.tokens_per_micro_batch, with_entropy=False)
        return Batch(tensors={"ref_log_probs": log_probs.cpu()},
                     meta={"timing/reference_forward_s": time.perf_counter() - start})

    @register(Dispatch.DP_SPLIT)
    @torch.no_grad()
    def compute_ref_pair_log_probs(self, pairs: Batch, per_token: bool = False) -> Batch:
        """`ref_chosen_log_probs` / `ref_rejected_log_probs` (B,) of a pair batch with the adapter disabled:
        each response's summed log-probability, or its mean per token with `per_token`."""
        with self._adapter_disabled("compute_ref_pair_log_probs"):
            return pair_log_probs(self.model, pairs.to(self.ctx.device), self.cfg.samples_per_micro_batch,
                                  self.cfg.tokens_per_micro_batch, per_token, prefix="ref_")

    def _adapter_disabled(self, call: str):
        """The model's context with its LoRA adapter off; refuses a model without one, naming `call`."""
        if not hasattr(self.model, "disable_adapter"):
            raise RuntimeError(f"{call} on the actor needs actor.lora.rank > 0; "
                               "without LoRA the reference role computes reference log-probs")
        return self.model.disable_adapter()
