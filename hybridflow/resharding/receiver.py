"""The generation side of a weight sync: the protocol a rollout worker's receiver implements.

A receiver wraps one rollout engine in one process: vLLM's is `VLLMReceiver` (workers/rollout/vllm/receiver.py,
beside our transfer engine inside vLLM), and `ModuleReceiver` here serves any engine that
generates with a torch module in its process (the hf engine, a user's). It says which region of each checkpoint
tensor its rank needs (`needed_boxes`), takes buckets — handed over in-process by a colocated
sender, or received by the plan's transport's receiving route (transports/) — inside one vLLM
update session, and answers the checks: per-parameter checksums and a log-prob probe. Every call the
engine base (workers/rollout/__init__.py) makes on a receiver is declared on `Receiver`; what an
engine cannot do raises saying so and the setting that avoids it.

A colocated sender reaches the receiver of its own process through the engine that serves it, a
`ColocatedReceiver`: the host that builds the roles of one process introduces them to each other
(hybridflow/controller/context.py `introduce`), the actor keeps the engine it met and hands it to the
colocated transport at each sync; the engine checks its state around the load.
"""

from __future__ import annotations

import time
from typing import Iterable, Protocol, runtime_checkable

import torch

from hybridflow.resharding.layout import Box
from hybridflow.resharding.verify import WeightSyncError, checksum, verify_against


@runtime_checkable
class ColocatedReceiver(Protocol):
    """What loads the weights a colocated sync hands over in this process (a rollout engine:
    workers.rollout.RolloutEngineBase.load_colocated, which refuses while its weights sleep)."""

    def load_colocated(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], route) -> dict[str, float]:
        """Every bucket into the engine (`route`: the transport that handed them over); the seconds it took."""


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

    def set_version(self, version: int) -> None:
        self.version = version

    def join(self, plan) -> None:
        """Disaggregated: join the transfer group of the plan's route."""
        raise WeightSyncError(f"{type(self).__name__} receives weights only from a colocated actor: put "
                              "placement.roles.rollout on the actor's pool, or use rollout=vllm")

    def receive(self) -> dict[str, float]:
        """Disaggregated: receive every bucket of one sync and load it."""
        return self.join(None)  # raises: only a colocated actor feeds this receiver

    def stage(self, version: int, expected: dict | None = None) -> dict[str, float]:
        """Disaggregated, beside generation: receive policy `version` into host memory (checked against
        `expected` checksums when given), loaded later by `load_staged`."""
        raise WeightSyncError(f"{type(self).__name__} cannot stage weights while its engine generates: set "
                              "trainer.max_staleness to 0 or 1, or use rollout.backend=vllm on a pool of its own")

    def load_staged(self, min_version: int, timeout_s: float) -> dict[str, float]:
        """Load the newest staged weights (at least policy `min_version`, waiting up to `timeout_s`)."""
        return self.stage(min_version)  # raises: nothing is ever staged here

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
        """weight_sync.lora=adapter: serve the actor's LoRA adapter of policy `version` from now on."""
        raise WeightSyncError(f"{type(self).__name__} cannot serve a LoRA adapter: set weight_sync.lora=folded, or use "
                              "rollout.backend=vllm")

    def served_adapter(self) -> dict:
        """The checksums of the adapter the engine serves (weight_sync.lora=adapter)."""
        return self.load_adapter(-1, {})  # raises: no adapter is ever served here

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
