"""The generation side of a weight sync: the protocol a rollout worker's receiver implements.

A receiver wraps one rollout engine in one process: vLLM's is `VLLMReceiver` (workers/rollout/vllm/receiver.py,
beside our transfer engine inside vLLM), and `ModuleReceiver` here serves any engine that
generates with a torch module in its process (the hf engine, a user's). It says which region of each checkpoint
tensor its rank needs (`needed_boxes`), takes buckets — handed over in-process by a colocated
sender, or received by the plan's transport's receiving route (transports/) — inside one vLLM
update session, and answers the checks: per-parameter checksums and a log-prob probe. Colocated senders find the receiver
of their own process through `register_local` / `local_receiver`, so the actor never holds the
rollout worker: the two meet only here.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Callable, Iterable

import torch

from hybridflow.resharding.layout import Box
from hybridflow.resharding.verify import WeightSyncError, checksum, verify_against

_LOCAL: dict[str, "Receiver"] = {}


def register_local(group_name: str, receiver: "Receiver",
                   on_teardown: Callable[[Callable[[], None]], None] | None = None) -> None:
    """`receiver` serves colocated senders of `group_name` in this process; with `on_teardown` (the
    worker's `WorkerContext.on_teardown`) the registry forgets it when the host frees the stage's workers."""
    _LOCAL[group_name] = receiver
    if on_teardown is not None:
        on_teardown(partial(forget_local, group_name))


def forget_local(group_name: str) -> None:
    """Drop the receiver registered for `group_name` (run by a one-process host's teardown, which frees its engine)."""
    _LOCAL.pop(group_name, None)


def local_receiver(group_name: str) -> "Receiver":
    receiver = _LOCAL.get(group_name)
    if receiver is None:
        raise WeightSyncError(
            f"colocated weight sync: no rollout engine started in this process (worker group {group_name!r}); "
            "map placement.roles.actor and placement.roles.rollout to the same pool, or give the rollout a pool "
            "of its own (placement=disaggregated)")
    return receiver


def copy_floor_seconds(nbytes: int, repeats: int = 3) -> float:
    """Seconds of a plain memory copy of `nbytes` on this machine (best of `repeats`)."""
    src = torch.empty(max(1, nbytes // 4), dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return best


ENGINE_PARTS = ("weights", "kv_cache")  # what an engine may free while the actor trains, by vLLM's wake-up tags


class EngineStateError(RuntimeError):
    """A rollout engine asked for a call its state cannot serve (a part it needs asleep):
    workers.rollout.RolloutEngineBase keeps the state."""


class Receiver:
    """Interface every rollout engine's receiver implements."""

    version = -1  # the policy version of the weights the engine computes with (-1: none given yet)
    engine_state = None  # the engine that serves it (workers.rollout.RolloutEngineBase.serve_weights): its state

    def set_version(self, version: int) -> None:
        self.version = version

    def join(self, plan) -> None:
        raise WeightSyncError(f"{type(self).__name__} receives weights only from a colocated actor: put "
                              "placement.roles.rollout on the actor's pool, or use rollout=vllm")

    def receive(self) -> dict[str, float]:
        return self.join(None)  # raises: only a colocated actor feeds this receiver

    def needed_boxes(self, shapes: dict[str, list[int]]) -> dict[str, tuple]:
        raise NotImplementedError

    def load(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], route) -> dict[str, float]:
        """Full-shape tensors handed over in this process, one bucket at a time (`route`: the
        transport that handed them over)."""
        raise NotImplementedError

    def checksums(self) -> dict:
        raise NotImplementedError

    def buffer_checksums(self) -> dict[str, tuple[float, float]]:
        """Checksums of the engine's buffers, which no weight sync rewrites (rotary caches, other
        non-persistent buffers): compared after a level-2 sleep's reload. {}: none to compare."""
        return {}

    def load_adapter(self, version: int, payload: dict) -> dict:
        raise WeightSyncError(f"{type(self).__name__} cannot serve a LoRA adapter: set weight_sync.lora=folded, or use "
                              "rollout.backend=vllm")

    def probe(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], torch.Tensor]:
        """Greedy continuations of `prompts` ([] for a prompt the engine cannot hold) and the
        log-probs of their tokens, concatenated in order (float64)."""
        raise NotImplementedError


class ModuleReceiver(Receiver):
    """Receiver for a plain torch module (the Hugging Face rollout): full tensors, copied by name."""

    def __init__(self, model: torch.nn.Module, pad_token_id: int) -> None:
        self.model, self.pad_token_id = model, pad_token_id

    def needed_boxes(self, shapes: dict[str, list[int]]) -> dict[str, tuple]:
        return {name: Box.whole(shape).ranges for name, shape in shapes.items()}

    def load(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], route) -> dict[str, float]:
        start = time.perf_counter()
        params = dict(self.model.named_parameters())
        for bucket in buckets:
            for name, tensor in bucket:
                if name not in params:
                    raise WeightSyncError(f"the rollout model has no parameter {name!r}")
                params[name].data.copy_(tensor)
        return {"received_bytes": 0.0, "load_seconds": time.perf_counter() - start}

    def checksums(self) -> dict:
        return {"sums": {n: checksum(p) for n, p in self.model.named_parameters()}, "packed": {}, "empty": []}

    def buffer_checksums(self) -> dict[str, tuple[float, float]]:
        return {n: checksum(b) for n, b in self.model.named_buffers()}

    @torch.no_grad()
    def probe(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], torch.Tensor]:
        from hybridflow.resharding.verify import probe_fits

        max_len = getattr(self.model.config, "max_position_embeddings", None)
        tokens, log_probs = [], []
        for prompt_ids in prompts:
            if not probe_fits(prompt_ids, max_len, new_tokens):
                tokens.append([])
                continue
            ids = torch.tensor([prompt_ids], device=next(self.model.parameters()).device)
            # raw logits, not `scores`: min_new_tokens masks EOS out of the scores, which renormalises them
            out = self.model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                      output_logits=True, return_dict_in_generate=True, pad_token_id=self.pad_token_id)
            tokens.append(out.sequences[0, len(prompt_ids):].tolist())
            log_probs += [torch.log_softmax(s[0].double(), -1)[t].cpu() for s, t in zip(out.logits, tokens[-1])]
        return tokens, torch.stack(log_probs)


def verify(receiver: Receiver, expected: dict[str, tuple[float, float]]) -> dict[str, float]:
    return verify_against(receiver.checksums(), expected)
