"""The resharding engine for real: FSDP2 actors and vLLM engines in Ray workers, on the CPU.

- colocated, generation TP 2 over the actor's 2 FSDP ranks: bytes received per rank equal the
  layout minimum, computed here by hand from the model's shapes;
- disaggregated, the rollout on its own pool: 1 -> 1, 2 -> 1, 1 -> 2 (TP 2: about half the
  model per rollout rank);
- faults: a corrupted bucket is caught by the checksum check; a rollout process killed mid-
  transfer gives a named error within the configured timeout;
- staged pushes (trainer.max_staleness >= 2): the rollout receives new weights on its "weights"
  lane while its generating lane is busy, and loads them before the batch that needs them; with
  rollout.on_update=recompute, weights landing mid-batch are loaded between two engine steps and
  the running requests continue on them, each token stamped with its version.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from transformers import AutoTokenizer

from hybridflow.config.schema import ActorConfig, HybridFlowConfig, OptimConfig, RolloutConfig, WeightSyncConfig
from hybridflow.controller import RoleSpec
from hybridflow.data import ArithmeticSpec, make_arithmetic_rows
from hybridflow.data.prompts import encode_prompts
from hybridflow.resharding import WeightSyncError
from hybridflow.resharding.sync import WeightSync
from hybridflow.resharding.transports import build_transport
from recipes.roles import actor_role
from hybridflow.run.stage import prepare_stage
from tests.e2e.workers import CorruptibleVLLMRollout, FaultyActor, PausingVLLMRollout, spawn_actor_and_rollout

MAX_PROMPT_TOKENS = 8
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
FLOAT32 = 4


def _spawn(tiny_model_dir, actor_ranks: int, rollout_ranks: int | None, tp: int, name: str,
           checksum_every: int = 0, bucket_mb: float = 64.0, timeout_s: float = 60.0, actor_cls: type | None = None,
           rollout_cls: type = CorruptibleVLLMRollout, on_update: str = "finish"):
    """Actor and rollout groups (one pool when rollout_ranks is None) and their WeightSync."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rollout = RoleSpec(rollout_cls, dict(
        model_path=str(tiny_model_dir), rollout=RolloutConfig(max_response_tokens=6, tensor_parallel_size=tp,
                                                              on_update=on_update),
        max_prompt_tokens=MAX_PROMPT_TOKENS, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        verifiable_weights=checksum_every > 0), replica_size=tp)
    actor = actor_role(prepare_stage(HybridFlowConfig(actor=ActorConfig(optim=OptimConfig(lr=1e-3), samples_per_micro_batch=4))).config,
                       tiny_model_dir)
    if actor_cls is not None:
        actor = RoleSpec(actor_cls, actor.kwargs)
    groups = spawn_actor_and_rollout(actor, rollout, actor_ranks, rollout_ranks, name, VLLM_ENV)
    config = WeightSyncConfig(bucket_mb=bucket_mb, timeout_s=timeout_s, checksum_every_steps=checksum_every)
    sync = WeightSync(groups["actor"], groups["rollout"], config,
                      build_transport(rollout_ranks is None), "float32")
    setup = sync.setup()
    return groups, sync, tok, setup


def _shutdown(groups) -> None:
    for group in {id(g.pool): g for g in groups.values()}.values():
        group.shutdown()


def _train_one_step(groups, tok, seed: int) -> None:
    prompts = encode_prompts(make_arithmetic_rows(8, ArithmeticSpec(), seed=seed), tok, MAX_PROMPT_TOKENS)
    samples = groups["rollout"].generate(prompts)
    samples = samples.union(groups["actor"].compute_log_probs(samples))
    torch.manual_seed(seed)
    samples.tensors["advantages"] = torch.randn(len(samples), 1).expand_as(samples["old_log_probs"]).contiguous()
    groups["actor"].update_policy(samples)


def _sampler_gap(groups, tok, seed: int) -> float:
    prompts = encode_prompts(make_arithmetic_rows(8, ArithmeticSpec(), seed=seed), tok, MAX_PROMPT_TOKENS)
    samples = groups["rollout"].generate(prompts)
    actor_lp = groups["actor"].compute_log_probs(samples)["old_log_probs"]
    mask = samples["response_mask"]
    return float((actor_lp[mask] - samples["sampler_log_probs"][mask]).abs().max())


def _tiny_dims(model_dir) -> dict:
    c = json.loads((model_dir / "config.json").read_text())
    return {"V": c["vocab_size"], "H": c["hidden_size"], "I": c["intermediate_size"], "L": c["num_hidden_layers"],
            "kv": c["num_key_value_heads"] * c["hidden_size"] // c["num_attention_heads"],
            "tied": c["tie_word_embeddings"]}


def _colocated_tp2_minimum(d: dict) -> int:
    """By hand, FSDP2 over 2 ranks (dim-0 halves, torch.chunk) -> vLLM TP 2 on the same 2 ranks.

    q/k/v, their biases, gate/up: vLLM's slice is the rank's own FSDP half -> 0.
    o_proj (H, H) and down_proj (H, I): vLLM wants the rank's column half, FSDP gave a row half:
    the rank lacks one quarter. Norms (H,): wanted whole, half held -> the other half.
    embed_tokens: vLLM pads the vocabulary to a multiple of 64 and gives rank 0 rows
    [0, padded/2); FSDP gives rank 0 rows [0, ceil(V/2)) -> rank 0 lacks the rows in between.
    """
    H, I, L, V = d["H"], d["I"], d["L"], d["V"]
    per_layer = (H * H) // 4 + (H * I) // 4 + 2 * (H // 2)
    padded = -(-V // 64) * 64
    embed_gap = max(0, min(padded // 2, V) - -(-V // 2)) * H
    assert d["tied"], "the tiny model ties lm_head to the embedding (no lm_head tensor travels)"
    return (L * per_layer + H // 2 + embed_gap) * FLOAT32


def _model_bytes(d: dict) -> int:
    H, I, L, V, kv = d["H"], d["I"], d["L"], d["V"], d["kv"]
    layer = H * H + H + 2 * (kv * H + kv) + H * H + 3 * H * I + 2 * H
    return (V * H + L * layer + H) * FLOAT32


@pytest.fixture(scope="module")
def ray(ray_local):
    return ray_local


def test_colocated_tp2_moves_exactly_the_layout_minimum(ray, tiny_model_dir):
    groups, sync, tok, setup = _spawn(tiny_model_dir, 2, None, tp=2, name="co-tp2", checksum_every=1)
    try:
        first = sync.sync(step=0, version=0)
        assert first["weight_sync/min_bytes_per_rank"] == _colocated_tp2_minimum(_tiny_dims(tiny_model_dir))
        assert first["weight_sync/bytes_received_per_rank"] == first["weight_sync/min_bytes_per_rank"]
        assert first["weight_sync/min_bytes_per_rank"] < 0.15 * _model_bytes(_tiny_dims(tiny_model_dir))
        _train_one_step(groups, tok, seed=1)
        after = sync.sync(step=1, version=1)  # the checksum check compares every vLLM parameter slice
        assert after["weight_sync/verified_tensors"] > 0 and after["weight_sync/probe_log_prob_gap"] < 1e-3
        assert _sampler_gap(groups, tok, seed=2) < 1e-3
        assert setup["weight_sync/copy_floor_s"] > 0 and after["weight_sync/copy_floor_ratio"] > 1
    finally:
        _shutdown(groups)


# 1 -> 1 runs in every disaggregated e2e run (its own run here was CI's time, tests/budget.py); 1 -> TP 2, with
# a corrupted bucket caught on it, is the TP-2 staged test's first and last sync below (slow)
@pytest.mark.parametrize("actor_ranks,rollout_ranks,tp", [(2, 1, 1)], ids=["2to1"])
def test_disaggregated_sync_over_a_gloo_group(ray, tiny_model_dir, actor_ranks, rollout_ranks, tp):
    """Each layout syncs at its minimum, checked; then a bucket corrupted on arrival (one element
    +1) is caught by the checksum check (last: a failed check retires the worker group)."""
    groups, sync, tok, setup = _spawn(tiny_model_dir, actor_ranks, rollout_ranks, tp=tp,
                                      name=f"dis{actor_ranks}{tp}", checksum_every=1, bucket_mb=0.25)
    try:
        _train_one_step(groups, tok, seed=3)
        metrics = sync.sync(step=1, version=1)
        assert metrics["weight_sync/verified_tensors"] > 0 and metrics["weight_sync/probe_log_prob_gap"] < 1e-3
        received, model = metrics["weight_sync/bytes_received_per_rank"], _model_bytes(_tiny_dims(tiny_model_dir))
        assert received == metrics["weight_sync/min_bytes_per_rank"]
        if tp == 1:
            assert received == model  # a whole engine per rank: the whole model
        else:
            assert 0.4 * model < received < 0.6 * model  # each TP rank: about half, not all of it
        assert _sampler_gap(groups, tok, seed=4) < 1e-3
        assert setup["weight_sync/buckets"] > 1
        groups["rollout"].inject_weight_sync_fault("corrupt", 0)  # one element of bucket 1 gets +1
        with pytest.raises(WeightSyncError, match="verification failed for 1 of"):
            sync.sync(step=2, version=2)
    finally:
        _shutdown(groups)


def test_a_staged_push_is_received_beside_a_busy_generate_and_loaded_before_its_batch(ray, tiny_model_dir):
    """A generate that needs policy version 1 blocks the rollout's default lane, waiting for it;
    the push of version 1 is then received on the "weights" lane (it could not be, were the lanes
    one), loaded before the batch, checked against the actor's checksums, and stamped on every
    sample. A corrupted staged push is caught at its load, naming the version; a version never
    pushed ends the wait at its timeout."""
    groups, sync, tok, _ = _spawn(tiny_model_dir, 1, 1, tp=1, name="staged", checksum_every=1, bucket_mb=0.05)
    try:
        sync.sync(step=0, version=0)
        _train_one_step(groups, tok, seed=1)  # the actor now holds version 1
        prompts = encode_prompts(make_arithmetic_rows(8, ArithmeticSpec(), seed=2), tok, MAX_PROMPT_TOKENS)
        waiting = groups["rollout"].generate.remote(prompts, min_version=1, weights_timeout_s=60.0)
        time.sleep(1.0)  # the generate lane is now blocked on version 1
        push = sync.stage(step=1, version=1)
        metrics = push.finish()  # returns only if the weights lane received it beside the blocked generate
        assert metrics["weight_sync/bytes_received_per_rank"] == metrics["weight_sync/min_bytes_per_rank"] > 0
        samples = waiting.get(timeout_s=60)
        assert samples["behavior_version"].tolist() == [1] * len(samples)
        assert samples["weights_wait_s"].min() > 0.5
        actor_lp = groups["actor"].compute_log_probs(samples)["old_log_probs"]
        mask = samples["response_mask"]
        assert float((actor_lp - samples["sampler_log_probs"]).abs()[mask].max()) < 1e-3  # it computes with v1

        _train_one_step(groups, tok, seed=3)
        groups["rollout"].inject_weight_sync_fault("corrupt", 0)
        sync.stage(step=2, version=2).finish()
        with pytest.raises(Exception, match=r"(?s)policy version 2, loaded from staging.*verification failed"):
            groups["rollout"].generate(prompts, min_version=2, weights_timeout_s=60.0)
    finally:
        _shutdown(groups)


@pytest.mark.slow  # CI's slow tier, for the default run's 20 minutes on a CPU without bf16 (README "Two commands")
def test_the_ranks_of_a_tp2_engine_load_the_newest_staged_version_they_all_hold(ray, tiny_model_dir):
    """The first sync from one actor rank to a TP-2 engine moves each rank about half the model (its
    layout minimum), checked. Then max_staleness >= 2: rank 1 of the engine registers the
    push of version 2 six seconds after it arrived (faults.hold_staged), while rank 0 has it. A
    batch that may use version 1 then runs on version 1 on both ranks, the newest both hold (not
    version 2 on rank 0 and 1 on rank 1: a model no policy ever was), each rank's load checked
    against its checksums; the next batch, needing version 2, waits for rank 1 and loads version 2
    on both, and the engine computes the actor's log-probs. Last (it retires the group), a bucket
    corrupted on arrival at rank 0 of the engine (one element +1) is caught by the checksum check."""
    groups, sync, tok, _ = _spawn(tiny_model_dir, 1, 2, tp=2, name="tp2-staged", checksum_every=1, bucket_mb=0.25)
    try:
        metrics = sync.sync(step=0, version=0)  # 1 -> TP 2 over the gloo group, checked
        assert metrics["weight_sync/verified_tensors"] > 0 and metrics["weight_sync/probe_log_prob_gap"] < 1e-3
        received, model = metrics["weight_sync/bytes_received_per_rank"], _model_bytes(_tiny_dims(tiny_model_dir))
        assert received == metrics["weight_sync/min_bytes_per_rank"] and 0.4 * model < received < 0.6 * model
        prompts = encode_prompts(make_arithmetic_rows(8, ArithmeticSpec(), seed=2), tok, MAX_PROMPT_TOKENS)
        _train_one_step(groups, tok, seed=1)
        sync.stage(step=1, version=1).finish()  # staged on both ranks, not loaded
        _train_one_step(groups, tok, seed=3)  # the actor now holds version 2
        groups["rollout"].hold_staged(2, 6.0, 1)
        push = sync.stage(step=2, version=2)
        time.sleep(2.0)  # rank 0 holds versions 1 and 2 staged, rank 1 only version 1
        start = time.monotonic()
        samples = groups["rollout"].generate(prompts, min_version=1, weights_timeout_s=60.0)
        assert samples["behavior_version"].tolist() == [1] * len(samples)
        assert time.monotonic() - start < 3.0  # it did not wait for rank 1's version 2
        push.finish()
        samples = groups["rollout"].generate(prompts, min_version=2, weights_timeout_s=60.0)
        assert samples["behavior_version"].tolist() == [2] * len(samples)
        actor_lp = groups["actor"].compute_log_probs(samples)["old_log_probs"]
        mask = samples["response_mask"]
        assert float((actor_lp - samples["sampler_log_probs"]).abs()[mask].max()) < 1e-3

        groups["rollout"].inject_weight_sync_fault("corrupt", 0)  # one element of bucket 1 gets +1
        with pytest.raises(WeightSyncError, match="verification failed for 1 of"):
            sync.sync(step=3, version=3)
    finally:
        _shutdown(groups)


@pytest.mark.slow  # CI's slow tier, for the default run's 20 minutes on a CPU without bf16 (README "Two commands")
def test_an_actor_killed_mid_push_is_named_and_the_rollout_waiting_for_it_stops_at_its_timeout(
        ray, tiny_model_dir):
    """At max_staleness >= 2: the actor dies sending bucket 3 of a staged push while the rollout
    waits, in generate, for that version. Finishing the push names the actor's death (and the
    rollout's receive that lost its peer); the waiting generate ends at its timeout naming the
    version it waited for and the one it holds: no hang on either side."""
    groups, sync, tok, _ = _spawn(tiny_model_dir, 1, 1, tp=1, name="actor-dies", bucket_mb=0.05, timeout_s=20.0,
                                  actor_cls=FaultyActor)
    try:
        sync.sync(step=0, version=0)
        prompts = encode_prompts(make_arithmetic_rows(4, ArithmeticSpec(), seed=2), tok, MAX_PROMPT_TOKENS)
        waiting = groups["rollout"].generate.remote(prompts, min_version=1, weights_timeout_s=8.0)
        groups["actor"].exit_sending_bucket(2)
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"(?s)step 1 \(policy version 1, staged\).*send_weights.*died"):
            sync.stage(step=1, version=1).finish()
        with pytest.raises(Exception, match=r"waited 8 s \(weight_sync.timeout_s\) for the weights of policy version 1 "
                                            r"and holds version 0"):
            waiting.get(timeout_s=60)
        assert time.monotonic() - start < 30
    finally:
        _shutdown(groups)


@pytest.mark.slow  # CI's slow tier, for the default run's 20 minutes on a CPU without bf16 (README "Two commands")
def test_weights_landing_mid_batch_are_loaded_between_two_engine_steps_and_running_requests_continue(
        ray, tiny_model_dir):
    """rollout.on_update=recompute: a seeded batch on version 0 pauses before its third engine step
    until the push of version 1 has arrived (the test worker's seam); the load lands there. Every
    request keeps its first two tokens (version 0) and samples the rest with version 1 on keys and
    values recomputed from the new weights: those tokens' log-probs are the actor's (version 1),
    the first two are not. Then a receiver killed mid-transfer is a WeightSyncError within
    `weight_sync.timeout_s` naming the step, the rank, the stage, the method and the bucket (one
    pair of workers for both: each start costs more than its checks)."""
    groups, sync, tok, _ = _spawn(tiny_model_dir, 1, 1, tp=1, name="recompute", rollout_cls=PausingVLLMRollout,
                                  on_update="recompute", bucket_mb=0.05, timeout_s=30.0)
    try:
        sync.sync(step=0, version=0)
        _train_one_step(groups, tok, seed=1)  # the actor now holds version 1
        prompts = encode_prompts(make_arithmetic_rows(8, ArithmeticSpec(), seed=2), tok, MAX_PROMPT_TOKENS)
        prompts.tensors["sample_seed"] = torch.arange(100, 108)  # seeded, as the recipe samples
        running = groups["rollout"].generate.remote(prompts, min_version=0, weights_timeout_s=60.0)
        time.sleep(1.0)
        sync.stage(step=1, version=1).finish()
        samples = running.get(timeout_s=120)
        versions, mask = samples["token_versions"], samples["response_mask"]
        assert (versions[:, :2] == 0).all() and mask[:, 2:].any()
        assert (versions[:, 2:][mask[:, 2:]] == 1).all() and (versions[~mask] == -1).all()
        assert samples["behavior_version"].tolist() == [0] * len(samples)
        gap = (groups["actor"].compute_log_probs(samples)["old_log_probs"] - samples["sampler_log_probs"]).abs()
        assert float(gap[:, 2:][mask[:, 2:]].max()) < 1e-3  # sampled by version 1, on recomputed keys/values
        assert float(gap[:, :2].max()) > 1e-3  # sampled by version 0: the actor has moved since

        # last (it retires the group): the receiving process dies mid-transfer, named within the timeout
        groups["rollout"].inject_weight_sync_fault("exit", 2)  # the process dies when bucket 3 arrives
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"(?s)step 2.*rank 0.*stage weight_sync") as error:
            sync.sync(step=2, version=2)
        assert time.monotonic() - start < 30.0
        message = str(error.value)
        assert "receive_weights" in message and "died" in message
        assert "bucket" in message  # the sender's side: which bucket it was sending when the peer went away
    finally:
        _shutdown(groups)
