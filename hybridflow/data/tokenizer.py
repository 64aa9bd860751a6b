"""The model's tokenizer, loaded the same way by every recipe and check, and what it implies.

Checkpoints come with tokenizers as their authors saved them; the run adapts to them and says so
once, rather than failing at the first batch:
- no pad token (many Llama and Mistral checkpoints): the EOS token, or else the unk token, serves
  as pad. Padding positions are masked out everywhere (`prompt_mask`, `response_mask`), so the
  pad's id never reaches a loss or a reward;
- a tokenizer that starts text with a BOS token itself (Llama, Mistral, Gemma: its post-processor
  adds one): text prompts get it, as the model saw in pre-training. Chat prompts do not: the chat
  template writes its own BOS into the text, as `apply_chat_template` does;
- the chat template that renders chat prompts is named on the console (its file and its family),
  so a run on the wrong template is visible before it trains.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

_log = logging.getLogger("hybridflow")
_said: set[str] = set()

# Markers of the common template families, first match wins (a name for the console, nothing more).
TEMPLATE_FAMILIES = (("<|im_start|>", "ChatML (Qwen)"), ("<|start_header_id|>", "Llama 3"),
                     ("<start_of_turn>", "Gemma"), ("<|user|>", "Phi-3 / Zephyr"), ("[INST]", "Llama 2 / Mistral"),
                     ("<|User|>", "DeepSeek"))


def load_tokenizer(model_dir: str | Path, trust_remote_code: bool = False):
    """The tokenizer of a Hugging Face model directory, with a pad token (see `ensure_pad_token`)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    ensure_pad_token(tokenizer, str(model_dir))
    return tokenizer


def ensure_pad_token(tokenizer, where: str) -> None:
    """Give a tokenizer without a pad token its EOS (or unk) token as pad, and say so once."""
    if tokenizer.pad_token_id is not None:
        return
    for name in ("eos_token", "unk_token"):
        token = getattr(tokenizer, name, None)
        if token is not None:
            tokenizer.pad_token = token
            say_once(f"hybridflow: the tokenizer of {where} has no pad token; its {name.split('_')[0]} token "
                     f"{token!r} (id {tokenizer.pad_token_id}) serves as pad (padding is masked out)")
            return
    raise ValueError(f"the tokenizer of {where} has no pad, EOS or unk token to pad with; fix: add a pad token "
                     "(tokenizer.pad_token = ...; tokenizer.save_pretrained(dir))")


def text_prefix(tokenizer) -> list[int]:
    """[BOS] when the tokenizer adds a BOS token to text on its own, else []."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return []
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    return [bos] if with_special[:1] == [bos] and plain[:1] != [bos] else []


def chat_template_name(tokenizer, model_dir: str | Path) -> str:
    """Where the tokenizer's chat template comes from and which family it looks like, e.g.
    "chat_template.jinja of /models/x (ChatML (Qwen), sha256 1a2b3c4d)"; '' when it has none."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return ""
    if isinstance(template, dict):  # several named templates: the default one renders
        template = template.get("default") or next(iter(template.values()))
    root = Path(model_dir)
    source = next((name for name in ("chat_template.jinja", "chat_template.json") if (root / name).is_file()),
                  "tokenizer_config.json 'chat_template'")
    family = next((name for marker, name in TEMPLATE_FAMILIES if marker in template), "a custom template")
    digest = hashlib.sha256(template.encode()).hexdigest()[:8]
    return f"{source} of {model_dir} ({family}, sha256 {digest})"


def say_once(text: str) -> None:
    """A line on the console, once per process (the console is what a run's user reads; inside a
    run the line also goes to logs/driver.log)."""
    if text in _said:
        return
    _said.add(text)
    from hybridflow.output import console

    console.say(text)
    if console.quiet():  # inside a run whose library output goes to logs/: driver.log keeps it too
        _log.info(text)
