"""The torchrun variables each rollout rank hands vLLM's external_launcher on GPUs
(workers/rollout/vllm_rollout.py `launcher_variables`), for simulated nodes of 8 GPUs.

vLLM's GPU worker opens `cuda:<LOCAL_RANK>` after asserting LOCAL_RANK is below the number of
devices the process sees (vllm/v1/worker/gpu_worker.py, `init_device`). Ray gives each worker
one GPU and makes it the only visible one, so the rank's position in its pool (what LOCAL_RANK
was) fails that assertion on every rank but the first of a node."""

from __future__ import annotations

import pytest

from hybridflow.controller.context import WorkerContext
from workers.rollout.vllm_rollout import launcher_variables, parallel_arguments

GPUS_PER_NODE = 8


def ray_assignment(nodes: int, per_node: int, all_visible: bool) -> list[tuple[WorkerContext, str, str]]:
    """Each rank of a pool of `nodes` x `per_node` GPU workers: its context, the CUDA_VISIBLE_DEVICES
    Ray sets (its own GPU; the node's eight with RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES) and
    the GPU id Ray reports for it. The pool takes the node's GPUs from the highest down, so a
    GPU's id and the rank's position differ."""
    ranks = []
    for node in range(nodes):
        for slot in range(per_node):
            rank = node * per_node + slot
            gpu = str(GPUS_PER_NODE - 1 - slot)
            visible = ",".join(str(g) for g in range(GPUS_PER_NODE)) if all_visible else gpu
            ctx = WorkerContext(rank=rank, world_size=nodes * per_node, local_rank=rank, node_id=f"node{node}",
                                device="cuda", backend="nccl", master_addr="10.0.0.1", master_port=29500)
            ranks.append((ctx, visible, gpu))
    return ranks


@pytest.mark.parametrize("all_visible", [False, True], ids=["ray-one-gpu-each", "noset-all-visible"])
@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("per_node,tp", [(2, 1), (2, 2), (4, 2), (4, 4), (8, 1), (8, 2), (8, 4), (8, 8)])
def test_every_rank_opens_its_own_gpu_and_passes_vllms_bound(nodes, per_node, tp, all_visible):
    """Pools of 2, 4 and 8 GPUs per node on one node and two; an engine of `tp` consecutive ranks
    (at TP 1 vLLM's uniprocess executor opens cuda:0, which is the same device when Ray shows one)."""
    opened: dict[str, set[str]] = {}
    for ctx, visible, gpu in ray_assignment(nodes, per_node, all_visible):
        env = launcher_variables(ctx, visible, gpu)
        seen = visible.split(",")
        local = int(env["LOCAL_RANK"])
        assert local < len(seen), (ctx.rank, env, visible)  # vLLM's assertion in init_device
        assert seen[local] == gpu  # the device it opens is the one Ray gave it
        opened.setdefault(ctx.node_id, set()).add(seen[local])
        assert (env["RANK"], env["WORLD_SIZE"]) == (str(ctx.rank), str(nodes * per_node))
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "29500")
    assert all(len(gpus) == per_node for gpus in opened.values())  # no two ranks of a node share a GPU


def test_the_old_variables_fail_vllms_bound_on_every_rank_but_the_first():
    """What the rollout wrote before: LOCAL_RANK = the rank's position in the pool."""
    failing = [ctx.rank for ctx, visible, _ in ray_assignment(1, 4, all_visible=False)
               if not ctx.local_rank < len(visible.split(","))]
    assert failing == [1, 2, 3]


def test_a_gpu_the_process_cannot_see_is_named():
    ctx = WorkerContext(rank=1, world_size=2, local_rank=1, device="cuda", backend="nccl")
    with pytest.raises(RuntimeError, match=r"rollout rank 1: its GPU '3' is not among the visible devices "
                                           r"CUDA_VISIBLE_DEVICES='0'"):
        launcher_variables(ctx, "0", "3")


def test_on_a_cpu_local_rank_is_the_position_in_the_pool():
    ctx = WorkerContext(rank=3, world_size=4, local_rank=1, master_addr="127.0.0.1", master_port=1234)
    assert launcher_variables(ctx) == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
                                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}


def test_a_cuda_tp_engine_turns_custom_all_reduce_off_and_a_cpu_engine_never_sleeps():
    """vLLM's custom all-reduce opens the other ranks' buffers by CUDA IPC, which needs their GPUs
    visible in this process; Ray shows each worker one."""
    assert parallel_arguments("cuda", 4) == {"tensor_parallel_size": 4, "distributed_executor_backend": "external_launcher",
                                             "enable_sleep_mode": True, "disable_custom_all_reduce": True}
    assert parallel_arguments("cuda", 1)["disable_custom_all_reduce"] is False  # one GPU: no all-reduce at all
    cpu = parallel_arguments("cpu", 2)
    assert cpu["distributed_executor_backend"] == "external_launcher" and not cpu["enable_sleep_mode"]
    assert not cpu["disable_custom_all_reduce"] and parallel_arguments("cpu", 1)["distributed_executor_backend"] is None
    # a pool of 4 ranks at TP 2: two engines, vLLM's data parallel under the external launcher
    assert parallel_arguments("cuda", 2, 4)["data_parallel_size"] == 2
    assert "data_parallel_size" not in parallel_arguments("cuda", 2, 2) and "data_parallel_size" not in parallel_arguments("cpu", 1, 4)
