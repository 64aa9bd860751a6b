"""The OpenAI-compatible endpoint (hybridflow/agents/endpoint.py) through the real `openai` client: a
scripted engine, the tiny character tokenizer and its chat template.

The re-tokenisation case: the tiny tokenizer has `<calc>` as one token, but the engine may sample its
six characters as six tokens. The decoded reply "<calc>7" re-encodes to two ids, so an endpoint that
re-tokenised the conversation would train on ids the engine never sampled; this one must carry the
six sampled ids into the next call's prompt and the trajectory.
"""

from __future__ import annotations

import openai
import pytest

from hybridflow.agents.endpoint import ChatEndpoint
from hybridflow.builders.tiny_model import build_char_tokenizer

TEMPERATURE = 1.0


class ScriptedEngine:
    """A GenerateFn that answers the n-th request with the n-th scripted text, sampled character by
    character (so markers the tokenizer would merge stay apart), plus EOS; log-probs -0.5 each."""

    def __init__(self, tokenizer, replies: list[str]) -> None:
        self.tokenizer, self.replies, self.requests, self.batches = tokenizer, list(replies), [], []

    def __call__(self, requests):
        self.batches.append(len(requests))
        out = []
        for r in requests:
            self.requests.append(r)
            text = self.replies.pop(0)
            ids = [self.tokenizer.convert_tokens_to_ids(c) for c in text] + [self.tokenizer.eos_token_id]
            ids = ids[: r.max_tokens]
            out.append((ids, [-0.5] * len(ids), len(ids) == r.max_tokens and ids[-1] != self.tokenizer.eos_token_id))
        return out


@pytest.fixture()
def endpoint():
    tokenizer = build_char_tokenizer()
    engine = ScriptedEngine(tokenizer, ["<calc>7", "done", "x", "y"])
    served = ChatEndpoint(tokenizer)
    served.start()
    yield served, engine, tokenizer
    served.stop()


def _client(served, key) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url(key), api_key="unused", max_retries=0)


def test_multi_turn_carries_the_sampled_ids_not_the_retokenised_text(endpoint):
    served, engine, tok = endpoint
    (key,) = served.open_phase(version=3, seeds=[11], budget=64, generate=engine, temperature=TEMPERATURE)
    client = _client(served, key)
    messages = [{"role": "user", "content": "3+4="}]
    first = client.chat.completions.create(model="any", messages=messages)
    reply = first.choices[0].message.content
    assert reply == "<calc>7"
    sampled = [tok.convert_tokens_to_ids(c) for c in "<calc>7"] + [tok.eos_token_id]
    retokenised = tok.encode(reply, add_special_tokens=False)
    assert len(retokenised) == 2 and retokenised != sampled[:-1]  # the case: re-encoding changes the ids

    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "ok?"}]
    stream = client.chat.completions.create(model="any", messages=messages, stream=True,
                                            stream_options={"include_usage": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "done"

    root = tok(tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]
    tail = tok.encode(" user: ok? assistant: ", add_special_tokens=False)
    second_prompt = engine.requests[1].prompt_ids
    assert second_prompt == root + sampled + tail  # the first turn as sampled, EOS included
    records = served.close_phase()
    trajectory = records[key].trajectory()
    done = [tok.convert_tokens_to_ids(c) for c in "done"] + [tok.eos_token_id]
    assert trajectory.root_ids == root
    assert trajectory.response_ids == sampled + tail + done
    assert trajectory.loss_mask == [True] * len(sampled) + [False] * len(tail) + [True] * len(done)
    assert trajectory.log_probs == [-0.5] * len(sampled) + [0.0] * len(tail) + [-0.5] * len(done)
    assert records[key].unchained_calls() == 0


def test_a_rewritten_history_starts_a_new_chain_and_is_counted(endpoint):
    served, engine, tok = endpoint
    (key,) = served.open_phase(version=0, seeds=[None], budget=64, generate=engine, temperature=TEMPERATURE)
    client = _client(served, key)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
    edited = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<calc>8"},
              {"role": "user", "content": "b"}]
    client.chat.completions.create(model="m", messages=edited)
    record = served.close_phase()[key]
    assert record.trajectory().parent is None and record.unchained_calls() == 1


def test_refusals_name_the_cause(endpoint):
    served, engine, tok = endpoint
    (key,) = served.open_phase(version=5, seeds=[1], budget=3, generate=engine, temperature=TEMPERATURE)
    client = _client(served, key)
    with pytest.raises(openai.BadRequestError, match="rollout.temperature"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}], temperature=0.2)
    out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}], max_tokens=50)
    assert out.choices[0].finish_reason == "length"  # the 3-token budget cut "<calc>7"
    again = [{"role": "user", "content": "a"}, {"role": "assistant", "content": out.choices[0].message.content},
             {"role": "user", "content": "b"}]
    with pytest.raises(openai.BadRequestError, match="max_response_tokens=3"):
        client.chat.completions.create(model="m", messages=again)
    with pytest.raises(openai.BadRequestError, match="no rollout.tool_call_parser is set"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}], tools=[
            {"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}])
    records = served.close_phase()
    assert records[key].truncated
    with pytest.raises(openai.ConflictError, match="policy version 5"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
    served.open_phase(version=6, seeds=[1], budget=3, generate=engine, temperature=TEMPERATURE)
    with pytest.raises(openai.ConflictError, match="serves version 6"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=served.base_url("nope"), api_key="x", max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "a"}])


def test_calls_waiting_together_reach_the_engine_in_one_batch(endpoint):
    """Many agents' calls in flight at once go to the engine together (its continuous batching), not
    one by one nor capped by a thread pool."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    served, engine, tok = endpoint
    engine.replies = ["7"] * 16
    keys = served.open_phase(version=1, seeds=list(range(16)), budget=8, generate=engine, temperature=TEMPERATURE)
    clients, start = [_client(served, k) for k in keys], threading.Barrier(16)

    def call(client) -> str:
        start.wait()
        return client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}]).choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(call, clients))
    assert replies == ["7"] * 16
    assert max(engine.batches) >= 8 and len(engine.batches) < 16, engine.batches  # not one by one


# ---- tool calls (rollout.tool_call_parser=hermes: vLLM's parser of <tool_call>{json}</tool_call>) --------------
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluate an expression.",
                                           "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                                                          "required": ["expr"]}}}]
# sampled without the spaces the tiny template writes between JSON keys: its re-rendering of the parsed call
# is other text than the sampled one, so only the sampled ids can be the trained ones
CALL = '<tool_call>{"name":"calc","arguments":{"expr":"3+4"}}</tool_call>'


@pytest.fixture()
def tool_endpoint():
    from hybridflow.agents.tool_calls import ToolCallParser

    tokenizer = build_char_tokenizer(json_characters=True)
    engine = ScriptedEngine(tokenizer, [CALL, "7", "<tool_call>{oops</tool_call>"])
    served = ChatEndpoint(tokenizer, tool_parser=ToolCallParser("hermes", tokenizer))
    served.start()
    yield served, engine, tokenizer
    served.stop()


def _ids(tok, text: str) -> list[int]:
    return [tok.convert_tokens_to_ids(c) for c in text] + [tok.eos_token_id]  # as ScriptedEngine samples it


def test_a_tool_call_is_parsed_and_its_episode_trains_on_the_sampled_ids(tool_endpoint):
    served, engine, tok = tool_endpoint
    (key,) = served.open_phase(version=0, seeds=[3], budget=128, generate=engine, temperature=TEMPERATURE)
    client = _client(served, key)
    messages = [{"role": "user", "content": "3+4="}]
    first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    root = engine.requests[0].prompt_ids
    assert tok.decode(root) == "tools: calc; user: 3+4= assistant: "  # the template rendered the tools
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == ("function", "calc", '{"expr": "3+4"}')
    assert call.id

    # the agent's next request, as the openai client writes it: the call repeated, then the tool's result
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "7"}]
    second = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    assert second.choices[0].message.content == "7" and second.choices[0].finish_reason == "stop"
    rendered = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '{"name": "calc", "arguments": {"expr": "3+4"}}' in rendered and CALL not in rendered  # differs
    sampled, tail = _ids(tok, CALL), tok.encode(" tool: 7 assistant: ", add_special_tokens=False)
    assert engine.requests[1].prompt_ids == root + sampled + tail
    trajectory = served.close_phase()[key].trajectory()
    assert trajectory.parent == 0 and trajectory.root_ids == root
    assert trajectory.response_ids == sampled + tail + _ids(tok, "7")  # the engine's sampled ids, both turns
    assert trajectory.loss_mask == [True] * len(sampled) + [False] * len(tail) + [True] * 2  # the result masked


def test_a_reply_without_a_call_is_a_message_and_a_broken_call_is_counted(tool_endpoint):
    served, engine, tok = tool_endpoint
    engine.replies = ["7", "<tool_call>{oops</tool_call>"]
    keys = served.open_phase(version=0, seeds=[1, 2], budget=64, generate=engine, temperature=TEMPERATURE)
    plain = _client(served, keys[0]).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "a"}], tools=TOOLS).choices[0]
    assert (plain.message.content, plain.message.tool_calls, plain.finish_reason) == ("7", None, "stop")
    broken = _client(served, keys[1]).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "a"}], tools=TOOLS).choices[0]
    assert (broken.message.content, broken.message.tool_calls) == ("<tool_call>{oops</tool_call>", None)
    records = served.close_phase()
    assert [records[k].malformed_tool_calls for k in keys] == [0, 1]


def test_a_tool_call_streams_as_one_chunk(tool_endpoint):
    served, engine, tok = tool_endpoint
    (key,) = served.open_phase(version=0, seeds=[3], budget=128, generate=engine, temperature=TEMPERATURE)
    chunks = list(_client(served, key).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "3+4="}], tools=TOOLS, stream=True))
    (call,) = chunks[0].choices[0].delta.tool_calls
    assert (call.function.name, call.function.arguments) == ("calc", '{"expr": "3+4"}')
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    served.close_phase()
