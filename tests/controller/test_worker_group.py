"""Worker groups on real Ray (CPU slots): concurrency, collectives, dispatch, failures."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.controller import PoolSpec, ResourcePool, RoleSpec, WorkerError, WorkerGroupBroken, spawn_workers
from tests.controller.workers import BrokenInitWorker, CounterWorker, EchoWorker, LingeringWorker


@pytest.fixture(scope="module")
def pair(ray_local):
    """A 2-rank EchoWorker group and a 1-rank EchoWorker group on two separate pools."""
    two = spawn_workers(ResourcePool(PoolSpec("two", devices_per_node=2)), {"echo": RoleSpec(EchoWorker)})["echo"]
    one = spawn_workers(ResourcePool(PoolSpec("one")), {"echo": RoleSpec(EchoWorker, {"scale": 10.0})})["echo"]
    return two, one


def test_ranks_get_rank_world_size_and_gloo(pair):
    two, _ = pair
    infos = two.whoami()
    assert [i["rank"] for i in infos] == [0, 1]
    assert {i["world_size"] for i in infos} == {2}
    assert {i["backend"] for i in infos} == {"gloo"}
    assert infos[0]["pid"] != infos[1]["pid"]


def test_workers_start_forked_from_the_tests_warm_interpreter(pair):
    """The suite's Ray workers fork from its warm interpreter (tests/warm_workers.py), vLLM imported before
    their first line: a server that fell back to cold starts (an import that started a thread, say) would
    cost CI minutes and fail nothing else. Their exits stay Ray's intended ones (the shutdown tests below)."""
    two, _ = pair
    warm = os.environ.get("HYBRIDFLOW_TEST_WARM_WORKERS") != "0"
    assert [i["vllm_imported"] for i in two.whoami()] == [warm, warm]


def test_cpu_workers_start_with_onednns_kernel_caches_bounded(pair, monkeypatch):
    """Left at 1,024 entries, the caches grew by ~12 MB a step over a long CPU run (controller/memory.py);
    the driver's own setting wins."""
    from hybridflow.controller.memory import CPU_KERNEL_CACHE_ENTRIES, cpu_kernel_cache_env

    expected = {k: os.environ.get(k, str(CPU_KERNEL_CACHE_ENTRIES)) for k in ("LRU_CACHE_CAPACITY",
                                                                              "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    two, _ = pair
    assert [i["kernel_caches"] for i in two.whoami()] == [expected, expected]
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    assert cpu_kernel_cache_env()["LRU_CACHE_CAPACITY"] == "7"


def test_all_reduce_through_group_process_group(pair):
    two, _ = pair
    assert two.all_reduce_rank() == [3.0, 3.0]  # (0+1) + (1+1)


def test_two_pools_run_concurrently(pair):
    two, one = pair
    """Each rank sleeps 1 s and returns the wall-clock time it woke: the two pools' sleeps overlapped
    (woke less than 1 s apart) whatever the load, where one after the other they would wake 1 s apart."""
    two.sleep(0.0), one.sleep(0.0)  # warm both
    a, b = two.sleep.remote(1.0), one.sleep.remote(1.0)
    woke = [*a.get(), *b.get()]
    assert max(woke) - min(woke) < 1.0, f"the pools' sleeps woke {max(woke) - min(woke):.2f} s apart: one after the other"


@pytest.mark.parametrize("size", [8, 7, 1])
def test_dp_split_round_trip(pair, size):
    two, _ = pair
    batch = Batch({"x": torch.arange(size, dtype=torch.float32)}, {"tag": [f"s{i}" for i in range(size)]})
    out = two.double(batch)
    assert len(out) == size
    assert torch.equal(out["x"], batch["x"] * 2)
    assert out["tag"] == [f"s{i}!" for i in range(size)]
    # Rows are split in order: the first half (rounded up after padding) went to rank 0.
    assert out["owner"].tolist() == sorted(out["owner"].tolist())
    if size > 1:
        assert set(out["owner"].tolist()) == {0, 1}


def test_future_feeds_another_group_without_driver(pair):
    two, one = pair
    batch = Batch({"x": torch.arange(5, dtype=torch.float32)}, {"tag": list("abcde")})
    doubled = two.double.remote(batch)  # 2 ranks, padded to 6
    scaled = one.double.remote(doubled)  # re-split inside the cluster for 1 rank (scale 10)
    chained_same_size = two.add_one.remote(two.double.remote(batch))  # refs passed straight through
    out = scaled.get()
    assert torch.equal(out["x"], batch["x"] * 2 * 2 * 10)
    assert out["tag"] == ["a!!", "b!!", "c!!", "d!!", "e!!"]
    assert torch.equal(chained_same_size.get()["x"], batch["x"] * 2 + 1)


def test_rank_zero_and_all_to_all(pair):
    two, _ = pair
    assert two.rank_zero_value() == 100
    assert two.only_rank_zero() == 0
    assert two.take([1, 2]) == [10, 21]
    with pytest.raises(ValueError, match="all-to-all argument 0 must be a list of 2"):
        two.take([1])


def test_unknown_method_names_registered_ones(pair):
    two, _ = pair
    with pytest.raises(AttributeError, match="registered: .*all_reduce_rank"):
        two.no_such_method()


def test_colocated_roles_share_one_process(ray_local):
    groups = spawn_workers(ResourcePool(PoolSpec("fused", devices_per_node=2)),
                           {"echo": RoleSpec(EchoWorker), "counter": RoleSpec(CounterWorker)})
    echo_pids = [i["pid"] for i in groups["echo"].whoami()]
    assert groups["counter"].pid() == echo_pids
    groups["echo"].set_state(7)
    assert groups["echo"].get_state() == [7, 7]


def test_remote_exception_names_class_method_rank_quickly(ray_local):
    group = spawn_workers(ResourcePool(PoolSpec("failing", devices_per_node=2)), {"echo": RoleSpec(EchoWorker)})["echo"]
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        group.fail_on_rank(1)  # rank 0 is stuck in all_reduce; the error must not wait for it
    assert time.monotonic() - start < 10
    err = info.value
    assert (err.worker_class, err.method, err.rank) == ("EchoWorker", "fail_on_rank", 1)
    assert "EchoWorker.fail_on_rank failed on rank 1 of 2" in str(err)
    assert "deliberate failure on rank 1" in str(err) and "Traceback" in str(err)
    with pytest.raises(WorkerGroupBroken):
        group.whoami()


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has ended
    except FileNotFoundError:
        return True


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if not _gone(p)]


def _exit_types(group) -> list[str]:
    import ray._private.state

    causes = [str(ray._private.state.actors(host.actor._actor_id.hex())["DeathCause"]) for host in group.hosts]
    return ["INTENDED_USER_EXIT" if "INTENDED_USER_EXIT" in c else c for c in causes]


def test_a_group_shut_down_ends_its_processes_itself_and_what_they_started(ray_local):
    """Each host ends itself (Ray's intended exit), never by Ray's kill, whose SIGKILL five seconds later
    goes to the process id, which a busy machine may have given to another process by then (it killed a
    new vLLM rank in CI once). A thread a library left running and a child process do not keep it."""
    group = spawn_workers(ResourcePool(PoolSpec("lingering", devices_per_node=2)), {"l": RoleSpec(LingeringWorker)})["l"]
    pids = [p for pair in group.process_ids() for p in pair]
    group.shutdown()
    assert _wait_gone(pids, 10.0) == []
    assert _exit_types(group) == ["INTENDED_USER_EXIT"] * 2


@pytest.mark.slow  # ~10 s: the default tier's 16 minutes are full
def test_a_host_still_inside_a_call_at_shutdown_ends_itself_and_one_that_answers_nothing_is_killed(
        ray_local, monkeypatch):
    """A rank inside a call (stuck in a collective its peer left) ends itself from its monitor lane within
    seconds; a process whose monitor lane does not answer either is killed after `END_TIMEOUT_S`."""
    from hybridflow.controller import ray_host

    monkeypatch.setattr(ray_host, "END_TIMEOUT_S", 3.0)
    group = spawn_workers(ResourcePool(PoolSpec("busy", devices_per_node=2)), {"l": RoleSpec(LingeringWorker)})["l"]
    pids = [p for pair in group.process_ids() for p in pair]
    group.sleep(600)
    group.hosts[1].submit("l", "hold_the_monitor_lane", (600,), {}, "monitor")
    time.sleep(0.5)
    start = time.monotonic()
    group.shutdown()
    assert time.monotonic() - start < 3.0 + 5.0
    assert _wait_gone(pids, 10.0) == []
    rank0, rank1 = _exit_types(group)
    assert "RAY_KILL" not in rank0 and "RAY_KILL" in rank1


def test_constructor_failure_is_reported(ray_local):
    with pytest.raises(WorkerError, match=r"(?s)BrokenInitWorker.__init__ failed on rank 0 .*cannot build this worker"):
        spawn_workers(ResourcePool(PoolSpec("broken")), {"b": RoleSpec(BrokenInitWorker)})


def test_pool_too_large_is_a_clear_error(ray_local):
    with pytest.raises(RuntimeError, match=r"placement plan refused: pool 'huge' needs 1 node\(s\) with \{CPU: 64\}"):
        ResourcePool(PoolSpec("huge", devices_per_node=64)).create(timeout_s=5)


def test_dp_split_over_replicas_gives_each_replica_one_part_and_collects_from_its_first_rank(pair):
    """The 2-rank group seen as one replica of 2 (as a TP-2 vLLM engine is): both ranks see the
    whole batch, and the result comes back once, from rank 0."""
    from hybridflow.controller import WorkerGroup

    two, _ = pair
    replica = WorkerGroup(two.name, "echo", EchoWorker, two.hosts, two.infos, replica_size=2)
    batch = Batch({"x": torch.arange(5, dtype=torch.float32)}, {"tag": [f"s{i}" for i in range(5)]})
    out = replica.double(batch)
    assert len(out) == 5 and out["owner"].tolist() == [0] * 5
    assert torch.equal(out["x"], batch["x"] * 2)
    assert len(replica.double.remote(batch).refs) == 2  # both ranks ran it


def test_wait_all_returns_each_calls_result_and_names_the_first_failure(pair):
    from hybridflow.controller import wait_all

    two, one = pair
    echo, sleeper = two.whoami.remote(), one.sleep.remote(0.2)
    infos, stamps = wait_all([echo, sleeper], timeout_s=30)
    assert [i["rank"] for i in infos] == [0, 1] and len(stamps) == 1
    with pytest.raises(Exception, match=r"no result within 0.5 s from: EchoWorker.sleep rank 0"):
        wait_all([one.sleep.remote(3.0)], timeout_s=0.5)


def test_a_wait_inside_a_stage_ends_at_its_deadline_naming_stage_method_and_ranks(pair):
    from hybridflow.controller import deadlines

    two, _ = pair
    deadlines.configure({"generate": 0.5}, default_s=None)
    try:
        start = time.monotonic()
        with deadlines.stage("generate"), pytest.raises(deadlines.StageTimeoutError) as error:
            two.sleep(3.0)
        assert time.monotonic() - start < 2.9  # the 3 s sleep's end: the deadline was ignored
        message = str(error.value)
        assert "stage 'generate'" in message and "trainer.stage_timeout_s.generate" in message
        assert "EchoWorker.sleep rank 0" in message and "EchoWorker.sleep rank 1" in message
        two.sleep(3.0)  # outside the stage, and with no default: no deadline
    finally:
        deadlines.configure({}, default_s=None)


def test_a_callers_timeout_does_not_lift_the_stage_deadline_and_a_call_keeps_its_own(pair):
    """`weight_sync.timeout_s` is longer than `trainer.stage_timeout_s.weight_sync`: the stage
    still ends the wait. A call issued under one stage and awaited in a later one (an
    asynchronous rollout's generation) ends by the deadline it was issued under."""
    from hybridflow.controller import deadlines, wait_all

    two, _ = pair
    deadlines.configure({"weight_sync": 0.5, "generate": 0.5, "score": 60.0}, default_s=None)
    try:
        start = time.monotonic()
        with deadlines.stage("weight_sync"), pytest.raises(deadlines.StageTimeoutError, match="stage_timeout_s.weight_sync"):
            wait_all([two.sleep.remote(3.0)], timeout_s=60.0)
        assert time.monotonic() - start < 2.9  # the 3 s sleep's end: the deadline was ignored
        with deadlines.stage("generate"):
            issued = two.sleep.remote(3.0)
        start = time.monotonic()
        with deadlines.stage("score"), pytest.raises(deadlines.StageTimeoutError, match="stage 'generate'"):
            issued.get()
        assert time.monotonic() - start < 2.9  # the 3 s sleep's end: the deadline was ignored
    finally:
        deadlines.configure({}, default_s=None)



def test_a_worker_python_this_node_cannot_run_is_refused_naming_the_variable(monkeypatch, tmp_path):
    """HYBRIDFLOW_WORKER_PYTHON is checked before Ray starts: a missing command would leave every worker
    unstarted until Ray's registration timeout."""
    from hybridflow.controller.runtime import worker_python

    monkeypatch.setenv("HYBRIDFLOW_WORKER_PYTHON", str(tmp_path / "no-such-python") + " -X dev")
    with pytest.raises(ValueError, match=r"HYBRIDFLOW_WORKER_PYTHON=.*no-such-python.* is not an executable on this node"):
        worker_python()
    monkeypatch.setenv("HYBRIDFLOW_WORKER_PYTHON", sys.executable + " -X dev")
    assert worker_python() == sys.executable + " -X dev"
    monkeypatch.delenv("HYBRIDFLOW_WORKER_PYTHON")
    assert worker_python() is None
