"""Rollout workers: generation engines returning token ids, masks and sampler log-probs.

`RolloutEngineBase` is the contract every engine's worker class inherits (its entry, what it can do,
is a `RolloutEngine` in hybridflow/config/engines.py, named by `rollout.backend`):
- required: `start()` loads the model and builds `self.receiver`, the receiving end of the weight path
  (`hybridflow.resharding.receiver.Receiver`, which declares every call made on it: load what a
  transport delivers, checksums, probe; staging and adapters where the engine can), and makes it the
  engine's with `self.serve_weights(receiver)`. An engine in the actor's processes is met by the actor
  when the host builds them (hybridflow/controller/context.py `introduce`): the actor keeps it, as a
  `ColocatedReceiver`, and the colocated sync hands it the weights through `load_colocated`;
  `generate(prompts, greedy=False)` (DP_SPLIT) returns the prompts' batch with `response_ids`,
  `response_mask`, `sampler_log_probs` (of the tempered distribution it sampled), `behavior_version`
  and the objects `response` (text) and `finish_reason`;
- optional, for an engine that frees device memory while the actor trains: `release()` frees it and
  says whether it freed anything, `restore(parts)` takes back some of its parts ("weights",
  "kv_cache"); the base's `sleep()` / `wake_up(parts)` call them;
- kept by the base: which parts are awake. `generate` and the probe need both; loading, staging and
  checking weights need the weights. A call in the wrong state raises `EngineStateError` naming the
  call, what sleeps and the fix, on every engine alike (the colocated hand-over's order rests on it:
  hybridflow/resharding/transports/colocated.py);
- the sleep level (`sleep_level`, set by the engine's start from `rollout.sleep_level`): at 1 a sleep
  keeps the weights (vLLM: in host memory), at 2 it discards them, for runs whose every sync rewrites
  every weight (vLLM's level 2; verl sleeps so unless LoRA keeps the base weights). Woken from level 2
  the weights hold nothing until a whole load (`loaded_whole`): generating, probing or checking them
  before is refused, and the load is followed by a check that the buffers no sync rewrites (rotary
  caches, non-persistent buffers: the receiver's `buffer_checksums`) came back as they were at start;
  the weights themselves are then compared with the actor's, every one, by the weight sync that loaded
  them (hybridflow/resharding/sync.py `WeightSync.verify_reload`: after a sync and after the reload
  before a generation that follows no sync), whatever `weight_sync.checksum_every_steps` says.
"""

from __future__ import annotations

import abc
import functools

import torch

from hybridflow.controller import Dispatch, register
from hybridflow.resharding import faults
from hybridflow.resharding.receiver import ENGINE_PARTS as PARTS, EngineStateError  # noqa: F401 - the contract's


def _when_awake(method, call: str):
    """`method`, refused unless every part is awake; the dispatch metadata of `register` kept."""
    @functools.wraps(method)
    def checked(self, *args, **kwargs):
        self.require_awake(call, PARTS)
        self.require_loaded(call)
        return method(self, *args, **kwargs)
    return checked


class RolloutEngineBase(abc.ABC):
    receiver = None  # set by start
    ctx = None
    _asleep: frozenset = frozenset()  # the parts freed by the last sleep and not woken since
    sleep_level = 1  # 2: a sleep discards the weights (every sync rewrites every one); the engine's start sets it
    _discarded = False  # the last sleep was at level 2 and no whole load has come since
    _start_buffers: dict = {}  # the receiver's buffer checksums at start (`serve_weights`)

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "generate" in cls.__dict__:  # every engine's generate is checked, whoever writes it
            cls.generate = _when_awake(cls.__dict__["generate"], f"{cls.__name__}.generate")

    # ---- the engine's own ---------------------------------------------------------------------
    @abc.abstractmethod
    def start(self) -> float:
        """Load the model, build the receiver (`serve_weights`); returns the seconds it took."""

    @abc.abstractmethod
    def generate(self, prompts, greedy: bool = False):
        """The prompts' batch with the response keys (module docstring)."""

    def release(self) -> bool:
        """Free device memory while the actor trains (every part in `PARTS`; the weights discarded, not
        kept, at `sleep_level` 2); False: nothing to free."""
        return False

    def restore(self, parts: list[str]) -> None:
        """Take back `parts` of what `release` freed."""

    def serve_weights(self, receiver) -> None:
        """Make `receiver` this engine's receiving end (the colocated sync's too, through `load_colocated`,
        which refuses a load while the weights sleep)."""
        self.receiver = receiver
        self._start_buffers = receiver.buffer_checksums()

    # ---- the state, kept here -------------------------------------------------------------------
    def require_awake(self, call: str, parts) -> None:
        asleep = [p for p in parts if p in self._asleep]
        if asleep:
            awake = [p for p in PARTS if p not in self._asleep] or ["nothing"]
            raise EngineStateError(
                f"{call} needs the engine's {' and '.join(asleep)} awake; asleep: {', '.join(sorted(self._asleep))}, "
                f"awake: {', '.join(awake)}; fix: wake_up({asleep!r}) first. A colocated run wakes the KV cache "
                f"once the actor's training state has left the device (WeightSync.generating): a call between "
                f"the weight sync and generation must not need it")

    def require_loaded(self, call: str) -> None:
        if self._discarded:
            raise EngineStateError(
                f"{call} needs the engine's weights, and a level-2 sleep discarded them (rollout.sleep_level="
                f"{self.sleep_level}): no whole weight load has come since they woke. Fix: load every weight "
                "after waking them (WeightSync reloads them before a generation that follows no sync), or "
                "rollout.sleep_level=1 to keep them across the sleep")

    def load_colocated(self, buckets, route) -> dict[str, float]:
        """The colocated sync's receiving end in this process (`ColocatedReceiver`: the actor met this engine
        and its transport calls this): every weight, bucket by bucket, into the receiver, refused while the
        weights sleep; a level-2 sleep's weights are whole again after it."""
        self.require_awake("the colocated weight load", ["weights"])
        if self._discarded:  # a reload after a level-2 sleep: a planted fault may write one weight wrong
            buckets = faults.after_level_2_wake(buckets)
        loaded = self.receiver.load(buckets, route=route)
        self.loaded_whole()
        return loaded

    def loaded_whole(self) -> None:
        """Every weight was just loaded: after a level-2 sleep, the engine computes again, once the
        buffers no sync rewrites are found as they were at start (else `EngineStateError` naming them).
        That every weight holds the actor's value is the caller's check, against the actor's checksums
        (`WeightSync.verify_reload`, run after each load that follows a level-2 sleep)."""
        if not self._discarded:
            return
        found = self.receiver.buffer_checksums()
        changed = sorted(n for n, s in self._start_buffers.items() if found.get(n) != s)
        if changed:
            raise EngineStateError(
                f"{type(self).__name__}: after a level-2 sleep and a whole weight load, {len(changed)} buffer(s) no "
                f"weight sync rewrites differ from their values at start: {changed[:5]}. The engine did not restore "
                "them on wake-up (rotary caches and other non-persistent buffers): generation would compute another "
                "model. Fix: rollout.sleep_level=1, or restore the buffers in the engine's restore()")
        self._discarded = False

    @register(Dispatch.ONE_TO_ALL)
    def weights_discarded(self) -> bool:
        """Whether a level-2 sleep discarded the weights and no whole load has come since."""
        return self._discarded

    @register(Dispatch.ONE_TO_ALL)
    def awake_parts(self) -> list[str]:
        """The parts awake now (of `PARTS`)."""
        return [p for p in PARTS if p not in self._asleep]

    @register(Dispatch.ONE_TO_ALL)
    def sleep(self) -> bool:
        """Free device memory while the actor trains; False when asleep already or nothing to free."""
        if self._asleep or not self.release():
            return False
        self._asleep = frozenset(PARTS)
        self._discarded = self.sleep_level == 2
        return True

    @register(Dispatch.ONE_TO_ALL)
    def wake_up(self, parts: list[str] | None = None) -> bool:
        """Take back those of `parts` (None: all) that sleep; returns whether anything woke."""
        unknown = sorted(set(parts or ()) - set(PARTS))
        if unknown:
            raise ValueError(f"{type(self).__name__}.wake_up: unknown parts {unknown}; known: {list(PARTS)}")
        wanted = [p for p in (parts or PARTS) if p in self._asleep]
        if not wanted:
            return False
        self.restore(wanted)
        self._asleep = self._asleep - set(wanted)
        return True

    # ---- the weight path, each call delegating to the receiver ---------------------------------
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
        self.require_awake(f"{type(self).__name__}.receive_weights", ["weights"])
        received = self.receiver.receive()
        self.loaded_whole()
        return received

    @register(Dispatch.ONE_TO_ALL, lane="weights")
    def stage_weights(self, version: int, expected_per_rank: list[dict] | None = None) -> dict[str, float]:
        """Disaggregated, beside generation (lane "weights"): receive policy `version` into host
        memory; the next `generate(min_version=...)` loads it between two batches, comparing
        this rank's `expected_per_rank` checksums when given."""
        return self.receiver.stage(version, None if expected_per_rank is None else expected_per_rank[self.ctx.rank])

    @register(Dispatch.ONE_TO_ALL)
    def load_staged_weights(self, min_version: int, timeout_s: float) -> dict[str, float]:
        """Load the newest staged weights now (at least policy `min_version`): a drain's."""
        self.require_awake(f"{type(self).__name__}.load_staged_weights", ["weights"])
        return self.receiver.load_staged(min_version, timeout_s)

    @register(Dispatch.ONE_TO_ALL)
    def load_adapter(self, version: int, payload: dict) -> dict:
        """weight_sync.lora=adapter: serve the actor's LoRA adapter of policy `version` from now on
        (hybridflow/resharding/adapter.py); returns its checks' inputs and what moved."""
        self.require_awake(f"{type(self).__name__}.load_adapter", ["weights"])
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

        self.require_awake(f"{type(self).__name__}.verify_weights", ["weights"])
        self.require_loaded(f"{type(self).__name__}.verify_weights")
        return verify(self.receiver, expected_per_rank[self.ctx.rank])

    @register(Dispatch.ONE_TO_ALL)
    def probe_log_probs(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], torch.Tensor]:
        """Greedy continuations of `prompts` and their log-probs: it generates, so both parts must be awake."""
        self.require_awake(f"{type(self).__name__}.probe_log_probs", PARTS)
        self.require_loaded(f"{type(self).__name__}.probe_log_probs")
        return self.receiver.probe(prompts, new_tokens)
