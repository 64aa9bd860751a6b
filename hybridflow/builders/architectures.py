"""Tiny random models of real architectures with a trained byte-level BPE tokenizer, built offline.

A researcher's first run is a Hugging Face checkpoint with a BPE tokenizer and a chat template,
not our Qwen2 with its character tokenizer. These builders give tests and docs that shape without
a download: a `transformers` config of the architecture at hidden size 128 and 2 layers (head_dim
32: vLLM's CPU attention refuses 16), random weights, and a byte-level BPE tokenizer trained here
on generated arithmetic and chat text, with special tokens and a chat template.

    build_tiny_architecture("phi3", "/tmp/phi3")  # a Hugging Face directory vLLM and transformers load
"""

from __future__ import annotations

import json
import random
from pathlib import Path

BPE_VOCAB_SIZE = 384  # bytes (256) + merges: enough that "37+45=" is a few tokens
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 128, 2, 4, 2, 256  # head_dim 32
# Dropout would make the actor's forward differ from vLLM's (train mode): off here, whatever the
# architecture's default, so a test of these models isolates the weight sync.
NO_DROPOUT = {"attention_dropout": 0.0, "hidden_dropout": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
              "attn_pdrop": 0.0}


def _decoder(config_class, **extra):
    common = dict(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512)
    return lambda: config_class(**{**common, **extra})


def _configs() -> dict:
    import transformers as tf

    return {
        "llama": _decoder(tf.LlamaConfig),
        "qwen3": _decoder(tf.Qwen3Config, head_dim=HIDDEN // HEADS),
        "mistral": _decoder(tf.MistralConfig, sliding_window=None),
        "gemma2": _decoder(tf.Gemma2Config, head_dim=HIDDEN // HEADS, query_pre_attn_scalar=HIDDEN // HEADS),
        "phi3": _decoder(tf.Phi3Config, num_key_value_heads=HEADS),  # qkv_proj and gate_up_proj fused
        "olmo2": _decoder(tf.Olmo2Config),
        "gpt2": lambda: tf.GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=INTERMEDIATE,
                                      n_positions=512),  # Conv1D weights, stored transposed
        "qwen3_moe": _decoder(tf.Qwen3MoeConfig, head_dim=HIDDEN // HEADS, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=64, decoder_sparse_step=1, norm_topk_prob=True),
    }


ARCHITECTURES = ("llama", "qwen3", "mistral", "gemma2", "phi3", "olmo2", "gpt2", "qwen3_moe")


def corpus(lines: int = 2000, seed: int = 0) -> list[str]:
    """Generated training text for the tokenizer: arithmetic prompts and answers, chat-rendered."""
    rng = random.Random(seed)
    words = ["What", "is", "the", "sum", "of", "and", "answer", "Compute", "Please", "result"]
    out = []
    for _ in range(lines):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        out.append(f"{a}+{b}={a + b}")
        out.append(" ".join(rng.choice(words) for _ in range(rng.randint(2, 6))) + f" {a} {b}?")
    return out


def build_bpe_tokenizer(seed: int = 0):
    """A byte-level BPE fast tokenizer trained on `corpus()`, with <|pad|>/<|bos|>/<|eos|> and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(corpus(seed=seed), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", padding_side="left", clean_up_tokenization_spaces=False,
                                   chat_template=CHAT_TEMPLATE)


def build_tiny_architecture(architecture: str, output_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny random `architecture` model (one of ARCHITECTURES) and its BPE tokenizer to
    `output_dir`. Re-running with the same arguments reuses a complete directory."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    configs = _configs()
    if architecture not in configs:
        raise ValueError(f"unknown architecture {architecture!r}; known: {sorted(configs)}")
    output_dir = Path(output_dir)
    marker = output_dir / "hybridflow_tiny_architecture.json"
    wanted = json.dumps({"architecture": architecture, "seed": seed})
    if marker.exists() and marker.read_text() == wanted:
        return output_dir
    tokenizer = build_bpe_tokenizer(seed)
    config = configs[architecture]()
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    for key, value in {**NO_DROPOUT, **ids, "vocab_size": len(tokenizer), "torch_dtype": "float32"}.items():
        if key in NO_DROPOUT and not hasattr(config, key):
            continue
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    GenerationConfig(**ids).save_pretrained(output_dir)
    marker.write_text(wanted)
    return output_dir
