"""Ulysses sequence parallelism (hybridflow/training/ulysses.py) is SP 1 to the last digit (issue 82).

Two gloo ranks spawned on the CPU hold one sequence-parallel group (actor.sequence_parallel_size=2, one
data-parallel group): each is handed the whole batch and computes half of every packed row. Against one
rank with the whole batch (SP 1, packed, one process), in float32 on the tiny model with ragged responses:
the log-probs and the entropy of every response token, the policy loss (with an entropy term), SFT's loss
and the top-k distillation's loss, and every parameter's gradient (FSDP2's shards gathered), each within
1e-5 relative, with one micro-batch and with a token budget that cuts the batch into several. The planted
faults are caught by the same comparison: the loss factor counting ranks instead of data-parallel groups
(every gradient doubled), and the gathered log-probs' backward that keeps one rank's gradient instead of
the group's sum (every gradient halved). The refusals before start and at start have their tests too.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.config.schema import ActorConfig, CriticConfig, HybridFlowConfig, ModelConfig, OptimConfig
from hybridflow.controller import RoleSpec, WorkerContext
from hybridflow.run.stage import prepare_stage
from hybridflow.training.objectives import PolicyObjective, SFTObjective, TopKDistillObjective, ValueObjective
from recipes.roles import actor_role, critic_role, reference_role, teacher_role
from tests.unit.test_gradient_splits import _batch, _free_port, _full_gradients, _named

# (samples_per_micro_batch, tokens_per_micro_batch, share_prompts): one packed micro-batch, a budget that makes
# several, and the budget with rows that share their prompts (hybridflow/training/shared_prompts.py)
SPLITS = [(8, None, False), (8, 24, False), (8, 24, True)]
LOSSES = ("policy", "sft", "topk")


def _config(micro: int, budget: int | None, share: bool = False, sp: int = 1, model_path: str | None = None
            ) -> HybridFlowConfig:
    actor = ActorConfig(samples_per_micro_batch=micro, tokens_per_micro_batch=budget, entropy_coef=0.01,
                        optim=OptimConfig(max_grad_norm=0.0))
    model = ModelConfig(path=model_path, pack_sequences=True, share_prompts=share)
    config = prepare_stage(HybridFlowConfig(model=model, actor=actor)).config
    # placed here, past the plan's checks, which need a 2-rank actor pool for it (the refusals' tests below)
    return dataclasses.replace(config, actor=dataclasses.replace(config.actor, sequence_parallel_size=sp))


def _objective(loss: str, worker):
    if loss == "policy":
        return PolicyObjective(worker.cfg, worker.temperature)
    return SFTObjective() if loss == "sft" else TopKDistillObjective(beta=0.5)


def _results(model_dir, context: WorkerContext, sp: int, splits=SPLITS, losses=LOSSES, real: bool = False) -> dict:
    """Each split: log-probs and entropy (B, R), and each loss's figure and full gradients; `real`: the
    model at `model_dir` is model.path's (SmolLM2), not the tiny one that `prepare_stage` builds."""
    from hybridflow.training.sequences import log_probs_and_entropy

    out = {}
    for split in splits:
        for loss in losses if not split[2] else ("policy",):
            config = _config(*split, sp=sp, model_path=str(model_dir) if real else None)
            worker = actor_role(config, model_dir).build(context)
            worker.start()
            worker.optimizer.step = lambda: None  # the gradients stay to be compared
            worker.free_gradients = lambda: None  # (an update frees them before the weight sync)
            batch = _shared_batch(model_dir) if split[2] else _batch(model_dir)
            if loss == "policy":
                log_probs, entropy = log_probs_and_entropy(worker.model, batch, 8, 1.0, split[1])
                out[("log_probs", split)], out[("entropy", split)] = log_probs, entropy
            stats = worker.run_objective(batch, _objective(loss, worker), "actor")
            out[(loss, split)] = (stats["actor/loss"], _full_gradients(worker.model))
    return out


def _role_config(micro: int, budget: int | None, share: bool, sp: int) -> HybridFlowConfig:
    """`_config` with the critic's micro-batches as the actor's, and the reference (by the actor's key), the
    critic and the teacher at sequence-parallel size `sp`."""
    config = _config(micro, budget, share, sp)
    critic = CriticConfig(samples_per_micro_batch=micro, tokens_per_micro_batch=budget, sequence_parallel_size=sp,
                          optim=OptimConfig(max_grad_norm=0.0))
    return dataclasses.replace(config, critic=critic,
                               teacher=dataclasses.replace(config.teacher, sequence_parallel_size=sp))


def _role_results(model_dir, context: WorkerContext, sp: int, splits=SPLITS) -> dict:
    """Each split: the reference's and the teacher's log-probs (B, R), the teacher's top-3 ids and log-probs
    (B, R, 3), the critic's values (B, R), and its value loss's figure and full gradients."""
    out = {}
    for split in splits:
        config = _role_config(*split, sp=sp)
        batch = _shared_batch(model_dir) if split[2] else _batch(model_dir)
        reference = reference_role(config, model_dir).build(context)
        reference.start()
        out[("reference", split)] = reference.compute_ref_log_probs(batch)["ref_log_probs"]
        teacher = teacher_role(config, str(model_dir)).build(context)
        teacher.start()
        out[("teacher", split)] = teacher.compute_teacher_log_probs(batch)["teacher_log_probs"]
        topk = teacher.compute_teacher_topk(batch, 3)
        out[("teacher_topk", split)] = (topk["teacher_topk_ids"], topk["teacher_topk_log_probs"])
        critic = critic_role(config, model_dir).build(context)
        critic.start()
        critic.optimizer.step = lambda: None  # the gradients stay to be compared
        critic.free_gradients = lambda: None
        out[("values", split)] = critic.compute_values(batch)["values"]
        stats = critic.run_objective(batch, ValueObjective(0.2, "token-mean"), "critic")
        out[("value_loss", split)] = (stats["critic/loss"], _full_gradients(critic.model))
    return out


def _shared_batch(model_dir) -> Batch:
    """`_batch`'s responses after 3, 2 and 3 copies of its first three prompts: groups that share them."""
    batch = _batch(model_dir)
    shared = batch.index([0, 0, 0, 1, 1, 2, 2, 2])
    shared.tensors.update({k: v for k, v in batch.tensors.items() if k not in ("prompt_ids", "prompt_mask")})
    return shared


def _rank(rank: int, world: int, port: int, model_dir: str, out_file: str, fault: str, roles: bool = False) -> None:
    import torch.distributed as dist

    from hybridflow.training import loop, ulysses

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if fault == "factor_counts_ranks":  # the loss times the world's ranks, as at SP 1
        loop.data_parallel_size = lambda model, world: world
    if fault == "gather_backward_keeps_one_rank":  # the all-gather's backward without the group's sum
        ulysses.dist = _NoSumInBackward(dist)
    if fault == "positions_restart_on_each_rank":  # each rank's slice numbered from 0, not the row's positions
        plain = ulysses.SequenceShard.model_kwargs

        def local_positions(shard):
            kwargs = plain(shard)
            kwargs["position_ids"] = torch.arange(shard.width)[None]
            return kwargs

        ulysses.SequenceShard.model_kwargs = local_positions
    try:
        context = WorkerContext(rank=rank, world_size=world)
        if roles:
            out = _role_results(model_dir, context, sp=world, **({} if fault == "none" else ROLE_FAULT_RUN))
        elif fault == "real":
            out = _results(model_dir, context, sp=world, **REAL_RUN)
        else:
            out = _results(model_dir, context, sp=world, **({} if fault == "none" else FAULT_RUN))
        if rank == 0:
            torch.save(out, out_file)
    finally:
        dist.destroy_process_group()


class _NoSumInBackward:
    """torch.distributed with `all_reduce` a no-op: only the gathered values' backward calls it in ulysses.py."""

    def __init__(self, dist) -> None:
        self._dist = dist

    def __getattr__(self, name):
        return (lambda *a, **k: None) if name == "all_reduce" else getattr(self._dist, name)


def _over_ranks(model_dir, out_file, fault: str = "none", roles: bool = False, ranks: int = 2) -> dict:
    from tests.ranks import start_ranks

    start_ranks(_rank, (ranks, _free_port(), str(model_dir), str(out_file), fault, roles), ranks, [__name__])
    return torch.load(out_file, weights_only=False)


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir) -> dict:
    return _results(tiny_model_dir, WorkerContext(), sp=1)


def _assert_same_gradients(got: dict, want: dict, what: str) -> None:
    got = _named(got)
    assert got.keys() == want.keys(), what
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=f"{what}: {name}")


def test_sequence_parallel_2_gives_sp_1s_log_probs_entropy_losses_and_gradients(tiny_model_dir, tmp_path, one_rank):
    got = _over_ranks(tiny_model_dir, tmp_path / "sp2.pt")
    assert got.keys() == one_rank.keys()
    for split in SPLITS:
        for key in ("log_probs", "entropy"):
            torch.testing.assert_close(got[(key, split)], one_rank[(key, split)], rtol=1e-5, atol=1e-6,
                                       msg=f"{key} {split}")
        assert one_rank[("entropy", split)].abs().sum() > 0
        for loss in LOSSES if not split[2] else ("policy",):
            (got_loss, got_grads), (want_loss, want_grads) = got[(loss, split)], one_rank[(loss, split)]
            assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7), (loss, split)
            assert any(g.abs().sum() > 0 for g in want_grads.values())
            _assert_same_gradients(got_grads, want_grads, f"SP 2 {loss} {split}")


FAULT_RUN = {"splits": SPLITS[1:2], "losses": ("policy",)}
ROLE_FAULT_RUN = {"splits": SPLITS[1:2]}


@pytest.mark.parametrize("fault, factor", [("factor_counts_ranks", 2.0), ("gather_backward_keeps_one_rank", 0.5)])
def test_a_planted_gradient_fault_is_caught_by_the_sp_comparison(tiny_model_dir, tmp_path, one_rank, fault, factor):
    """The loss factor counting ranks doubles every gradient; the gathered values' backward without the
    group's sum halves it. Both leave the log-probs as they are."""
    got = _over_ranks(tiny_model_dir, tmp_path / f"{fault}.pt", fault)
    key = ("policy", SPLITS[1])
    torch.testing.assert_close(got[("log_probs", key[1])], one_rank[("log_probs", key[1])], rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError):
        _assert_same_gradients(got[key][1], one_rank[key][1], fault)
    name = "model.embed_tokens.weight"
    torch.testing.assert_close(_named(got[key][1])[name], one_rank[key][1][name] * factor, rtol=1e-5, atol=1e-7)


def test_positions_restarting_on_each_rank_are_caught_by_the_log_prob_comparison(tiny_model_dir, tmp_path, one_rank):
    """The planted fault: each rank numbers its slice of the row from 0 (rotary embeddings then see the wrong
    positions on rank 1); the log-probs differ from SP 1's."""
    got = _over_ranks(tiny_model_dir, tmp_path / "positions.pt", "positions_restart_on_each_rank")
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got[("log_probs", SPLITS[1])], one_rank[("log_probs", SPLITS[1])],
                                   rtol=1e-5, atol=1e-6)


# ---- the other roles that run a training-layout forward: reference, teacher, critic -------------------------

@pytest.fixture(scope="module")
def one_rank_roles(tiny_model_dir) -> dict:
    return _role_results(tiny_model_dir, WorkerContext(), sp=1)


def _assert_role_outputs(got: dict, want: dict, split) -> None:
    for key in ("reference", "teacher", "values"):
        assert want[(key, split)].abs().sum() > 0
        torch.testing.assert_close(got[(key, split)], want[(key, split)], rtol=1e-5, atol=1e-6, msg=f"{key} {split}")
    (got_ids, got_top), (want_ids, want_top) = got[("teacher_topk", split)], want[("teacher_topk", split)]
    assert torch.equal(got_ids, want_ids), f"teacher top-k ids {split}"
    torch.testing.assert_close(got_top, want_top, rtol=1e-5, atol=1e-6, msg=f"teacher top-k {split}")


def test_the_reference_teacher_and_critic_at_sp_2_give_sp_1s_log_probs_values_value_loss_and_gradients(
        tiny_model_dir, tmp_path, one_rank_roles):
    """Two gloo ranks, one sequence-parallel group for each role: the reference's log-probs (split by
    actor.sequence_parallel_size), the teacher's log-probs and top-k (teacher.sequence_parallel_size), the
    critic's per-token values, its value loss and every gradient of it (critic.sequence_parallel_size)."""
    got = _over_ranks(tiny_model_dir, tmp_path / "roles.pt", roles=True)
    assert got.keys() == one_rank_roles.keys()
    for split in SPLITS:
        _assert_role_outputs(got, one_rank_roles, split)
        (got_loss, got_grads), (want_loss, want_grads) = got[("value_loss", split)], one_rank_roles[("value_loss", split)]
        assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7), split
        assert any(g.abs().sum() > 0 for g in want_grads.values())
        _assert_same_gradients(got_grads, want_grads, f"SP 2 critic {split}")


def test_planted_faults_in_the_other_roles_are_caught_by_the_sp_comparison(tiny_model_dir, tmp_path, one_rank_roles):
    """The critic's gathered values' backward without the group's sum halves its value loss's gradients (the
    values stay SP 1's); each rank numbering its slice from 0 changes the reference's and the teacher's
    log-probs and the critic's values."""
    split = SPLITS[1]
    got = _over_ranks(tiny_model_dir, tmp_path / "roles_gather.pt", "gather_backward_keeps_one_rank", roles=True)
    _assert_role_outputs(got, one_rank_roles, split)
    want = one_rank_roles[("value_loss", split)][1]
    with pytest.raises(AssertionError):
        _assert_same_gradients(got[("value_loss", split)][1], want, "critic")
    name = "model.embed_tokens.weight"
    torch.testing.assert_close(_named(got[("value_loss", split)][1])[name], want[name] * 0.5, rtol=1e-5, atol=1e-7)
    got = _over_ranks(tiny_model_dir, tmp_path / "roles_positions.pt", "positions_restart_on_each_rank", roles=True)
    for key in ("reference", "teacher", "values"):
        with pytest.raises(AssertionError):
            torch.testing.assert_close(got[(key, split)], one_rank_roles[(key, split)], rtol=1e-5, atol=1e-6)


# ---- SmolLM2-135M (tests/real_model.py): 9 attention heads, 3 key/value heads ------------------------------

REAL_RUN = {"splits": SPLITS[:2], "losses": ("policy",), "real": True}


def test_smollm2s_heads_refuse_sp_2_with_the_arithmetic_before_start_and_at_start(real_model_dir):
    """2 divides neither 9 nor 3: refused by the plan's checks (the sizes that run: 1 and 3) and, for a role
    built past them, when its model loads."""
    from hybridflow.config import ConfigError

    with pytest.raises(ConfigError) as refused:
        _stage("model=local_hf", f"model.path={real_model_dir}", "placement.pools.global.devices_per_node=2",
               "actor.sequence_parallel_size=2")
    assert ("the model has 9 attention heads and 3 key/value heads (9 % 2 = 1, 3 % 2 = 1), and each rank of a group "
            "attends with 1/2 of both; fix: a size that divides both: one of [1, 3]") in str(refused.value)
    spec = actor_role(_config(8, None, model_path=str(real_model_dir)), real_model_dir)
    cfg = dataclasses.replace(spec.kwargs["actor"], sequence_parallel_size=2)
    worker = RoleSpec(spec.cls, {**spec.kwargs, "actor": cfg}, replica_size=2).build(WorkerContext(world_size=2))
    with pytest.raises(ValueError, match=r"9 attention heads and 3 key/value heads \(9 % 2 = 1, 3 % 2 = 1\)"):
        worker.start()


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, in float64."""
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.slow
def test_smollm2_at_sp_3_over_three_ranks_gives_sp_1s_log_probs_and_gradients_to_float32s_noise(real_model_dir,
                                                                                                tmp_path, monkeypatch):
    """SmolLM2's heads divide by 3 (3 heads and 1 key/value head a rank): three gloo ranks, one group, the
    policy loss in float32 with one micro-batch and with a token budget. The log-probs and the entropy equal
    one rank's within 1e-5 of their largest magnitude (measured: bit for bit with one micro-batch, 1e-6
    relative with the budget), the loss within 1e-5 relative. The gradients differ from SP 1's by 4.3e-5 over
    all parameters and 7.2e-4 on the worst tensor (a norm weight, whose gradient is a sum over tokens that
    nearly cancels): at SP 3 the group's three equal copies of each gradient (ulysses.py) sum and FSDP2's
    average divides by 3, which round where SP 2's and SP 4's powers of two do not. SP 1 with its loss
    times 3 (the loop's factor) and its gradients divided by 3 rounds the same way: with one micro-batch,
    SP 3's gradients equal that within 1e-5 relative element by element (under the token budget the
    micro-batches' accumulation adds float32 noise of its own, as it does to SP 1 against itself: 2.1e-5
    over all parameters, 9.7e-5 on one tensor). Against plain SP 1, at both splits: 2e-4 over all parameters (1.09e-4
    on an AVX2-only EPYC, under 1e-4 on CPUs with bfloat16 instructions)
    and 2e-3 on each tensor, where the planted faults above are off by 50-100%."""
    from hybridflow.training import loop

    want = _results(real_model_dir, WorkerContext(), sp=1, **REAL_RUN)
    monkeypatch.setattr(loop, "data_parallel_size", lambda model, world: 3)
    tripled = _results(real_model_dir, WorkerContext(), sp=1, **REAL_RUN)
    monkeypatch.undo()
    got = _over_ranks(real_model_dir, tmp_path / "sp3.pt", "real", ranks=3)
    assert got.keys() == want.keys()
    for split in REAL_RUN["splits"]:
        for key in ("log_probs", "entropy"):
            scale = float(want[(key, split)].abs().max())
            torch.testing.assert_close(got[(key, split)], want[(key, split)], rtol=1e-5, atol=1e-5 * scale,
                                       msg=f"{key} {split}")
        (got_loss, got_grads), (want_loss, want_grads) = got[("policy", split)], want[("policy", split)]
        assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7), split
        if split == REAL_RUN["splits"][0]:  # one micro-batch: the same sums; a budget's several add their own order
            _assert_same_gradients(got_grads, {k: g / 3 for k, g in tripled[("policy", split)][1].items()},
                                   f"SmolLM2 SP 3 against SP 1's loss times 3 {split}")
        got_grads = _named(got_grads)
        everything = _relative_error(torch.cat([got_grads[k].flatten() for k in want_grads]),
                                     torch.cat([want_grads[k].flatten() for k in want_grads]))
        assert everything < 2e-4, (split, everything)
        worst = max((_relative_error(got_grads[k], want_grads[k]), k) for k in want_grads)
        assert worst[0] < 2e-3, (split, worst)


# ---- refused before start, with the arithmetic and the fix ------------------------------------------------

def _stage(*overrides: str):
    from hybridflow.config import compose

    return prepare_stage(compose(["recipe=grpo", *overrides]))


@pytest.mark.parametrize("overrides, said", [
    (["placement.pools.global.devices_per_node=3", "actor.sequence_parallel_size=2"],
     "the actor pool has 3 rank(s), which groups of 2 do not divide (3 % 2 = 1); fix: one of [1, 3]"),
    (["placement.pools.global.devices_per_node=4", "actor.sequence_parallel_size=4"],
     "the model has 4 attention heads and 2 key/value heads (4 % 4 = 0, 2 % 4 = 2)"),
    (["placement.pools.global.devices_per_node=2", "actor.sequence_parallel_size=2", "model.tiny.num_key_value_heads=1"],
     "fix: a size that divides both: one of [1]"),
    (["placement.pools.global.devices_per_node=2", "actor.sequence_parallel_size=2", "model.pack_sequences=false"],
     "the padded path runs at actor.sequence_parallel_size=1 only"),
])
def test_a_sequence_parallel_size_that_cannot_run_is_refused_before_start(overrides, said):
    from hybridflow.config import ConfigError

    with pytest.raises(ConfigError) as refused:
        _stage(*overrides)
    assert said in str(refused.value)
    assert "actor.sequence_parallel_size" in str(refused.value) or "model.pack_sequences" in str(refused.value)


@pytest.mark.parametrize("overrides, said", [
    (["critic.sequence_parallel_size=2"], "config critic.sequence_parallel_size=2 is invalid: no critic runs"),
    (["teacher.sequence_parallel_size=2"], "config teacher.sequence_parallel_size=2 is invalid: no teacher runs"),
    (["recipe=ppo", "placement=split", "placement.pools.global.devices_per_node=2", "critic.sequence_parallel_size=2"],
     "config critic.sequence_parallel_size=2 is invalid: the critic pool has 1 rank(s), which groups of 2 do not "
     "divide (1 % 2 = 1); fix: one of [1]"),
    (["recipe=ppo", "placement.pools.global.devices_per_node=4", "critic.sequence_parallel_size=4"],
     "config critic.sequence_parallel_size=4 is invalid: the model has 4 attention heads and 2 key/value heads"),
    (["placement=split", "placement.pools.global.devices_per_node=2", "actor.sequence_parallel_size=2",
      "actor.kl_loss_coef=0.1"],  # the reference, on a pool of its own, splits as the actor does
     "config actor.sequence_parallel_size=2 is invalid: the reference pool has 1 rank(s)"),
])
def test_the_critic_teacher_and_reference_sizes_are_refused_before_start_with_the_arithmetic(overrides, said):
    from hybridflow.config import ConfigError

    with pytest.raises(ConfigError) as refused:
        _stage(*overrides)
    assert said in str(refused.value)


def test_a_teachers_own_heads_are_checked_against_its_size(tiny_model_dir):
    """The teacher is its own model: its config.json's heads (the tiny model's 4 and 2 here) are divided."""
    from hybridflow.config import ConfigError

    teacher = ["recipe=distill", f"teacher.path={tiny_model_dir}", "placement.pools.global.devices_per_node=4"]
    with pytest.raises(ConfigError) as refused:
        _stage(*teacher, "teacher.sequence_parallel_size=4")
    assert (f"config teacher.sequence_parallel_size=4 is invalid: the teacher model {tiny_model_dir} has 4 attention "
            "heads and 2 key/value heads (4 % 4 = 0, 2 % 4 = 2)") in str(refused.value)
    assert _stage(*teacher, "teacher.sequence_parallel_size=2").config.teacher.sequence_parallel_size == 2


def test_a_size_that_divides_ranks_and_heads_is_accepted_and_the_step_splits_over_data_parallel_groups():
    from hybridflow.config import ConfigError

    stage = _stage("placement.pools.global.devices_per_node=4", "actor.sequence_parallel_size=2")
    assert stage.config.actor.sequence_parallel_size == 2
    # 2 data-parallel groups: a mini-batch of 2 rows is one per group; 1 row per step would leave a group idle
    with pytest.raises(ConfigError, match=r"over the 2 actor data-parallel groups \(sequence-parallel groups of 2"):
        _stage("placement.pools.global.devices_per_node=4", "actor.sequence_parallel_size=2",
               "trainer.prompts_per_step=1", "rollout.samples_per_prompt=1")
    with pytest.raises(ValueError, match="actor.sequence_parallel_size=0 is invalid: must be >= 1"):
        ActorConfig(sequence_parallel_size=0)


def test_an_actor_whose_replicas_do_not_span_its_group_is_refused_at_start(tiny_model_dir):
    """Built without actor_role's replica size, the ranks of a group would be handed different rows."""
    spec = actor_role(_config(8, None, False), tiny_model_dir)
    cfg = dataclasses.replace(spec.kwargs["actor"], sequence_parallel_size=2)
    worker = RoleSpec(spec.cls, {**spec.kwargs, "actor": cfg}).build(WorkerContext(world_size=2))
    with pytest.raises(ValueError, match="this role.s replicas span 1 rank"):
        worker.start()
