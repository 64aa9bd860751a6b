"""Rollout workers: generation engines returning token ids, masks and sampler log-probs.

The rollout protocol every engine's worker class follows (its entry, what it can do, is a
`RolloutEngine` in hybridflow/config/engines.py, named by `rollout.backend`):
- `start()`: load the model and build `self.receiver`, the receiving end of the weight path
  (`hybridflow.resharding.receiver.Receiver`: load what a transport delivers, checksums, probe);
  an engine in the actor's processes also registers it (`register_local`) for the colocated sync;
- `generate(prompts, greedy=False)` (DP_SPLIT): the prompts' batch with `response_ids`,
  `response_mask`, `sampler_log_probs` (of the tempered distribution it sampled), `behavior_version`
  and the objects `response` (text) and `finish_reason`;
- `sleep()` / `wake_up(parts)`: free and take back device memory around training (`ReceivingEnd`'s: nothing to free);
- the weight methods below (`ReceivingEnd`), each delegating to the receiver.
"""

from __future__ import annotations

import torch

from hybridflow.controller import Dispatch, register


class ReceivingEnd:
    receiver = None  # set by start
    ctx = None

    @register(Dispatch.ONE_TO_ALL)
    def sleep(self) -> bool:
        """Free device memory while the actor trains; an engine that holds none to free says False."""
        return False

    @register(Dispatch.ONE_TO_ALL)
    def wake_up(self, parts: list[str] | None = None) -> bool:
        """Take back what `sleep` freed (`parts`: some of it); False: nothing was freed."""
        return False

    @register(Dispatch.ONE_TO_ALL)
    def weight_needs(self, shapes: dict[str, list[int]]) -> dict[str, tuple]:
        """Per checkpoint tensor, the region this rank's engine reads from it."""
        return self.receiver.needed_boxes(shapes)

    @register(Dispatch.ONE_TO_ALL)
    def join_weight_sync(self, plan) -> bool:
        """Disaggregated: join the transfer group that spans the actor's pool and this one."""
        self.receiver.join(plan)
        return True

    @register(Dispatch.ONE_TO_ALL)
    def receive_weights(self) -> dict[str, float]:
        """Disaggregated: receive every bucket of one sync and load it."""
        return self.receiver.receive()

    @register(Dispatch.ONE_TO_ALL, lane="weights")
    def stage_weights(self, version: int, expected_per_rank: list[dict] | None = None) -> dict[str, float]:
        """Disaggregated, beside generation (lane "weights"): receive policy `version` into host
        memory; the next `generate(min_version=...)` loads it between two batches, comparing
        this rank's `expected_per_rank` checksums when given."""
        return self.receiver.stage(version, None if expected_per_rank is None else expected_per_rank[self.ctx.rank])

    @register(Dispatch.ONE_TO_ALL)
    def load_staged_weights(self, min_version: int, timeout_s: float) -> dict[str, float]:
        """Load the newest staged weights now (at least policy `min_version`): a drain's."""
        return self.receiver.load_staged(min_version, timeout_s)

    @register(Dispatch.ONE_TO_ALL)
    def load_adapter(self, version: int, payload: dict) -> dict:
        """weight_sync.lora=adapter: serve the actor's LoRA adapter of policy `version` from now on
        (hybridflow/resharding/adapter.py); returns its checks' inputs and what moved."""
        return self.receiver.load_adapter(version, payload)

    @register(Dispatch.ONE_TO_ALL)
    def served_adapter(self) -> dict:
        """The checksums of the adapter the engine serves beside the actor's of the last one sent."""
        return self.receiver.served_adapter()

    @register(Dispatch.ONE_TO_ALL)
    def set_weight_version(self, version: int) -> bool:
        """After a checked sync: label the engine's weights with their policy version."""
        self.receiver.set_version(version)
        return True

    @register(Dispatch.ONE_TO_ALL)
    def copy_floor_seconds(self, nbytes: int) -> float:
        from hybridflow.resharding.receiver import copy_floor_seconds

        return copy_floor_seconds(nbytes)

    @register(Dispatch.ONE_TO_ALL)
    def verify_weights(self, expected_per_rank: list[dict]) -> dict[str, float]:
        """Compare every engine parameter with the checksums of the part of the actor's tensors
        this rank needs; raises WeightSyncError naming what differs."""
        from hybridflow.resharding.receiver import verify

        return verify(self.receiver, expected_per_rank[self.ctx.rank])

    @register(Dispatch.ONE_TO_ALL)
    def probe_log_probs(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], torch.Tensor]:
        return self.receiver.probe(prompts, new_tokens)
