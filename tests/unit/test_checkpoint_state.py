"""RNG capture/restore, and the training state in one process (no process group): round trip and errors."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from hybridflow.checkpoint import (CheckpointError, capture_rng_state, load_training_state, restore_rng_state,
                                   save_training_state)


def _draw() -> tuple:
    return (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.normal(),
            torch.rand(4).tolist(), torch.randint(0, 1000, (3,)).tolist())


def test_rng_round_trip_through_json():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in python's and numpy's states
    np.random.normal()
    state = json.loads(json.dumps(capture_rng_state()))  # the driver keeps it in trainer_state.json
    expected = _draw()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng_state(state)
    assert _draw() == expected


def test_rng_restore_rejects_foreign_state():
    with pytest.raises(CheckpointError, match="rng_rank3.pt: expected an RNG state with keys"):
        restore_rng_state({"python": [3, [], None]}, source="rng_rank3.pt")


def _tiny_training(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def _step(model, optimizer, scheduler) -> float:
    x = torch.randn(16, 4)  # a random draw and dropout: the RNG state decides the result
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return loss.item()


def test_single_process_round_trip(tmp_path):
    model, optimizer, scheduler = _tiny_training()
    for _ in range(2):
        _step(model, optimizer, scheduler)
    save_training_state(tmp_path / "actor", model=model, optimizer=optimizer, scheduler=scheduler, rank=0,
                        extra={"kl_coef": 0.25})
    expected_loss = _step(model, optimizer, scheduler)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    model, optimizer, scheduler = _tiny_training(seed=7)  # other weights and RNG: all must be restored
    extra = load_training_state(tmp_path / "actor", model=model, optimizer=optimizer, scheduler=scheduler, rank=0)
    assert extra == {"kl_coef": 0.25}
    assert scheduler.last_epoch == 2 and optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 3)
    assert _step(model, optimizer, scheduler) == expected_loss
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_one_rank_of_a_process_group_saves_and_loads_without_a_collective(tmp_path, monkeypatch):
    """DCP's plan exchange over gloo on a one-rank group exchanges nothing and slows every later CPU
    step (hybridflow/checkpoint/training_state.py): a rank alone in its group saves and loads with none."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("this process already has a process group")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    calls = []
    for name in ("gather_object", "all_gather_object", "scatter_object_list", "broadcast_object_list",
                 "all_reduce", "barrier", "gather", "all_gather", "broadcast"):
        monkeypatch.setattr(dist, name, lambda *a, _name=name, **k: calls.append(_name))
    try:
        model, optimizer, scheduler = _tiny_training()
        _step(model, optimizer, scheduler)
        save_training_state(tmp_path / "actor", model=model, optimizer=optimizer, scheduler=scheduler, rank=0)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        model, optimizer, scheduler = _tiny_training(seed=7)
        load_training_state(tmp_path / "actor", model=model, optimizer=optimizer, scheduler=scheduler, rank=0)
    finally:
        dist.destroy_process_group()
    assert calls == []
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_load_errors_name_path_and_fix(tmp_path):
    model, optimizer, scheduler = _tiny_training()
    directory = tmp_path / "actor"
    with pytest.raises(CheckpointError, match="actor does not exist; start without resume"):
        load_training_state(directory, model=model, optimizer=optimizer, rank=0)
    save_training_state(directory, model=model, optimizer=optimizer, rank=0)
    with pytest.raises(CheckpointError, match="saved without an LR scheduler"):
        load_training_state(directory, model=model, optimizer=optimizer, scheduler=scheduler, rank=0)
    (directory / "rng_rank0.pt").unlink()
    with pytest.raises(CheckpointError, match=r"actor is missing \['rng_rank0.pt'\]; start without resume, or "
                                              "point resume at a complete checkpoint"):
        load_training_state(directory, model=model, optimizer=optimizer, rank=0)
    # another rank count is not an error: tests/unit/test_resume_rank_count.py
    with pytest.raises(CheckpointError, match="rank=1 but torch.distributed is not initialised"):
        save_training_state(directory, model=model, optimizer=optimizer, rank=1)


def test_lora_round_trip_saves_only_trainable_weights(tmp_path):
    import peft
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from hybridflow.builders import build_tiny_model
    from hybridflow.config.schema import TinyModelConfig

    base_dir = build_tiny_model(tmp_path / "base", TinyModelConfig(hidden_size=32, intermediate_size=64,
                                                                   num_hidden_layers=1, num_attention_heads=2,
                                                                   num_key_value_heads=1, tie_word_embeddings=False))

    def build():
        model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir),
                                    peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)

    torch.manual_seed(0)
    model, optimizer = build()
    ids = torch.randint(4, 60, (2, 6))  # (B=2, T=6)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    save_training_state(tmp_path / "actor", model=model, optimizer=optimizer, rank=0)
    saved = dcp.FileSystemReader(tmp_path / "actor").read_metadata().state_dict_metadata
    assert {k for k in saved if k.startswith("model.")} == {
        "model.base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
        "model.base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"}
    expected = model(input_ids=ids, labels=ids).loss.item()
    torch.manual_seed(1)
    model, optimizer = build()  # same frozen base, other LoRA weights
    load_training_state(tmp_path / "actor", model=model, optimizer=optimizer, rank=0)
    assert model(input_ids=ids, labels=ids).loss.item() == expected


def test_commit_refuses_training_state_with_missing_or_short_files(tmp_path):
    from hybridflow.checkpoint import CheckpointManager

    manager = CheckpointManager(tmp_path, required=())
    model, optimizer, scheduler = _tiny_training()
    tmp = manager.begin(1)
    save_training_state(tmp / "actor", model=model, optimizer=optimizer, scheduler=scheduler, rank=0)
    shard = tmp / "actor" / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])  # a rank that did not finish writing
    with pytest.raises(CheckpointError, match=r"shard files \['__0_0.distcp'\] are missing or shorter"):
        manager.commit(tmp, 1, {})
    shard.write_bytes(data)
    (tmp / "actor" / "rng_rank0.pt").unlink()  # a rank that wrote onto another node's disk
    with pytest.raises(CheckpointError, match=r"missing \['rng_rank0.pt'\]; every rank must write into the same"):
        manager.commit(tmp, 1, {})
    assert manager.latest() is None
