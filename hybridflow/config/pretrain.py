"""The `pretrain.*` config schema (`recipe=pretrain`'s corpus): plain dataclasses, importable
without torch, so the config schema and the `hybridflow` command's checks stay cheap to import.
The corpus itself is hybridflow/data/corpus.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


def _require(ok: bool, key: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"config {key}={value!r} is invalid: {allowed}")


@dataclass
class GeneratedCorpusConfig:
    train_documents: int = 20000  # ~150 characters each: ~3M tokens, more than a few thousand steps read
    val_documents: int = 400
    world_entities: int = 300  # facts to memorise: 3 per entity
    seed: int = 0  # the world and the training documents; held-out documents use seed + 1

    def __post_init__(self) -> None:
        _require(self.train_documents >= 1 and self.val_documents >= 1, "pretrain.generated.train/val_documents",
                 (self.train_documents, self.val_documents), "must be >= 1")
        _require(self.world_entities >= 1, "pretrain.generated.world_entities", self.world_entities, "must be >= 1")


@dataclass
class PretrainConfig:
    """What `recipe=pretrain` reads: the corpus, how it is cut, and how much of it one step takes."""

    train_path: Optional[str] = None  # .jsonl / .parquet, one document per row; null: the generated corpus
    val_path: Optional[str] = None
    text_column: str = "text"
    generated: GeneratedCorpusConfig = field(default_factory=GeneratedCorpusConfig)
    tokens_per_sequence: int = 64
    sequences_per_step: int = 32  # global, over the actor's ranks
    val_sequences: int = 64  # held-out sequences scored at each validation (at most what the held-out text gives)

    def __post_init__(self) -> None:
        _require((self.train_path is None) == (self.val_path is None), "pretrain.train_path/val_path",
                 (self.train_path, self.val_path), "set both to .jsonl/.parquet files, or leave both null for the "
                 "generated corpus")
        _require(self.tokens_per_sequence >= 2, "pretrain.tokens_per_sequence", self.tokens_per_sequence, "must be >= 2")
        _require(self.sequences_per_step >= 1, "pretrain.sequences_per_step", self.sequences_per_step, "must be >= 1")
        _require(self.val_sequences >= 1, "pretrain.val_sequences", self.val_sequences, "must be >= 1")
