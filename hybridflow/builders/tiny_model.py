"""A tiny Qwen2-architecture causal LM and a character tokenizer, built offline.

Nothing can be downloaded at run time, so tests and the embedded default make their model
here: a `tokenizers` WordLevel model over single characters (every printable ASCII
character is one token, which makes arithmetic easy to learn) wrapped as a transformers
fast tokenizer, and a randomly initialised Qwen2 model from a `Qwen2Config`. Both are saved
into one Hugging Face directory that transformers and vLLM load like any other model.

Built once per machine: the first build of a spec goes to `cache_dir()/tiny/<key>` and every later
one copies those files (a few MB) into its directory. The key covers the spec, this file's source
and the torch and transformers versions, so a change to any of them builds anew. A build imports
the Qwen2 modeling code and writes the weights, 2-3 s on 2 cores that every run of the default
model paid on its driver before (the tests run it about a hundred times).
"""

from __future__ import annotations

import json
import os
import shutil
import string
from pathlib import Path

from hybridflow.config.schema import TinyModelConfig

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARACTERS = string.digits + "+-*/=()?., " + string.ascii_letters + ":;!'\"#%&<>[]_"
# Tool-call markers (hybridflow/agents): one token each, so a call and its result cost few tokens
# and a turn can stop on the closing tag's token id. Appended after the characters: the ids of
# every other token are unchanged.
MARKER_TOKENS = ["<calc>", "</calc>", "<result>", "</result>"]
# Braces, for JSON tool calls (Hermes' <tool_call>{"name": ..., "arguments": {...}}</tool_call>), with
# `model.tiny.json_characters`: appended after the markers, so that no earlier id moves. Off by default: the
# embeddings have rows past the tokenizer's tokens, which a random model samples now and then and which decode
# to nothing; ids turned into braces would change what such samples read, and every recorded result with them.
JSON_CHARACTERS = "{}"
# Chat prompts (verl's layout) render as "user: 3+4= assistant: ": only characters in the vocabulary.
# With tools (the OpenAI-compatible endpoint, hybridflow/agents/endpoint.py), Hermes' format, compactly:
# the tools' names first ("tools: calc; "), an assistant's calls after its content as
# <tool_call>{"name": "calc", "arguments": {"expr": "3+4"}}</tool_call>, a tool's result as "tool: 7 ".
CHAT_TEMPLATE = ("{% if tools %}tools: {% for t in tools %}{{ t['function']['name'] }}; {% endfor %}{% endif %}"
                 "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                 "{% for c in m['tool_calls'] or [] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
                 "\"arguments\": {% if c['function']['arguments'] is string %}{{ c['function']['arguments'] }}"
                 "{% else %}{{ c['function']['arguments'] | tojson }}{% endif %}}</tool_call>{% endfor %} {% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def tiny_vocab_size() -> int:
    """The tiny model's vocabulary: its tokenizer's tokens, rounded up to a multiple of 64 (tidy matmul shapes)."""
    tokens = len(SPECIAL_TOKENS) + len(dict.fromkeys(CHARACTERS)) + len(MARKER_TOKENS) + len(JSON_CHARACTERS)
    return ((tokens + 63) // 64) * 64


def build_char_tokenizer(json_characters: bool = False):
    """A transformers fast tokenizer with one token per character and <s>/</s>/<pad>; with
    `json_characters`, '{' and '}' too (after every other token)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(dict.fromkeys(CHARACTERS)) + MARKER_TOKENS
                                            + list(JSON_CHARACTERS if json_characters else ""))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_tokens([AddedToken(m, normalized=False) for m in MARKER_TOKENS])  # matched before the split
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_model(output_dir: str | Path, spec: TinyModelConfig | None = None) -> Path:
    """Write a tiny Qwen2 model and its tokenizer to `output_dir` (a Hugging Face directory);
    `spec` is the `model.tiny` config node (None: its defaults).

    Re-running with the same spec and seed reuses a complete directory and rebuilds a
    different or partial one.
    """
    spec = spec if spec is not None else TinyModelConfig()
    output_dir = Path(output_dir)
    marker = output_dir / "hybridflow_tiny_spec.json"
    wanted = json.dumps(spec.__dict__, sort_keys=True)
    if marker.exists() and marker.read_text() == wanted:
        return output_dir
    cached = _cached_build(spec, wanted)
    output_dir.mkdir(parents=True, exist_ok=True)
    for item in cached.iterdir():
        if item.name != marker.name:
            shutil.copy2(item, output_dir / item.name)
    marker.write_text(wanted)  # last: a directory with the marker is complete
    return output_dir


def _cached_build(spec: TinyModelConfig, wanted: str) -> Path:
    """The machine's one build of `spec` (see the module docstring), made now if missing. Built in a
    folder of its own and renamed into place, so two processes building at once both end complete."""
    import hashlib

    import torch
    import transformers

    from hybridflow.builders.gguf import cache_dir

    key = hashlib.sha256("\n".join([wanted, Path(__file__).read_text(), torch.__version__,
                                     transformers.__version__]).encode()).hexdigest()[:16]
    target = cache_dir() / "tiny" / key
    if (target / "hybridflow_tiny_spec.json").exists():
        return target
    building = target.parent / f".{key}.{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    _build(building, spec, wanted)
    try:
        building.rename(target)
    except OSError:  # another process put its complete build there first
        shutil.rmtree(building, ignore_errors=True)
    return target


def _build(output_dir: Path, spec: TinyModelConfig, wanted: str) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    marker = output_dir / "hybridflow_tiny_spec.json"
    tokenizer = build_char_tokenizer(spec.json_characters)
    vocab_size = tiny_vocab_size()
    assert vocab_size >= len(tokenizer), "every token of the tokenizer needs a row of the embeddings"
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_theta=10000.0,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config)
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(output_dir)
    marker.write_text(wanted)
