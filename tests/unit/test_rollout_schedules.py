"""The schedules (`hybridflow.rollout_schedules`: Synchronous, OneStepOff, Staged) driven by a
stub generator and a stub weight sync, no Ray or vLLM: over random step patterns (steps without an update,
hook reloads, validation and checkpoint drains), each batch trains within the staleness bound
on the version the schedule promises, syncs run in version order and never while the rollout
generates (depth <= 1), and every step's prompts are drawn once. At depth >= 2 pushes arrive
while the rollout generates, after random delays, and each batch loads the newest weights that
have arrived when it starts: the bound holds, no batch waits for weights never pushed, and a
checkpoint taken with batches in flight resumes onto the same schedule."""

from __future__ import annotations

import json
import random

import pytest

from hybridflow.rollout_schedules import OneStepOff, Pending, Staged, StalenessError, build_schedule


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class JSONBatches:
    """The generator's checkpoint side for the stubs' dict batches."""

    def version_of(self, batch: dict) -> int:
        return batch["version"]

    def encode(self, batch: dict) -> dict:
        return batch

    def decode(self, saved: dict) -> dict:
        return saved


class StubRollout(JSONBatches):
    """One generation at a time, like the one-thread rollout actor; a batch finishes after a
    random number of seconds of the fake clock, which the driver's wait advances to."""

    def __init__(self, clock: Clock, rng: random.Random) -> None:
        self.clock, self.rng = clock, rng
        self.busy_until = 0.0
        self.drawn: list[int] = []  # steps whose prompts were drawn (the loader)
        self.events: list[tuple] = []

    def launch(self, step: int, version: int, staged: bool) -> Pending:
        assert not staged
        self.drawn.append(step)
        return self.submit(step, version)

    def relaunch(self, pending: Pending, version: int) -> Pending:
        return self.submit(pending.step, version)

    def submit(self, step: int, version: int) -> Pending:
        done_at = max(self.clock.now, self.busy_until) + self.rng.uniform(0.1, 2.0)
        self.busy_until = done_at
        self.events.append(("launch", step, version))

        def collect():
            self.clock.now = max(self.clock.now, done_at)
            self.events.append(("done", step, version))
            return {"step": step, "version": version}

        return Pending(step, version, collect, source=step)


class StubSync:
    def __init__(self, rollout: StubRollout) -> None:
        self.rollout = rollout
        self.versions: list[int] = []

    def sync(self, step: int, version: int) -> dict[str, float]:
        assert self.rollout.clock.now >= self.rollout.busy_until, "a sync ran while the rollout was generating"
        self.versions.append(version)
        self.rollout.events.append(("sync", step, version))
        return {"weight_sync/seconds": 0.01}


def run(depth: int, steps: int, seed: int, start_step: int = 0):
    rng = random.Random(seed)
    clock = Clock()
    rollout = StubRollout(clock, rng)
    sync = StubSync(rollout)
    queue = build_schedule(rollout, sync, depth, last_step=steps, clock=clock)
    queue.start(start_step)
    taken = []
    for step in range(start_step + 1, steps + 1):
        batch, trained_version, metrics = queue.next(step)
        assert batch["step"] == step
        taken.append((step, batch["version"], trained_version))
        assert trained_version - batch["version"] <= depth
        assert metrics["timing/generate_wait_s"] >= 0 and metrics["timing/overlap_fraction"] <= 1
        clock.now += rng.uniform(0.1, 3.0)  # score and update
        learned, reloaded = rng.random() < 0.8, rng.random() < 0.15
        metrics = queue.updated(step, learned=learned, reloaded=reloaded)
        assert metrics["timing/weight_sync_s"] >= 0
        if rng.random() < 0.3:  # validation or a checkpoint
            queue.drain(step)
            assert queue.rollout_version == queue.actor_version
    return taken, rollout, sync, queue


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("depth", [0, 1])
def test_every_batch_trains_within_the_bound_syncs_in_order_and_prompts_are_drawn_once(depth, seed):
    taken, rollout, sync, queue = run(depth, steps=12, seed=seed)
    assert [s for s, _, _ in taken] == list(range(1, 13))
    assert rollout.drawn == list(range(1, 13))  # each step's prompts once, in order (relaunches reuse them)
    assert sync.versions == sorted(set(sync.versions)) and sync.versions[0] == 0
    if depth == 0:
        assert all(v == t for _, v, t in taken)  # on-policy: today's loop
    in_flight = 0
    for kind, *_ in rollout.events:
        in_flight += {"launch": 1, "done": -1}.get(kind, 0)
        assert 0 <= in_flight <= max(depth, 1)


def test_one_step_off_without_reloads_is_exactly_one_version_behind():
    """Every step learns: batch s is generated by version max(s-2, 0) and trains on s-1."""
    clock, rng = Clock(), random.Random(0)
    rollout = StubRollout(clock, rng)
    queue = OneStepOff(rollout, StubSync(rollout), 1, last_step=6, clock=clock)
    queue.start(0)
    for step in range(1, 7):
        batch, trained_version, _ = queue.next(step)
        assert (batch["version"], trained_version) == (max(step - 2, 0), step - 1)
        queue.updated(step, learned=True)
    assert ("launch", 7, 5) not in rollout.events and len(rollout.drawn) == 6  # nothing past the last step


def test_a_hook_reload_regenerates_the_batch_in_flight_with_the_reloaded_weights():
    clock, rng = Clock(), random.Random(1)
    rollout = StubRollout(clock, rng)
    queue = OneStepOff(rollout, StubSync(rollout), 1, last_step=4, clock=clock)
    queue.start(0)
    queue.next(1)
    queue.updated(1, learned=True, reloaded=True)  # version 2: the batch for step 2 (version 0) is regenerated
    assert rollout.events[-1] == ("launch", 2, 2) and rollout.drawn == [1, 2]
    batch, trained_version, _ = queue.next(2)
    assert (batch["version"], trained_version) == (2, 2)


def test_the_overlap_fraction_is_the_share_of_generation_the_trainer_did_not_wait_for():
    clock = Clock()
    calls = []

    class Batches(JSONBatches):
        def launch(self, step, version, staged):
            calls.append(clock.now)

            def collect():
                clock.now = 6.0  # the batch finishes at t=6
                return {"version": version}
            return Pending(step, version, collect)

    queue = OneStepOff(Batches(), StubSync(StubRollout(clock, random.Random(0))), 1, last_step=3, clock=clock)
    queue.start(0)  # launches step 1 at t=0
    clock.now = 5.0  # the trainer asks at t=5
    _, _, metrics = queue.next(1)
    assert metrics["timing/generate_wait_s"] == pytest.approx(1.0)
    assert metrics["timing/overlap_fraction"] == pytest.approx(1 - 1 / 6)


def test_a_lost_batch_and_a_deeper_queue_are_refused_by_name():
    clock = Clock()
    rollout = StubRollout(clock, random.Random(0))
    queue = OneStepOff(rollout, StubSync(rollout), 1, last_step=3, clock=clock)
    queue.start(0)
    with pytest.raises(StalenessError, match="step 2: the batch in flight is for step 1"):
        queue.next(2)
    with pytest.raises(ValueError, match="trainer.max_staleness=-1: no schedule runs it"):
        build_schedule(rollout, StubSync(rollout), -1, last_step=3)
    with pytest.raises(ValueError, match="trainer.max_staleness=2: the one_step_off schedule does not run it"):
        OneStepOff(rollout, StubSync(rollout), 2, last_step=3)


def test_a_batch_over_the_bound_raises_naming_step_and_versions():
    clock = Clock()
    rollout = StubRollout(clock, random.Random(0))
    queue = OneStepOff(rollout, StubSync(rollout), 1, last_step=3, clock=clock)
    queue.start(0)
    queue.actor_version = 2  # as if two updates had landed without the schedule seeing them
    with pytest.raises(StalenessError, match=r"step 1: batch generated by policy version 0 would train on version 2"):
        queue.next(1)


def test_a_checkpoint_drains_the_batch_in_flight_and_a_resumed_queue_trains_on_it():
    """Kill after the step-2 checkpoint at depth 1: the resumed schedule takes the drained batch
    for step 3 (not a regenerated one) and from there matches the uninterrupted run."""
    def schedule(resume_from=None):
        clock, rng = Clock(), random.Random(5)
        rollout = StubRollout(clock, rng)
        queue = OneStepOff(rollout, StubSync(rollout), 1, last_step=5, clock=clock)
        first = 1 if resume_from is None else 3
        queue.start(first - 1, **(resume_from or {}))
        taken, saved = [], None
        for step in range(first, 6):
            batch, trained_version, _ = queue.next(step)
            taken.append((step, batch["version"], trained_version))
            queue.updated(step, learned=True)
            if step == 2:
                queue.drain(step)
                saved = json.loads(json.dumps(queue.state()))  # what the checkpoint holds
        return taken, saved, rollout.drawn

    whole, saved, _ = schedule()
    assert [b["step"] for b in saved["in_flight"]] == [3] and saved["actor_version"] == 2
    resumed, _, drawn = schedule(resume_from=saved)
    assert resumed == whole[2:]
    assert drawn == [4, 5]  # step 3's prompts are not drawn again


# ---- depth >= 2: staged pushes ------------------------------------------------------------------


class StagingStub(JSONBatches):
    """A rollout generating one batch at a time, and a weight sync whose pushes (`stage`) arrive
    after a random delay while it generates. A batch starts when the one before it is done, loads
    the newest version that has arrived by then, and, when that is older than its `min_version`,
    waits for the push of that version (the real rollout's `load_staged`)."""

    def __init__(self, clock: Clock, rng: random.Random) -> None:
        self.clock, self.rng = clock, rng
        self.free_at = 0.0
        self.pushes: list[tuple[float, int]] = []  # (arrives at, version)
        self.loaded = -1
        self.drawn: list[int] = []
        self.batches: list[tuple[int, int, int]] = []  # (step, min_version, version used)

    def launch(self, step: int, min_version: int, staged: bool) -> Pending:
        assert staged
        self.drawn.append(step)
        launched_at, seconds = self.clock.now, self.rng.uniform(0.1, 2.0)

        def collect():
            start = max(launched_at, self.free_at)
            if self.loaded < min_version:
                needed = [t for t, v in self.pushes if v >= min_version]
                assert needed, f"step {step} needs policy version {min_version}, which was never pushed: a hang"
                start = max(start, min(needed))
            self.loaded = max([self.loaded] + [v for t, v in self.pushes if t <= start])
            self.free_at = start + seconds
            self.clock.now = max(self.clock.now, self.free_at)
            self.batches.append((step, min_version, self.loaded))
            return {"step": step, "version": self.loaded}

        return Pending(step, min_version, collect)

    def relaunch(self, pending: Pending, version: int) -> Pending:
        raise AssertionError("the staged schedule never regenerates a batch")

    def sync(self, step: int, version: int) -> dict[str, float]:
        assert self.clock.now >= self.free_at, "a blocking sync ran while the rollout was generating"
        self.pushes.append((self.clock.now, version))
        self.loaded = version
        return {}

    def stage(self, step: int, version: int):
        arrives = self.clock.now + self.rng.uniform(0.05, 1.5)
        self.pushes.append((arrives, version))
        clock = self.clock

        class Push:
            def finish(self) -> dict[str, float]:
                clock.now = max(clock.now, arrives)
                return {"weight_sync/seconds": 0.01}

        return Push()

    def load_staged(self, step: int, version: int) -> dict[str, float]:
        assert self.clock.now >= self.free_at, "a drain loaded weights while the rollout was generating"
        assert any(v == version for _, v in self.pushes)
        self.loaded = version
        return {"weight_sync/probe_log_prob_gap": 0.0}


def run_staged(depth: int, steps: int, seed: int, learn_p: float = 0.8, resume_from: dict | None = None,
               save_at: int | None = None):
    rng = random.Random(seed)
    clock = Clock()
    stub = StagingStub(clock, rng)
    queue = Staged(stub, stub, depth, last_step=steps, clock=clock)
    first = 1 if resume_from is None else save_at + 1
    queue.start(first - 1, **(resume_from or {}))
    taken, saved = [], None
    for step in range(first, steps + 1):
        batch, trained_version, metrics = queue.next(step)
        assert batch["step"] == step and 0 <= metrics["timing/overlap_fraction"] <= 1
        assert 1 <= len(queue.in_flight) + 1 <= depth + 1  # this batch and at most depth more in flight
        taken.append((step, batch["version"], trained_version))
        clock.now += rng.uniform(0.1, 3.0)  # score and update
        queue.updated(step, learned=rng.random() < learn_p)
        if step == save_at:
            queue.drain(step)
            saved = json.loads(json.dumps(queue.state()))
        elif rng.random() < 0.2:
            queue.drain(step)
            assert stub.loaded == queue.actor_version == queue.rollout_version
    return taken, stub, saved


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("depth", [2, 3])
def test_staged_pushes_keep_every_batch_within_the_bound_and_never_wait_for_unpushed_weights(depth, seed):
    taken, stub, _ = run_staged(depth, steps=14, seed=seed)
    assert [s for s, _, _ in taken] == list(range(1, 15)) and stub.drawn == list(range(1, 15))
    for step, version, trained in taken:
        assert 0 <= trained - version <= depth, (step, version, trained)
    used = [v for _, _, v in stub.batches]
    assert used == sorted(used)  # versions only move forward
    assert all(v >= m for _, m, v in stub.batches)


def test_when_generation_outpaces_training_staleness_reaches_the_bound_and_no_further():
    """Every step learns and the rollout is never the bottleneck: from step depth+1 on, each batch
    was generated exactly `depth` versions before the one it trains on (the pacing's promise)."""
    for depth in (2, 3):
        taken, _, _ = run_staged(depth, steps=10, seed=3, learn_p=1.0)
        for step, version, trained in taken:
            assert trained == step - 1 and trained - version <= depth
        assert max(t - v for _, v, t in taken) == depth


def test_a_checkpoint_with_batches_in_flight_resumes_onto_the_same_schedule():
    whole, _, saved = run_staged(2, steps=8, seed=7, learn_p=1.0, save_at=3)
    assert [b["step"] for b in saved["in_flight"]] == [4, 5] and saved["actor_version"] == 3
    resumed, stub, _ = run_staged(2, steps=8, seed=7, learn_p=1.0, resume_from=saved, save_at=3)
    assert [s for s, _, _ in resumed] == list(range(4, 9))
    assert [(s, v) for s, v, _ in resumed[:2]] == [(s, v) for s, v, _ in whole[3:5]]  # the drained batches
    assert stub.drawn == [6, 7, 8]  # steps 4 and 5 were drawn by the saving run


def test_a_weight_reload_at_depth_2_is_refused_by_name():
    clock = Clock()
    stub = StagingStub(clock, random.Random(0))
    queue = Staged(stub, stub, 2, last_step=5, clock=clock)
    queue.start(0)
    queue.next(1)
    with pytest.raises(StalenessError, match="step 1: a hook reloaded the actor's weights with trainer.max_staleness=2"):
        queue.updated(1, learned=True, reloaded=True)
