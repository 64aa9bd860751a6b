"""The `exact` engine: generation with the actor's own module, in the actor's processes, by the decode the
actor's π_old pass replays (hybridflow/training/exact_layout.py), so that the sampler's log-probs are the trainer's bit for bit: `rollout_mismatch/abs_diff_max` is 0.0 on
every step, in float32 and in bfloat16 (slime's "true on-policy" mode makes SGLang compute what
Megatron computes for the same end; docs/algorithms.md "Rollout correction").

It decodes as the hf engine does, over a KV cache, ended rows leaving the batch; the price of the equality
is the actor's π_old pass, which replays this decode rather than running one forward of the whole
sequence (docs/results/rollout_mismatch.md measures both against the hf engine). What it saves: a second
copy of the model and the weight sync (the receiver here loads nothing: the engine reads the actor's
parameters themselves, whatever their dtype, LoRA adapter and output head).

Decoding is a micro-batch at a time: the actor's `rows_per_forward` consecutive rows of this rank's
prompts, which are the rows its π_old pass reads together (the data-parallel split of the samples is
the split of the prompts they were generated from). Each step's token is drawn from the step's whole
tempered distribution — no top-p filter: the trainer computes the unfiltered one, and the config
refuses rollout.top_p < 1 here — with one generator per batch seeded by its first sample seed, as the
hf engine does. A finished row leaves the batch; a micro-batch stops when no row of any rank runs, every rank
together (the actor's FSDP forwards are collective).

The engine finds the actor's module through the meeting of the workers of its process (`meet`: the host
hands it the other workers once it has built them all; it keeps the one that `OffersModule`).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

import torch

from hybridflow.batch import Batch
from hybridflow.config.schema import RolloutConfig
from hybridflow.controller import Dispatch, WorkerContext, peer_with, register
from hybridflow.resharding.receiver import Receiver
from hybridflow.resharding.verify import probe_fits
from hybridflow.training.exact_layout import OfferedModule, OffersModule, layout_decode
from workers.rollout import RolloutEngineBase


class ExactRollout(RolloutEngineBase):
    def __init__(self, ctx: WorkerContext, model_path: str, rollout: RolloutConfig, max_prompt_tokens: int,
                 eos_token_id: int, pad_token_id: int, verifiable_weights: bool = False,
                 trust_remote_code: bool = False) -> None:
        self.ctx, self.model_path, self.cfg = ctx, model_path, rollout
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.trust_remote_code = trust_remote_code
        self.module_owner = None  # the worker of this process that offers its module (`meet`)

    def meet(self, peers: list) -> None:
        """Keep the worker of this process that offers the module to generate with (the actor)."""
        self.module_owner = peer_with(peers, OffersModule)

    def offered(self) -> OfferedModule:
        """The actor's module and the rows of one forward, asked of the actor each time (its start builds it)."""
        if self.module_owner is None:
            raise RuntimeError(
                f"rollout.backend=exact generates with the actor's own module, and no actor in this process (worker "
                f"group {self.ctx.group_name!r}) offered one: the exact engine runs only in the actor's processes "
                "(placement.roles.rollout on the actor's pool), built with the actor by a host, which introduces "
                "them (hybridflow/controller/context.py introduce)")
        return self.module_owner.offered_module()

    @register(Dispatch.ONE_TO_ALL)
    def start(self) -> float:
        """Nothing to load: the actor's module is asked for when the engine generates."""
        start = time.perf_counter()
        self.serve_weights(ActorModuleReceiver(self.offered, self.eos_token_id, self.pad_token_id))
        return time.perf_counter() - start

    @register(Dispatch.DP_SPLIT)
    @torch.no_grad()
    def generate(self, prompts: Batch, greedy: bool = False) -> Batch:
        """Same contract as HFRollout.generate: response ids, mask, sampler log-probs, version, text."""
        module = self.offered()
        sample = not greedy and self.cfg.temperature > 0
        generator = None
        if sample:
            generator = torch.Generator(self.ctx.device)
            generator.manual_seed(int(prompts["sample_seed"][0]) if "sample_seed" in prompts else 0)
        parts = [decode(module.model, micro.to(self.ctx.device), self.cfg.max_response_tokens, self.cfg.temperature,
                        self.eos_token_id, self.pad_token_id, generator)
                 for micro in prompts.select(["prompt_ids", "prompt_mask"]).split(module.rows_per_forward)]
        ids, response_mask, sampler, running = (torch.cat(p).cpu() for p in zip(*parts))
        finish = ["length" if bool(r) else "stop" for r in running]  # still running at the limit: cut
        version = torch.full((len(prompts),), self.receiver.version, dtype=torch.long)
        return prompts.union(Batch(tensors={"response_ids": ids, "response_mask": response_mask,
                                            "sampler_log_probs": sampler, "behavior_version": version},
                                   objects={"response": self._texts(ids, response_mask), "finish_reason": finish}))

    def _texts(self, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
        if not hasattr(self, "_tokenizer"):
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=self.trust_remote_code)
        return [self._tokenizer.decode(row[m], skip_special_tokens=True) for row, m in zip(ids, mask)]


def decode(model: torch.nn.Module, prompts: Batch, width: int, temperature: float, eos_token_id: int,
           pad_token_id: int, generator: torch.Generator | None, stop_at_eos: bool = True):
    """One micro-batch's decode loop in the exact layout (`layout_decode`): (response ids, response mask, sampler
    log-probs, rows still running at the limit), each (B, width) or (B,). Column t is drawn from the step's
    distribution (`generator`; None: greedy); a row's EOS is its last response token unless not `stop_at_eos`
    (the probe's fixed length). Collective under FSDP: every rank runs as many steps."""
    def draw(t: int, live: torch.Tensor, log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        token = torch.multinomial(log_probs.exp(), 1, generator=generator)[:, 0] if generator is not None \
            else log_probs.argmax(-1)
        return token, (token != eos_token_id) if stop_at_eos else torch.ones_like(token, dtype=torch.bool)

    return layout_decode(model, prompts, width, temperature, pad_token_id, draw)


class ActorModuleReceiver(Receiver):
    """The exact engine's end of the weight path. The engine computes with the actor's parameters
    themselves, so a sync has nothing to deliver: it needs no region of any tensor (the plan moves 0
    bytes, `weight_sync/min_bytes_per_rank` 0), its load draws no bucket (nothing is gathered or
    exchanged), it holds no parameter of its own to checksum (`weight_sync/verified_tensors` 0), and its
    probe is the engine's greedy decode of each probe prompt, which the actor scores in its usual layout."""

    def __init__(self, offered: Callable[[], OfferedModule], eos_token_id: int, pad_token_id: int) -> None:
        """`offered`: the engine's way to the actor's module (`ExactRollout.offered`)."""
        self.offered, self.eos_token_id, self.pad_token_id = offered, eos_token_id, pad_token_id

    def needed_boxes(self, shapes: dict[str, list[int]]) -> dict[str, tuple]:
        return {name: tuple((0, 0) for _ in shape) for name, shape in shapes.items()}  # an empty box each

    def load(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], route) -> dict[str, float]:
        return {"received_bytes": 0.0, "load_seconds": 0.0}  # the buckets are lazy: none is drawn

    def checksums(self) -> dict:
        return {"sums": {}, "packed": {}, "empty": []}

    @torch.no_grad()
    def probe(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], torch.Tensor]:
        """Each prompt decoded greedily by itself (no padding to the longest: a forward per token costs the
        prompt's length), `new_tokens` tokens whatever they are, at temperature 1."""
        module = self.offered()
        device = next(module.model.parameters()).device
        max_len = getattr(module.model.config, "max_position_embeddings", None)
        tokens, log_probs = [], []
        for prompt in prompts:
            if not probe_fits(prompt, max_len, new_tokens):
                tokens.append([])
                continue
            one = Batch({"prompt_ids": torch.tensor([prompt]),
                         "prompt_mask": torch.ones(1, len(prompt), dtype=torch.bool)})
            ids, _, sampler, _ = decode(module.model, one.to(device), new_tokens, 1.0, self.eos_token_id,
                                        self.pad_token_id, None, stop_at_eos=False)
            tokens.append(ids[0].tolist())
            log_probs.append(sampler[0].double().cpu())
        return tokens, torch.cat(log_probs)
