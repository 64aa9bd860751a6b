"""The placement plan as a pure function: nodes from what each has free, no Ray."""

from __future__ import annotations

import json

import pytest

from hybridflow.controller.placement import NodeInfo, PlacementError, plan_placement
from hybridflow.controller.pools import PoolSpec


def node(name: str, cpu: float, gpu: float = 0, free: dict | None = None, labels: dict | None = None,
         **custom: float) -> NodeInfo:
    total = {"CPU": cpu, **({"GPU": gpu} if gpu else {}), **custom}
    return NodeInfo(f"{name}{'0' * 50}", f"10.0.0.{name[-1]}", total, dict(free if free is not None else total),
                    labels or {})


def nodes_of(plan, pool):
    return [n[:2] for n in plan.pools[pool].node_ids]


def test_two_pools_each_filling_a_node_get_two_nodes():
    """The issue's case: ranking nodes by total resources put both pools on one node."""
    nodes = [node("n1", 2), node("n2", 2)]
    plan = plan_placement([PoolSpec("global", cpus_per_device=2), PoolSpec("gen", cpus_per_device=2)], nodes,
                          {"global": ["actor"], "gen": ["rollout"]})
    assert sorted(nodes_of(plan, "global") + nodes_of(plan, "gen")) == ["n1", "n2"]
    assert plan.hosted_on(plan.pools["gen"].node_ids[0]) == ["pool 'gen' (rollout) rank(s) 0"]


def test_the_free_view_counts_what_others_hold():
    """A node whose CPUs another job holds is skipped although its total is large."""
    nodes = [node("n1", 8, free={"CPU": 1}), node("n2", 4)]
    plan = plan_placement([PoolSpec("p", devices_per_node=2, cpus_per_device=2)], nodes)
    assert nodes_of(plan, "p") == ["n2"]


def test_eight_gpu_nodes_train_and_rollout_apart_and_ranks_node_major():
    nodes = [node(f"n{i}", 96, gpu=8) for i in (1, 2, 3)]
    plan = plan_placement([PoolSpec("train", nodes=2, devices_per_node=8, use_gpu=True, cpus_per_device=8),
                           PoolSpec("gen", devices_per_node=8, use_gpu=True, cpus_per_device=8)], nodes)
    assert len(set(plan.pools["train"].node_ids) | set(plan.pools["gen"].node_ids)) == 3
    first = plan.pools["train"].node_ids[0]
    assert plan.pools["train"].ranks_on(first) == list(range(8))


def test_best_fit_leaves_the_big_node_for_the_big_pool():
    """Placed biggest first and best-fit, a 1-slot pool takes the small node, whatever the order given."""
    nodes = [node("n1", 4), node("n2", 1)]
    for order in ((PoolSpec("small"), PoolSpec("big", devices_per_node=4)),
                  (PoolSpec("big", devices_per_node=4), PoolSpec("small"))):
        plan = plan_placement(list(order), nodes)
        assert nodes_of(plan, "big") == ["n1"] and nodes_of(plan, "small") == ["n2"]


def test_pools_share_a_node_when_it_has_room_unless_exclusive():
    nodes = [node("n1", 4), node("n2", 4)]
    shared = plan_placement([PoolSpec("a"), PoolSpec("b")], nodes)
    assert nodes_of(shared, "a") == nodes_of(shared, "b")
    apart = plan_placement([PoolSpec("a", exclusive_nodes=True), PoolSpec("b")], nodes)
    assert nodes_of(apart, "a") != nodes_of(apart, "b")
    with pytest.raises(PlacementError, match="exclusive"):
        plan_placement([PoolSpec("a", exclusive_nodes=True), PoolSpec("b", nodes=2)], nodes)


def test_affinity_by_label_and_by_custom_resource():
    nodes = [node("n1", 4, labels={"tier": "train"}), node("n2", 4, labels={"tier": "gen"}, gen_node=1)]
    by_label = plan_placement([PoolSpec("gen", node_affinity="tier=gen"), PoolSpec("train")], nodes)
    assert nodes_of(by_label, "gen") == ["n2"]
    by_resource = plan_placement([PoolSpec("gen", node_affinity="gen_node")], nodes)
    assert nodes_of(by_resource, "gen") == ["n2"]
    with pytest.raises(PlacementError, match="affinity 'tier=eval'"):
        plan_placement([PoolSpec("eval", node_affinity="tier=eval")], nodes)


def test_a_pool_spans_distinct_nodes():
    nodes = [node("n1", 8), node("n2", 8)]
    plan = plan_placement([PoolSpec("wide", nodes=2, devices_per_node=2)], nodes)
    assert sorted(nodes_of(plan, "wide")) == ["n1", "n2"]
    with pytest.raises(PlacementError, match="needs 3 node"):
        plan_placement([PoolSpec("wide", nodes=3)], nodes)


def test_refusal_names_pools_nodes_and_what_each_has():
    nodes = [node("n1", 2), node("n2", 2, free={"CPU": 1})]
    with pytest.raises(PlacementError) as caught:
        plan_placement([PoolSpec("global", cpus_per_device=2), PoolSpec("gen", cpus_per_device=2)], nodes)
    text = str(caught.value)
    # equal pools are placed in name order: 'gen' took n1, so 'global' is the one refused
    assert "pool 'global' needs 1 node(s) with {CPU: 2} free each" in text
    assert "after placing 'gen'" in text and "Nothing was reserved" in text
    assert "node 10.0.0.1 (n1000000): free {CPU: 2} of {CPU: 2}, planned for gen" in text
    assert "node 10.0.0.2 (n2000000): free {CPU: 1} of {CPU: 2}" in text
    assert "placement.pools.<name>" in text


def test_gpu_pool_never_lands_on_a_cpu_node():
    nodes = [node("n1", 64), node("n2", 16, gpu=2)]
    plan = plan_placement([PoolSpec("train", devices_per_node=2, use_gpu=True, cpus_per_device=4)], nodes)
    assert nodes_of(plan, "train") == ["n2"]


def test_plan_json_and_console_lines():
    nodes = [node("n1", 2), node("n2", 4)]
    plan = plan_placement([PoolSpec("global", nodes=2, devices_per_node=2, cpus_per_device=1)], nodes,
                          {"global": ["actor", "rollout"]})
    saved = json.loads(json.dumps(plan.to_dict()))  # as the plan file holds it
    assert saved["pools"]["global"]["roles"] == ["actor", "rollout"]
    assert [n["ranks"] for n in saved["pools"]["global"]["nodes"]] == [[0, 1], [2, 3]]
    assert [n["free_before"]["CPU"] for n in saved["nodes"]] == [2, 4]
    (line,) = plan.lines()
    assert line.startswith("  pool 'global' (actor+rollout): 2 node(s) x 2 x {CPU: 1} -> ")
    assert "ranks 0-1" in line and "ranks 2-3" in line


def test_assign_nodes_refuses_at_once_what_no_node_could_hold_and_waits_out_a_stale_release(monkeypatch):
    """hybridflow.run.cluster.assign_nodes reads Ray's per-node free view, which trails a release: pools
    that fit the nodes' totals are retried for a moment; pools that cannot fit them are refused at once."""
    import time

    from hybridflow.run import cluster
    from hybridflow.config import compose
    from hybridflow.controller import placement
    from hybridflow.planning.plan import Plan

    config = compose(["placement.pools.global.devices_per_node=1", "placement.pools.global.cpus_per_device=2"])
    views = [[node("n1", 2, free={"CPU": 0})], [node("n1", 2)]]  # a release not yet reported, then reported
    monkeypatch.setattr(placement, "cluster_nodes", lambda: views.pop(0) if len(views) > 1 else views[0])
    plan = cluster.assign_nodes(Plan.from_config(config).with_transport("cpu"), {"global": ["actor"]})
    assert nodes_of(plan, "global") == ["n1"] and not views[1:]

    monkeypatch.setattr(placement, "cluster_nodes", lambda: [node("n1", 1)])
    start = time.monotonic()
    with pytest.raises(PlacementError, match="needs 1 node"):
        cluster.assign_nodes(Plan.from_config(config).with_transport("cpu"), {"global": ["actor"]})
    assert time.monotonic() - start < 2.5  # refused at once, not after the 5 s retry for a late release
