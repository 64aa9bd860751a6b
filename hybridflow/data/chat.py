"""Prompts as chat messages: verl's and TRL's layout, `[{"role": "user", "content": "..."}, ...]`.

A row's `prompt` is either text, used as is, or a list of chat messages, rendered with the
model tokenizer's chat template (generation prompt appended) into the text the model sees.
A tokenizer without a chat template cannot render messages: that is an error naming the fix,
never a silent guess at a format the model was not trained on.
"""

from __future__ import annotations

from typing import Any

CHAT_FIX = 'write the prompt as text, or as a list of chat messages [{"role": "user", "content": "..."}, ...]'


def is_chat(prompt: Any) -> bool:
    """True for a non-empty list of {role, content} dicts (the shape is checked by `prompt_problem`)."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(isinstance(m, dict) for m in prompt)


def prompt_problem(prompt: Any) -> str | None:
    """Why `prompt` is neither text nor chat messages, as '<type> <value>: <what is wrong>'; None if fine."""
    if prompt is None:
        return "null: the row has no prompt"
    if isinstance(prompt, str):
        return None if prompt.strip() else f"str {prompt!r}: an empty prompt"
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            return "list []: no messages"
        for i, message in enumerate(prompt):
            if not isinstance(message, dict):
                return f"list whose message {i} is a {type(message).__name__} ({_short(message)}), not a dict"
            bad = [k for k in ("role", "content") if not isinstance(message.get(k), str)]
            if bad:
                return (f"list whose message {i} ({_short(message)}) has no text {' or '.join(bad)}; "
                        "each message needs 'role' and 'content' strings")
        return None
    return f"{type(prompt).__name__} {_short(prompt)}"


def render_prompt(prompt: Any, tokenizer) -> str:
    """The text the model sees: `prompt` itself, or chat messages through the chat template."""
    if isinstance(prompt, str):
        return prompt
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"{NO_TEMPLATE} ({getattr(tokenizer, 'name_or_path', '?')})")
    messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


NO_TEMPLATE = ("the prompt is a list of chat messages but the model's tokenizer has no chat template; use a "
               "model whose tokenizer_config.json (or chat_template.jinja) has one, or write the prompts as text")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
