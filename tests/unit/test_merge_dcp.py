"""FSDP2 training states (torch.distributed.checkpoint) as merge inputs, from real checkpoints.

Fresh processes (gloo; world sizes 2 and 1) train a tiny Qwen2 wrapped with `fully_shard` and
save with `hybridflow.checkpoint.save_training_state`, as the actor does, plus the full state
dict of each checkpoint for reference. The run layout (2 ranks):

    run/checkpoints/step_00000001/  COMPLETE  actor/ (DCP)  hf/ (export_hf_model)
    run/checkpoints/step_00000002/  COMPLETE  actor/ (DCP)

The reader must give every model tensor in full under its Hugging Face name, one at a time
and without a process group; merging two DCP checkpoints must equal merging their full state
dicts, and the result must load with transformers.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
from pathlib import Path

import pytest
import torch

from hybridflow.builders import build_tiny_model
from hybridflow.config.schema import TinyModelConfig
from hybridflow.merge import DcpCheckpoint, MergeError, last_checkpoints, merge_checkpoints, open_checkpoint
from hybridflow.merge.checkpoints import SafetensorsCheckpoint
from hybridflow.merge.cli import main

SPEC = TinyModelConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, max_position_embeddings=32)
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _save_run(rank: int, port: int, world_size: int, model_dir: str, run_dir: str, steps: list[int],
              export_steps: list[int], peft_dir: str) -> None:
    """Train one step before each checkpoint; save it as the actor worker and the driver do."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from hybridflow.checkpoint import export_hf_model, save_training_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(rank)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in steps:
            input_ids = torch.randint(4, 60, (2, 8))  # (B=2, T=8), different on each rank
            model(input_ids=input_ids, labels=input_ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step_dir = Path(run_dir) / "checkpoints" / f"step_{step:08d}"
            save_training_state(step_dir / "actor", model=model, optimizer=optimizer, rank=rank)
            if step in export_steps:
                export_hf_model(step_dir / "hf", model=model, tokenizer_source_dir=model_dir, rank=rank)
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            dist.barrier()
            if rank == 0:
                torch.save(full, step_dir / "full_state.pt")
                (step_dir / "COMPLETE").write_text("{}\n")
        if peft_dir:  # a LoRA run's training state: only the adapter factors are trainable
            from peft import LoraConfig, get_peft_model

            lora = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                                  LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
            fully_shard(lora)
            trainable = [p for p in lora.parameters() if p.requires_grad]
            save_training_state(peft_dir, model=lora, optimizer=torch.optim.AdamW(trainable), rank=rank)
    finally:
        dist.destroy_process_group()


# Imported once by the forkserver (in parallel with the test process's own imports), so the
# ranks fork with everything loaded and start in well under a second.
PRELOAD = ["transformers", "transformers.models.auto.modeling_auto", "transformers.models.qwen2.modeling_qwen2",
           "torch.distributed.fsdp", "torch.distributed.checkpoint", "hybridflow.checkpoint", "peft", __name__]


def _start_forkserver() -> None:
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()


def _spawn(world_size: int, *args) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(_save_run, args=(_free_port(), world_size, *args), nprocs=world_size, join=True,
                       start_method="forkserver")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    _start_forkserver()  # its imports overlap the model build below
    root = tmp_path_factory.mktemp("dcp")
    model_dir = build_tiny_model(root / "base", SPEC)
    _spawn(2, str(model_dir), str(root / "run"), [1, 2], [1], "")
    _spawn(1, str(model_dir), str(root / "run1"), [1], [], str(root / "peft_actor"))
    return root, model_dir


def step_dir(root: Path, step: int, run: str = "run") -> Path:
    return root / run / "checkpoints" / f"step_{step:08d}"


def hf_reference(step: Path) -> dict[str, torch.Tensor]:
    """The full state dict under HF names: the config ties lm_head to the embedding, so it is not a weight."""
    full = torch.load(step / "full_state.pt", weights_only=True)
    assert torch.equal(full[HEAD], full[EMBED])
    return {k: v for k, v in full.items() if k != HEAD}


@pytest.mark.parametrize("run, world_size", [("run", 2), ("run1", 1)])
def test_reader_gives_full_tensors_under_hf_names(runs, run, world_size):
    root, model_dir = runs
    step = step_dir(root, 1, run)
    want = hf_reference(step)
    ckpt = open_checkpoint(step / "actor", base=open_checkpoint(model_dir))  # run1 has no hf/: config from the base
    assert isinstance(ckpt, DcpCheckpoint)
    assert sorted(ckpt.keys()) == sorted(want)  # no "model." / optimizer / FSDP prefixes, lm_head tied away
    assert len(list((step / "actor").glob("*.distcp"))) == world_size
    for key, tensor in want.items():
        assert ckpt.shape(key) == tuple(tensor.shape) and ckpt.dtype(key) == tensor.dtype
        assert torch.equal(ckpt.read(key), tensor), key


def test_dcp_and_hf_export_of_one_step_read_the_same(runs):
    root, _ = runs
    dcp, hf = open_checkpoint(step_dir(root, 1) / "actor"), open_checkpoint(step_dir(root, 1) / "hf")
    assert sorted(dcp.keys()) == sorted(hf.keys())
    assert all(torch.equal(dcp.read(k), hf.read(k)) for k in hf.keys())
    assert dcp.files_to_copy() == hf.files_to_copy() and not dcp.uses_base  # config and tokenizer from hf/


def test_step_dir_resolves_to_hf_else_actor(runs, tmp_path):
    root, model_dir = runs
    assert isinstance(open_checkpoint(step_dir(root, 1)), SafetensorsCheckpoint)
    assert open_checkpoint(step_dir(root, 1)).path == step_dir(root, 1) / "hf"
    second = open_checkpoint(step_dir(root, 2), base=open_checkpoint(model_dir))
    assert isinstance(second, DcpCheckpoint) and second.path == step_dir(root, 2) / "actor" and second.uses_base
    assert last_checkpoints(root / "run", 2) == [step_dir(root, 1) / "hf", step_dir(root, 2) / "actor"]
    incomplete = tmp_path / "step_00000009"
    shutil.copytree(step_dir(root, 2) / "actor", incomplete / "actor")
    with pytest.raises(MergeError, match="step_00000009 has no COMPLETE file"):
        open_checkpoint(incomplete)


def test_sma_of_dcp_checkpoints_equals_sma_of_full_state_dicts(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    root, model_dir = runs
    a, b = hf_reference(step_dir(root, 1)), hf_reference(step_dir(root, 2))
    # step 2 has no hf/ beside its actor/: config.json and the tokenizer come from the base model
    out = merge_checkpoints([step_dir(root, 1) / "actor", step_dir(root, 2) / "actor"], tmp_path / "out", "sma",
                            base=model_dir)
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    merged = model.state_dict()
    for key in a:
        torch.testing.assert_close(merged[key], (a[key] + b[key]) / 2, rtol=0, atol=1e-6)
    assert torch.equal(merged[HEAD], merged[EMBED])
    record = json.loads((out / "merge_provenance.json").read_text())
    assert [i["step"] for i in record["inputs"]] == [1, 2]
    for item in record["inputs"]:
        for file, digest in item["sha256"].items():
            assert digest == hashlib.sha256(Path(file).read_bytes()).hexdigest(), file
    # the CLI on the run (step 1 read from hf/, step 2 from actor/) writes the same tensors
    assert main(["--method", "sma", "--output", str(tmp_path / "cli"), "--base", str(model_dir),
                 "--last", "2", str(root / "run")]) == 0
    again = open_checkpoint(tmp_path / "cli")
    assert all(torch.equal(again.read(k), merged[k]) for k in a)


def test_dcp_without_config_source_is_refused_before_writing(runs, tmp_path):
    root, _ = runs
    with pytest.raises(MergeError, match=r"holds no config.json .* pass the model the run started from"):
        merge_checkpoints([step_dir(root, 1) / "actor", step_dir(root, 2) / "actor"], tmp_path / "out", "sma")
    assert list(tmp_path.iterdir()) == []


def test_lora_training_state_is_refused(runs):
    root, _ = runs
    with pytest.raises(MergeError, match=r"holds LoRA adapter tensors .* merge the step's hf/ export"):
        open_checkpoint(root / "peft_actor")


def test_damaged_checkpoints_are_refused_naming_the_file(runs, tmp_path):
    root, model_dir = runs
    base = open_checkpoint(model_dir)
    broken = tmp_path / "actor"
    shutil.copytree(step_dir(root, 2) / "actor", broken)
    shard = broken / "__0_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(bytes(size))  # zeros: the right length, unreadable content
    ckpt = open_checkpoint(broken, base=base)
    with pytest.raises(MergeError, match=r"actor: reading 'model\.model\.embed_tokens\.weight' failed \(.*\); a "
                                         r"shard file is truncated or corrupt"):
        ckpt.read(EMBED)
    shard.write_bytes(bytes(100))
    with pytest.raises(MergeError, match=rf"shorter than .metadata says: \['__0_0.distcp \(100 of {size} bytes\)'\]"):
        open_checkpoint(broken, base=base)
    (broken / "__1_0.distcp").unlink()
    with pytest.raises(MergeError, match=r"the shard files \['__1_0.distcp'\] listed in .metadata are missing"):
        open_checkpoint(broken, base=base)
    (broken / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(MergeError, match=r"actor/.metadata: cannot be read"):
        open_checkpoint(broken, base=base)
    (broken / ".metadata").unlink()
    with pytest.raises(MergeError, match="has no .metadata file"):
        open_checkpoint(broken, base=base)
