"""The controller's side of weight movement: one object, one call per step.

`WeightSync(actor, rollout, config, transport)` owns the whole trip from the actor group's
training layout to the rollout group's generation layout: at `setup()` it asks the rollout
ranks which part of each checkpoint tensor they need, plans the buckets, opens the transfer
group when the rollout has a pool of its own, and measures the copy floor; at `sync(step, version)` it
wakes the engine parts the transport loads into (`Transport.wakes_for_sync`), drives the sender and
(disaggregated) the receiver together, waits on both with the configured
deadline, checks the result, and returns the step's `weight_sync/*` metrics; with the rollout on
a pool of its own, `stage(step, version)` instead starts a push the rollout receives while it
generates (trainer.max_staleness >= 2, docs/async.md) and `load_staged` loads and probes it when
both sides are idle. The recipe never
sees a bucket, and the actor never sees the rollout worker. How the bytes travel is the
`Transport`'s business (transports/); `WeightSync` keeps the plan, the checks and the metrics.
`AdapterSync`, its subclass, moves a LoRA actor's adapter alone (weight_sync.lora=adapter;
hybridflow/resharding/adapter.py). The policy version a push carries is an argument: its owner is the recipe's schedule
(hybridflow/rollout_schedules.py); the rollout labels its engine with it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch

from hybridflow.config.schema import WeightSyncConfig
from hybridflow.controller import WorkerError, WorkerGroup, deadlines, wait_all
from hybridflow.resharding.adapter import verify_adapter
from hybridflow.resharding.layout import Box, buckets, layout_minimum, numel
from hybridflow.resharding.receiver import ENGINE_PARTS
from hybridflow.resharding.sender import SyncPlan
from hybridflow.resharding.transports import Transport
from hybridflow.resharding.verify import (
    PROBE_NEW_TOKENS,
    PROBE_PROMPTS,
    PROBE_TOLERANCE,
    QUANTILE_FACTOR,
    WeightSyncError,
    gap_statistics,
    probe_passes,
)



class WeightSync:
    def __init__(self, actor: WorkerGroup, rollout: WorkerGroup, config: WeightSyncConfig, transport: Transport,
                 dtype: str) -> None:
        self.actor, self.rollout, self.cfg = actor, rollout, config
        self.transport, self.dtype = transport, dtype
        self.syncs = 0
        self.probe_due = False  # a sync's probe waits for the engine to wake whole (`generating`)
        self.probed: dict[str, float] = {}  # the last deferred probe's metrics, read by handover_seconds
        self.floor_seconds = 0.0
        self.min_bytes = self.engine_bytes = 0

    def setup(self) -> dict[str, float]:
        """Plan the sync and open its transport; call once, after both groups have started."""
        shapes = self.actor.weight_shapes()
        needs = self.rollout.weight_needs(shapes)
        size = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        plan_buckets = buckets(list(shapes), {n: numel(s) * size for n, s in shapes.items()},
                               int(self.cfg.bucket_mb * 2 ** 20))
        addr, port = self.transport.rendezvous(self.actor)
        plan = SyncPlan(self.transport, self.dtype, int(self.cfg.bucket_mb * 2 ** 20), self.cfg.timeout_s, needs,
                        addr, port, plan_buckets, shapes)
        self._wait(self.transport.setup_calls(self.actor, self.rollout, plan), "setup")
        boxes = [{n: Box.of(need[n]) for n in shapes} for need in needs]
        held = self.transport.held(shapes, self.actor.world_size)
        self.min_bytes = max(layout_minimum(shapes, boxes, held, size))
        self.engine_bytes = max(layout_minimum(shapes, boxes, None, size))
        self.floor_seconds = max(self.rollout.copy_floor_seconds(self.engine_bytes))
        return {"weight_sync/buckets": float(len(plan_buckets)), "weight_sync/engine_bytes_per_rank":
                float(self.engine_bytes), "weight_sync/copy_floor_s": self.floor_seconds}

    @contextmanager
    def generating(self) -> Iterator[None]:
        """Around generation: the transport's device memory steps (colocated on GPUs). A probe the
        last sync deferred runs here: the engine's half once it is awake whole (the actor's training
        state has left the device), the actor's half once the training state is back."""
        due, self.probe_due = self.probe_due, False
        self._reload_discarded()
        with self.transport.generating(self.actor, self.rollout):
            engine_probes = self._engine_probes() if due else None
            yield
        if due:
            self.probed.update(self._compare_probes(engine_probes, deferred=True))

    def _reload_discarded(self) -> None:
        """An engine whose level-2 sleep discarded its weights (rollout.sleep_level) with no sync since
        (a validation's generation slept, and the next step generates): the actor's weights, the
        version the engine is labelled with, sent again before its training state leaves the device
        (`weight_sync/reload_s`)."""
        if not any(self.rollout.weights_discarded()):
            return
        start = time.perf_counter()
        self._wait(self.sync_calls(), "reloading the weights a level-2 sleep discarded (rollout.sleep_level=1 keeps "
                   "them)")
        self.probed["weight_sync/reload_s"] = time.perf_counter() - start
        self.probed.update(self.verify_reload())

    def rest(self) -> bool:
        """The engine sleeps until its first use, where it shares the actor's devices (the transport's
        `rest`): for a recipe whose next calls train (SFT, whose first generation is its first validation),
        not one that generates next. The sync before that generation wakes its weights and, after a level-2
        sleep, loads and checks every one (`sync`'s `verify_reload`); `generating` wakes the KV cache.
        Returns whether it slept."""
        return self.transport.rest(self.rollout)

    def handover_seconds(self) -> dict[str, float]:
        """The last `generating`'s device memory steps, each timed (the transport's), the probe it ran
        for the sync before it, and the reload of weights a level-2 sleep discarded."""
        probed, self.probed = self.probed, {}
        return {**self.transport.handover_seconds(), **probed}

    def sync(self, step: int, version: int) -> dict[str, float]:
        """Move the actor's current weights into the rollout engines, check them, and measure.
        The rollout's engine is then labelled with policy `version`, once the checks pass."""
        start = time.perf_counter()
        discarded = self.engine_bytes > 0 and any(self.rollout.weights_discarded())
        results = self._wait(self.sync_calls(), f"step {step}")
        seconds = time.perf_counter() - start
        per_rank = self.transport.per_rank(results)
        self.syncs += 1
        metrics = {
            "weight_sync/bytes_received_per_rank": max(r["received_bytes"] for r in per_rank),
            "weight_sync/min_bytes_per_rank": float(self.min_bytes),
            "weight_sync/seconds": seconds,
            # where the time went, slowest rank: vLLM's load session (colocated: with the exchange
            # inside it, bucket by bucket) and, colocated, the exchange between training ranks
            "weight_sync/load_s": max(r.get("load_seconds", 0.0) for r in per_rank),
        }
        if self.engine_bytes:  # an engine that computes with the actor's own weights needs none: no floor
            metrics["weight_sync/copy_floor_ratio"] = seconds / max(self.floor_seconds, 1e-9)
        metrics.update(self.transport.metrics(per_rank))
        if discarded:  # every weight came back, exactly: a weight no load rewrote holds whatever the wake gave it
            metrics.update(self.verify_reload())
        metrics.update(self.check(step, checked=discarded))
        self._wait([self.rollout.set_weight_version.remote(version)], "labelling the engine")
        return metrics

    def sync_calls(self) -> list:
        """The transport's calls of one sync, issued once the engine parts it loads into are awake
        (`Transport.wakes_for_sync`: colocated, the weights alone, the training state still on the device)."""
        if self.transport.wakes_for_sync:
            self.rollout.wake_up(list(self.transport.wakes_for_sync))
        return self.transport.sync_calls(self.actor, self.rollout)

    def verify_reload(self) -> dict[str, float]:
        """After a level-2 sleep (rollout.sleep_level=2 discards the engine's weights) and the load that
        followed, every weight's checksum against the actor's: a weight the load did not rewrite holds
        what the wake-up's allocation held, and a probe need not read it (issue 87). Raises
        WeightSyncError naming the tensors; `weight_sync/reload_checksum_s` is its cost."""
        start = time.perf_counter()
        verified = self.verify_checksums()
        return {**verified, "weight_sync/reload_checksum_s": time.perf_counter() - start}

    def stage(self, step: int, version: int) -> "StagedPush":
        """Start moving the actor's current weights (policy `version`) to the rollout's host memory
        while the rollout keeps generating (its "weights" lane); the rollout loads them before its
        next batch that needs them. The actor is busy only for its send. Returns at once; the
        push's `finish()` waits for it. Per-tensor checksums (every weight_sync.checksum_every_steps
        pushes) are taken from the actor now and compared by the rollout right after its load; the
        probe, which needs both sides holding the same weights, runs at `load_staged` (drains)."""
        if not self.transport.supports_staging:
            raise WeightSyncError(f"a staged weight push needs a transport that receives while the engine generates; "
                                  f"this run's transport, {self.transport}, does not (supports_staging): set "
                                  "trainer.max_staleness to 0 or 1, or give the rollout a pool of its own")
        self.syncs += 1
        every = self.cfg.checksum_every_steps
        expected = self.actor.weight_checksums()[0] if every and self.syncs % every == 0 else None
        futures = [self.actor.send_weights.remote(), self.rollout.stage_weights.remote(version, expected)]
        return StagedPush(self, step, version, futures, time.perf_counter())

    def load_staged(self, step: int, version: int) -> dict[str, float]:
        """Both sides idle (a drain): the rollout loads the staged policy `version` now, and the
        probe compares it with the actor, which holds the same weights."""
        self._wait([self.rollout.load_staged_weights.remote(version, self.cfg.timeout_s)], f"step {step}")
        return self.probe() if self.cfg.check == "probe" else {}

    def check(self, step: int, checked: bool = False) -> dict[str, float]:
        """The cheap check every sync (a log-prob probe), the per-tensor checksums every N syncs
        (first when due: their error names the tensor; `checked`: compared already)."""
        out = {}
        every = self.cfg.checksum_every_steps
        if every and self.syncs % every == 0 and not checked:
            out.update(self.verify_checksums())
        return {**out, **self._probe_or_defer()}

    def _probe_or_defer(self) -> dict[str, float]:
        """The probe now when the engine is awake whole; else (a colocated engine whose KV cache
        sleeps until the actor's training state leaves the device) at the next `generating`. None
        when the engine holds no weights of its own (it computes with the actor's parameters: the
        exact engine): a sync has delivered nothing that could differ, and the equality the probe
        would measure is every step's `rollout_mismatch/*`, 0.0, on the step's own samples."""
        if self.cfg.check != "probe" or not self.engine_bytes:
            return {}
        if all(set(parts) == set(ENGINE_PARTS) for parts in self.rollout.awake_parts()):
            return self.probe()
        self.probe_due = True
        return {}

    def probe(self) -> dict[str, float]:
        """Every rollout rank's greedy log-probs on the probe prompts against the actor's own: the
        mean, 90th percentile and largest gap per token of the worst rank (verify.py)."""
        return self._compare_probes(self._engine_probes())

    def _engine_probes(self) -> list:
        """Each rollout rank's greedy tokens and their log-probs on the probe prompts (it generates)."""
        return self._wait([self.rollout.probe_log_probs.remote(PROBE_PROMPTS, PROBE_NEW_TOKENS)], "the probe")[0]

    def _compare_probes(self, probes: list, deferred: bool = False) -> dict[str, float]:
        """The engine's probe log-probs against the actor's on the same tokens, worst rank first
        (`deferred`: after generation, the engine asleep again)."""
        worst, actor_lp = None, {}
        tolerance = self.cfg.probe_tolerance or PROBE_TOLERANCE
        for rank, (tokens, rollout_lp) in enumerate(probes):
            key = tuple(map(tuple, tokens))
            if key not in actor_lp:
                actor_lp[key] = self.actor.probe_log_probs(PROBE_PROMPTS, [list(t) for t in tokens])[0]
            stats = gap_statistics(rollout_lp - actor_lp[key])
            if not probe_passes(stats, tolerance):
                self._probe_failed(rank, stats, tolerance, len(rollout_lp), deferred)
            worst = stats if worst is None or stats["mean"] > worst["mean"] else worst
        return {"weight_sync/probe_log_prob_gap": worst["max"], "weight_sync/probe_log_prob_gap_mean": worst["mean"],
                "weight_sync/probe_log_prob_gap_q90": worst["q90"]}

    def _probe_failed(self, rank: int, stats: dict[str, float], tolerance: float, tokens: int,
                      deferred: bool = False) -> None:
        """Raise, saying which question failed: does the engine hold the actor's weights (exact,
        the checksums, run now when the engine can show its weights), or do the two engines compute
        the same model (the probe's statistic, which rounding in 16 bits moves)."""
        found = (f"after the weight sync, rollout rank {rank}'s log-probs differ from the actor's by "
                 f"{stats['mean']:.3g} on average, {stats['q90']:.3g} at the 90th percentile and {stats['max']:.3g} "
                 f"at most over {tokens} probe tokens (tolerance {tolerance:g} on average and "
                 f"{QUANTILE_FACTOR * tolerance:g} at the 90th percentile, weight_sync.probe_tolerance)")
        if not self.cfg.checksum_every_steps:
            raise WeightSyncError(
                f"{found}. Either the engine does not hold the actor's weights, or the two engines compute "
                "different models at this precision. Set weight_sync.checksum_every_steps=1 to compare every "
                "tensor exactly: if they match, the gap is the engines' arithmetic (raise weight_sync.probe_tolerance "
                f"above {stats['mean']:.3g}, or compute in float32: model.dtype=float32 rollout.dtype=float32)")
        if deferred:  # the engine slept again after generating: its weights back to read their checksums
            self._wait([self.rollout.wake_up.remote(["weights"])], "waking the engine's weights")
            self._reload_discarded()
        self.verify_checksums()  # raises naming the tensors when the weights differ
        raise WeightSyncError(
            f"{found}, although the engine holds exactly the actor's weights (every tensor's checksum matches): "
            "the two engines compute different models at this precision. Raise weight_sync.probe_tolerance above "
            f"{stats['mean']:.3g} to accept it, or compute in float32 (model.dtype=float32 rollout.dtype=float32)")

    def verify_checksums(self) -> dict[str, float]:
        expected = self.actor.weight_checksums()[0]  # per rollout rank: checksums of the box it needs
        found = self._wait([self.rollout.verify_weights.remote(expected)], "the checksum check")[0]
        return {"weight_sync/verified_tensors": min(f["weight_sync/verified_tensors"] for f in found)}

    def _wait(self, futures: list, when: str) -> list:
        try:
            return wait_all(futures, self.cfg.timeout_s)
        except WorkerError as exc:
            others = _other_errors(futures, exc)  # the peer's side: which bucket, or that it died
            peers = "".join(f"; and {e.worker_class}.{e.method} on rank {e.rank} of worker group {e.group!r}: "
                            f"{_last_line(e.detail)}" for e in others)
            detail = "".join(f"\n{e}" for e in others)
            raise WeightSyncError(f"weight sync ({self.transport}) failed at {when} in {exc.worker_class}.{exc.method} "
                                  f"on rank {exc.rank} of worker group {exc.group!r} (stage weight_sync): "
                                  f"{_last_line(exc.detail)}{peers}\n{exc.detail}{detail}") from None
        except deadlines.StageTimeoutError as exc:  # the stage's deadline came first: it names its key
            raise WeightSyncError(f"weight sync ({self.transport}) at {when}: {exc}") from None
        except TimeoutError as exc:
            raise WeightSyncError(f"weight sync ({self.transport}) at {when} did not finish within "
                                  f"weight_sync.timeout_s={self.cfg.timeout_s} (stage weight_sync): {exc}") from None


class AdapterSync(WeightSync):
    """`WeightSync` for a LoRA actor served as a vLLM adapter: the same calls for the schedules
    (setup, sync, generating, probe); what moves is the adapter. The transport is kept for the
    device memory steps around generation (colocated on GPUs); it moves nothing here."""

    def setup(self) -> dict[str, float]:
        shapes = self.actor.weight_shapes()  # the folded model's tensors: what a full sync would move
        size = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        self.engine_bytes = sum(numel(s) for s in shapes.values()) * size
        self.min_bytes = 0  # set by the first sync: the adapter's bytes
        self.floor_seconds = 0.0
        return {"weight_sync/engine_bytes_per_rank": float(self.engine_bytes)}

    def sync(self, step: int, version: int) -> dict[str, float]:
        start = time.perf_counter()
        # GPU, colocated: asleep after generating; its weights alone, as the colocated transport's `wakes_for_sync`
        self._wait([self.rollout.wake_up.remote(["weights"])], "waking the engine")
        # actor rank 0's payload goes to every rollout rank through Ray's object store, not through
        # here; a failure on the actor's side reaches us as the rollout's (its argument failed)
        payload = self.actor.lora_adapter.remote(self.dtype)
        loaded = self._wait([self.rollout.load_adapter.remote(version, payload)], f"step {step}")[0]
        live = self._live_checksums()  # the actor's weights, read again: not the payload's own checksums
        seconds = time.perf_counter() - start
        self.syncs += 1
        nbytes = max(r["received_bytes"] for r in loaded)
        self.min_bytes = int(nbytes)
        metrics = {"weight_sync/bytes_received_per_rank": nbytes,
                   "weight_sync/min_bytes_per_rank": nbytes,
                   "weight_sync/engine_bytes_per_rank": float(self.engine_bytes),
                   "weight_sync/adapter_fraction": nbytes / max(self.engine_bytes, 1),
                   "weight_sync/seconds": seconds,
                   "weight_sync/load_s": max(r["load_seconds"] for r in loaded)}
        checked = [verify_adapter(r["found"], live, r["served"], version, rank) for rank, r in enumerate(loaded)]
        metrics["weight_sync/verified_tensors"] = min(c["weight_sync/verified_tensors"] for c in checked)
        metrics.update(self._probe_or_defer())
        self._wait([self.rollout.set_weight_version.remote(version)], "labelling the engine")
        return metrics

    def _live_checksums(self) -> dict:
        """Actor rank 0's checksums of its live LoRA weights (every rank joins the gather)."""
        return self._wait([self.actor.lora_checksums.remote(self.dtype)], "reading the actor's adapter")[0][0]

    def stage(self, step: int, version: int):
        raise WeightSyncError("a staged weight push (trainer.max_staleness >= 2) moves the folded model; the adapter "
                              "sync does not stage: set weight_sync.lora=folded (auto chooses it there)")

    def verify_checksums(self) -> dict[str, float]:
        found = self._wait([self.rollout.served_adapter.remote()], "the adapter check")[0]
        live = self._live_checksums()
        checked = [verify_adapter(r["found"], live, r["served"], r["version"], rank) for rank, r in enumerate(found)]
        return {"weight_sync/verified_tensors": min(c["weight_sync/verified_tensors"] for c in checked)}


class StagedPush:
    """One weight push in flight (`WeightSync.stage`): `finish()` waits for the actor's send and
    the rollout's receive (within weight_sync.timeout_s, and the deadline of the stage that
    started it) and returns the push's `weight_sync/*` metrics."""

    def __init__(self, sync: WeightSync, step: int, version: int, futures: list, started: float) -> None:
        self.sync, self.step, self.version, self.futures, self.started = sync, step, version, futures, started

    def finish(self) -> dict[str, float]:
        per_rank = self.sync._wait(self.futures, f"step {self.step} (policy version {self.version}, staged)")[1]
        seconds = max(r["receive_seconds"] for r in per_rank)
        return {"weight_sync/bytes_received_per_rank": max(r["received_bytes"] for r in per_rank),
                "weight_sync/min_bytes_per_rank": float(self.sync.min_bytes),
                "weight_sync/seconds": seconds,
                "weight_sync/copy_floor_ratio": seconds / max(self.sync.floor_seconds, 1e-9)}


def _last_line(detail: str) -> str:
    """What a worker error comes to: the last line of its traceback (the exception), or the first
    line of a message without one (a dead process's)."""
    lines = [line for line in detail.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    return (lines[-1] if lines[0].startswith("Traceback") else lines[0])[:300]


def _other_errors(futures: list, first: WorkerError, grace_s: float = 5.0) -> list[WorkerError]:
    """Errors the other side reports shortly after the first failure (a sender blocked on a dead
    receiver fails in a moment, naming the bucket it was sending)."""
    found = []
    for future in futures:
        try:
            future.get(timeout_s=grace_s)
        except WorkerError as exc:
            if (exc.group, exc.method, exc.rank) != (first.group, first.method, first.rank):
                found.append(exc)
        except Exception:  # still blocked, or already reported: the first error stands
            pass
    return found
