"""Text corpora for `recipe=pretrain`: a generated one by default, or text files, packed into
fixed-length token sequences.

The generated corpus mixes several skills in one character vocabulary, so that a tiny model
keeps learning for thousands of steps instead of saturating in minutes: arithmetic with
answers (1-3 digit add / sub / mul), counting, reversing and sorting, copying random strings,
and facts about a fixed random world of made-up entities (memorised, never inferable). A
document is several such sentences; documents are joined with EOS and cut into sequences of
`tokens_per_sequence` tokens (the usual pretraining packing: a sequence may start inside a
document). The held-out documents are drawn with another seed from the same world.

Files: `.jsonl` / `.parquet` with one document per row in `pretrain.text_column`.

Each training sequence is one row of a Batch in the layout every actor method takes: a one-
token prompt (BOS, or EOS where the tokenizer has no BOS) and the sequence as the "response",
so the SFT loss on the response is the causal-LM loss on every token of the sequence.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridflow.batch import Batch
from hybridflow.config.pretrain import GeneratedCorpusConfig, PretrainConfig  # noqa: F401 - the schema, torch-free


# ------------------------------------------------------------------------ the generated corpus

_NAME_LETTERS = string.ascii_lowercase
_COLORS = ["red", "blue", "green", "teal", "gold", "gray", "pink", "plum", "navy", "rust"]
_PLACES = ["oslo", "lima", "kiev", "rome", "bern", "doha", "riga", "baku", "suva", "apia", "male", "nuuk"]


def _world(entities: int, seed: int) -> list[tuple[str, str, str, int]]:
    """(name, color, place, number) per made-up entity; fixed by `seed`, shared by train and held-out text."""
    rng = random.Random(seed * 7919 + 17)
    names: set[str] = set()
    while len(names) < entities:
        names.add("".join(rng.choice(_NAME_LETTERS) for _ in range(rng.randint(4, 6))))
    return [(n, rng.choice(_COLORS), rng.choice(_PLACES), rng.randint(2, 99)) for n in sorted(names)]


def _number(rng: random.Random) -> int:
    digits = rng.randint(1, 3)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _sentence(rng: random.Random, world: list[tuple[str, str, str, int]]) -> str:
    kind = rng.randrange(7)
    if kind == 0:
        a, b, op = _number(rng), _number(rng), rng.choice("+-*")
        a, b = (a, b) if op != "-" or a >= b else (b, a)
        return f"{a}{op}{b}={a + b if op == '+' else a - b if op == '-' else a * b}."
    if kind == 1:
        start, length = rng.randint(0, 90), rng.randint(3, 8)
        return f"count {start} to {start + length - 1}: " + " ".join(str(start + i) for i in range(length)) + "."
    if kind == 2:
        word = "".join(rng.choice(_NAME_LETTERS) for _ in range(rng.randint(3, 8)))
        return f"reverse {word}: {word[::-1]}."
    if kind == 3:
        values = [rng.randint(0, 99) for _ in range(rng.randint(3, 6))]
        return "sort " + " ".join(map(str, values)) + ": " + " ".join(map(str, sorted(values))) + "."
    if kind == 4:
        word = "".join(rng.choice(_NAME_LETTERS + string.digits) for _ in range(rng.randint(3, 8)))
        return f"copy {word}: {word}."
    name, color, place, number = rng.choice(world)
    fact = rng.randrange(3)
    if fact == 0:
        return f"{name} is {color}."
    if fact == 1:
        return f"{name} lives in {place}."
    return f"{name} has {number} coins."


def generated_documents(count: int, *, world_entities: int, world_seed: int, seed: int) -> list[str]:
    """`count` documents of 3-8 sentences each; deterministic in (world_seed, seed)."""
    world = _world(world_entities, world_seed)
    rng = random.Random(seed * 1_000_003 + 5)
    return [" ".join(_sentence(rng, world) for _ in range(rng.randint(3, 8))) for _ in range(count)]


# ------------------------------------------------------------------------------- files


def read_documents(path: str | Path, column: str, key: str) -> list[str]:
    """The `column` text of every row of a .jsonl / .parquet file; a missing or non-text value is
    named by row."""
    from hybridflow.data.rows import iter_rows

    documents = []
    for i, row in enumerate(iter_rows(path)):
        text = row.get(column)
        if not isinstance(text, str):
            found = "no such column" if column not in row else f"a {type(text).__name__}"
            raise ValueError(f"{key}={str(path)!r}, row {i}: column {column!r} holds {found}, not text; set "
                             f"pretrain.text_column to the column with the documents (the row has {sorted(row)})")
        documents.append(text)
    if not documents:
        raise ValueError(f"{key}={str(path)!r} has no rows")
    return documents


# ------------------------------------------------------------------------------ packing


def pack_documents(documents: list[str], tokenizer, tokens_per_sequence: int) -> torch.Tensor:
    """(S, T) token ids: the documents' tokens, each followed by EOS, concatenated and cut into
    S = total // T sequences of T tokens (the ragged tail is dropped)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token; pretraining separates documents with it")
    ids: list[int] = []
    for tokens in tokenizer(documents, add_special_tokens=False)["input_ids"]:
        ids.extend(tokens)
        ids.append(eos)
    count = len(ids) // tokens_per_sequence
    return torch.tensor(ids[: count * tokens_per_sequence], dtype=torch.long).view(count, tokens_per_sequence)


def sequence_batch(sequences: torch.Tensor, start_token_id: int) -> Batch:
    """The actor's layout for (B, T) sequences: `prompt_ids` (B, 1) the start token, and the
    sequence as `response_ids` (B, T) with `response_mask` all True: loss on every token."""
    rows = sequences.shape[0]
    return Batch(tensors={
        "prompt_ids": torch.full((rows, 1), start_token_id, dtype=torch.long),
        "prompt_mask": torch.ones((rows, 1), dtype=torch.bool),
        "response_ids": sequences,
        "response_mask": torch.ones_like(sequences, dtype=torch.bool),
    })


@dataclass
class Corpus:
    train: torch.Tensor  # (S, T) packed training sequences
    val: torch.Tensor  # (V, T) packed held-out sequences
    start_token_id: int


def build_corpus(config: PretrainConfig, tokenizer) -> Corpus:
    """Read or generate the text, tokenize and pack it; checks that one step and the held-out set fit."""
    gen = config.generated
    if config.train_path is None:
        train_docs = generated_documents(gen.train_documents, world_entities=gen.world_entities,
                                         world_seed=gen.seed, seed=gen.seed)
        val_docs = generated_documents(gen.val_documents, world_entities=gen.world_entities,
                                       world_seed=gen.seed, seed=gen.seed + 1)
    else:
        train_docs = read_documents(config.train_path, config.text_column, "pretrain.train_path")
        val_docs = read_documents(config.val_path, config.text_column, "pretrain.val_path")
    train = pack_documents(train_docs, tokenizer, config.tokens_per_sequence)
    val = pack_documents(val_docs, tokenizer, config.tokens_per_sequence)[: config.val_sequences]
    source = "the generated corpus (pretrain.generated.train_documents)" if config.train_path is None \
        else f"pretrain.train_path={config.train_path!r}"
    if len(train) < config.sequences_per_step:
        raise ValueError(f"{source} packs into {len(train)} sequences of {config.tokens_per_sequence} tokens, fewer "
                         f"than pretrain.sequences_per_step={config.sequences_per_step}; add text or lower it")
    if len(val) < config.val_sequences:
        raise ValueError(f"the held-out text packs into {len(val)} sequences, fewer than pretrain.val_sequences="
                         f"{config.val_sequences}; lower it, or add held-out documents")
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    return Corpus(train=train, val=val, start_token_id=start)
