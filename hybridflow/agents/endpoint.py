"""An OpenAI-compatible chat-completions endpoint on the rollout engine, for agents written for the
OpenAI client (a verifiers environment's harness, any agent loop), recording every call's tokens.

Served on loopback (127.0.0.1, an ephemeral port) by the rollout worker for the duration of one
generation phase, over a `GenerateFn` (token ids in, sampled ids and log-probs out:
hybridflow/agents/trajectory.py), so it runs on any engine that gives one. Each sample of the phase
gets a base URL of its own, `http://127.0.0.1:<port>/samples/<key>/v1`: the key in the path is the
only per-sample channel every client keeps (a proxy in between, such as verifiers' interception
server, rewrites the body's `model` and drops unknown fields and headers, but relays to the
base URL it was given).

Token in, token out. A call's messages are rendered with the model's chat template. When they
extend an earlier call of the same sample (that call's messages, then its reply as the assistant
message, then new messages), the earlier turns are taken as the ids recorded then, never the
re-tokenised text: the new prompt is the earlier call's prompt ids, its sampled ids, then the
tokens of the text the template adds after the reply (the tool results, the next user turn, the
generation prompt). The sample's trajectory is its last call's chain: the first call's prompt,
then every reply as sampled (loss mask True, with its log-probs) and every tail as encoded
(False). A call that extends nothing starts a new chain (a harness that rewrites the history,
a template that drops earlier reasoning); the calls left off the last chain are counted.

Refused with an OpenAI-style error (the agent's client raises it): a key of a phase that ended
(HTTP 409: a stale policy version, or an agent still running after its phase), an unknown key
(404), sampling the trainer did not ask for (temperature other than the run's, top_p < 1, n > 1:
the trained policy must be the one that sampled; 400), a call past the sample's token budget
(`rollout.max_response_tokens`, all tokens after the first prompt; 400), and a call that offers tools
when no `rollout.tool_call_parser` is set (400): tool calls are written in each model family's own
format, and an agent that never saw its calls answered would be trained as if it had offered none.

Tool calls. With a parser set (tool_calls.py: vLLM's parsers, by name), a request's `tools` are
rendered by the chat template and each reply is parsed into OpenAI `tool_calls` (finish_reason
"tool_calls"); a reply with no call is a plain message, one whose call the parser rejects is plain
text too and counted (`SampleRecord.malformed_tool_calls`). The next request repeats the assistant
message with its `tool_calls`, which the template renders its own way (key order, spacing): where that
text is not what was sampled, the tail is found by rendering the repeated message as the sampled text,
so the chain still carries the sampled ids (`ChatTokens.tail`).
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from hybridflow.agents.tool_calls import ToolCallParser, call_signature
from hybridflow.agents.trajectory import GenerateFn, TurnRequest

BATCH_WINDOW_S = 0.02  # calls arriving this close together go to the engine in one generate call


class EndpointError(Exception):
    """A request the endpoint refuses: HTTP `status`, OpenAI error `code`, and a message naming the fix."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class Call:
    """One chat completion of a sample: its messages (normalised), the chain it extends, and its tokens."""

    messages: list[tuple]
    reply: str  # the sampled text (special tokens skipped)
    root_ids: list[int]  # the chain's first prompt
    response_ids: list[int]  # after the root: the chain's earlier replies and tails, then this reply
    loss_mask: list[bool]  # True on sampled ids
    log_probs: list[float]  # the sampler's, 0 on tail ids
    parent: int | None  # the index of the call it extends
    completion_ids: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    content: str | None = None  # the assistant content returned: the reply, less the tool calls parsed out of it
    tool_calls: list[dict] = field(default_factory=list)  # the OpenAI tool calls returned

    def returned(self) -> tuple:
        """The assistant message returned, as `normalise` gives it when a later request repeats it."""
        return ("assistant", self.content or "", call_signature(self.tool_calls))


@dataclass
class SampleRecord:
    """Every call of one sample in one phase; its trajectory is the last call's chain."""

    key: str
    seed: int | None
    budget: int  # tokens after the first prompt
    calls: list[Call] = field(default_factory=list)
    truncated: bool = False  # a call ran out of the budget, or one was refused for it
    refused: list[str] = field(default_factory=list)  # the endpoint's refusals, for the sample's message
    malformed_tool_calls: int = 0  # replies that opened a tool call the parser rejected

    @property
    def last(self) -> Call | None:
        return self.calls[-1] if self.calls else None

    def trajectory(self) -> Call | None:
        """The sample's trajectory: its last call, whose root and response hold the whole chain."""
        return self.last

    def unchained_calls(self) -> int:
        """Calls that are not on the last call's chain (a history the agent rewrote)."""
        on_chain, i = 0, len(self.calls) - 1 if self.calls else None
        while i is not None:
            on_chain, i = on_chain + 1, self.calls[i].parent
        return len(self.calls) - on_chain


def message_text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise EndpointError(400, "invalid_message", f"message content {content!r:.60} is neither text nor content parts")


def normalise(message: dict) -> tuple:
    """What identifies a message when a later call repeats it: role, text, tool calls and tool call id."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise EndpointError(400, "invalid_message", f"message {message!r:.60} has no role")
    return (message["role"], message_text(message.get("content")), call_signature(message.get("tool_calls")),
            message.get("tool_call_id") or "")


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as the chat template reads them (text content)."""
    out = []
    for m in messages:
        rendered = {"role": m["role"], "content": message_text(m.get("content"))}
        for k in ("tool_calls", "tool_call_id", "name"):
            if m.get(k):
                rendered[k] = m[k]
        out.append(rendered)
    return out


class ChatTokens:
    """Chat template rendering and the token-in, token-out prompt of a call (the module docstring)."""

    def __init__(self, tokenizer) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"the OpenAI-compatible endpoint renders chat messages with the model's chat template, "
                             f"and the tokenizer of {getattr(tokenizer, 'name_or_path', '?')} has none; use a model "
                             "whose tokenizer_config.json (or chat_template.jinja) has one")
        self.tokenizer = tokenizer

    def render(self, messages: list[dict], tools: list | None, generation_prompt: bool = True) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(template_messages(messages), tokenize=False,
                                                  add_generation_prompt=generation_prompt, **kwargs)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def reply_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def tail(self, messages: list[dict], tools: list | None, parent: Call) -> list[int] | None:
        """The ids after `parent`'s prompt and reply when `messages` extend them, else None: the text the
        template puts after the reply, encoded. The reply's own text is matched whether the template
        writes the sampled end token after it (Qwen's <|im_end|>) or not. A repeated tool-call message
        that the template renders otherwise than it was sampled is rendered as the sampled text instead
        (a plain assistant message), so the tail is what follows the sampled ids."""
        n = len(parent.messages)
        head = self.render(messages[:n], tools)
        found = self._tail_text(head, self.render(messages, tools), parent)
        if found is None and parent.tool_calls:
            as_sampled = [*messages[:n], {"role": "assistant", "content": parent.reply}, *messages[n + 1:]]
            try:
                found = self._tail_text(head, self.render(as_sampled, tools), parent)
            except Exception:  # noqa: BLE001 - a template that insists on the call (jinja's raise_exception)
                found = None
        return None if found is None else self.encode(found)

    def _tail_text(self, head: str, text: str, parent: Call) -> str | None:
        if not text.startswith(head):
            return None
        rest = text[len(head):]
        with_specials = self.tokenizer.decode(parent.completion_ids, skip_special_tokens=False)
        for sampled in (with_specials, parent.reply):
            if rest.startswith(sampled):
                return rest[len(sampled):]
        return None


@dataclass
class _Pending:
    """A call prepared for the engine."""

    record: SampleRecord
    call: Call
    body: dict
    request: TurnRequest
    at_budget: bool  # its max_tokens is what is left of the sample's budget


class _Batcher:
    """One thread that submits the calls waiting together to the engine in one `generate` call, so
    the engine batches the turns of every agent that is waiting on it."""

    def __init__(self, generate: GenerateFn) -> None:
        self.generate = generate
        self.pending: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="endpoint-batcher", daemon=True)
        self.stopping = False
        self.thread.start()

    def submit(self, request: TurnRequest) -> Future:
        future: Future = Future()
        self.pending.put((request, future))
        return future

    def _run(self) -> None:
        while not self.stopping:
            try:
                batch = [self.pending.get(timeout=0.1)]
            except queue.Empty:
                continue
            deadline = time.monotonic() + BATCH_WINDOW_S
            while (left := deadline - time.monotonic()) > 0:
                try:
                    batch.append(self.pending.get(timeout=left))
                except queue.Empty:
                    break
            try:
                outputs = self.generate([r for r, _ in batch])
            except BaseException as exc:  # noqa: BLE001 - every waiting call gets the engine's error
                for _, future in batch:
                    future.set_exception(exc)
                continue
            for (_, future), output in zip(batch, outputs):
                future.set_result(output)

    def stop(self) -> None:
        self.stopping = True
        self.thread.join(timeout=5)


class ChatEndpoint:
    """The endpoint: `start()` once, then per generation phase `open_phase(...)` -> keys,
    `base_url(key)` per sample, and `close_phase()` -> the samples' records; `stop()` at the end."""

    def __init__(self, tokenizer, model_name: str = "policy", tool_parser: ToolCallParser | None = None) -> None:
        self.tokens = ChatTokens(tokenizer)
        self.tool_parser = tool_parser  # None: requests that offer tools are refused
        self.model_name = model_name
        self.generate: GenerateFn | None = None  # the open phase's engine, and its temperature
        self.temperature = 1.0
        self.lock = threading.Lock()
        self.samples: dict[str, SampleRecord] = {}
        self.ended: dict[str, int] = {}  # key of an ended phase -> its policy version
        self.version: int | None = None  # the open phase's policy version; None: no phase open
        self.port: int | None = None
        self._server = self._thread = self._batcher = None

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> int:
        """Serve on 127.0.0.1 at an ephemeral port (a thread of this process); returns the port."""
        import uvicorn

        self._batcher = _Batcher(lambda requests: self.generate(requests))
        config = uvicorn.Config(self._app(), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="chat-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the OpenAI-compatible endpoint did not start on 127.0.0.1 within 30 s")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._batcher.stop()
            self._server = None

    def open_phase(self, version: int, seeds: list[int | None], budget: int, generate: GenerateFn,
                   temperature: float) -> list[str]:
        """A phase of generation by policy `version` through `generate` (sampling at `temperature`): one
        key per sample (its seed, its token budget)."""
        with self.lock:
            if self.version is not None:
                raise RuntimeError("ChatEndpoint.open_phase: a phase is open already; close_phase() it first")
            self.version, self.generate, self.temperature = version, generate, temperature
            keys = [f"v{version}-{uuid.uuid4().hex[:12]}-{i}" for i in range(len(seeds))]
            self.samples = {k: SampleRecord(k, s, budget) for k, s in zip(keys, seeds)}
        return keys

    def close_phase(self) -> dict[str, SampleRecord]:
        """End the phase: later calls with its keys are refused. Returns the records by key."""
        with self.lock:
            records, self.samples = self.samples, {}
            self.ended.update({k: self.version for k in records})
            self.version = self.generate = None
        return records

    def base_url(self, key: str) -> str:
        return f"http://127.0.0.1:{self.port}/samples/{key}/v1"

    # ---- one call -------------------------------------------------------------------------------
    def record_for(self, key: str) -> SampleRecord:
        with self.lock:
            record = self.samples.get(key)
            if record is not None:
                return record
            if key in self.ended:
                served = "no phase is open" if self.version is None else f"the engine now serves version {self.version}"
                raise EndpointError(409, "stale_policy",
                                    f"sample {key}: its generation phase (policy version {self.ended[key]}) has "
                                    f"ended and {served}; a call after its phase would train on another policy's "
                                    "tokens. The agent must finish within its rollout")
        raise EndpointError(404, "unknown_sample", f"sample {key} is not one of this endpoint's; use the base_url "
                                                   "the rollout gave the agent")

    def check_sampling(self, body: dict) -> None:
        temperature = body.get("temperature")
        if temperature is not None and abs(float(temperature) - self.temperature) > 1e-6:
            raise EndpointError(400, "sampling_mismatch",
                                f"temperature={temperature} asked, the run samples at rollout.temperature="
                                f"{self.temperature}: the trained policy must be the one that sampled. Leave it "
                                "unset in the agent, or set rollout.temperature")
        top_p = body.get("top_p")
        if top_p is not None and float(top_p) < 1.0:
            raise EndpointError(400, "sampling_mismatch",
                                f"top_p={top_p}: truncated sampling is a policy the actor does not compute; leave it unset")
        if body.get("n") not in (None, 1):
            raise EndpointError(400, "sampling_mismatch", f"n={body.get('n')}: one choice per call (the rollout "
                                                          "samples rollout.samples_per_prompt episodes instead)")

    def prompt(self, record: SampleRecord, messages: list[dict], tools: list | None) -> tuple[Call, list[int]]:
        """The call's chain (root, response so far, parent) and its prompt ids, token-faithful."""
        normalised = [normalise(m) for m in messages]
        for i in range(len(record.calls) - 1, -1, -1):
            parent = record.calls[i]
            n = len(parent.messages)
            if (len(normalised) > n + 1 and normalised[:n] == parent.messages
                    and normalised[n][:3] == parent.returned()):
                tail = self.tokens.tail(messages, tools, parent)
                if tail is not None:
                    call = Call(normalised, "", parent.root_ids, parent.response_ids + tail,
                                parent.loss_mask + [False] * len(tail), parent.log_probs + [0.0] * len(tail), i)
                    return call, call.root_ids + call.response_ids
        root = self.tokens.encode(self.tokens.render(messages, tools))
        return Call(normalised, "", root, [], [], [], None), root

    def complete(self, key: str, body: dict) -> dict:
        """One chat completion (blocking): the OpenAI response dict, or an EndpointError."""
        pending = self.prepare(key, body)
        return self.finish(pending, self._batcher.submit(pending.request).result())

    def prepare(self, key: str, body: dict) -> "_Pending":
        """A call's engine request (its prompt token-faithful, its budget, seed and stops), checked."""
        record = self.record_for(key)
        self.check_sampling(body)
        messages, tools = body.get("messages"), body.get("tools") or None
        if not isinstance(messages, list) or not messages:
            raise EndpointError(400, "invalid_request", "messages must be a non-empty list of chat messages")
        if tools and self.tool_parser is None:
            raise EndpointError(400, "tools_unsupported",
                                f"the request offers tools {[t.get('function', {}).get('name') for t in tools][:5]}, and "
                                "no rollout.tool_call_parser is set to parse the calls out of the model's text (each "
                                "model family writes them its own way): the agent would never see a call and the run "
                                "would train on that. Set rollout.tool_call_parser to the model's format (hermes for "
                                "<tool_call>{json}</tool_call>: Qwen2.5/Qwen3), or use an agent without tools")
        call, prompt_ids = self.prompt(record, messages, tools)
        left = record.budget - len(call.response_ids)
        if left < 1:
            record.truncated = True
            message = (f"sample {key}: the conversation so far fills the sample's token budget "
                       f"(rollout.max_response_tokens={record.budget} after the first prompt); raise it")
            record.refused.append(message)
            raise EndpointError(400, "context_length_exceeded", message)
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        max_tokens = min(int(asked), left) if asked else left
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        seed = None if record.seed is None else (record.seed * 1_000_003 + len(record.calls)) % (2**31 - 1)
        return _Pending(record, call, body, TurnRequest(prompt_ids, max_tokens, seed, stop), max_tokens == left)

    def finish(self, pending: "_Pending", output: tuple[list[int], list[float], bool]) -> dict:
        """Record what the engine sampled for a prepared call; the OpenAI response dict."""
        ids, log_probs, hit_length = output
        call = pending.call
        call.completion_ids, call.reply = list(ids), self.tokens.reply_text(ids)
        call.response_ids = call.response_ids + list(ids)
        call.loss_mask = call.loss_mask + [True] * len(ids)
        call.log_probs = call.log_probs + list(log_probs)
        call.finish_reason = "length" if hit_length else "stop"
        call.content, malformed = call.reply, False
        tools = pending.body.get("tools")
        if tools and not hit_length:  # a reply cut by the token limit is returned as text, its call unfinished
            parsed = self.tool_parser.parse(call.reply, tools)
            call.content, call.tool_calls, malformed = parsed.content, parsed.tool_calls, parsed.malformed
            call.finish_reason = "tool_calls" if call.tool_calls else call.finish_reason
        with self.lock:
            pending.record.truncated = pending.record.truncated or (hit_length and pending.at_budget)
            pending.record.malformed_tool_calls += malformed
            pending.record.calls.append(call)
        return self.response(pending.body, call, len(pending.request.prompt_ids), log_probs)

    def response(self, body: dict, call: Call, prompt_tokens: int, log_probs: list[float]) -> dict:
        message = {"role": "assistant", "content": call.content}
        if call.tool_calls:
            message["tool_calls"] = call.tool_calls
        choice = {"index": 0, "message": message, "finish_reason": call.finish_reason}
        if body.get("logprobs"):
            pieces = [self.tokens.tokenizer.decode([t]) for t in call.completion_ids]
            choice["logprobs"] = {"content": [{"token": p, "logprob": lp, "top_logprobs": []}
                                              for p, lp in zip(pieces, log_probs)]}
        completion = len(call.completion_ids)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model") or self.model_name, "choices": [choice],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                          "total_tokens": prompt_tokens + completion}}

    # ---- HTTP -----------------------------------------------------------------------------------
    def _app(self):
        """A Starlette app (FastAPI's core, installed with it): two routes under each sample's base URL."""
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        def error(exc: EndpointError) -> JSONResponse:
            return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error", "code": exc.code}},
                                status_code=exc.status)

        async def chat_completions(request):
            key = request.path_params["key"]
            try:
                try:
                    body = await request.json()
                except ValueError as exc:
                    raise EndpointError(400, "invalid_json", f"the request body is not JSON: {exc}") from None
                # rendering in a thread; the wait for the engine on this loop, so that every agent's call
                # can be waiting at once (a thread per waiting call would cap the engine's batch)
                pending = await asyncio.to_thread(self.prepare, key, body)
                output = await asyncio.wrap_future(self._batcher.submit(pending.request))
                result = self.finish(pending, output)
            except EndpointError as exc:
                return error(exc)
            if body.get("stream"):
                usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return StreamingResponse(_sse(result, usage), media_type="text/event-stream")
            return JSONResponse(result)

        async def models(request):
            try:
                self.record_for(request.path_params["key"])
            except EndpointError as exc:
                return error(exc)
            return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                            "owned_by": "hybridflow"}]})

        return Starlette(routes=[Route("/samples/{key}/v1/chat/completions", chat_completions, methods=["POST"]),
                                 Route("/samples/{key}/v1/models", models, methods=["GET"])])


def _sse(result: dict, usage: bool):
    """A whole completion as chat.completion.chunk events (the engine does not stream tokens out)."""
    choice = result["choices"][0]
    base = {k: result[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    delta = {"role": "assistant", "content": choice["message"]["content"]}
    if choice["message"].get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(choice["message"]["tool_calls"])]
    first = {"index": 0, "delta": delta, "finish_reason": None}
    if "logprobs" in choice:
        first["logprobs"] = choice["logprobs"]
    chunks = [base | {"choices": [first]},
              base | {"choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]}]
    if usage:
        chunks.append(base | {"choices": [], "usage": result["usage"]})
    for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"
