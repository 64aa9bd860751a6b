"""The `hf` engine: generation with a Hugging Face model and its own KV cache, where vLLM is not
(the lent GPU machines, a model vLLM does not support, a reference to check vLLM against). Returns
the same Batch layout as the vLLM engine.

A decode loop of its own rather than `model.generate`: `generate` can only return the log-probs it
sampled from by keeping every step's scores (rows x response tokens x vocabulary floats: 128 x 512 x
151,936 in float32 is 40 GB), where this loop keeps one step's and gathers the sampled token's
log-prob from it. Each step is one forward pass of the new tokens over a KV cache preallocated for the batch
(hybridflow/training/kv_cache.py: the prompt's keys and values computed once, each step's written in place where
transformers' `DynamicCache` concatenates), sampled from the tempered, top-p filtered distribution
(what vLLM's `processed_logprobs` report). On the CPU the model's linear layers compute through oneDNN and its
attention takes grouped key and value heads as they are (hybridflow/training/decode_kernels.py: transformers'
defaults ran a decode 1.3x slower on SmolLM2), and an ended row's cache pages are given back to the system as it
leaves. The prefill computes the logits of the last prompt position
only (transformers' `logits_to_keep=1`): every position's would be rows x prompt x vocabulary (128 x 256
x 151,936 in bf16 is 10 GB) for one row of each.

A rank's rows decode in batches of at most `rollout.max_num_seqs` (vLLM's cap on sequences in one
batch), each with its own KV cache, allocated whole at its start (rows x (prompt + response) positions) and
freed before the next batch starts; outputs keep the rows' order. On a GPU with `rollout.compile_decode=true`
(off by default: not yet run on a GPU) the decode step runs at one shape
(transformers' `StaticCache` at full width for the most rows a batch has had, ended rows kept as padding, a
smaller batch padded) so that torch.compile captures it once (CUDA graphs, mode reduce-overhead); that cache is
the engine's, kept across calls, its memory returned at sleep.
Each sample draws from a stream of its own, seeded by its `sample_seed` (one uniform per response
token, drawn on the host before decoding, turned into a token through the distribution's cumulative
sum): its tokens do not depend on the batch it decodes in, so any `max_num_seqs` or rank count draws the
same samples (vLLM draws so with `rollout.seed_per_request`; without the key each row is seeded by its
index). Peak memory: the weights, one batch's KV cache (max_num_seqs x (prompt + response) tokens), one
step's logits.

Sleep (colocated with the actor): at `rollout.sleep_level` 2 (every sync rewrites every weight) the
weights are discarded, on any device (on a CPU it is host memory the actor's training gets back), and
the buffers no sync rewrites (rotary frequencies) kept aside and put back at wake-up; at level 1, on a
GPU, the weights go to host memory; the device's cached blocks are returned. The KV cache lives only
inside a `generate` call, so nothing else is held. The engine keeps a copy of the model of its own (a
sync loads the actor's weights into it); generating from the actor's own gathered weights is not done:
the actor's FSDP2 shards are gathered per layer and its parameters are in the training dtype.
"""

from __future__ import annotations

import time

import torch

from hybridflow.batch import Batch
from hybridflow.config.schema import RolloutConfig
from hybridflow.controller import Dispatch, WorkerContext, register
from workers.rollout import RolloutEngineBase
from hybridflow.training.decode_kernels import grouped_query_attention, onednn_linears
from hybridflow.training.kv_cache import CapturedSteps, LiveRowSteps, free_storage, refill_storage


class HFRollout(RolloutEngineBase):
    def __init__(self, ctx: WorkerContext, model_path: str, rollout: RolloutConfig, max_prompt_tokens: int,
                 eos_token_id: int, pad_token_id: int, verifiable_weights: bool = False,
                 trust_remote_code: bool = False) -> None:
        self.ctx, self.model_path, self.cfg = ctx, model_path, rollout
        self.max_prompt_tokens = max_prompt_tokens
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.trust_remote_code = trust_remote_code
        self.model = None
        self._compiled = self._static = None  # on a GPU: the captured step and its StaticCache (rows, positions, cache)

    @register(Dispatch.ONE_TO_ALL)
    def start(self) -> float:
        from transformers import AutoModelForCausalLM

        from hybridflow.resharding.receiver import ModuleReceiver

        start = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=getattr(torch, self.cfg.dtype.value),
                                                          trust_remote_code=self.trust_remote_code)
        self.model.to(self.ctx.device).eval().requires_grad_(False)
        if self.cfg.fp32_lm_head:  # rollout.fp32_lm_head: the head's matmul and logits in float32
            from hybridflow.training.fsdp import fp32_output_head

            fp32_output_head(self.model)
        if self.ctx.device == "cpu":  # transformers' defaults are slow at a decode's shapes on the CPU
            grouped_query_attention(self.model)
            onednn_linears(self.model)
        self.sleep_level = self.cfg.sleep_level or 1  # null outside a HybridFlowConfig: keep the weights
        self.serve_weights(ModuleReceiver(self.model, self.pad_token_id))
        return time.perf_counter() - start

    def release(self) -> bool:
        """Level 2: the weights discarded (their shapes kept) and the buffers set aside in host memory, on
        any device; level 1: on a GPU the weights to host memory, on the CPU nothing. The allocator's
        cached blocks returned. On a GPU the captured step's StaticCache freed too, its tensors kept (`free_storage`)."""
        if self._static is not None:
            free_storage(self._static[2])
        if self.sleep_level == 2:
            self._buffers = {n: b.to("cpu", copy=True) for n, b in self.model.named_buffers()}
            self._shapes = {n: p.shape for n, p in self.model.named_parameters()}
            for t in [*self.model.parameters(), *self.model.buffers()]:
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        elif self.ctx.device == "cuda":
            self.model.to("cpu")
        else:
            return False
        if self.ctx.device == "cuda":
            torch.cuda.empty_cache()
        return True

    def restore(self, parts: list[str]) -> None:
        """The weights back: after level 2 allocated as NaN (a sync fills them) with the buffers put back,
        after level 1 moved from host memory. The KV cache is made by each generate call, but for the captured
        step's StaticCache on a GPU, whose storage comes back with the KV cache."""
        if "kv_cache" in parts and self._static is not None:
            refill_storage(self._static[2])
        if "weights" not in parts:
            return
        if getattr(self, "_shapes", None) is None:
            self.model.to(self.ctx.device)
            return
        for name, param in self.model.named_parameters():  # NaN until a load writes it: a weight no load rewrote
            # can never hold, by the allocator's reuse of its freed block, the very values it held before the
            # sleep, and pass the reload's checksums by chance (tests/e2e/test_guards.py)
            param.data = torch.full(self._shapes[name], float("nan"), dtype=param.dtype, device=self.ctx.device)
        for name, buffer in self.model.named_buffers():
            buffer.data = self._buffers[name].to(self.ctx.device)
        self._shapes = self._buffers = None

    @register(Dispatch.DP_SPLIT)
    @torch.no_grad()
    def generate(self, prompts: Batch, greedy: bool = False) -> Batch:
        """Same contract as VLLMRollout.generate: response ids, mask, sampler log-probs, version, text. The
        rows decode in batches of at most rollout.max_num_seqs, in order."""
        sample = not greedy and self.cfg.temperature > 0
        draws = self._draws(prompts) if sample else None  # (B, R) each sample's uniforms, or None: greedy
        parts = [self._decode(prompts["prompt_ids"][rows].to(self.ctx.device),
                              prompts["prompt_mask"][rows].to(self.ctx.device),
                              None if draws is None else draws[rows].to(self.ctx.device))
                 for rows in torch.arange(len(prompts)).split(self.cfg.max_num_seqs)]
        ids, response_mask, sampler, running = (torch.cat(p) for p in zip(*parts))
        finish = ["length" if bool(r) else "stop" for r in running]  # still running at the limit: cut
        version = torch.full((len(prompts),), self.receiver.version, dtype=torch.long)
        return prompts.union(Batch(tensors={"response_ids": ids, "response_mask": response_mask,
                                            "sampler_log_probs": sampler, "behavior_version": version},
                                   objects={"response": self._texts(ids, response_mask), "finish_reason": finish}))

    def _draws(self, prompts: Batch) -> torch.Tensor:
        """(B, R) float64 uniforms in [0, 1): row i's from a generator seeded by its `sample_seed` (its index
        without one), so a sample's draws are its own whatever batch it decodes in."""
        seeds = prompts["sample_seed"].tolist() if "sample_seed" in prompts else range(len(prompts))
        width = self.cfg.max_response_tokens
        return torch.stack([torch.rand(width, dtype=torch.float64, generator=torch.Generator().manual_seed(int(s)))
                            for s in seeds])

    def _decode(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, draws: torch.Tensor | None):
        """One batch's decode loop over its own KV cache: (response ids, response mask, sampler log-probs,
        rows still running at the limit), on the CPU. Prompts are left-padded; a row's EOS is its last response
        token. `draws` (B, R): each row's uniforms (None: greedy). A row that has ended leaves the batch and the
        KV cache (vLLM computes only live sequences too): the steps after it cost only the rows still running."""
        first = int(prompt_mask.any(0).long().argmax())  # left padding: the columns before it are padding in every row
        prompt_ids, prompt_mask = prompt_ids[:, first:], prompt_mask[:, first:]  # not computed, not cached
        rows, width, device = len(prompt_ids), self.cfg.max_response_tokens, prompt_ids.device
        ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long, device=device)  # (B, R)
        response_mask = torch.zeros((rows, width), dtype=torch.bool, device=device)
        sampler = torch.zeros((rows, width), dtype=torch.float32, device=device)
        running = torch.zeros(rows, dtype=torch.bool, device=device)
        live = torch.arange(rows, device=device)  # the batch rows still decoding, in cache order
        positions = (prompt_mask.long().cumsum(1) - 1).clamp(min=0)  # (B, P): left padding shifts nothing
        steps = self._steps(prompt_mask)
        logits = steps.prefill(prompt_ids, positions)  # (B, V)
        position = positions[:, -1:] + 1
        for t in range(width):
            log_probs = self._processed_log_probs(logits.float(), draws is not None)  # (L, V): this step's only
            token = log_probs.argmax(-1) if draws is None else _inverse_cdf(log_probs.exp(), draws[live, t])
            ids[live, t], response_mask[live, t] = token, True
            sampler[live, t] = log_probs.gather(-1, token[:, None])[:, 0]
            going = token != self.eos_token_id
            if t == width - 1 or not going.any():
                running[live] = going  # cut at the limit
                break
            if not going.all():  # ended rows leave the batch and the cache
                keep = going.nonzero()[:, 0]
                live, token, position = live[keep], token[keep], position[keep]
                steps.drop(keep)
            logits = steps.next(token, position)
            position = position + 1
        return ids.cpu(), response_mask.cpu(), sampler.cpu(), running.cpu()

    def _steps(self, prompt_mask: torch.Tensor):
        """The batch's forward passes: over a preallocated cache of its live rows (the CPU), or on a GPU at one
        fixed shape through the engine's captured step (`CapturedSteps`, the cache kept across batches)."""
        positions = prompt_mask.shape[1] + self.cfg.max_response_tokens
        if prompt_mask.device.type != "cuda" or not self.cfg.compile_decode:
            return LiveRowSteps(self.model, prompt_mask, positions)
        positions = max(positions, self.max_prompt_tokens + self.cfg.max_response_tokens)  # one width for all
        if self._compiled is None:
            self._compiled = torch.compile(self.model, mode="reduce-overhead", dynamic=False)
        if self._static is None or self._static[0] < len(prompt_mask) or self._static[1] != positions:
            from transformers import StaticCache

            self._static = None  # the smaller cache freed before the larger is allocated: shapes only grow
            self._static = (len(prompt_mask), positions, StaticCache(config=self.model.config, max_cache_len=positions))
        capacity, _, cache = self._static
        return CapturedSteps(self.model, self._compiled, cache, capacity, positions, prompt_mask, self.pad_token_id)

    def _processed_log_probs(self, logits: torch.Tensor, sample: bool) -> torch.Tensor:
        """(B, V) log-probs of the distribution sampled from: tempered, then top-p filtered (the
        smallest set of tokens whose probability reaches top_p; the rest -inf) after the top-k filter, in
        vLLM's order, as vLLM reports them."""
        if not sample:
            return torch.log_softmax(logits, dim=-1)
        logits = logits / self.cfg.temperature
        if 0 < self.cfg.top_k < logits.shape[-1]:
            kth = logits.topk(self.cfg.top_k, dim=-1).values[..., -1:]  # (B, 1) the k-th largest
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.cfg.top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            before = sorted_logits.softmax(-1).cumsum(-1) - sorted_logits.softmax(-1)  # mass before each token
            drop = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, before >= self.cfg.top_p)
            logits = logits.masked_fill(drop, float("-inf"))
        return torch.log_softmax(logits, dim=-1)

    def _texts(self, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
        if not hasattr(self, "_tokenizer"):
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=self.trust_remote_code)
        return [self._tokenizer.decode(row[m], skip_special_tokens=True) for row, m in zip(ids, mask)]


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """(L,) the token each row's uniform in [0, 1) falls on in its distribution (L, V): the first token
    whose cumulative probability passes uniform x total. The sum in float64 (a float32 one over 151,936
    tokens may round past a boundary); a zero-probability token adds nothing to it, so it is never chosen,
    and a uniform rounding to the total takes the last token that has any probability."""
    cdf = probs.double().cumsum(-1)  # (L, V)
    total = cdf[:, -1:].contiguous()  # (L, 1)
    token = torch.searchsorted(cdf, uniforms[:, None].to(cdf) * total, right=True)
    return torch.minimum(token, torch.searchsorted(cdf, total))[:, 0]  # the first index reaching the total

