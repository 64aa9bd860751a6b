"""CPU pools pinned to disjoint cores (`CoreLedger`, `pin_threads`), in a Ray instance of their own
(the other controller tests keep their pools' CPUs reserved)."""

from __future__ import annotations

import os

import pytest

from hybridflow.controller import PoolSpec, ResourcePool, RoleSpec, spawn_workers
from hybridflow.controller.pools import CoreLedger
from tests.controller.workers import EchoWorker


def test_pools_given_one_core_ledger_pin_their_processes_to_disjoint_cores(ray_local):
    """Two one-core pools on this (2-core) machine: each process's threads, those started after
    the pinning included, run on a core of their own, and torch uses one thread; a third process
    would run past the cores and is left as it was."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    ledger = CoreLedger()
    a = spawn_workers(ResourcePool(PoolSpec("pin-a")), {"echo": RoleSpec(EchoWorker)}, cores=ledger)["echo"]
    b = spawn_workers(ResourcePool(PoolSpec("pin-b")), {"echo": RoleSpec(EchoWorker)}, cores=ledger)["echo"]
    cores = [a.infos[0]["cores"], b.infos[0]["cores"]]
    assert len(cores[0]) == len(cores[1]) == 1 and cores[0] != cores[1]
    for group, mine in ((a, cores[0]), (b, cores[1])):
        per_thread, threads = group.affinity()[0]
        assert threads == 1 and all(t == mine for t in per_thread), per_thread
    if len(os.sched_getaffinity(0)) == 2:
        c = spawn_workers(ResourcePool(PoolSpec("pin-c")), {"echo": RoleSpec(EchoWorker)}, cores=ledger)["echo"]
        assert c.infos[0]["cores"] is None
        c.shutdown()
    a.shutdown()
    b.shutdown()
