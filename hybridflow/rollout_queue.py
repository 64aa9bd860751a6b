"""Who owns the schedule of generation and weight syncs: `RolloutQueue`.

A PPO-family step trains on one batch of samples. `RolloutQueue.next(step)` hands it over;
`updated(step)` says the actor's weights changed. With `depth` = `trainer.max_staleness`:

- depth 0 (today's loop, the default): `next` generates the step's batch and waits for it;
  `updated` pushes the new weights to the rollout at once. Every batch is on-policy.
- depth 1 (one-step-off): batch s+1 is launched right after batch s is taken, so the rollout
  pool generates it while the actor scores and trains on batch s. `next(s)` takes batch s,
  then — both pools idle — pushes the actor's newest weights if the rollout lags, then
  launches s+1. Batch s was generated with policy version s−2 and trains on version s−1:
  staleness exactly 1 (0 for the first batch). Nothing is dropped: pacing keeps every batch
  within the bound, and a batch over it raises naming step and versions.

Depth ≥ 2 needs weights received while the rollout generates (ASYNC.md phase B) and is refused
by the config. Versions count weight loads into the actor (updates and hook reloads); the
first push at start-up is version 0. A hook reload with a batch in flight regenerates that
batch (same prompts and seeds) with the reloaded weights. `drain()` (before validation and
checkpoints) waits for the batch in flight and pushes the newest weights — which the next
launch would have used anyway, so what a step trains on does not depend on when it runs.

`launch(step, version)` is the recipe's: it draws the step's prompts and submits generation,
returning a `Pending`; the queue never sees a prompt. The weight sync is any object with
`sync(step, version) -> metrics`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from hybridflow.controller import deadlines


class StalenessError(RuntimeError):
    """A batch would train further from its generating policy than `trainer.max_staleness`."""


class Sync(Protocol):
    def sync(self, step: int, version: int | None = None) -> dict[str, float]: ...


@dataclass
class Pending:
    """One batch being generated: the step it is for, the policy version generating it, and
    `collect() -> (samples, extras)` waiting for it; `relaunch(version)` resubmits the same
    prompts and seeds (after a hook reload)."""

    step: int
    version: int
    collect: Callable[[], Any]
    relaunch: Callable[[int], "Pending"]
    launched_at: float = 0.0
    result: Any = None  # filled by `wait`

    def wait(self) -> Any:
        if self.result is None:
            self.result = self.collect()
        return self.result


class RolloutQueue:
    def __init__(self, launch: Callable[[int, int], Pending], weight_sync: Sync, depth: int, last_step: int,
                 clock: Callable[[], float] = time.monotonic, encode: Callable[[Any], Any] = lambda x: x,
                 decode: Callable[[Any], Any] = lambda x: x) -> None:
        if depth not in (0, 1):
            raise ValueError(f"trainer.max_staleness={depth}: only 0 and 1 exist (2 and more need phase B, "
                             "docs/async.md)")
        self.launch, self.weight_sync, self.depth, self.last_step, self.clock = launch, weight_sync, depth, last_step, clock
        self.encode, self.decode = encode, decode  # a finished batch to and from a checkpoint's JSON
        self.actor_version = self.rollout_version = 0
        self.in_flight: Pending | None = None
        self.pushed_once = False

    # ---- the step loop's calls ---------------------------------------------------------------
    def start(self, step: int, actor_version: int = 0, in_flight: dict | None = None) -> None:
        """Push the actor's weights (version `actor_version`, restored on resume), and at depth 1
        restore the batch a checkpoint drained (`in_flight`, from `state`) or launch the first."""
        self.actor_version = actor_version
        self._push(step)
        if in_flight is not None:
            result = self.decode(in_flight["result"])
            self.in_flight = Pending(in_flight["step"], in_flight["version"], lambda: result,
                                     relaunch=_restored_cannot_relaunch)
        self._refill(step)

    def next(self, step: int) -> tuple[Any, int, dict[str, float]]:
        """Step `step`'s batch, the policy version it trains on (the actor's now), and the queue's
        metrics (wait and overlap times; at depth 1 also the weight sync it ran)."""
        pending = self.in_flight if self.depth else self._launch(step)
        if pending is None or pending.step != step:
            raise StalenessError(f"step {step}: the batch in flight is for step "
                                 f"{None if pending is None else pending.step}; the schedule lost a batch")
        self.in_flight = None
        start = self.clock()
        result = pending.wait()
        end = self.clock()
        trained_version = self.actor_version
        staleness = trained_version - pending.version
        if not 0 <= staleness <= self.depth:
            raise StalenessError(f"step {step}: batch generated by policy version {pending.version} would train on "
                                 f"version {self.actor_version}, staleness {staleness} > trainer.max_staleness="
                                 f"{self.depth}")
        metrics = {"timing/generate_wait_s": end - start,
                   "timing/overlap_fraction": 1.0 - (end - start) / max(end - pending.launched_at, 1e-9)}
        if self.depth:
            metrics.update(self._push(step))  # both pools idle: the rollout catches up, then generates s+1
            self._refill(step)
        return result, trained_version, metrics

    def updated(self, step: int, learned: bool, reloaded: bool = False) -> dict[str, float]:
        """The actor's weights changed at `step` (`learned`: an update; `reloaded`: a hook loaded
        other weights). Depth 0 pushes them now; depth 1 at the next `next` (or `drain`)."""
        self.actor_version += int(learned) + int(reloaded)
        if reloaded and self.in_flight is not None:  # generated by weights the hook threw away
            stale = self.in_flight
            stale.wait()
            self._push(step)
            self.in_flight = stale.relaunch(self.rollout_version)
            self.in_flight.launched_at = self.clock()
        if self.depth == 0 and self.rollout_version != self.actor_version:
            return self._push(step)
        return {}

    def drain(self, step: int) -> dict[str, float]:
        """Before validation or a checkpoint: wait for the batch in flight (kept) and push the
        newest weights."""
        if self.in_flight is not None:
            self.in_flight.wait()
        return self._push(step)

    # ---- internals -----------------------------------------------------------------------------
    def _push(self, step: int) -> dict[str, float]:
        if self.rollout_version == self.actor_version and self.pushed_once:
            return {}
        with deadlines.stage("weight_sync"):  # also inside `next`: bounded by trainer.stage_timeout_s.weight_sync
            metrics = self.weight_sync.sync(step, self.actor_version)
        self.rollout_version, self.pushed_once = self.actor_version, True
        return metrics

    def _launch(self, step: int) -> Pending:
        pending = self.launch(step, self.rollout_version)
        pending.launched_at = self.clock()
        return pending

    def _refill(self, step: int) -> None:
        if self.depth and self.in_flight is None and step + 1 <= self.last_step:
            self.in_flight = self._launch(step + 1)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (JSON), after `drain`: the actor's policy version and the
        finished batch in flight, which `start` restores, so a resumed run trains on exactly
        what the uninterrupted one would have."""
        out: dict[str, Any] = {"actor_version": self.actor_version}
        if self.in_flight is not None:
            p = self.in_flight
            out["in_flight"] = {"step": p.step, "version": p.version, "result": self.encode(p.wait())}
        return out


def _restored_cannot_relaunch(version: int) -> Pending:
    raise StalenessError("a weight reload with a batch restored from a checkpoint in flight: its prompts are not "
                         "kept, so it cannot be regenerated (hooks that reload weights are refused with "
                         "trainer.max_staleness > 0)")
