"""Who owns the schedule of generation and weight syncs: `RolloutQueue`.

A PPO-family step trains on one batch of samples. `RolloutQueue.next(step)` hands it over;
`updated(step)` says the actor's weights changed. With `depth` = `trainer.max_staleness`:

- depth 0 (today's loop, the default): `next` generates the step's batch and waits for it;
  `updated` pushes the new weights to the rollout at once. Every batch is on-policy.
- depth 1 (one-step-off): batch s+1 is launched right after batch s is taken, so the rollout
  pool generates it while the actor scores and trains on batch s. `next(s)` takes batch s,
  then — both pools idle — pushes the actor's newest weights if the rollout lags, then
  launches s+1. Batch s was generated with policy version s−2 and trains on version s−1:
  staleness exactly 1 (0 for the first batch).
- depth N ≥ 2 (staged pushes): up to N batches are in flight. `updated` starts a push of the
  new weights at once (`weight_sync.stage`): the rollout receives it on a lane of its own while
  it keeps generating, and loads it before the next batch that needs it (between two batches,
  so no forward pass sees half-loaded weights). Each launch names the oldest policy version
  its batch may be generated with (`min_version`): the batch for step t, launched while the
  actor holds version V before step s's update, trains on at most version V + (t − s), so it
  needs version V + (t − s) − N or newer; the rollout waits for that push if it has not
  arrived. The rollout reports the version that generated each batch (`version_of`).

Nothing is dropped: pacing keeps every batch within the bound, and a batch over it raises
naming step and versions. Versions count weight loads into the actor (updates and hook
reloads); the first push at start-up is version 0. A hook reload with a batch in flight
regenerates that batch (same prompts and seeds) with the reloaded weights (depth 1; refused
at depth ≥ 2 by the config). `drain()` (before validation and checkpoints) waits for the
batches in flight and gives the rollout the newest weights — which the next launch would have
used anyway, so what a step trains on does not depend on when it runs.

`launch(step, version)` is the recipe's: it draws the step's prompts and submits generation
with policy `version` (depth ≤ 1: the version the rollout holds; depth ≥ 2: the oldest it may
use), returning a `Pending`; the queue never sees a prompt. The weight sync is any object with
`sync(step, version) -> metrics`, and at depth ≥ 2 `stage(step, version)` (returning a push
whose `finish()` gives its metrics) and `load_staged(step, version) -> metrics`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Protocol

from hybridflow.controller import deadlines


class StalenessError(RuntimeError):
    """A batch would train further from its generating policy than `trainer.max_staleness`."""


class Sync(Protocol):
    def sync(self, step: int, version: int | None = None) -> dict[str, float]: ...


class StagingSync(Sync, Protocol):  # depth >= 2
    def stage(self, step: int, version: int) -> Any: ...

    def load_staged(self, step: int, version: int) -> dict[str, float]: ...


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
    def __init__(self, launch: Callable[[int, int], Pending], weight_sync: Sync | StagingSync, depth: int,
                 last_step: int,
                 clock: Callable[[], float] = time.monotonic, encode: Callable[[Any], Any] = lambda x: x,
                 decode: Callable[[Any], Any] = lambda x: x,
                 version_of: Callable[[Any], int] | None = None) -> None:
        if depth < 0:
            raise ValueError(f"trainer.max_staleness={depth}: must be >= 0")
        self.launch, self.weight_sync, self.depth, self.last_step, self.clock = launch, weight_sync, depth, last_step, clock
        self.encode, self.decode = encode, decode  # a finished batch to and from a checkpoint's JSON
        self.version_of = version_of  # the oldest policy version that generated a finished batch
        self.actor_version = self.rollout_version = 0  # depth >= 2: rollout_version is the newest *loaded*
        self.in_flight: list[Pending] = []  # oldest first
        self.pushed_once = False
        self.push = None  # depth >= 2: the staged push in flight

    # ---- the step loop's calls ---------------------------------------------------------------
    def start(self, step: int, actor_version: int = 0, in_flight: list | dict | None = None) -> None:
        """Push the actor's weights (version `actor_version`, restored on resume), and at depth >= 1
        restore the batches a checkpoint drained (`in_flight`, from `state`; a dict from depth 1's
        older checkpoints) and launch the rest."""
        self.actor_version = actor_version
        self._push(step)
        for saved in [in_flight] if isinstance(in_flight, dict) else in_flight or []:  # a dict: depth 1's
            self.in_flight.append(Pending(saved["step"], saved["version"], partial(lambda r: r, self.decode(
                saved["result"])), relaunch=_restored_cannot_relaunch))
        self._refill(step, current=step + 1)

    def next(self, step: int) -> tuple[Any, int, dict[str, float]]:
        """Step `step`'s batch, the policy version it trains on (the actor's now), and the queue's
        metrics (wait and overlap times; at depth 1 also the weight sync it ran)."""
        pending = self.in_flight.pop(0) if self.in_flight else self._launch(step) if not self.depth else None
        if pending is None or pending.step != step:
            raise StalenessError(f"step {step}: the batch in flight is for step "
                                 f"{None if pending is None else pending.step}; the schedule lost a batch")
        start = self.clock()
        result = pending.wait()
        end = self.clock()
        if self.version_of is not None:
            pending.version = self.version_of(result)
        trained_version = self.actor_version
        staleness = trained_version - pending.version
        if not 0 <= staleness <= self.depth:
            raise StalenessError(f"step {step}: batch generated by policy version {pending.version} would train on "
                                 f"version {self.actor_version}, staleness {staleness} > trainer.max_staleness="
                                 f"{self.depth}")
        metrics = {"timing/generate_wait_s": end - start,
                   "timing/overlap_fraction": 1.0 - (end - start) / max(end - pending.launched_at, 1e-9)}
        if self.depth == 1:
            metrics.update(self._push(step))  # both pools idle: the rollout catches up, then generates s+1
        self._refill(step, current=step)
        return result, trained_version, metrics

    def updated(self, step: int, learned: bool, reloaded: bool = False) -> dict[str, float]:
        """The actor's weights changed at `step` (`learned`: an update; `reloaded`: a hook loaded
        other weights). Depth 0 pushes them now; depth 1 at the next `next` (or `drain`); depth >= 2
        starts a staged push now, after finishing the previous one, whose metrics it returns."""
        self.actor_version += int(learned) + int(reloaded)
        if reloaded and self.depth >= 2:
            raise StalenessError(f"step {step}: a hook reloaded the actor's weights with trainer.max_staleness="
                                 f"{self.depth}; hooks that reload weights run only at max_staleness <= 1")
        if reloaded and self.in_flight:  # generated by weights the hook threw away
            stale = self.in_flight[0]
            stale.wait()
            self._push(step)
            self.in_flight = [stale.relaunch(self.rollout_version)]
            self.in_flight[0].launched_at = self.clock()
        if self.depth == 0 and self.rollout_version != self.actor_version:
            return self._push(step)
        if self.depth >= 2 and learned:  # the rollout receives it while it generates
            metrics = self._finish_push()
            with deadlines.stage("weight_sync"):  # the push keeps this deadline wherever it is awaited
                self.push = self.weight_sync.stage(step, self.actor_version)
            return metrics
        return {}

    def drain(self, step: int) -> dict[str, float]:
        """Before validation or a checkpoint: wait for the batch in flight (kept) and push the
        newest weights."""
        for pending in self.in_flight:
            pending.wait()
        if self.depth < 2:
            return self._push(step)
        metrics = self._finish_push()
        if self.rollout_version != self.actor_version:
            with deadlines.stage("weight_sync"):
                metrics.update(self.weight_sync.load_staged(step, self.actor_version))
            self.rollout_version = self.actor_version
        return metrics

    # ---- internals -----------------------------------------------------------------------------
    def _push(self, step: int) -> dict[str, float]:
        if self.rollout_version == self.actor_version and self.pushed_once:
            return {}
        with deadlines.stage("weight_sync"):  # also inside `next`: bounded by trainer.stage_timeout_s.weight_sync
            metrics = self.weight_sync.sync(step, self.actor_version)
        self.rollout_version, self.pushed_once = self.actor_version, True
        return metrics

    def _finish_push(self) -> dict[str, float]:
        push, self.push = self.push, None
        if push is None:
            return {}
        with deadlines.stage("weight_sync"):
            return push.finish()

    def _launch(self, step: int, current: int | None = None) -> Pending:
        """Launch step `step`'s batch; `current`: the step about to train (depth >= 2 pacing)."""
        version = self.rollout_version if self.depth < 2 else \
            max(self.actor_version + step - current - self.depth, 0)
        pending = self.launch(step, version)
        pending.launched_at = self.clock()
        return pending

    def _refill(self, step: int, current: int) -> None:
        """Keep `depth` batches in flight, for the steps after `step`; `current` is the step about to
        train (start: the next one; `next`: the one just taken, before its update)."""
        while self.depth and len(self.in_flight) < self.depth:
            nxt = (self.in_flight[-1].step if self.in_flight else step) + 1
            if nxt > self.last_step:
                break
            self.in_flight.append(self._launch(nxt, current))

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (JSON), after `drain`: the actor's policy version and the
        finished batch in flight, which `start` restores, so a resumed run trains on exactly
        what the uninterrupted one would have."""
        out: dict[str, Any] = {"actor_version": self.actor_version}
        if self.in_flight:
            out["in_flight"] = [{"step": p.step, "version": self.version_of(p.wait()) if self.version_of else p.version,
                                 "result": self.encode(p.wait())} for p in self.in_flight]
        return out


def _restored_cannot_relaunch(version: int) -> Pending:
    raise StalenessError("a weight reload with a batch restored from a checkpoint in flight: its prompts are not "
                         "kept, so it cannot be regenerated (hooks that reload weights are refused with "
                         "trainer.max_staleness > 0)")
