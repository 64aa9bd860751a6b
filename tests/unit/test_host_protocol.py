"""Adding a backend is one new host file (hybridflow/controller/hosts.py, the host protocol): a toy third
host defined here runs each rank's calls on a thread of its own, and worker groups, their futures and the
wait drive it through the protocol alone: every dispatch and execute mode, a future passed into another
group's call, the first failure raised at once as the WorkerError naming class, method and rank while the
other rank is still blocked, a stage's deadline naming the stage, and the roles of one process introduced to
each other once (`meet`) and dropped at teardown."""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from functools import partial

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.controller import (Dispatch, RoleSpec, WorkerError, WorkerGroup, WorkerGroupBroken, deadlines,
                                   register, wait_all)
from hybridflow.controller.hosts import Host, WorkerHost
from tests.controller.workers import EchoWorker

RELEASE = threading.Event()  # what a blocked call waits for (at most 10 s)
_MOVER = ThreadPoolExecutor(max_workers=4, thread_name_prefix="thread-host-apply")  # gathers between groups


def _values(values) -> list:
    return [v.result() if isinstance(v, Future) else v for v in values]


class ThreadHost(Host):
    """One rank whose calls run, one at a time, on a thread of its own; a reference is a `Future`."""

    def __init__(self, group_name: str, rank: int, world_size: int, roles: dict[str, RoleSpec]) -> None:
        self.worker_host = WorkerHost(group_name, rank, world_size, rank, "threads", False, roles)
        self.info = self.worker_host.build_roles()
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{group_name}-rank{rank}")
        self.alive = True

    def submit(self, role, method, args, kwargs, lane=None) -> Future:
        fn = getattr(self.worker_host, method) if role is None else partial(self.worker_host.call, role, method)
        return self.thread.submit(lambda: fn(*_values(args), **dict(zip(kwargs, _values(kwargs.values())))))

    def ready(self, refs, timeout_s):
        wait(refs, timeout_s, return_when=FIRST_COMPLETED)
        done = [ref.done() for ref in refs]  # read once: a call may finish meanwhile
        return [r for r, d in zip(refs, done) if d], [r for r, d in zip(refs, done) if not d]

    def result(self, ref, worker_class, method):
        return ref.result()  # a failure is the WorkerHost's WorkerError already

    def value(self, ref):
        return ref.result()

    def apply(self, fn, args, returns=1):
        whole = _MOVER.submit(lambda: fn(*_values(args)))
        return [whole] if returns == 1 else [_MOVER.submit(lambda i=i: whole.result()[i]) for i in range(returns)]

    def kill(self) -> None:
        self.teardown()

    def teardown(self) -> None:
        if self.alive:  # once: a group's shutdown, or the test's
            self.alive = False
            self.thread.submit(self.worker_host.teardown).result()
            self.thread.shutdown()


def spawn_threads(name: str, roles: dict[str, RoleSpec], ranks: int) -> dict[str, WorkerGroup]:
    hosts = [ThreadHost(name, rank, ranks, roles) for rank in range(ranks)]
    return {role: WorkerGroup(name, role, rs.cls, hosts, [h.info for h in hosts]) for role, rs in roles.items()}


class Scaler(EchoWorker):
    """The controller tests' worker (its rank-zero, execute-on-rank-zero and all-to-all methods), with what a
    thread host shows: the thread a rank runs on, a failure while a peer blocks, the peers it met."""

    def __init__(self, ctx, scale: float = 2.0) -> None:
        super().__init__(ctx, scale)
        self.met: list = []

    def meet(self, peers: list) -> None:
        self.met.append([type(peer).__name__ for peer in peers])

    @register(Dispatch.DP_SPLIT)
    def scale_rows(self, batch: Batch) -> Batch:
        return Batch(tensors={"x": batch["x"] * self.scale, "owner": torch.full_like(batch["x"], self.ctx.rank)})

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self) -> tuple[int, int, str]:
        return self.ctx.rank, self.ctx.world_size, threading.current_thread().name

    @register(Dispatch.ONE_TO_ALL)
    def fail_on_rank(self, rank: int) -> None:
        if self.ctx.rank == rank:
            raise ValueError(f"deliberate failure on rank {rank}")
        RELEASE.wait(10)  # as a peer blocked in a collective waits for the failed rank

    @register(Dispatch.ONE_TO_ALL)
    def block(self) -> None:
        RELEASE.wait(10)

    @register(Dispatch.ONE_TO_ALL)
    def peers_met(self) -> list:
        return self.met


class Watcher(EchoWorker):
    """A second role fused into the scaler's processes (no `meet`: it is introduced to no one)."""


@pytest.fixture
def groups():
    RELEASE.clear()
    made = {**spawn_threads("threads-two", {"scaler": RoleSpec(Scaler), "watcher": RoleSpec(Watcher)}, 2),
            "one": spawn_threads("threads-one", {"scaler": RoleSpec(Scaler, {"scale": 10.0})}, 1)["scaler"]}
    yield made
    RELEASE.set()
    for group in made.values():
        group.shutdown()


def test_a_toy_thread_host_runs_every_dispatch_mode_and_moves_futures_between_groups(groups):
    two, one = groups["scaler"], groups["one"]
    assert [(rank, world) for rank, world, _ in two.whoami()] == [(0, 2), (1, 2)]
    assert len({thread for _, _, thread in two.whoami()}) == 2  # each rank on a thread of its own
    batch = Batch(tensors={"x": torch.arange(5.0)})
    out = two.scale_rows(batch)  # padded to 6, split over the 2 ranks, collected and unpadded
    assert out["x"].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0] and out["owner"].tolist() == [0, 0, 0, 1, 1]
    assert two.rank_zero_value() == 100 and two.only_rank_zero() == 0 and two.take([1, 2]) == [10, 21]
    moved = one.scale_rows.remote(two.scale_rows.remote(batch))  # re-split for 1 rank by `Host.apply`
    assert moved.get()["x"].tolist() == [0.0, 20.0, 40.0, 60.0, 80.0]
    both = wait_all([two.whoami.remote(), one.whoami.remote()])
    assert [len(results) for results in both] == [2, 1]


def test_the_first_failure_is_raised_at_once_naming_class_method_and_rank(groups):
    two = groups["scaler"]
    start = time.monotonic()
    with pytest.raises(WorkerError) as error:
        two.fail_on_rank(1)  # rank 0 is blocked until RELEASE: the error must not wait for it
    assert time.monotonic() - start < 5
    assert (error.value.worker_class, error.value.method, error.value.rank) == ("Scaler", "fail_on_rank", 1)
    assert "Scaler.fail_on_rank failed on rank 1 of 2 in worker group 'threads-two'" in str(error.value)
    assert "deliberate failure on rank 1" in str(error.value)
    with pytest.raises(WorkerGroupBroken):
        two.whoami()


def test_a_stage_deadline_ends_the_wait_naming_the_stage_and_the_ranks(groups):
    two = groups["scaler"]
    deadlines.configure({"generate": 0.3}, default_s=None)
    try:
        start = time.monotonic()
        with deadlines.stage("generate"), pytest.raises(deadlines.StageTimeoutError) as error:
            two.block()
        assert time.monotonic() - start < 5
        assert "stage 'generate'" in str(error.value) and "trainer.stage_timeout_s.generate" in str(error.value)
        assert "Scaler.block rank 0" in str(error.value) and "Scaler.block rank 1" in str(error.value)
    finally:
        deadlines.configure({}, default_s=None)


def test_the_roles_of_a_process_meet_once_and_teardown_drops_them(groups):
    """Each rank's WorkerHost hands a worker with `meet` the other workers of its process, once, after building
    them all; the alone one meets nobody."""
    assert groups["scaler"].peers_met() == [[["Watcher"]], [["Watcher"]]] and groups["one"].peers_met() == [[[]]]
    groups["scaler"].shutdown()
    assert groups["scaler"].hosts[0].worker_host.workers == {}
