"""Environments from the hubs, trained unchanged (issue 85; docs/agents.md "Environments from the hubs"):
a verifiers (v1) environment written with verifiers' own classes (tests/e2e/fixtures/verifiers_arith.py),
its episodes played by verifiers' own harness and scored by its rubric, the model reached through the
rollout engine's OpenAI-compatible endpoint (hybridflow/agents/endpoint.py). No network: the harness's
chat program runs with this interpreter (hybridflow/agents/hubs/verifiers_env.py `local_chat_program`).

Token in, token out: every sample's trained ids are the ids the engine sampled (recorded at the engine,
tests/e2e/workers.py), and the actor's log-probs of them are the sampler's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.config.schema import RolloutConfig
from hybridflow.controller import PoolSpec, ResourcePool, RoleSpec, spawn_workers
from hybridflow.data.prompts import encode_prompts
from hybridflow.data.rows import read_rows
from hybridflow.training.sequences import log_probs_and_entropy
from tests.e2e.test_agent_rollout import _segments  # (is the model's, start, end) runs of a loss mask
from tests.e2e.cli_in_one_process import without_ray
from tests.e2e.workers import RecordingVLLMRollout

pytest.importorskip("verifiers.v1")

FIXTURES = Path(__file__).parent / "fixtures"
SUMS = FIXTURES / "verifiers_arith.py"
GUESS = FIXTURES / "verifiers_guess.py"  # multi-turn: the env's own Env.run answers each guess
CALC = FIXTURES / "verifiers_calc.py"  # a vf.Toolset calculator: the harness's own tool loop
NULL_HARNESS = {"agent": {"harness": {"id": "null"}}}  # verifiers' plain chat loop, as its --env.agent flag gives it
MAX_PROMPT_TOKENS = 32
BUDGET = 16
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def _rows(out_dir: Path, env: Path = SUMS) -> tuple[Path, Path]:
    from hybridflow.agents.hubs.verifiers_env import main

    main([str(env), str(out_dir), "--args", '{"agent": {"harness": {"id": "null"}}}', "--val-rows", "8"])
    return out_dir / "train.jsonl", out_dir / "val.jsonl"


def _roll_out(tiny_model_dir, out_dir: Path, env: Path, arguments: dict, budget: int, rows: int, pool: str):
    """A recording vLLM rollout worker serving `env` on a pool of its own (`pool`: the module fixture's
    worker is still alive); its batch for the first `rows` training rows."""
    train, _ = _rows(out_dir, env)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = RolloutConfig(max_response_tokens=budget, temperature=1.0, environment=f"verifiers:{env}",
                           environment_args=arguments)
    spec = RoleSpec(RecordingVLLMRollout, dict(model_path=str(tiny_model_dir), rollout=config,
                                               max_prompt_tokens=MAX_PROMPT_TOKENS, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id))
    group = spawn_workers(ResourcePool(PoolSpec(pool, devices_per_node=1)), {"rollout": spec},
                          env_vars=VLLM_ENV)["rollout"]
    group.start()
    chosen = read_rows(train)[:rows]
    prompts = encode_prompts(chosen, tok, MAX_PROMPT_TOKENS)
    prompts.tensors["sample_seed"] = torch.arange(len(chosen)) + 500
    return group, tok, chosen, group.generate(prompts)


@pytest.fixture(scope="module")
def rolled_out(ray_local, tiny_model_dir, tmp_path_factory):
    return _roll_out(tiny_model_dir, tmp_path_factory.mktemp("rows"), SUMS, NULL_HARNESS, BUDGET, 6, "rollout")


def test_the_trained_ids_are_the_engines_sampled_ids(rolled_out):
    group, tok, rows, samples = rolled_out
    records = group.recorded()[0]
    assert len(records) == len(rows)  # one model call per single-turn episode
    for i in range(len(rows)):
        n = int(samples["response_mask"][i].sum())
        prompt = samples["prompt_ids"][i][samples["prompt_mask"][i]].tolist()
        response = samples["response_ids"][i, :n].tolist()
        assert (prompt, response) in records, f"sample {i}: trained ids are not what the engine sampled"
        assert samples["loss_mask"][i, :n].all()  # single turn: every response token is the model's
        assert prompt == tok(tok.apply_chat_template([{"role": "user", "content": rows[i]["prompt"][0]["content"]}],
                                                     tokenize=False, add_generation_prompt=True),
                             add_special_tokens=False)["input_ids"]


def test_the_rubric_scores_every_sample_by_name(rolled_out):
    _, _, rows, samples = rolled_out
    for i, rewards in enumerate(samples["env_rewards"]):
        assert rewards is not None, samples["agent_failure"][i]
        assert set(rewards) == {"score", "correct", "brevity"}
        reply = samples["response"][i]
        assert rewards["brevity"] == pytest.approx(1.0 / (1.0 + len(reply.strip())))  # verifiers strips the reply
        assert rewards["score"] == pytest.approx(rewards["correct"] + 0.5 * rewards["brevity"])
    assert float(samples["agent_env_failures"].sum()) == 0


def test_the_actors_log_probs_of_the_sampled_ids_are_the_samplers(rolled_out, tiny_model_dir):
    _, _, _, samples = rolled_out
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    log_probs, _ = log_probs_and_entropy(model, samples, rows_per_micro_batch=8)
    mask = samples["loss_mask"]
    torch.testing.assert_close(log_probs[mask], samples["sampler_log_probs"][mask], atol=1e-3, rtol=0)


@pytest.mark.slow  # ~60 s under two workers: the default tier keeps the single-turn rollout's three tests
def test_multi_turn_episodes_train_on_every_turn_as_sampled(ray_local, tiny_model_dir, tmp_path):
    """The guessing env's later turns are the harness resumed on the whole conversation: each model turn
    of a trajectory is exactly what the engine sampled for the trajectory so far (never the reply's text
    re-encoded), the env's answers between them are not trained, and the rubric scores the whole episode."""
    arguments = {"agent": {"harness": {"id": "null"}, "sampling": {"max_tokens": 6}}}  # short guesses
    group, tok, rows, samples = _roll_out(tiny_model_dir, tmp_path, GUESS, arguments, 96, 6, "guess")
    records = group.recorded()[0]
    several = 0
    for i in range(len(rows)):
        n = int(samples["response_mask"][i].sum())
        prompt = samples["prompt_ids"][i][samples["prompt_mask"][i]].tolist()
        response, mask = samples["response_ids"][i, :n].tolist(), samples["loss_mask"][i, :n].tolist()
        runs = _segments(mask)
        for is_model, start, end in runs:
            if is_model:
                assert (prompt + response[:start], response[start:end]) in records, f"sample {i}: turn at {start}"
        turns = sum(m for m, _, _ in runs)
        assert turns == samples["agent_turns"][i] and not samples["env_unchained_calls"][i]
        rewards = samples["env_rewards"][i]
        assert rewards is not None, samples["agent_failure"][i]
        assert rewards["turns"] == turns  # verifiers' own count of the trace's turns agrees
        several += turns > 1
    assert several >= 3  # a random model rarely guesses right at once: most episodes take several turns


# The single-turn env's GRPO run (SUMS, the null harness, its rubric as the reward, 2 steps) is the hub side of
# bench/hub_environments.py's verifiers task, whose dry run the slow tier runs (tests/unit/test_bench_dry_runs.py)
# each case 1 prompt a step and 2 held out, its samples per prompt its own
@pytest.mark.parametrize("env, arguments, budget, rubric, samples, extra", [
    # the multi-turn episodes through a whole GRPO step: 136 s alone at 2 prompts x 4 samples a step and 4 held
    # out on a 2-core AVX2-only EPYC (a harness run per episode), so 1 x 4 and 2
    pytest.param(GUESS, '{agent: {harness: {id: "null"}, sampling: {max_tokens: 6}}}', 96, ("found", "turns"), 4, [],
                 marks=pytest.mark.slow),
    # the env offers its calculator on every call: the template renders it (a longer first prompt), vLLM's
    # hermes parser reads each reply (a random model's is plain text, a message; the tool loop itself is
    # tests/unit/test_verifiers_tools.py, on a scripted call)
    # (verifiers starts a tool server per episode: 1 prompt x 2 samples a step, 2 held out; 83 s alone there)
    pytest.param(CALC, '{agent: {harness: {id: "null"}}}', 32, ("correct", "brevity"), 2,
                 ["rollout.tool_call_parser=hermes", "model.tiny.json_characters=true"], marks=pytest.mark.slow),
], ids=["multi_turn", "tools"])
def test_grpo_trains_on_a_verifiers_environment_with_its_rubric_as_the_reward(env, arguments, budget, rubric, samples,
                                                                                extra, tmp_path):
    import json

    train, val = _rows(tmp_path / "rows", env)
    done = without_ray(["recipe=grpo", "trainer.export_hf=false", "placement.pools.global.devices_per_node=1",
                        "rollout.backend=vllm", "trainer.total_steps=2", "trainer.val_every_steps=2",
                        "trainer.val_prompts=2", "trainer.prompts_per_step=1", f"rollout.samples_per_prompt={samples}",
                        "actor.samples_per_micro_batch=8", "trainer.max_steps_without_signal=null",
                        "data=files", f"data.train_path={train}", f"data.val_path={val}",
                        f"data.max_prompt_tokens={48 if env == CALC else MAX_PROMPT_TOKENS}",  # + "tools: calc; "
                        f"rollout.max_response_tokens={budget}",
                        f"rollout.environment=verifiers:{env}", f"+rollout.environment_args={arguments}",
                        "reward.fn=environment", *extra], tmp_path, "vf")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "vf" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward/score", *(f"reward/{name}" for name in rubric), "agent/turns_mean", "agent/unchained_calls",
                "val/accuracy", "actor/loss"):
        assert key in rows[-1], f"{key} missing from the metrics"
    assert rows[0]["agent/env_failures"] == 0 and rows[0]["agent/unchained_calls"] == 0
    turns = rows[0]["agent/turns_mean"]
    assert turns > 1.0 if env == GUESS else turns >= 1.0  # tools: more per call
    assert rows[0]["rollout/log_prob_diff"] < 1e-3  # the sampler's log-probs are the actor's on the trained ids
