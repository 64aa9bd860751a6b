"""CheckpointManager: the atomic save protocol, finding the latest checkpoint, pruning, errors."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hybridflow.checkpoint import CheckpointError, CheckpointManager, config_hash, read_trainer_state
from hybridflow.checkpoint import manager as manager_module


def _save(manager: CheckpointManager, step: int, **state) -> Path:
    """What the driver does: begin, the workers write into the temporary dir, commit."""
    tmp = manager.begin(step)
    (tmp / "hf").mkdir()
    (tmp / "hf" / "config.json").write_text("{}")
    (tmp / "actor").mkdir()
    (tmp / "actor" / "weights").write_text(f"step {step}")
    return manager.commit(tmp, step, {"data_position": {"epoch": 0, "index": step * 4}, **state})


def test_commit_writes_layout_and_latest_finds_it(tmp_path):
    manager = CheckpointManager(tmp_path)
    assert manager.latest() is None and manager.all_complete() == []
    path = _save(manager, 2, metrics={"loss": 1.5})
    assert path == tmp_path / "checkpoints" / "step_00000002"
    assert (path / "COMPLETE").is_file() and (path / "actor" / "weights").read_text() == "step 2"
    assert manager.latest() == (2, path)
    state = manager.load_trainer_state(path)
    assert state["step"] == 2 and state["data_position"] == {"epoch": 0, "index": 8}
    assert state["metrics"] == {"loss": 1.5} and isinstance(state["saved_at"], float)
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


def test_crash_before_commit_keeps_previous_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path)
    first = _save(manager, 1)
    tmp = manager.begin(2)  # workers wrote, then the driver died: no commit
    (tmp / "hf").mkdir()
    (tmp / "hf" / "config.json").write_text("{}")
    assert manager.latest() == (1, first)
    assert manager.latest(clean_stale=True) == (1, first)
    assert not tmp.exists()


def test_step_dir_without_complete_is_ignored_and_replaced(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path)
    first = _save(manager, 1)
    real_write = manager_module.atomic_write_text

    def crash_on_marker(path, text):
        if path.name == "COMPLETE":
            raise KeyboardInterrupt("killed between rename and COMPLETE")
        real_write(path, text)

    monkeypatch.setattr(manager_module, "atomic_write_text", crash_on_marker)
    with pytest.raises(KeyboardInterrupt):
        _save(manager, 2)
    monkeypatch.setattr(manager_module, "atomic_write_text", real_write)
    half = tmp_path / "checkpoints" / "step_00000002"
    assert half.is_dir() and not (half / "COMPLETE").exists()
    assert manager.latest() == (1, first)
    assert [s for s, _ in manager.all_complete()] == [1]
    with pytest.raises(CheckpointError, match="no COMPLETE file.*start without resume"):
        manager.load_trainer_state(half)
    (half / "actor" / "stale_file").write_text("from the crashed save")
    again = _save(manager, 2)  # the same step saved again replaces the incomplete directory
    assert again == half and (again / "COMPLETE").is_file()
    assert not (again / "actor" / "stale_file").exists()
    assert manager.latest() == (2, again)


CRASH_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from hybridflow.checkpoint import CheckpointManager
    from hybridflow.checkpoint import manager as manager_module
    run_dir, where = sys.argv[1], sys.argv[2]
    manager = CheckpointManager(run_dir)
    tmp = manager.begin(5)
    (tmp / "hf").mkdir()
    (tmp / "hf" / "config.json").write_text("{}")
    if where == "before_commit":
        os.kill(os.getpid(), signal.SIGKILL)
    real = manager_module.os.rename
    def rename_then_die(src, dst):
        real(src, dst)
        os.kill(os.getpid(), signal.SIGKILL)
    manager_module.os.rename = rename_then_die
    manager.commit(tmp, 5, {})
""")


@pytest.mark.parametrize("where", ["before_commit", "after_rename"])
def test_killed_process_never_leaves_a_complete_looking_checkpoint(tmp_path, where):
    manager = CheckpointManager(tmp_path)
    first = _save(manager, 4)
    proc = subprocess.run([sys.executable, "-c", CRASH_SCRIPT, str(tmp_path), where], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert manager.latest() == (4, first)
    leftovers = manager.clean_stale()
    assert len(leftovers) == 1 and not leftovers[0].exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000004"]


def test_keep_last_prunes_oldest(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2, keep_weights=0)
    for step in (1, 2, 3, 4):
        _save(manager, step)
    assert [s for s, _ in manager.all_complete()] == [3, 4]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000003", "step_00000004"]
    with pytest.raises(CheckpointError, match="keep_last=0"):
        CheckpointManager(tmp_path, keep_last=0)
    with pytest.raises(CheckpointError, match="keep_weights=-1"):
        CheckpointManager(tmp_path, keep_weights=-1)


def test_older_checkpoints_become_weights_only_snapshots(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2, keep_weights=4)
    for step in range(1, 7):
        _save(manager, step)
    root = tmp_path / "checkpoints"
    assert [s for s, _ in manager.all_complete()] == [3, 4, 5, 6]  # steps 1 and 2 are outside both windows
    assert [s for s, _ in manager.resumable()] == [5, 6]
    for step in (3, 4):
        snapshot = root / f"step_{step:08d}"
        assert sorted(p.name for p in snapshot.iterdir()) == ["COMPLETE", "MANIFEST.json", "hf", "trainer_state.json"]
        manifest = json.loads((snapshot / "MANIFEST.json").read_text())
        assert manifest["full_state"] is False and not any(name.startswith("actor/") for name in manifest["files"])
        assert manager.verify(snapshot, include_weights=True) > 0  # what is left still matches its checksums
    for step in (5, 6):
        assert (root / f"step_{step:08d}" / "actor" / "weights").is_file()
        assert json.loads((root / f"step_{step:08d}" / "MANIFEST.json").read_text())["full_state"] is True


def test_weights_kept_for_every_checkpoint_by_default_and_a_half_stripped_one_is_finished(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=1)
    for step in (1, 2, 3):
        _save(manager, step)
    assert [s for s, _ in manager.all_complete()] == [1, 2, 3] and [s for s, _ in manager.resumable()] == [3]
    # A crash while stripping step 1: its manifest says weights-only, its actor/ is still there.
    (tmp_path / "checkpoints" / "step_00000001" / "actor").mkdir()
    (tmp_path / "checkpoints" / "step_00000001" / "actor" / "weights").write_text("left over")
    assert [s for s, _ in manager.resumable()] == [3]  # the manifest, not the directory, decides
    _save(manager, 4)
    assert not (tmp_path / "checkpoints" / "step_00000001" / "actor").exists()


def test_keep_last_one_never_deletes_newest(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=1, keep_weights=0)
    _save(manager, 10)
    newest = _save(manager, 20)
    assert manager.all_complete() == [(20, newest)]
    # A run resumed from an earlier step: the checkpoint just saved is kept, and so is the newest.
    fifteen = _save(manager, 15)
    assert manager.all_complete() == [(15, fifteen), (20, newest)]
    assert manager.discard_after(15) == [newest]
    assert manager.latest() == (15, fifteen)


def test_truncated_trainer_state_names_file_and_fix(tmp_path):
    manager = CheckpointManager(tmp_path)
    path = _save(manager, 3)
    text = (path / "trainer_state.json").read_text()
    (path / "trainer_state.json").write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match=r"trainer_state\.json: cannot be read as JSON.*truncated.*"
                                              r"start without resume"):
        manager.load_trainer_state(path)
    (path / "trainer_state.json").unlink()
    with pytest.raises(CheckpointError, match="missing trainer_state.json"):
        read_trainer_state(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        read_trainer_state(tmp_path / "nowhere")


def test_config_hash_mismatch_is_reported(tmp_path):
    manager = CheckpointManager(tmp_path)
    saved = config_hash({"lr": 1e-5, "model": "tiny"})
    assert saved == config_hash({"model": "tiny", "lr": 1e-5})
    path = _save(manager, 1, config_hash=saved)
    assert read_trainer_state(path, config_hash=saved)["config_hash"] == saved
    other = config_hash({"lr": 2e-5, "model": "tiny"})
    with pytest.raises(CheckpointError, match=f"config hash '{saved}'.*hashes to '{other}'"):
        read_trainer_state(path, config_hash=other)


def test_commit_checks_inputs(tmp_path):
    manager = CheckpointManager(tmp_path)
    tmp = manager.begin(7)
    with pytest.raises(CheckpointError, match=r"did not write \['hf/config.json'\]"):
        manager.commit(tmp, 7, {})
    (tmp / "hf").mkdir()
    (tmp / "hf" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="not the directory begin"):
        manager.commit(tmp, 8, {})
    with pytest.raises(CheckpointError, match="not JSON-serialisable"):
        manager.commit(tmp, 7, {"metrics": {"loss": object()}})
    with pytest.raises(CheckpointError, match="must be a non-negative integer"):
        manager.begin(-1)
    manager.abort(tmp)
    assert not tmp.exists() and manager.latest() is None
    with pytest.raises(CheckpointError, match="not a temporary directory"):
        manager.abort(tmp_path)
    bare = CheckpointManager(tmp_path / "other", required=())
    done = bare.commit(bare.begin(0), 0, {"step": 0})
    assert json.loads((done / "trainer_state.json").read_text())["step"] == 0
