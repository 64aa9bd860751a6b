"""Batch operations the dataflow relies on."""

from __future__ import annotations

import pickle

import pytest
import torch

from hybridflow.batch import Batch


def make(n: int = 5) -> Batch:
    return Batch(
        tensors={"ids": torch.arange(n * 3).reshape(n, 3), "score": torch.arange(n, dtype=torch.float32)},
        objects={"prompt": [f"p{i}" for i in range(n)]},
        meta={"temperature": 1.0},
    )


def test_sizes_must_agree():
    with pytest.raises(ValueError, match="disagree on the batch size"):
        Batch({"a": torch.zeros(3)}, {"b": [1, 2]})
    with pytest.raises(ValueError, match="scalar"):
        Batch({"a": torch.tensor(1.0)})


def test_select_and_missing_key():
    b = make().select(["ids", "prompt"])
    assert b.keys() == ["ids", "prompt"] and b.meta == {"temperature": 1.0}
    with pytest.raises(KeyError, match="no key.*'nope'"):
        make().select(["nope"])


@pytest.mark.parametrize("n,parts", [(6, 2), (5, 2), (7, 3), (1, 4)])
def test_pad_chunk_concat_unpad_round_trip(n, parts):
    b = make(n)
    padded, pad = b.pad_to_multiple(parts)
    assert len(padded) % parts == 0 and pad == (-n) % parts
    chunks = padded.chunk(parts)
    assert len({len(c) for c in chunks}) == 1
    back = Batch.concat(chunks).unpad(pad)
    assert torch.equal(back["ids"], b["ids"]) and back["prompt"] == b["prompt"]
    # pad rows are copies of real rows, so computing on them is well-defined
    assert torch.equal(padded["ids"][n:], b["ids"][torch.arange(pad) % n])


def test_chunk_refuses_uneven():
    with pytest.raises(ValueError, match="pad_to_multiple"):
        make(5).chunk(2)


def test_union_merges_and_refuses_conflicts():
    a = make(3).select(["ids"])
    b = Batch({"ids": a["ids"].clone(), "values": torch.ones(3)}, meta={"step": 1})
    u = a.union(b)
    assert set(u.keys()) == {"ids", "values"} and u.meta == {"temperature": 1.0, "step": 1}
    with pytest.raises(ValueError, match="tensor 'ids' differs"):
        a.union(Batch({"ids": a["ids"] + 1}))
    with pytest.raises(ValueError, match="meta 'temperature'"):
        make(3).union(Batch({"x": torch.zeros(3)}, meta={"temperature": 0.5}))


def test_repeat_interleave_and_reorder():
    b = make(2).repeat_interleave(3)
    assert b["prompt"] == ["p0", "p0", "p0", "p1", "p1", "p1"]
    assert b["score"].tolist() == [0, 0, 0, 1, 1, 1]
    r = make(4).reorder([3, 1, 0, 2])
    assert r["prompt"] == ["p3", "p1", "p0", "p2"] and r["score"].tolist() == [3, 1, 0, 2]
    with pytest.raises(IndexError):
        make(2).index([5])


def test_concat_refuses_different_keys():
    with pytest.raises(ValueError, match="batch 1 has keys"):
        Batch.concat([make(2), make(2).select(["ids"])])


def test_pickles_without_copying_views():
    b = make(4)
    view = b.slice(1, 3)
    restored = pickle.loads(pickle.dumps(view, protocol=5))
    assert torch.equal(restored["ids"], b["ids"][1:3]) and restored["prompt"] == ["p1", "p2"]
    assert restored["ids"].is_contiguous()


def test_a_batch_through_json_comes_back_bit_for_bit():
    import json

    from hybridflow.batch import from_json, to_json

    torch.manual_seed(0)
    batch = Batch({"lp": torch.randn(3, 4), "ids": torch.randint(0, 9, (3, 4)), "mask": torch.rand(3, 4) > 0.5,
                   "bf": torch.randn(3).bfloat16()}, {"prompt": ["a", "b", "c"]}, {"step": 2})
    back = from_json(json.loads(json.dumps(to_json(batch))))
    for k, v in batch.tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    assert back.objects == batch.objects and back.meta == batch.meta
