"""Fault injection on a run directory (no Ray): a corrupt fault truncates the newest complete
checkpoint's largest file once, and the checkpoint's own check then names that file."""

from __future__ import annotations

import pytest

from hybridflow.config import compose
from hybridflow.run.faults import inject_faults


def test_corrupt_fault_truncates_the_newest_complete_checkpoint_once(tmp_path, capsys):
    for step, complete in [(1, True), (2, True), (3, False)]:
        directory = tmp_path / "checkpoints" / f"step_{step:08d}" / "actor"
        directory.mkdir(parents=True)
        (directory / "__0_0.distcp").write_bytes(b"x" * 1000)
        (directory / "small.pt").write_bytes(b"y" * 10)
        if complete:
            (directory.parent / "COMPLETE").write_text("")
    config = compose(["trainer.fault_injection=[{kind:corrupt,step:4}]"])
    inject_faults(config, 3, {}, tmp_path)  # not its step
    newest = tmp_path / "checkpoints" / "step_00000002" / "actor" / "__0_0.distcp"
    assert newest.stat().st_size == 1000
    inject_faults(config, 4, {}, tmp_path)
    assert newest.stat().st_size == 500  # step 3 is incomplete: step 2 is the newest checkpoint
    assert (tmp_path / "checkpoints" / "step_00000001" / "actor" / "__0_0.distcp").stat().st_size == 1000
    assert "truncated" in capsys.readouterr().out
    inject_faults(config, 4, {}, tmp_path)  # the step run again after a restart: fired already
    assert newest.stat().st_size == 500


def test_fault_config_is_checked_before_anything_starts():
    with pytest.raises(ValueError, match="trainer.fault_injection"):
        compose(["trainer.fault_injection=[{kind:melt,step:2}]"])
    with pytest.raises(ValueError, match="kind=hang needs the worker method"):
        compose(["trainer.fault_injection=[{kind:hang,role:rollout,step:2}]"])


def test_a_worker_killed_for_memory_is_named_as_such():
    from hybridflow.controller.memory import memory_kill

    ray_text = ("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
                "detail: Task was killed due to the node running low on memory. Memory on the node (IP: 10.0.0.2) "
                "where the task was running was 22.80GB / 23.50GB (0.97), which exceeds the memory usage threshold "
                "of 0.95.")
    assert memory_kill(ray_text).startswith("killed for memory: Ray's memory monitor")
    assert "actor.gradient_checkpointing" in memory_kill(ray_text)
    assert "out-of-memory killer" in memory_kill("Worker exit detail: the process was killed by SIGKILL")
    assert memory_kill("the actor died because of an error raised in its creation task") is None
