"""rollout.environment and rollout.environment_args (hybridflow/agents/hubs) are checked when the command
composes, before Ray starts: each refusal names the key, the value and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.run.pipeline_stages import compose_command

SUMS = Path(__file__).resolve().parents[1] / "e2e" / "fixtures" / "verifiers_arith.py"
ENV = f"rollout.environment=verifiers:{SUMS}"


def test_an_environment_composes_with_its_arguments_and_rubric():
    config = compose_command([ENV, '+rollout.environment_args={agent: {harness: {id: "null"}}}', "reward.fn=environment"])
    assert config.rollout.environment == f"verifiers:{SUMS}"
    assert config.rollout.environment_args == {"agent": {"harness": {"id": "null"}}}
    assert compose_command([ENV, "reward.fn=environment", "rollout.tool_call_parser=hermes"]).rollout.tool_call_parser \
        == "hermes"


@pytest.mark.parametrize("overrides, named", [
    (["rollout.environment=gym:x", "reward.fn=environment"], "rollout.environment='gym:x' is invalid: name an environment as '<hub>:<id>'"),
    (["rollout.environment=verifiers:missing.py", "reward.fn=environment"], "missing.py does not exist"),
    (["+rollout.environment_args={agent: {max_turns: 2}}"], "rollout.environment_args={'agent': {'max_turns': 2}} is invalid: arguments of no environment"),
    ([ENV, "rollout.environment_args=3", "reward.fn=environment"], "a mapping of the environment's load arguments"),
    ([ENV, "rollout.agent=[x.py:Tool]", "reward.fn=environment"], "unset rollout.agent"),
    ([ENV], "rewarded by its own rubric: set reward.fn=environment"),
    (["reward.fn=environment"], "scores a hub environment's episodes: set rollout.environment"),
    (["rollout.tool_call_parser=hermes"], "rollout.tool_call_parser='hermes' is invalid: parses the tool calls of a "
                                          "hub environment's agent (rollout.environment), and none is set"),
    ([ENV, "reward.fn=environment", "rollout.tool_call_parser=hermse"],  # vLLM's parser names, as its --tool-call-parser
     "rollout.tool_call_parser='hermse' is invalid: not one of vLLM's tool-call parsers ['apertus'"),
])
def test_refusals_name_the_key_and_the_fix(overrides, named, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("def Tool(x: str) -> str:\n    return x\n")
    with pytest.raises(Exception, match=None) as error:
        compose_command(overrides)
    assert named in str(error.value)
