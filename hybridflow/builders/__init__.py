"""Offline builders: a tiny model and tokenizer made from configs, never downloaded."""

from hybridflow.builders.tiny_model import build_char_tokenizer, build_tiny_model

__all__ = ["build_char_tokenizer", "build_tiny_model"]
