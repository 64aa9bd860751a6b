"""Start-up without the whole model on any rank's device (hybridflow/training/fsdp.py): rank 0 reads the
checkpoint into host memory and moves its model to the meta device, the other ranks build theirs there,
and every rank receives its shards tensor by tensor (`shard_model`: no `model.to(device)` of the whole
model on any rank, recorded below; on a GPU rank 0 once held the whole model and its state dict there).
Two gloo ranks on the CPU, each rank's peak resident memory during `ActorWorker.start` measured
(Linux's VmHWM, reset before the start) on a ~130M-parameter model (0.5 GB in float32)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

from hybridflow.config.schema import TinyModelConfig

SPEC = TinyModelConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=8, max_position_embeddings=64)


def _start(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    # the libraries the start imports on first use (transformers' model classes, FSDP, DCP's state-dict API):
    # their modules' memory is not the weights'
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    from hybridflow.config.schema import ActorConfig, HybridFlowConfig, OptimConfig
    from hybridflow.controller import WorkerContext
    from hybridflow.controller.memory import read_and_reset
    from recipes.roles import actor_role
    from hybridflow.run.stage import prepare_stage

    torch.set_num_threads(1)
    moves, to = [], torch.nn.Module.to

    def recorded_to(module, *args, **kwargs):  # where the whole model is moved (its root class only)
        if type(module).__name__.endswith("ForCausalLM"):
            moves.append(str(args[0] if args else kwargs.get("device")))
        return to(module, *args, **kwargs)

    torch.nn.Module.to = recorded_to
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        config = HybridFlowConfig(actor=ActorConfig(optim=OptimConfig(lr=1e-4), samples_per_micro_batch=2))
        actor = actor_role(prepare_stage(config).config, model_dir).build(WorkerContext(rank=rank, world_size=2))
        before = read_and_reset(use_gpu=False)["rss_bytes"]
        actor.start()
        peak = read_and_reset(use_gpu=False)["rss_peak_bytes"]
        local = {n: p.to_local() for n, p in actor.model.named_parameters()}
        full = {n: p.full_tensor() for n, p in actor.model.named_parameters()}  # collective
        buffers = {n: b.clone() for n, b in actor.model.named_buffers()}
        Path(out_dir, f"{rank}.json").write_text(json.dumps({
            "growth_bytes": peak - before, "moves": moves,
            "local_bytes": sum(t.numel() * t.element_size() for t in local.values())}))
        torch.save({"full": full, "buffers": buffers}, Path(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def large_model_dir(tmp_path_factory) -> Path:
    from hybridflow.builders import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("large") / "model", SPEC)


def test_only_rank_0_holds_the_whole_model_at_start_and_every_rank_gets_its_weights(large_model_dir, tmp_path):
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_start, args=(port, str(large_model_dir), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    reports = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    model = AutoModelForCausalLM.from_pretrained(large_model_dir, dtype=torch.float32)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model_bytes > 4e8
    # rank 1 never holds the whole model: its shards (half) and the transfer's buffers, not a copy
    assert reports[1]["growth_bytes"] < 0.8 * model_bytes, (reports, model_bytes)
    assert reports[1]["local_bytes"] == pytest.approx(model_bytes / 2, rel=0.05)
    assert reports[0]["growth_bytes"] > 0.9 * model_bytes  # rank 0 reads the checkpoint, into host memory
    assert [r["moves"] for r in reports] == [["meta"], []]  # and no rank moves the whole model to its device
    # every rank holds the checkpoint's weights and rank 0's buffers (the rotary table is not in a state dict)
    expected = dict(model.named_parameters())
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"{rank}.pt")
        for name, tensor in saved["full"].items():
            torch.testing.assert_close(tensor, expected[name].detach(), atol=0, rtol=0, msg=name)
        for name, buffer in saved["buffers"].items():
            torch.testing.assert_close(buffer, dict(model.named_buffers())[name], msg=name)
