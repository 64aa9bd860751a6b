"""vLLM's layerwise reload warns "Failed to load weights" for a layer that received nothing. A
rotary embedding (only a computed, non-persistent buffer) and an lm_head tied to the embedding
receive nothing by design at every weight sync; `mark_layers_without_checkpoint_tensors` tells vLLM
so, and any other layer that received nothing still warns (vLLM's reload on a toy model, no engine)."""

from __future__ import annotations

import logging

import pytest
import torch


@pytest.fixture
def layerwise():
    """vLLM's reload module, imported by the test (not at collection: vLLM's import is seconds in every
    pytest-xdist worker, and most runs of this file's tier never need it)."""
    return pytest.importorskip("vllm.model_executor.model_loader.reload.layerwise")


class _Rotary(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.randn(4, 2), persistent=False)


class _Weight(torch.nn.Module):
    def __init__(self, weight: torch.nn.Parameter | None = None) -> None:
        super().__init__()
        self.weight = weight if weight is not None else torch.nn.Parameter(torch.zeros(8, 4), requires_grad=False)


class _Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rotary_emb, self.embed_tokens, self.other = _Rotary(), _Weight(), _Weight()
        self.lm_head = _Weight(self.embed_tokens.weight)  # tie_word_embeddings: the same Parameter


def test_only_layers_without_a_checkpoint_tensor_by_design_are_quiet(layerwise):
    from workers.rollout.vllm.transfer import mark_layers_without_checkpoint_tensors

    model = _Toy()
    embedding = model.embed_tokens.weight
    layerwise.record_metadata_for_reloading(model)
    layerwise.initialize_layerwise_reload(model)
    new = torch.arange(32.0).reshape(8, 4)
    model.embed_tokens.weight.weight_loader(model.embed_tokens.weight, new)  # the one checkpoint tensor sent

    assert sorted(mark_layers_without_checkpoint_tensors(model)) == ["lm_head", "rotary_emb"]
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(layerwise.__name__)
    logger.addHandler(handler)
    try:
        layerwise.finalize_layerwise_reload(model, model_config=None)
    finally:
        logger.removeHandler(handler)
    warned = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert warned == ["_Weight: Failed to load weights"]  # `other`: a real miss still warns
    # the embedding loaded in place, and the tied head is still the very same Parameter
    assert model.embed_tokens.weight is embedding and torch.equal(embedding, new)
    assert model.lm_head.weight is embedding
    assert model.rotary_emb.cos_sin_cache.shape == (4, 2)
