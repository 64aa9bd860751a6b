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
    with pytest.raises(openai.BadRequestError, match="does not parse tool calls"):
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
