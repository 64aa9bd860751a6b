"""The agent layer without an engine: tools, environments, the turn loop and its limits.

`generate` is scripted: each call returns, per request, the next model turn of that sample's
script as token ids (with made-up log-probs), so every token of a trajectory is known in advance.
"""

from __future__ import annotations

import time

import pytest
import torch

from hybridflow.agents import AgentError, Trajectory, agent_metrics, load_agents, run_trajectories
from hybridflow.agents.tools import Tool, ToolEnvironment
from hybridflow.agents.trajectory import trajectories_to_batch
from hybridflow.batch import Batch
from hybridflow.builders import build_char_tokenizer
from hybridflow.config.schema import HybridFlowConfig, RecipeConfig, RolloutConfig
from hybridflow.data.calculator import calc, demonstration
from hybridflow.checks.preflight import check_run
from hybridflow.rewards import RewardConfig
from hybridflow.rewards.functions import AGENT_ARGUMENTS

TOK = build_char_tokenizer()
EOS = TOK.eos_token_id


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


class Script:
    """A fake engine: sample i's turns, in order; records every request it was given."""

    def __init__(self, turns: list[list[list[int]]]) -> None:
        self.turns, self.next, self.requests = turns, [0] * len(turns), []

    def __call__(self, requests):
        self.requests.append(requests)
        out = []
        for r in requests:
            i = next(k for k, t in enumerate(self.turns) if t and r.prompt_ids[: len(PROMPTS[k])] == PROMPTS[k])
            turn = self.turns[i][self.next[i]][: r.max_tokens]
            self.next[i] += 1
            out.append((turn, [-0.5 - 0.01 * j for j in range(len(turn))], len(turn) == r.max_tokens and turn[-1] != EOS
                        and not TOK.decode(turn).endswith("</calc>")))
        return out


PROMPTS = [ids("123*456="), ids("12*3="), ids("7*8=")]


def slow(expression: str) -> str:
    """Hangs far past any timeout."""
    time.sleep(30)
    return "0"


def broken(expression: str) -> str:
    """Raises."""
    raise RuntimeError("the tool is broken")


def number(expression: str) -> str:
    """Returns an int, not a str."""
    return 42  # type: ignore[return-value]


def tools_env(*fns):
    return ToolEnvironment({t.name: t for t in (Tool.of(fn) for fn in fns)})


def run(turns, envs, max_turns=4, max_tokens=64, timeout_s=5.0):
    trajectories = [Trajectory(list(PROMPTS[i]), env, "tools") for i, env in enumerate(envs)]
    script = Script(turns)
    run_trajectories(trajectories, [{"prompt": ""}] * len(envs), script, TOK, max_turns, max_tokens, timeout_s)
    return trajectories, script


def test_three_turn_trajectory_is_the_sampled_ids_plus_the_tool_ids_byte_for_byte():
    # Turn 1 calls the calculator, turn 2 checks with another call, turn 3 answers. The sampled
    # ids include one that decodes like other ids would encode ("<calc>" as one marker token vs
    # its six characters): re-encoding the decoded text would change them; the trajectory must not.
    turn1 = [ids("<")[0], *ids("calc>123*456"), *ids("</calc>")]  # "<" "c" "a" "l" "c" ">": not the marker id
    turn2 = ids("<calc>56088+0</calc>")
    turn3 = ids("56088") + [EOS]
    (t,), script = run([[turn1, turn2, turn3]], [tools_env(calc)])
    assert TOK.decode(turn1) == "<calc>123*456</calc>" and ids(TOK.decode(turn1)) != turn1  # re-encoding drifts
    obs1, result2 = ids("<result>56088</result>"), ids("<result>56088</result>")
    assert t.response_ids == turn1 + obs1 + turn2 + result2 + turn3
    assert t.loss_mask == [True] * len(turn1) + [False] * len(obs1) + [True] * len(turn2) + \
        [False] * len(result2) + [True] * len(turn3)
    assert t.turns == 3 and not t.truncated and t.last_response == "56088"
    # each request was the prompt plus the trajectory so far, as ids: never re-encoded text
    assert [r.prompt_ids for (r,) in script.requests] == [
        PROMPTS[0], PROMPTS[0] + turn1 + obs1, PROMPTS[0] + turn1 + obs1 + turn2 + result2]
    # the training input ids of the batch are the prompt, the sampled ids and the tool ids
    prompts = Batch({"prompt_ids": torch.tensor([PROMPTS[0]]), "prompt_mask": torch.ones(1, 8, dtype=torch.bool)},
                    objects={"prompt": ["123*456="]})
    batch = trajectories_to_batch([t], prompts, 48, TOK.pad_token_id, TOK)
    n = len(t.response_ids)
    assert batch["response_ids"][0, :n].tolist() == turn1 + obs1 + turn2 + result2 + turn3
    assert batch["loss_mask"][0, :n].tolist() == t.loss_mask and not batch["loss_mask"][0, n:].any()
    assert batch["response_mask"][0].tolist() == [True] * n + [False] * (48 - n)
    sampled = batch["sampler_log_probs"][0]
    assert torch.all(sampled[:n][~batch["loss_mask"][0, :n]] == 0) and torch.all(sampled[:n][batch["loss_mask"][0, :n]] < 0)
    assert batch["response"] == ["56088"] and batch["agent_turns"].tolist() == [3.0]
    # what a reward function may name beside the data columns (preflight lets them through)
    text = TOK.decode(t.response_ids, skip_special_tokens=True)
    assert {name: batch[name] for name in AGENT_ARGUMENTS} == {"trajectory": [text], "agent_reward": [t.reward]}


def test_the_calculator_answers_and_its_demonstration_matches_the_call_syntax():
    assert calc("123*456") == "56088" and calc("(2+3)*-4") == "-20"
    with pytest.raises(ValueError):
        calc("__import__('os')")
    with pytest.raises(ValueError):
        calc("9**9**9")
    assert demonstration("123*456=") == ["<calc>123*456</calc>", "<result>56088</result>", "56088"]
    env = tools_env(calc)
    assert env.step("<calc>123*456</calc>") == ("<result>56088</result>", 0.0, False)
    assert env.step("56088") == (None, 0.0, True)  # no call: the final answer


@pytest.mark.parametrize("tool, cause", [(broken, "RuntimeError: the tool is broken"),
                                         (number, "TypeError: tool number returned int 42, not a str"),
                                         (slow, "timed out after 0.5s")])
def test_a_tool_that_raises_hangs_or_returns_a_non_string_gives_a_counted_error_observation(tool, cause):
    name = tool.__name__
    call, answer = ids(f"<{name}>1</{name}>"), ids("7") + [EOS]
    start = time.monotonic()
    (t,), _ = run([[call, answer]], [tools_env(tool)], timeout_s=0.5, max_tokens=120)
    assert time.monotonic() - start < 5  # the hung tool was abandoned at its deadline
    observation = TOK.decode(t.response_ids[len(call): len(t.response_ids) - len(answer)])
    assert observation == f"<result>error: {cause}"[: len("<result>error: ") + 60] + "</result>"
    assert t.tool_errors == 1 and t.turns == 2 and t.done and not t.truncated and t.last_response == "7"


def test_turn_and_token_limits_truncate_and_are_counted():
    call = ids("<calc>1+1</calc>")
    # sample 0 calls forever: stopped after max_turns=3 model turns, ending on its own tokens
    # sample 1 writes past the token budget mid-turn; sample 2 answers at once
    turns = [[call] * 5, [ids("1111111111111111111111")], [ids("56") + [EOS]]]
    envs = [tools_env(calc) for _ in range(3)]
    trajectories, _ = run(turns, envs, max_turns=3, max_tokens=20)
    looping, long, answered = trajectories
    assert looping.turns == 3 and looping.truncated and looping.loss_mask[-1]  # no observation after the last turn
    assert len(long.response_ids) == 20 and long.truncated and long.turns == 1
    assert not answered.truncated and answered.turns == 1
    prompts = Batch({"prompt_ids": torch.zeros(3, 8, dtype=torch.long), "prompt_mask": torch.ones(3, 8, dtype=torch.bool)})
    batch = trajectories_to_batch(trajectories, prompts, 20, TOK.pad_token_id, TOK)
    assert batch["finish_reason"] == ["length", "length", "stop"]  # what reward functions see
    metrics = agent_metrics(batch)
    assert metrics["agent/truncated"] == pytest.approx(2 / 3)
    assert metrics["agent/turns_mean"] == pytest.approx((3 + 1 + 1) / 3)
    assert metrics["agent/tool_errors"] == 0


def test_an_observation_that_does_not_fit_ends_the_trajectory_truncated():
    call = ids("<calc>123*456</calc>")  # 9 tokens; the result 7: 16 + 1 more model token > 16
    (t,), _ = run([[call, ids("1") + [EOS]]], [tools_env(calc)], max_tokens=16)
    assert t.truncated and t.response_ids == call and t.turns == 1


class Guess:
    """An environment: the model guesses a number; the environment says higher or lower."""

    stop = ("?",)

    def reset(self, ground_truth):
        self.answer = int(ground_truth)
        return "guess?"

    def step(self, response):
        guess = int(response.rstrip("?").split()[-1])
        if guess == self.answer:
            return None, 1.0, True
        return ("higher " if guess < self.answer else "lower "), -0.1, False


def test_an_environment_class_gets_its_row_and_its_rewards_are_summed():
    trajectories = [Trajectory(list(PROMPTS[0]), Guess(), "Guess")]
    run_trajectories(trajectories, [{"ground_truth": "5", "prompt": "x"}],
                     Script([[ids("3?"), ids("6?"), ids("5?")]]), TOK, 4, 40, 5.0)
    t = trajectories[0]
    assert TOK.decode(t.response_ids) == "guess?3?higher 6?lower 5?"
    assert t.loss_mask[:6] == [False] * 6 and t.reward == pytest.approx(0.8) and t.turns == 3


def test_a_reward_on_agent_reward_passes_preflight_with_an_agent_and_names_rollout_agent_without(tmp_path):
    # docs/agents.md's example: an environment, and a reward function scoring its summed rewards
    (tmp_path / "guess.py").write_text("class Guess:\n    stop = ('?',)\n    def reset(self, ground_truth):\n"
                                       "        return 'guess?'\n    def step(self, response):\n"
                                       "        return None, 1.0, True\n")
    (tmp_path / "my_reward.py").write_text("def score(agent_reward, **_):\n    return agent_reward\n")
    reward = RewardConfig(fn=f"{tmp_path / 'my_reward.py'}:score")
    agent = RolloutConfig(agent=[f"{tmp_path / 'guess.py'}:Guess"], max_response_tokens=64)
    grpo = RecipeConfig(name="grpo")  # a recipe that scores with reward.fn (the demo's is fixed)
    assert check_run(HybridFlowConfig(recipe=grpo, rollout=agent, reward=reward), check_model=False) == []
    (problem,) = check_run(HybridFlowConfig(recipe=grpo, reward=reward), check_model=False)
    assert "requires the argument 'agent_reward'; fix: 'agent_reward' is filled by an agent rollout: set " \
           "rollout.agent" in problem


def test_load_agents_by_reference_and_choose_per_row(tmp_path):
    agent_file = tmp_path / "my_agents.py"
    agent_file.write_text("def add(a: int, b: int) -> str:\n    '''Adds.'''\n    return str(a + b)\n\n"
                          "class Echo:\n    stop = ()\n    def reset(self, **row):\n        return None\n"
                          "    def step(self, response):\n        return response, 0.0, False\n")
    agents = load_agents([f"{agent_file}:add", f"{agent_file}:Echo", "hybridflow.data.calculator:calc"])
    assert sorted(agents.factories) == ["Echo", "tools"]
    name, env = agents.make({"agent": "tools"}, 0)
    assert name == "tools" and env.step('<add>{"a": 2, "b": 3}</add>')[0] == "<result>5</result>"
    assert agents.make({"agent": "Echo"}, 1)[0] == "Echo"
    with pytest.raises(AgentError, match="sample 2: column 'agent'"):
        agents.make({"agent": "nope"}, 2)
    with pytest.raises(AgentError, match="does not load"):
        load_agents([f"{agent_file}:missing"])
    with pytest.raises(AgentError, match="annotation"):
        load_agents(["hybridflow.agents.tools:tool_environment"])


def test_a_failing_reset_names_the_sample_and_agent():
    class Bad:
        stop = ()

        def reset(self, **_):
            raise KeyError("ground_truth")

        def step(self, response):
            return None, 0.0, True

    with pytest.raises(AgentError, match="sample 0: agent 'Bad': reset raised"):
        run_trajectories([Trajectory([1], Bad(), "Bad")], [{}], Script([[]]), TOK, 2, 10, 1.0)


def test_sft_demonstrations_train_the_model_turns_and_attend_to_the_tool_output():
    from hybridflow.data.answers import encode_demonstrations, encode_sft_targets

    batch = encode_demonstrations([demonstration("123*456=")], TOK, 32)
    call, result, answer = ids("<calc>123*456</calc>"), ids("<result>56088</result>"), ids("56088")
    n = len(call) + len(result) + len(answer) + 1
    assert batch["response_ids"][0, :n].tolist() == call + result + answer + [EOS]
    assert batch["response_mask"][0].tolist() == [True] * n + [False] * (32 - n)
    assert batch["loss_mask"][0, :n].tolist() == [True] * len(call) + [False] * len(result) + [True] * (len(answer) + 1)
    plain = encode_sft_targets([{"ground_truth": "56088"}], TOK, 8)
    assert "loss_mask" not in plain and plain["response_ids"][0, :6].tolist() == answer + [EOS]
    with pytest.raises(ValueError, match="rollout.max_response_tokens=8; raise it"):
        encode_demonstrations([demonstration("123*456=")], TOK, 8)


def test_agent_config_keys_are_checked_before_anything_starts():
    from hybridflow.config import compose
    from hybridflow.config.schema import RolloutConfig

    assert RolloutConfig(agent="hybridflow.data.calculator:calc").agent == ["hybridflow.data.calculator:calc"]
    assert RolloutConfig().agent == []
    with pytest.raises(ValueError, match="rollout.agent"):
        RolloutConfig(agent=["calc"])
    with pytest.raises(ValueError, match="does not exist"):
        RolloutConfig(agent=["no/such/file.py:calc"])
    with pytest.raises(ValueError, match=r"rollout.backend='hf' is invalid: agent rollouts \(rollout.agent\) run on an "
                       r"engine that runs them: \['vllm'\]"):
        compose(["recipe=grpo", "rollout=hf", "rollout.agent=hybridflow.data.calculator:calc"])
    with pytest.raises(ValueError, match="rollout.max_turns"):
        RolloutConfig(max_turns=0)


def test_a_failed_step_blames_the_environment_unless_the_call_was_wrong():
    """ValueError, TypeError and LookupError say the model's call was wrong; anything else, or a
    timeout, is the environment's failure (hybridflow/agents/environment.py)."""
    import json

    from hybridflow.agents.environment import is_call_error

    assert all(is_call_error(e) for e in (ValueError("x"), TypeError("x"), KeyError("x"), IndexError("x"),
                                          json.JSONDecodeError("x", "", 0)))
    assert not any(is_call_error(e) for e in (ConnectionError("x"), OSError("x"), RuntimeError("x"),
                                              AttributeError("x"), None))


def test_the_environment_failure_guard_says_the_first_and_stops_past_the_share(capsys):
    import torch

    from hybridflow.agents.failures import EnvFailureGuard, EnvironmentFailureError
    from hybridflow.batch import Batch

    samples = Batch(tensors={"x": torch.zeros(3)},
                    objects={"agent_failure": ["agent 'a': ConnectionError: gone", "", "agent 'a': ConnectionError: gone"]})
    guard = EnvFailureGuard(0.5)
    guard.check(1, samples, {"agent/env_failures": 2.0, "agent/env_failure_fraction": 0.2})
    guard.check(2, samples, {"agent/env_failures": 2.0, "agent/env_failure_fraction": 0.2})
    said = capsys.readouterr().out
    assert said.count("failed on the environment's side") == 1 and "ConnectionError: gone (2 samples)" in said
    with pytest.raises(EnvironmentFailureError, match=r"step 3: 4 environment.*60.0%.*max_env_failure_fraction=0.5"):
        guard.check(3, samples, {"agent/env_failures": 4.0, "agent/env_failure_fraction": 0.6})
    guard.check(4, samples, {})  # a batch no agent rolled out
