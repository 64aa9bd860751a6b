"""The placement planner (hybridflow/planning): the plan object, the feasibility rules, the cost
model's arithmetic, the search, its registries (a toy policy and a toy cost model registered
here), placement=auto's choice, and the paper-scale simulation's choice."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest

from hybridflow.run.pipeline_stages import compose_command
from hybridflow.planning.cost import COST_MODELS, Analytical, CostModel, Prediction, Rates, register_cost_model
from hybridflow.planning.plan import Plan, PoolPlan
from hybridflow.planning.rules import memory_terms, problems
from hybridflow.planning.search import (
    POLICIES,
    Exhaustive,
    Policy,
    SearchOptions,
    device_splits,
    pool_sizes,
    register_policy,
    search,
    set_partitions,
)
from hybridflow.planning.workload import GIB, Cluster, Workload

PPO = ["recipe=ppo", "algorithm.kl_penalty_coef=0.01"]
ONES = Rates(train_flops_per_s=1e9, forward_flops_per_s=2e9, decode_bytes_per_s=1e9, decode_flops_per_s=1e18,
             decode_step_s=0.01, tp_step_s=0.001, call_s=0.1, intra_node_bytes_per_s=1e8,
             inter_node_bytes_per_s=1e7, sync_s=0.2, source="test")
TWO_CPUS = Cluster(1, 2, 8 * GIB)


def workload(**changes) -> Workload:
    base = Workload(parameters=1_000_000, layers=2, hidden=64, heads=4, kv_heads=2, vocab=100, prompts_per_step=10,
                    samples_per_prompt=1, prompt_tokens=10, response_tokens=10,
                    roles=("actor", "rollout", "critic", "reference"))
    return dataclasses.replace(base, **changes)


def test_set_partitions_are_the_bell_numbers_and_cover_every_role_once():
    for n, bell in ((1, 1), (2, 2), (3, 5), (4, 15), (5, 52)):
        parts = list(set_partitions(list("abcde"[:n])))
        assert len(parts) == bell
        assert len({tuple(sorted(map(tuple, map(sorted, p)))) for p in parts}) == bell  # all distinct
        assert all(sorted(r for s in p for r in s) == list("abcde"[:n]) for p in parts)


def test_device_splits_use_every_device_in_legal_pool_sizes():
    cluster = Cluster(4, 8, 80 * GIB, "cuda")
    sizes = pool_sizes(cluster)
    assert sizes == [1, 2, 4, 8, 16, 24, 32]
    splits = list(device_splits(3, 32, sizes))
    assert splits and all(sum(s) == 32 and all(n in sizes for n in s) for s in splits)
    assert (8, 8, 16) in splits and (16, 8, 8) in splits and (3, 3, 26) not in splits


def test_plan_from_config_reads_pools_roles_tp_staleness_pinning_and_transport():
    plan = Plan.from_config(compose_command(["recipe=grpo"]))
    assert [(p.name, p.devices) for p in plan.pools] == [("global", 2)]
    assert plan.rollout_colocated and plan.rollout_replicas == 2 and plan.transport == "colocated"
    apart = Plan.from_config(compose_command(["recipe=grpo", "placement=disaggregated", "trainer.max_staleness=1",
                                              "trainer.old_log_probs=actor"]))
    assert not apart.rollout_colocated and apart.transport == "broadcast" and apart.pin_cpus
    assert apart.pool_of("rollout").name == "gen" and apart.family() == "split"


def test_every_searched_plans_overrides_compose_to_a_config_with_that_plan():
    """The printed overrides select exactly the plan they are printed for (round trip through Hydra)."""
    config = compose_command(PPO)
    result = search(Workload.from_config(config), TWO_CPUS, Analytical(ONES))
    assert len(result.ranked) >= 10
    for candidate in result.ranked:
        composed = compose_command([*PPO, *candidate.plan.overrides()])
        again = Plan.from_config(composed)
        used = {p.name: (p.devices, set(p.roles) - {"reward", "teacher"}) for p in again.pools}  # neither starts
        assert used == {p.name: (p.devices, set(p.roles)) for p in candidate.plan.pools}, candidate.plan.describe()
        assert (again.rollout_tp, again.max_staleness) == (candidate.plan.rollout_tp, candidate.plan.max_staleness)


def test_rules_return_every_problem_and_the_config_checks_words():
    w = workload()
    plan = Plan((PoolPlan("actor", 1, 4, ("actor", "rollout", "critic", "reference")),), rollout_tp=3, max_staleness=1)
    found = problems(plan, w, TWO_CPUS)
    text = "\n".join(found)
    assert "the rollout pool 'actor' has 4 rank(s), which 3-rank engines do not divide: use one of [1, 2, 4]" in text  # the config check's words
    assert "rollout.tensor_parallel_size=3: does not divide the 4 attention heads" in text
    assert "needs the rollout on a pool of its own" in text
    assert "the pools take 4 devices; the cluster has 2" in text and "asks 4 devices per node" in text
    assert "neither divides the 2 key/value heads" in text
    assert len(found) == 6
    with pytest.raises(Exception, match="the rollout pool 'global' has 2 rank"):
        compose_command(["recipe=grpo", "rollout.tensor_parallel_size=3"])


def test_a_plan_that_does_not_fit_names_each_memory_term():
    w = workload(parameters=2 * 10 ** 9, master_bytes=4)
    plan = Plan((PoolPlan("actor", 1, 2, ("actor", "rollout", "critic", "reference")),))
    (problem,) = [p for p in problems(plan, w, TWO_CPUS) if "does not fit" in p]
    terms = memory_terms(plan, plan.pools[0], w, TWO_CPUS)
    # 2e9 parameters x 4 bytes x 4 (parameters, gradients, 2 moments) / 2 devices = 14.9 GiB for the actor alone
    actor = sum(v for k, v in terms.items() if k.startswith(("actor parameters", "actor gradients", "actor AdamW")))
    assert actor == pytest.approx(16e9)
    assert "3.73 GiB  actor parameters" in problem and "7.45 GiB  actor AdamW moments" in problem
    assert "GiB  vLLM KV cache" in problem
    # the run's own memory model, for the plan's pool: the floor the preflight refuses a configured run with
    from hybridflow.checks.memory_budget import device_terms

    assert terms == device_terms(w.memory_inputs(), plan.pools[0].roles, 2, 1, "cpu")


def test_a_separate_pools_transition_is_priced_as_the_broadcast_transport_moves_it():
    """hybridflow/resharding/transports/broadcast.py sends each TP rank's slice once to every replica
    at once: the whole model once, however many engines, whatever the TP (the planner priced one
    rank's slice, 1/TP of it)."""
    w = workload()
    model_bytes = w.parameters * w.rollout_bytes
    for tp, replicas in ((1, 1), (1, 2), (2, 1), (2, 2)):
        plan = Plan((PoolPlan("train", 1, 2, ("actor", "critic", "reference")),
                     PoolPlan("gen", 1, tp * replicas, ("rollout",))), rollout_tp=tp)
        seconds = Analytical(ONES).predict(plan, w, Cluster(1, 8, 8 * GIB)).stages["transition"]
        assert seconds == pytest.approx(ONES.sync_s + model_bytes / ONES.intra_node_bytes_per_s), (tp, replicas)


def test_the_planner_prices_a_pool_as_the_runs_own_memory_check_does():
    """One memory model: placement=auto's verdict on the configured plan is the preflight's (issue 39
    found the two with different formulas, so placement=auto switched the verdict from one to the other)."""
    from hybridflow.checks.memory_budget import actor_pool_roles, process_terms

    for extra in ([], ["actor.gradient_checkpointing=true", "placement.pools.global.devices_per_node=1"],
                  ["actor.lora.rank=8", "model.dtype=bfloat16"]):
        config = compose_command([*PPO, "actor.samples_per_micro_batch=4", *extra])
        plan, w = Plan.from_config(config), Workload.from_config(config)
        run = process_terms(config, plan, w.memory_inputs().shape, actor_pool_roles(config, plan))
        planned = memory_terms(plan, plan.pool_of("actor"), w, TWO_CPUS)
        assert planned == run and run, extra


def test_the_planner_prices_sequence_parallelism_as_the_run_does_and_refuses_pools_it_does_not_divide():
    """actor.sequence_parallel_size=2 (the reference's too): the planner's terms for the configured plan are
    the preflight's, 1/2 of the micro-batch's tokens a rank and the all-to-all's buffers; a plan that puts the
    actor or the reference on one device is refused, naming the key."""
    from hybridflow.checks.memory_budget import actor_pool_roles, process_terms

    config = compose_command(["recipe=grpo", "actor.kl_loss_coef=0.01", "actor.samples_per_micro_batch=4",
                              "actor.sequence_parallel_size=2"])
    plan, w = Plan.from_config(config), Workload.from_config(config)
    assert w.sequence_parallel() == {"actor": 2, "reference": 2}
    run = process_terms(config, plan, w.memory_inputs().shape, actor_pool_roles(config, plan))
    planned = memory_terms(plan, plan.pool_of("actor"), w, TWO_CPUS)
    assert planned == run
    assert any(k.startswith("activations of one micro-batch (1/2 of 4 rows") for k in planned), planned
    assert any(k.startswith("sequence parallel 2: all-to-all") for k in planned), planned
    split = Plan((PoolPlan("actor", 1, 1, ("actor",)), PoolPlan("rest", 1, 1, ("rollout", "reference"))), 1, 0)
    said = problems(split, w, TWO_CPUS)
    assert "actor.sequence_parallel_size=2: the actor pool's 1 device(s) do not divide into sequence-parallel groups " \
           "of 2" in said, said


def test_the_plan_command_shows_sequence_parallelism_per_pool(capsys):
    from hybridflow.planning.cli import main

    assert main(["--cluster", "1x2", "--device-memory-gib", "8", "recipe=grpo", "actor.kl_loss_coef=0.01",
                 "actor.sequence_parallel_size=2"], compose_command) == 0
    out = capsys.readouterr().out
    assert "; sequence parallel actor 2, reference 2" in out.splitlines()[0]
    assert "(actor+rollout+reference on 2, sequence parallel: actor 2, reference 2):" in out, out
    assert "activations of one micro-batch (1/2 of" in out and "all-to-all send and receive buffers" in out


def test_on_gpus_the_planner_checks_the_runs_own_phases_and_the_engines_share():
    """The planner's GPU phases are the run's (start, training, the weight sync, generation, the engine
    taking its rollout.gpu_memory_utilization share), and a share that cannot hold the engine's weights
    and one sequence's KV cache is refused (issue 41: the sync phase and vLLM's share in the rules)."""
    import dataclasses

    from hybridflow.checks.memory_budget import actor_pool_roles, gpu_phase_terms
    from hybridflow.planning.rules import phases

    config = compose_command([*PPO, "placement.device=cuda", "actor.samples_per_micro_batch=4",
                              "actor.gradient_checkpointing=false"])
    plan, w = Plan.from_config(config), Workload.from_config(config)
    gpus = Cluster(1, 2, 80 * GIB, "cuda")
    run = gpu_phase_terms(config, plan, w.memory_inputs().shape, actor_pool_roles(config, plan), 80 * GIB)
    assert list(run) == ["training", "start", "weight sync", "generation"]
    assert phases(plan, plan.pool_of("actor"), w, gpus) == {f" ({name})": terms for name, terms in run.items()}
    assert not [p for p in problems(plan, w, gpus) if "does not fit" in p or "gpu_memory_utilization" in p]
    starved = dataclasses.replace(w, gpu_memory_utilization=1e-6)
    assert any(p.startswith("rollout.gpu_memory_utilization=1e-06: the engine's share")
               for p in problems(plan, starved, gpus))


def test_analytical_cost_by_hand():
    """One pool of 2 devices, every role on it; the arithmetic of each stage written out."""
    w = workload(actor_forward=True)
    plan = Plan((PoolPlan("actor", 1, 2, ("actor", "rollout", "critic", "reference")),), rollout_tp=1)
    p = Analytical(ONES).predict(plan, w, TWO_CPUS)
    tokens = 10 * 20  # 10 sequences x (10 + 10) tokens
    fsdp_forward = 1e6 * 4 * 0.5 / 1e8  # the parameters' half each device lacks, at the intra-node rate: 0.02 s
    forward = 0.1 + max(2 * 1e6 * tokens / (2 * 2e9), fsdp_forward)  # 0.1 + max(0.05, 0.02)
    assert p.stages["score"] == pytest.approx(3 * forward + 0.1)  # actor, critic, reference add; + reward call
    train = 0.1 + max(6 * 1e6 * tokens / (2 * 1e9), 3 * fsdp_forward)  # 0.1 + max(0.6, 0.06)
    assert p.stages["update"] == pytest.approx(2 * train)
    # generate: 5 sequences per engine; prefill 2·P·5·10 / 2e9; per step: read (4 MB + 5 x 15 x KV) / 1e9 + 0.01
    kv = 2 * 2 * 2 * 16 * 4  # 2 (k, v) x layers x kv_heads x head_dim x bytes = 512 bytes per token
    step = (4e6 + 5 * 15 * kv) / 1e9 + 0.01
    assert p.stages["generate"] == pytest.approx(0.1 + 2 * 1e6 * 5 * 10 / 2e9 + 10 * step)
    assert p.stages["transition"] == pytest.approx(0.2 + 2e6 / 1e8)  # half of the 4 MB engine copy is local
    assert p.step_s == pytest.approx(sum(p.stages.values()))


def test_separate_pools_take_the_slowest_and_overlap_at_depth_one():
    w = workload()
    split = (PoolPlan("actor", 1, 1, ("actor", "reference")), PoolPlan("rollout", 1, 1, ("rollout", "critic")))
    sync, overlapped = (Analytical(ONES).predict(Plan(split, 1, depth), w, TWO_CPUS) for depth in (0, 1))
    cost = Analytical(ONES)
    ref, critic_fwd = cost.forward_s(w, split[0], TWO_CPUS), cost.forward_s(w, split[1], TWO_CPUS)
    assert sync.stages["score"] == pytest.approx(max(ref, critic_fwd) + 0.1)
    assert sync.step_s == pytest.approx(sum(sync.stages.values()))
    busy = overlapped.stages["generate"] + critic_fwd + cost.train_s(w, split[1], TWO_CPUS)
    chain = overlapped.stages["score"] + overlapped.stages["update"]
    assert overlapped.step_s == pytest.approx(max(busy, chain) + overlapped.stages["transition"])
    assert overlapped.step_s < sync.step_s


def test_search_ranks_fastest_first_and_keeps_the_refused_with_reasons():
    w = workload(parameters=150 * 10 ** 6)  # 5 GiB devices hold some plans, not those with a crowded device
    result = search(w, Cluster(1, 2, 5 * GIB), Analytical(ONES))
    assert result.ranked and result.refused
    steps = [c.prediction.step_s for c in result.ranked]
    assert steps == sorted(steps)
    assert all(any("does not fit" in problem for problem in found) for _, found in result.refused)
    assert result.considered == len(result.ranked) + len(result.refused)
    with pytest.raises(LookupError, match="no plan fits"):
        search(w, Cluster(1, 2, 0.5 * GIB), Analytical(ONES)).best


def test_a_toy_policy_and_a_toy_cost_model_are_one_class_each():
    @register_policy
    class OnlyColocated(Policy):
        name = "toy-only-colocated"

        def candidates(self, workload, cluster, options):
            return (c for c in Exhaustive().candidates(workload, cluster, options) if len(c.pools) == 1)

    @register_cost_model
    class FewestPools(CostModel):
        name = "toy-fewest-devices"

        def predict(self, plan, workload, cluster):
            return Prediction({s: 0.0 for s in ("generate", "score", "update", "transition")}, float(plan.devices))

    try:
        with pytest.raises(KeyError, match="placement policy 'toy-only-colocated' is already registered"):
            register_policy(OnlyColocated)
        config = compose_command([*PPO, "placement.planner.policy=toy-only-colocated",
                                  "placement.planner.cost_model=toy-fewest-devices"])
        from hybridflow.planning.auto import plan_search

        result = plan_search(config, TWO_CPUS, ONES)
        assert result.ranked and all(len(c.plan.pools) == 1 for c in result.ranked)
        assert all(c.prediction.step_s == 2.0 for c in result.ranked)
    finally:
        POLICIES.remove("toy-only-colocated")
        COST_MODELS.remove("toy-fewest-devices")
    with pytest.raises(KeyError, match="unknown cost model 'toy-fewest-devices'; registered: analytical"):
        plan_search(config, TWO_CPUS, ONES)


def test_placement_auto_hands_over_the_best_plan_and_saves_its_prediction(tmp_path, monkeypatch):
    from hybridflow.planning import auto

    monkeypatch.setattr(Cluster, "this_machine", classmethod(lambda cls, device="cpu": TWO_CPUS))
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps(ONES.to_dict()))
    from hybridflow.run.stage import prepare_stage

    config = compose_command([*PPO, "placement=auto", f"placement.planner.rates={rates}"])
    stage = prepare_stage(config)
    stage.save(tmp_path)  # as the runner does
    chosen, line = stage.plan, stage.said[0]
    saved = json.loads((tmp_path / "plan.json").read_text())
    best = search(Workload.from_config(config), TWO_CPUS, Analytical(ONES), options=SearchOptions(depths=(0,))).best
    assert [(p.devices, set(p.roles) - {"reward", "teacher"}) for p in chosen.pools] == \
        [(p.devices, set(p.roles)) for p in best.plan.pools]  # a reward function (and no teacher) joins the actor's pool
    assert "reward" in chosen.pool_of("actor").roles and chosen.device == "cpu" and chosen.transport
    assert chosen.rollout_tp == best.plan.rollout_tp and saved["plan"] == chosen.to_dict()
    assert config.placement.planner.auto and config.rollout.tensor_parallel_size == 1  # the config is not rewritten
    assert saved["prediction"]["step_s"] == pytest.approx(best.prediction.step_s)
    assert "placement=auto chose" in line and "s/step" in line
    metrics = stage.predicted_metrics()  # what the logger adds to every step
    assert metrics["plan/predicted_step_s"] == pytest.approx(best.prediction.step_s)
    assert set(metrics) == {f"plan/predicted_{s}_s" for s in ("generate", "score", "update", "transition", "step")}
    own = prepare_stage(compose_command(PPO))  # off: the config's own plan, saved as well
    own.save(tmp_path)
    assert not any("placement=auto" in said for said in own.said) and own.plan == auto.decide_plan(own.config).plan
    assert json.loads((tmp_path / "plan.json").read_text()) == {"plan": own.plan.to_dict()}
    assert own.predicted_metrics() == {}


def test_placement_auto_refuses_when_nothing_fits_naming_memory_terms(tmp_path, monkeypatch):
    from hybridflow.data.checks import InputError
    from hybridflow.planning import auto

    monkeypatch.setattr(Cluster, "this_machine", classmethod(lambda cls, device="cpu": Cluster(1, 2, 0.9 * GIB)))
    with pytest.raises(InputError, match="(?s)placement=auto on 1 node.*no plan fits.*GiB  vLLM KV cache"):
        auto.decide_plan(compose_command([*PPO, "placement=auto"]))


def fake_gpus(tmp_path, monkeypatch, count: int, name: str = "NVIDIA H100 80GB HBM3", mib: int = 81559) -> None:
    """A machine whose nvidia-smi reports `count` GPUs (the driver reads GPUs through NVML, not torch)."""
    fake = tmp_path / f"bin{count}"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\n" + "".join(f"echo '{name}, {mib}'\n" for _ in range(count)))
    (fake / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")


def test_placement_auto_and_the_plan_command_plan_this_machines_gpus(tmp_path, monkeypatch, capsys):
    """A GPU machine is planned as its GPUs, with their memory and their kind's rates (issue 41 found
    `placement=auto` planning its CPU cores, then asking Ray for as many GPUs as cores)."""
    from hybridflow.planning import auto
    from hybridflow.planning.cli import main

    fake_gpus(tmp_path, monkeypatch, 8)
    monkeypatch.setenv("HYBRIDFLOW_RATES_CACHE", str(tmp_path / "rates"))  # no cached rates of the user's
    cores = len(os.sched_getaffinity(0))
    assert Cluster.this_machine("cuda") == Cluster(1, 8, 81559 * 2 ** 20, "cuda", max(1.0, cores / 8))
    decided = auto.decide_plan(compose_command([*PPO, "placement=auto", "placement.device=cuda"]))
    plan, line = decided.plan, decided.line
    assert plan.device == "cuda" and plan.devices <= 8 and plan.transport in ("colocated", "broadcast")
    assert "on 1 node(s) x 8 cuda device(s), 79.6 GiB each" in line and "H100" in line
    assert decided.record["cluster"]["device"] == "cuda" and plan.to_dict()["device"] == "cuda"  # as plan.json saves
    assert main(["--device", "cuda", "--top", "2", *PPO], compose_command) == 0  # `hybridflow plan` on this machine
    assert "8 cuda device(s)" in capsys.readouterr().out
    assert Cluster.this_machine("cpu").device == "cpu"  # placement.device=cpu plans the cores
    fake_gpus(tmp_path, monkeypatch, 0)  # nvidia-smi, and no GPU it can read
    with pytest.raises(ValueError, match="shows no GPU"):
        Cluster.this_machine("cuda")


def test_a_joined_ray_cluster_is_planned_on_the_device_the_run_computes_on(tmp_path, monkeypatch):
    """One decider for the device: the Ray cluster's GPUs when the run computes on CUDA, its CPU slots
    when on the CPU, and a CUDA run on nodes without GPUs refused naming the fix."""
    import ray

    gpu_nodes = [{"Alive": True, "Resources": {"CPU": 32.0, "GPU": 8.0, "memory": 512 * GIB}} for _ in range(2)]
    monkeypatch.setattr(ray, "nodes", lambda: gpu_nodes)
    fake_gpus(tmp_path, monkeypatch, 8, "NVIDIA H200", 143771)
    cuda = Cluster.from_ray("cuda")
    assert (cuda.nodes, cuda.devices_per_node, cuda.device, cuda.device_memory_bytes) == (2, 8, "cuda", 143771 * 2 ** 20)
    assert (Cluster.from_ray("cpu").device, Cluster.from_ray("cpu").devices_per_node) == ("cpu", 32)
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 4.0, "memory": 16 * GIB}}])
    with pytest.raises(ValueError, match="placement.device=cuda, and the node of the Ray cluster has no GPU"):
        Cluster.from_ray("cuda")


@pytest.mark.parametrize("model, gpus, family", [("13B", 32, "colocate"), ("34B", 128, "split")])
def test_paper_scale_search_picks_the_papers_family(model, gpus, family):
    """How long the search takes is bench/paper_placement.py's to measure (docs/placement.md)."""
    from bench.paper_placement import paper_case

    result = paper_case(model, gpus)
    assert result.best.plan.family() == family
    assert math.isfinite(result.best.prediction.step_s)


def test_the_plan_command_prints_the_ranking_overrides_and_memory_and_exits_2_when_nothing_fits(capsys):
    from hybridflow.planning.cli import main

    assert main(["--cluster", "1x2", "--device-memory-gib", "8", "--top", "3", *PPO], compose_command) == 0
    out = capsys.readouterr().out
    assert "searched 13 plans" in out and "13 fit" in out
    ranked = [line for line in out.splitlines() if line[:3].strip() in ("1", "2", "3") and "depth" in line]
    assert len(ranked) == 3
    steps = [float(line.split()[1]) for line in ranked]
    assert steps == sorted(steps)
    assert "placement.roles.reward=" in out and "memory per device of the best plan" in out
    assert main(["--cluster", "1x2", "--device-memory-gib", "0.5", *PPO], compose_command) == 2
    out = capsys.readouterr().out
    assert "no plan fits" in out and "GiB  vLLM KV cache (rollout.kv_cache_space_gib)" in out
    assert main(["--cluster", "2by2", *PPO], compose_command) == 2
    assert "give here, ray, or NODESxDEVICES" in capsys.readouterr().err


def test_a_finished_auto_run_compares_the_prediction_with_its_steps(tmp_path):
    from hybridflow.planning.auto import compare_measured

    stages = {"generate": 1.0, "score": 0.2, "update": 0.5, "transition": 0.1}
    (tmp_path / "plan.json").write_text(json.dumps({"prediction": {"stages": stages, "step_s": 1.8}}))
    rows = [{"step": s, "timing/generate_s": g, "timing/score_s": 0.2, "timing/update_s": 0.5,
             "timing/weight_sync_s": 0.1, "timing/step_s": g + 0.8} for s, g in ((1, 9.0), (2, 1.1), (3, 1.3))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = compare_measured(tmp_path)
    # steps 2-3 (the first warms caches): generate 1.2, step 2.0; predicted 1.8 is 10% under
    assert "predicted 1.80 s/step, measured 2.00 (-10%; mean of steps 2-3)" in line
    saved = json.loads((tmp_path / "plan.json").read_text())["measured"]
    assert saved["stages"]["generate"] == pytest.approx(1.2) and saved["steps"] == [2, 3]
    assert compare_measured(tmp_path / "nowhere") is None


def test_placement_auto_names_a_bad_rates_file_before_anything_starts(tmp_path):
    from hybridflow.data.checks import InputError
    from hybridflow.planning import auto

    bad = tmp_path / "rates.json"
    bad.write_text("{}")
    with pytest.raises(InputError, match=f"placement=auto: placement.planner.rates='{bad}': not a rates file"):
        auto.decide_plan(compose_command([*PPO, "placement=auto", f"placement.planner.rates={bad}"]))


def test_a_policy_and_a_cost_model_can_be_named_by_module_and_class():
    from hybridflow.planning.cost import build_cost_model
    from hybridflow.planning.search import Exhaustive, build_policy

    assert isinstance(build_policy("hybridflow.planning.search:Exhaustive"), Exhaustive)
    assert isinstance(build_cost_model("hybridflow.planning.cost:Analytical", ONES), Analytical)
    with pytest.raises(KeyError, match="unknown placement policy 'nearest'; registered: exhaustive"):
        build_policy("nearest")


def test_placement_auto_plans_the_cluster_a_submitted_job_joins(_ray_head_address, monkeypatch):
    """Under `ray job submit` the driver finds its cluster in RAY_ADDRESS, and the run joins it
    (hybridflow.controller.runtime.join_address): placement=auto plans that cluster (here the tests'
    head, tests/ray_head.py, of HEAD_CPUS slots), not the machine the driver runs on."""
    from hybridflow.config import compose
    from hybridflow.planning.auto import cluster_for
    from tests.ray_head import HEAD_CPUS

    monkeypatch.setenv("RAY_ADDRESS", _ray_head_address)  # as `ray job submit` sets it for the job
    joined = cluster_for(compose(["placement=auto"]))
    assert (joined.nodes, joined.devices_per_node) == (1, HEAD_CPUS)
    monkeypatch.delenv("RAY_ADDRESS")
    here = cluster_for(compose(["placement=auto"]))
    assert here.devices_per_node != HEAD_CPUS  # this machine's own cores
