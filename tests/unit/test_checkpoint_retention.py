"""The runner's Checkpointer: retention (full state for the last K, weights-only snapshots for
the merge window), resume from the newest sound checkpoint (corrupt ones skipped or stopping),
and the pipeline telling each stage how many snapshots the next stage's merge hook reads.

Worker groups are stood in for by one in-process rank that makes the same calls as the actor
(`TrainingStateMixin.save_checkpoint` / `load_checkpoint`, `export_hf`).
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hybridflow.checkpoint import CheckpointCorrupt, load_training_state, save_training_state
from hybridflow.checkpoint import files as files_module
from hybridflow.config import ConfigError, compose
from hybridflow.merge import merge_checkpoints
from hybridflow.merge.checkpoints import last_checkpoints, open_checkpoint
from hybridflow.merge.hooks import HookConfig, checkpoints_needed
from hybridflow.run.runner import Checkpointer


class OneRankActor:
    """The checkpoint calls of an actor worker group, on one in-process rank."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(8, 8)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.updates = 0

    def train_step(self) -> None:
        self.model(torch.randn(4, 8)).pow(2).mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.updates += 1

    def save_checkpoint(self, directory: str) -> None:
        save_training_state(directory, model=self.model, optimizer=self.optimizer, rank=0,
                            extra={"updates": self.updates})

    def load_checkpoint(self, directory: str) -> None:
        self.updates = load_training_state(directory, model=self.model, optimizer=self.optimizer, rank=0)["updates"]

    def export_hf(self, directory: str, tokenizer_source_dir: str) -> str:
        Path(directory).mkdir()
        save_file({k: v.contiguous() for k, v in self.model.state_dict().items()}, f"{directory}/model.safetensors")
        Path(directory, "config.json").write_text('{"model_type": "linear"}')
        return directory


def _config(*overrides: str):
    return compose(["recipe=sft", "trainer.resume=true", *overrides])


def _train(run_dir: Path, steps: range, config, actor: OneRankActor | None = None) -> tuple[OneRankActor, dict]:
    """Steps with a checkpoint after each; returns the actor and its weights after every step."""
    actor = actor or OneRankActor(seed=0)
    checkpointer = Checkpointer(config, run_dir, run_dir, {"actor": actor})
    weights = {}
    for step in steps:
        actor.train_step()
        weights[step] = {k: v.clone() for k, v in actor.model.state_dict().items()}
        checkpointer.save(step, {"loader": {"index": step}})
    return actor, weights


def _resume(run_dir: Path, config) -> tuple[OneRankActor, dict | None]:
    actor = OneRankActor(seed=1)  # other weights: the checkpoint must replace them
    return actor, Checkpointer(config, run_dir, run_dir, {"actor": actor}).resume()


def _equal(model: torch.nn.Module, weights: dict) -> bool:
    return all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_full_state_for_the_last_two_weights_for_the_merge_window_resume_and_merge(tmp_path):
    config = _config("trainer.keep_last_checkpoints=2", "trainer.keep_last_weights=4")
    _, weights = _train(tmp_path, range(1, 9), config)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [f"step_{s:08d}" for s in (5, 6, 7, 8)]
    for step in (5, 6):  # weights-only snapshots: no optimizer, RNG or data position of the workers
        assert sorted(p.name for p in (root / f"step_{step:08d}").iterdir()) == [
            "COMPLETE", "MANIFEST.json", "hf", "trainer_state.json"]
    for step in (7, 8):
        assert (root / f"step_{step:08d}" / "actor" / "__0_0.distcp").is_file()

    actor, state = _resume(tmp_path, config)
    assert state["step"] == 8 and state["loader"] == {"index": 8} and actor.updates == 8
    assert _equal(actor.model, weights[8])

    inputs = last_checkpoints(tmp_path, 4)  # the PMA window reads the snapshots' hf/
    assert [p.parent.name for p in inputs] == [f"step_{s:08d}" for s in (5, 6, 7, 8)]
    merged = open_checkpoint(merge_checkpoints(inputs, tmp_path / "merged", "sma"))
    expected = torch.stack([weights[s]["weight"] for s in (5, 6, 7, 8)]).mean(0)
    assert torch.allclose(merged.read("weight"), expected, atol=1e-6)


def test_truncated_shard_is_named_and_the_previous_checkpoint_used(tmp_path, capsys):
    config = _config("trainer.keep_last_checkpoints=2", "trainer.keep_last_weights=0")
    _train(tmp_path, range(1, 4), config)
    shard = tmp_path / "checkpoints" / "step_00000003" / "actor" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-64])

    stopping = _config("trainer.keep_last_checkpoints=2", "trainer.keep_last_weights=0",
                       "trainer.on_corrupt_checkpoint=stop")
    with pytest.raises(CheckpointCorrupt, match=rf"{shard} \(.* bytes, .* when saved\).*on_corrupt_checkpoint=stop"):
        _resume(tmp_path, stopping)
    assert shard.is_file()  # stopping touches nothing

    actor, state = _resume(tmp_path, config)
    out = capsys.readouterr().out
    assert str(shard) in out and "trying the checkpoint before it" in out
    assert state["step"] == 2 and actor.updates == 2 and "resumed from" in out
    root = tmp_path / "checkpoints"
    assert [p.name for p in root.iterdir() if p.name.startswith("corrupt-step_00000003-")]  # kept for inspection
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_00000002"]

    _train(tmp_path, range(3, 5), config, actor)  # the run goes on from step 2 and saves again
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_00000003", "step_00000004"]
    assert _resume(tmp_path, config)[1]["step"] == 4


def test_every_full_checkpoint_corrupt_is_an_error_not_a_fresh_start(tmp_path):
    config = _config("trainer.keep_last_checkpoints=1")
    _train(tmp_path, range(1, 3), config)
    (tmp_path / "checkpoints" / "step_00000002" / "actor" / "rng_rank0.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointCorrupt, match="every checkpoint with a full training state is corrupt"):
        _resume(tmp_path, config)


def test_disk_full_during_a_save_leaves_the_previous_checkpoint_resumable(tmp_path, monkeypatch):
    config = _config("trainer.keep_last_checkpoints=1", "trainer.keep_last_weights=0")
    actor, weights = _train(tmp_path, range(1, 3), config)
    real_write = files_module.atomic_write_bytes

    def disk_full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(files_module, "atomic_write_bytes", disk_full)
    with pytest.raises(OSError, match="No space left"):
        _train(tmp_path, range(3, 4), config, actor)
    monkeypatch.setattr(files_module, "atomic_write_bytes", real_write)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002"]
    resumed, state = _resume(tmp_path, config)
    assert state["step"] == 2 and _equal(resumed.model, weights[2])


def test_stage_hooks_state_their_window_and_the_pipeline_passes_it_on(tmp_path):
    from recipes.pipeline import _retention, check_stages

    assert checkpoints_needed(HookConfig("pma_sma", {"last": 4})) == 4
    assert checkpoints_needed(HookConfig("pma_ema", {"last": 3, "alpha": 0.5})) == 3
    assert checkpoints_needed(HookConfig("last_checkpoint")) == 1
    assert checkpoints_needed(HookConfig("final_model")) == 0
    assert checkpoints_needed(HookConfig("recipes.pipeline:run")) is None  # says nothing: keep every snapshot

    config = compose(["recipe=pipeline"])  # the default pipeline: SFT -> SMA of the last 4 -> GRPO
    assert _retention(config, 0) == ["trainer.keep_last_weights=4"]
    assert _retention(config, 1) == ["trainer.keep_last_weights=null"]
    check_stages(config, tmp_path)
    config.pipeline.stages[0].overrides.append("trainer.keep_last_weights=2")
    with pytest.raises(ConfigError, match=r"stages\[0\] \(sft\) keeps the weights of its last 2 checkpoints.*"
                                          r"'pma_sma' reads 4.*trainer.keep_last_weights=4"):
        check_stages(config, tmp_path)
    config.pipeline.stages[0].overrides[-1] = "trainer.keep_last_weights=6"  # more than needed is allowed
    check_stages(config, tmp_path)


def test_retention_settings_are_checked():
    for override, message in [("trainer.keep_last_checkpoints=0", "keep_last_checkpoints=0 is invalid"),
                              ("trainer.keep_last_weights=-1", "keep_last_weights=-1 is invalid"),
                              ("trainer.on_corrupt_checkpoint=ignore", r"one of \['previous', 'stop'\]")]:
        with pytest.raises(Exception, match=message):
            compose([override])
    trainer = compose([]).trainer
    assert (trainer.keep_last_checkpoints, trainer.keep_last_weights, trainer.on_corrupt_checkpoint) == (
        2, None, "previous")
