"""Two real processes (gloo) training a tiny Qwen2 with FSDP2: resume is exact, the HF export loads.

Uninterrupted run: train 2 steps, save (training state + HF export) into a checkpoint that the
test commits like the driver would, train a 3rd step. Resumed run, in fresh processes: build
the model from the initial weights, seed differently, load the checkpoint, train one step.
The 3rd step's loss and the parameters after it must equal the uninterrupted run's bit for
bit. Each step draws its data from python `random`, numpy and torch, and the model uses
attention dropout, so every RNG state has to be restored for the results to match.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridflow.builders import build_tiny_model
from hybridflow.config.schema import TinyModelConfig
from hybridflow.checkpoint import CheckpointManager

WORLD_SIZE = 2
SPEC = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, max_position_embeddings=64)
PROBE = torch.arange(4, 20).reshape(2, 8)  # fixed input for comparing logits, (B=2, T=8)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(model_dir: str):
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attention_dropout=0.2, attn_implementation="eager")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def _train_step(model, optimizer, scheduler) -> float:
    length = random.randint(6, 10)  # python RNG
    offset = int(np.random.randint(0, 8))  # numpy RNG
    input_ids = (torch.randint(4, 60, (2, length)) + offset)  # torch RNG, (B=2, T)
    model.train()
    loss = model(input_ids=input_ids, labels=input_ids).loss  # attention dropout: torch RNG
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _probe_logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=PROBE).logits


def _run(rank: int, port: int, model_dir: str, phase: str, ckpt_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from hybridflow.checkpoint import export_hf_model, load_training_state, save_training_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        seed = 1000 + rank if phase == "uninterrupted" else 7  # the resumed run must not depend on its seed
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        model, optimizer, scheduler = _build(model_dir)
        out: dict = {}
        if phase == "uninterrupted":
            out["losses"] = [_train_step(model, optimizer, scheduler) for _ in range(2)]
            save_training_state(Path(ckpt_dir) / "actor", model=model, optimizer=optimizer, scheduler=scheduler,
                                rank=rank, extra={"rank": rank})
            export_hf_model(Path(ckpt_dir) / "hf", model=model, tokenizer_source_dir=model_dir, rank=rank)
            out["probe_logits"] = _probe_logits(model)
        else:
            out["extra"] = load_training_state(Path(ckpt_dir) / "actor", model=model, optimizer=optimizer,
                                               scheduler=scheduler, rank=rank)
        out["next_loss"] = _train_step(model, optimizer, scheduler)
        out["params"] = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        torch.save(out, Path(out_dir) / f"{phase}_rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _spawn(*args) -> None:
    """Start WORLD_SIZE processes of their own, forked from the test process's forkserver (tests/ranks.py):
    each group of ranks starts in well under a second."""
    from tests.ranks import start_ranks

    start_ranks(_run, (_free_port(), *args), WORLD_SIZE, [__name__])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Run the uninterrupted training once; commit its checkpoint as the driver would."""
    root = tmp_path_factory.mktemp("fsdp")
    model_dir = build_tiny_model(root / "base", SPEC)
    manager = CheckpointManager(root / "run")
    tmp = manager.begin(2)
    _spawn(str(model_dir), "uninterrupted", str(tmp), str(root))
    manager.commit(tmp, 2, {"data_position": {"epoch": 0, "index": 4}})
    outs = [torch.load(root / f"uninterrupted_rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]
    return root, model_dir, manager, outs


def test_resume_matches_uninterrupted_run_exactly(uninterrupted):
    root, model_dir, manager, expected = uninterrupted
    step, path = manager.latest()
    assert step == 2 and manager.load_trainer_state(path)["data_position"] == {"epoch": 0, "index": 4}
    _spawn(str(model_dir), "resumed", str(path), str(root))
    got = [torch.load(root / f"resumed_rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]
    assert expected[0]["next_loss"] != expected[1]["next_loss"]  # ranks drew different data
    for rank in range(WORLD_SIZE):
        assert got[rank]["extra"] == {"rank": rank}
        assert got[rank]["next_loss"] == expected[rank]["next_loss"], rank
    params, want = got[0]["params"], expected[0]["params"]
    assert params.keys() == want.keys()
    for key in want:
        assert torch.equal(params[key], want[key]), key


def test_hf_export_loads_with_transformers_and_matches_fsdp_logits(uninterrupted):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, model_dir, manager, expected = uninterrupted
    hf_dir = manager.latest()[1] / "hf"
    model, info = AutoModelForCausalLM.from_pretrained(hf_dir, output_loading_info=True)
    assert info["missing_keys"] == set() or not info["missing_keys"], info
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.config.architectures == ["Qwen2ForCausalLM"] and model.config.tie_word_embeddings
    with safe_open(hf_dir / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: transformers rebuilds it from embed_tokens
    assert AutoTokenizer.from_pretrained(hf_dir).decode([PROBE[0, 0].item()]) == \
        AutoTokenizer.from_pretrained(model_dir).decode([PROBE[0, 0].item()])
    assert (hf_dir / "generation_config.json").is_file()
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=PROBE).logits
    torch.testing.assert_close(logits, expected[0]["probe_logits"], atol=1e-5, rtol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    assert not torch.equal(base.model.embed_tokens.weight, model.model.embed_tokens.weight)  # trained weights
