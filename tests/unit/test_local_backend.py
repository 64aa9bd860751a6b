"""The one-process backend (placement.backend=local, hybridflow/controller/local.py): the same groups
and futures as under Ray, in this process; errors raised at the wait as the same `WorkerError`; what
crosses a call is copied; each host has its own random state; teardown frees its workers; and what one
process cannot do is refused before anything starts, naming the fix. The real runs, with Ray's import
blocked: tests/e2e/test_local_backend.py and the e2e tests run through
tests/e2e/cli_in_one_process.py `without_ray`."""

from __future__ import annotations

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.config import compose
from hybridflow.controller import Dispatch, RoleSpec, WorkerError, register


class Doubler:
    def __init__(self, ctx) -> None:
        self.ctx, self.seen, self.met = ctx, None, []

    def meet(self, peers: list) -> None:
        self.met += peers  # appended: a second introduction would show twice

    @register(Dispatch.DP_SPLIT)
    def double(self, batch: Batch) -> Batch:
        batch.tensors["x"] *= 2  # in place: under Ray the driver's batch never changes
        self.seen = batch
        return Batch(tensors={"y": batch["x"].clone()})

    @register(Dispatch.ONE_TO_ALL)
    def fail(self) -> None:
        raise ValueError("bad input 7")

    @register(Dispatch.ONE_TO_ALL)
    def draw(self) -> float:
        return float(torch.rand(()))

    @register(Dispatch.ONE_TO_ALL)
    def world(self) -> tuple[int, int, str]:
        import torch.distributed as dist

        return self.ctx.rank, dist.get_world_size(), self.ctx.backend


class Summer:
    def __init__(self, ctx) -> None:
        self.ctx, self.peers = ctx, []

    def meet(self, peers: list) -> None:
        self.peers = peers  # the doubler: the two now hold each other, as an actor and the exact engine do

    @register(Dispatch.DP_SPLIT)
    def total(self, batch: Batch) -> float:
        return float(batch["y"].sum())


@pytest.fixture
def groups():
    from hybridflow.controller.local import spawn_local

    import torch.distributed as dist

    made = not dist.is_initialized()
    groups = spawn_local("one:doubler+summer", "cpu", {"doubler": RoleSpec(Doubler, {}), "summer": RoleSpec(Summer, {})})
    yield groups
    groups["doubler"].shutdown()
    if made and dist.is_initialized():  # the run's group lives as long as its process; this test's process goes on
        dist.destroy_process_group()


def test_calls_futures_and_the_process_group_of_one(groups):
    batch = Batch(tensors={"x": torch.arange(4.0)})
    future = groups["doubler"].double.remote(batch)
    assert groups["summer"].total(future) == [12.0]  # a future passed to another group, as under Ray
    assert batch["x"].tolist() == [0.0, 1.0, 2.0, 3.0]  # the worker's in-place change stayed there
    assert groups["doubler"].world() == [(0, 1, "gloo")]


def test_an_error_is_raised_at_the_wait_as_a_worker_error_naming_class_method_and_rank(groups):
    future = groups["doubler"].fail.remote()  # submitted: it ran and failed; nothing raised yet
    with pytest.raises(WorkerError, match=r"Doubler.fail failed on rank 0 of 1(.|\n)*ValueError: bad input 7"):
        future.get()


def test_the_host_keeps_a_random_state_of_its_own(groups):
    """As in a process of its own: a worker's draws neither move the driver's stream nor follow it."""
    torch.manual_seed(0)
    expected = [float(torch.rand(())) for _ in range(2)]
    torch.manual_seed(0)
    first = float(torch.rand(()))
    host = groups["doubler"].hosts[0]
    for driver_seed in (1, 2):
        own = torch.Generator().set_state(host.rng["cpu"])
        torch.manual_seed(driver_seed) if driver_seed == 2 else None
        assert groups["doubler"].draw() == [float(torch.rand((), generator=own))]  # its own stream continues
        if driver_seed == 1:
            assert [first, float(torch.rand(()))] == expected  # the driver's went on where it was


def test_teardown_frees_the_workers_and_what_they_met_of_each_other(groups):
    """The host introduced the workers of its process to each other (each one's `meet`); dropping them frees
    them all, the ones that hold each other too, as between two stages of a pipeline (a stage's engine
    beside its actor: tests/unit/test_engine_meets_actor.py)."""
    import gc
    import weakref

    host = groups["doubler"].hosts[0]
    doubler = host.worker_host.workers["doubler"]
    assert doubler.met == [host.worker_host.workers["summer"]]  # once, the others of its process
    held = weakref.ref(doubler)
    del doubler
    groups["doubler"].shutdown()
    gc.collect()
    assert host.worker_host.workers == {} and held() is None


@pytest.mark.parametrize("overrides, key, fix", [
    (["placement.backend=local"], "placement.pools.global", "devices_per_node=1"),
    (["placement=disaggregated", "placement.backend=local"], "placement.pools", "one pool"),
    (["placement=local", "placement.planner.auto=true"], "placement.planner.auto", "use placement=local"),
    (["placement=local", "ray.address=10.0.0.1:6379"], "ray.address", "unset ray.address"),
    (["placement=local", "trainer.fault_injection=[{kind: kill, role: actor, step: 2}]"], "trainer.fault_injection",
     "use placement.backend=ray for them"),
])
def test_what_one_process_cannot_do_is_refused_when_the_config_is_composed(overrides, key, fix):
    with pytest.raises(ValueError, match=rf"{key}=.*is invalid: .*{fix}"):
        compose(["recipe=grpo", *overrides])
    compose(["recipe=grpo", "placement=local"])  # what placement=local sets passes


def test_ray_address_in_the_environment_and_a_missing_ray_are_refused_with_the_fix(monkeypatch):
    import importlib.util

    from hybridflow.run.launch import start_ray
    from hybridflow.planning.plan import Plan
    from hybridflow.checks.preflight import _cluster_problems

    config = compose(["recipe=grpo", "placement=local"])
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert "RAY_ADDRESS='10.0.0.1:6379' (the environment) asks to join a Ray cluster" in _cluster_problems(config)[0]
    monkeypatch.delenv("RAY_ADDRESS")
    assert start_ray(config, Plan.from_config(config)) == "one process"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    ray_config = compose(["recipe=grpo"])
    with pytest.raises(ImportError, match=r"placement.backend=ray needs Ray, which is not installed.*placement=local"):
        start_ray(ray_config, Plan.from_config(ray_config))
