"""A verifiers (v1) tool environment (tests/e2e/fixtures/verifiers_calc.py: a `vf.Toolset` calculator, built
with verifiers' own classes) played through the OpenAI-compatible endpoint with `rollout.tool_call_parser=hermes`,
without Ray or an engine: the engine is scripted (a random tiny model would not write a call by itself), so
the env's own tool loop runs on a call the test chose. tests/e2e/test_hub_environments.py trains on the same
env with the real engine."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1")

from hybridflow.agents.endpoint import ChatEndpoint  # noqa: E402
from hybridflow.agents.hubs import Phase  # noqa: E402
from hybridflow.agents.hubs.verifiers_env import MALFORMED_TOOL_CALL, VerifiersEnvironment  # noqa: E402
from hybridflow.agents.tool_calls import ToolCallParser  # noqa: E402
from hybridflow.agents.trajectory import agent_metrics  # noqa: E402
from hybridflow.builders.tiny_model import build_char_tokenizer  # noqa: E402
from hybridflow.data.prompts import encode_prompts  # noqa: E402

CALC = str(Path(__file__).resolve().parents[1] / "e2e" / "fixtures" / "verifiers_calc.py")
NULL = {"agent": {"harness": {"id": "null"}}}
CALL = '<tool_call>{"name":"calc","arguments":{"expr":"1+2"}}</tool_call>'  # the 2nd task: 1+2=
BROKEN = '<tool_call>{"name":"calc"</tool_call>'


class Scripted:
    """A GenerateFn: each sample's replies in order (by the sample's first prompt), sampled character by
    character plus EOS, log-probs -0.5; every request kept."""

    def __init__(self, tokenizer, replies: dict[str, list[str]]) -> None:
        self.tok, self.replies, self.requests = tokenizer, replies, []

    def __call__(self, requests):
        out = []
        for r in requests:
            self.requests.append(r)
            text = self.tok.decode(r.prompt_ids, skip_special_tokens=True)
            script = next(v for k, v in self.replies.items() if text.endswith(k) or f"user: {k} " in text)
            ids = [self.tok.convert_tokens_to_ids(c) for c in script.pop(0)] + [self.tok.eos_token_id]
            out.append((ids, [-0.5] * len(ids), False))
        return out


@pytest.mark.slow  # ~13 s on 2 cores: verifiers starts the tool server and its chat program as subprocesses
def test_the_envs_tool_loop_runs_on_a_parsed_call_and_its_result_is_masked():
    tok = build_char_tokenizer(json_characters=True)
    env = VerifiersEnvironment(CALC, NULL)
    rows = env.rows()[1:3]  # 1+2=, 1+3=
    engine = Scripted(tok, {"1+2=": [CALL, "3"], "1+3=": [BROKEN]})
    endpoint = ChatEndpoint(tok, tool_parser=ToolCallParser("hermes", tok))
    endpoint.start()
    try:
        phase = Phase(version=0, seeds=[1, 2], generate=engine, temperature=1.0, budget=128, max_prompt_tokens=48,
                      pad_token_id=tok.pad_token_id, tokenizer=tok)
        samples = env.rollout(encode_prompts(rows, tok, 48), endpoint, phase)
    finally:
        endpoint.stop()
    first = [r for r in engine.requests if tok.decode(r.prompt_ids).endswith("user: 1+2= assistant: ")]
    assert tok.decode(first[0].prompt_ids) == "tools: calc; user: 1+2= assistant: "  # the env's tool, rendered
    second = next(r for r in engine.requests if "tool: " in tok.decode(r.prompt_ids))
    sampled = [tok.convert_tokens_to_ids(c) for c in CALL] + [tok.eos_token_id]
    result = tok.encode(" tool: 3 assistant: ", add_special_tokens=False)  # the calculator's answer
    assert second.prompt_ids == first[0].prompt_ids + sampled + result

    n = int(samples["response_mask"][0].sum())
    answer = [tok.convert_tokens_to_ids("3"), tok.eos_token_id]
    assert samples["response_ids"][0, :n].tolist() == sampled + result + answer  # the engine's ids, as sampled
    assert samples["loss_mask"][0, :n].tolist() == [True] * len(sampled) + [False] * len(result) + [True] * 2
    assert samples["env_rewards"][0] == {"score": 1.25, "correct": 1.0, "brevity": 0.5}
    assert int(samples["agent_turns"][0]) == 2

    # the broken call: the agent got it as text, the episode ended there, and it is counted by kind
    assert samples["response"][1] == BROKEN and samples["env_rewards"][1]["correct"] == 0.0
    assert agent_metrics(samples)[f"env/errors/{MALFORMED_TOOL_CALL}"] == 1.0
    assert float(samples["agent_env_failures"].sum()) == 0
