"""Rollout with Hugging Face `generate`: the fallback backend (no vLLM needed).

Slower than vLLM but dependable: useful for models vLLM does not support, and as a
reference to check vLLM against. Returns the same Batch layout as the vLLM rollout.
"""

from __future__ import annotations

import time

import torch

from hybridflow.batch import Batch
from hybridflow.config.schema import RolloutConfig
from hybridflow.controller import Dispatch, WorkerContext, register
from workers.rollout import ReceivingEnd


class HFRollout(ReceivingEnd):
    def __init__(self, ctx: WorkerContext, model_path: str, rollout: RolloutConfig, max_prompt_tokens: int,
                 eos_token_id: int, pad_token_id: int, verifiable_weights: bool = False,
                 trust_remote_code: bool = False) -> None:
        self.ctx, self.model_path, self.cfg = ctx, model_path, rollout
        self.max_prompt_tokens = max_prompt_tokens
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.trust_remote_code = trust_remote_code
        self.model = None

    @register(Dispatch.ONE_TO_ALL)
    def start(self) -> float:
        from transformers import AutoModelForCausalLM

        from hybridflow.resharding.receiver import ModuleReceiver, register_local

        start = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=getattr(torch, self.cfg.dtype.value),
                                                          trust_remote_code=self.trust_remote_code)
        self.model.to(self.ctx.device).eval().requires_grad_(False)
        self.receiver = ModuleReceiver(self.model, self.pad_token_id)
        register_local(self.ctx.group_name, self.receiver)
        return time.perf_counter() - start

    @register(Dispatch.DP_SPLIT)
    @torch.no_grad()
    def generate(self, prompts: Batch, greedy: bool = False) -> Batch:
        """Same contract as VLLMRollout.generate: response ids, mask, sampler log-probs, version, text."""
        width = self.cfg.max_response_tokens
        sample = not greedy and self.cfg.temperature > 0
        if sample and "sample_seed" in prompts:
            torch.manual_seed(int(prompts["sample_seed"][0]))  # one stream per chunk: reproducible per step
        out = self.model.generate(
            prompts["prompt_ids"].to(self.ctx.device), attention_mask=prompts["prompt_mask"].long().to(self.ctx.device),
            max_new_tokens=width, do_sample=sample, temperature=self.cfg.temperature if sample else None,
            top_p=self.cfg.top_p if sample else None, top_k=0 if sample else None, output_scores=True,
            return_dict_in_generate=True, eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id)
        new = out.sequences[:, prompts["prompt_ids"].shape[1]:].cpu()  # (B, <=R)
        scores = torch.stack(out.scores, dim=1).float().cpu()  # (B, <=R, V) after temperature / top-p
        log_probs = torch.log_softmax(scores, -1).gather(-1, new[..., None])[..., 0]
        is_eos = (new == self.eos_token_id).long()
        mask = (is_eos.cumsum(1) - is_eos) == 0  # up to and including the first EOS
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((len(prompts), width), dtype=torch.bool)
        sampler = torch.zeros((len(prompts), width), dtype=torch.float32)
        n = new.shape[1]
        ids[:, :n] = torch.where(mask, new, torch.full_like(new, self.pad_token_id))
        response_mask[:, :n] = mask
        sampler[:, :n] = torch.where(mask, log_probs, torch.zeros_like(log_probs))
        texts = self._decode(ids, response_mask)
        finish = ["stop" if bool(row.any()) else "length" for row in (new == self.eos_token_id)]
        version = torch.full((len(prompts),), self.receiver.version, dtype=torch.long)
        return prompts.union(Batch(tensors={"response_ids": ids, "response_mask": response_mask,
                                            "sampler_log_probs": sampler, "behavior_version": version},
                                   objects={"response": texts, "finish_reason": finish}))

    def _decode(self, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
        if not hasattr(self, "_tokenizer"):
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=self.trust_remote_code)
        return [self._tokenizer.decode(row[m], skip_special_tokens=True) for row, m in zip(ids, mask)]
