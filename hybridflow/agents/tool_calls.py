"""Tool calls in the model's text, parsed into OpenAI `tool_calls` by vLLM's own tool parsers, for the
OpenAI-compatible endpoint (endpoint.py; docs/agents.md "Tool calls through the endpoint").

Each model family writes its calls its own way (Hermes and Qwen: `<tool_call>{json}</tool_call>`; Llama
3: bare JSON; Mistral: `[TOOL_CALLS]`; ...), and vLLM ships a parser per format, registered by name
(`vllm serve --tool-call-parser hermes`). `rollout.tool_call_parser` names one of them and the endpoint
parses every reply of a request that offered tools with it. Only the parsers' non-streaming
`extract_tool_calls` is used: the endpoint answers each call once the engine has sampled it whole.

Why vLLM's and not transformers' `parse_response`: the latter reads a response schema from the
tokenizer (`response_template`), which few tokenizers carry (not the tiny model's, nor SmolLM2's, nor
Qwen2.5's); vLLM's parsers work from the format alone, and vLLM is the engine that agent rollouts
run on already.

A reply that holds no call is a plain assistant message (the model chose not to call a tool). A reply
that opens a call the parser rejects (the Hermes parser's JSON that does not decode) is also returned as
plain text, and counted as malformed: the model's bad call, which it learns from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from hybridflow.config.references import check_tool_call_parser


@dataclass
class ParsedReply:
    """A reply as the OpenAI message gives it: `content` (None when the reply is calls alone), its
    `tool_calls` (OpenAI dicts: id, type 'function', function.name, function.arguments as a JSON
    string), and `malformed`: it opened a call the parser rejected (returned as plain text)."""

    content: str | None
    tool_calls: list[dict] = field(default_factory=list)
    malformed: bool = False


class ToolCallParser:
    """One vLLM tool parser (`name`) over the model's tokenizer; `parse(text, tools)` per reply."""

    def __init__(self, name: str, tokenizer) -> None:
        problems = check_tool_call_parser(name)
        if problems:
            raise ValueError(problems[0])
        from vllm.tool_parsers import ToolParserManager

        self.name, self.tokenizer = name, tokenizer
        self.parser_class = ToolParserManager.get_tool_parser(name)

    def parse(self, text: str, tools: list[dict]) -> ParsedReply:
        """The reply `text` of a request that offered `tools`, as an OpenAI assistant message."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(model="policy", messages=[{"role": "user", "content": ""}], tools=tools)
        parser = self.parser_class(self.tokenizer, request.tools)  # a parser keeps per-request state
        try:
            found = parser.extract_tool_calls(text, request)
        except Exception:  # noqa: BLE001 - a parser that raises on the model's text: the model's bad call
            return ParsedReply(text, [], malformed=True)
        if not found.tools_called:
            start = getattr(parser, "tool_call_start_token", None)  # the parser's call marker, where it has one
            return ParsedReply(text, [], malformed=bool(start) and start in text)
        calls = [{"id": c.id, "type": "function",
                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                 for c in found.tool_calls]
        return ParsedReply(found.content or None, calls)


def call_signature(tool_calls: list | None) -> str:
    """What identifies an assistant message's calls when a later request repeats it: each call's name and
    arguments (their JSON decoded, so a client's re-serialisation matches), not the ids or extra fields."""
    if not tool_calls:
        return ""
    out = []
    for c in tool_calls:
        function = (c.get("function") or {}) if isinstance(c, dict) else {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        out.append([function.get("name"), arguments])
    return json.dumps(out, sort_keys=True)
