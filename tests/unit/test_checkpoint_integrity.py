"""Checkpoint integrity: the manifest of checksums, what verification catches, and saves that crash.

Faults injected here: a truncated DCP shard, a flipped byte, a process SIGKILLed in the middle of
writing a shard and in the middle of writing an RNG file, and a full disk (ENOSPC) during a save.
In every case the previous checkpoint still verifies and loads the exact weights it saved.
"""

from __future__ import annotations

import errno
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hybridflow.checkpoint import (CheckpointCorrupt, CheckpointError, CheckpointManager, load_training_state,
                                   save_training_state)
from hybridflow.checkpoint import files as files_module
from hybridflow.checkpoint.integrity import digest_file


def _training(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(8, 16)).pow(2).mean().backward()
    optimizer.step()
    return model, optimizer


def _save(manager: CheckpointManager, step: int, model, optimizer):
    tmp = manager.begin(step)
    try:
        save_training_state(tmp / "actor", model=model, optimizer=optimizer, rank=0, extra={"step": step})
        (tmp / "hf").mkdir()
        (tmp / "hf" / "config.json").write_text("{}")
        return manager.commit(tmp, step, {"loader": {"index": step}})
    except BaseException:
        manager.abort(tmp)
        raise


def _loads_exactly(path, model) -> bool:
    fresh, optimizer = _training(seed=99)
    load_training_state(path / "actor", model=fresh, optimizer=optimizer, rank=0)
    return all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_manifest_records_every_file_with_the_writers_digests(tmp_path):
    manager = CheckpointManager(tmp_path)
    model, optimizer = _training(0)
    path = _save(manager, 1, model, optimizer)
    manifest = json.loads((path / "MANIFEST.json").read_text())
    on_disk = sorted(p.relative_to(path).as_posix() for p in path.rglob("*")
                     if p.is_file() and p.name not in ("MANIFEST.json", "COMPLETE"))
    assert sorted(manifest["files"]) == on_disk
    assert {"actor/__0_0.distcp", "actor/.metadata", "actor/rng_rank0.pt", "trainer_state.json"} <= set(on_disk)
    assert not list(path.rglob(".checksums-*"))  # the writers' sidecars are folded in and removed
    for name, value in manifest["files"].items():
        assert value == {"bytes": (path / name).stat().st_size, "sha256": digest_file(path / name)}, name
    assert manager.verify(path) == sum(v["bytes"] for n, v in manifest["files"].items() if not n.startswith("hf/"))


def test_truncated_or_altered_shard_is_named(tmp_path):
    manager = CheckpointManager(tmp_path)
    model, optimizer = _training(0)
    path = _save(manager, 1, model, optimizer)
    shard = path / "actor" / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    with pytest.raises(CheckpointCorrupt, match=rf"truncated or missing files: {shard} \({len(data) - 100} bytes, "
                                                rf"{len(data)} when saved\)"):
        manager.verify(path)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointCorrupt, match=rf"{shard} is corrupt \(its sha256 differs"):
        manager.verify(path)
    (path / "MANIFEST.json").write_text('{"files": ')
    with pytest.raises(CheckpointCorrupt, match="MANIFEST.json: cannot be read as JSON"):
        manager.verify(path)


def test_a_checkpoint_without_manifest_is_loaded_unverified(tmp_path, caplog):
    manager = CheckpointManager(tmp_path)
    model, optimizer = _training(0)
    path = _save(manager, 1, model, optimizer)
    (path / "MANIFEST.json").unlink()  # as saved before manifests existed
    assert manager.resumable() == [(1, path)] and manager.verify(path) == 0
    assert "not verified" in caplog.text


def test_disk_full_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path, keep_last=1)
    model, optimizer = _training(0)
    first = _save(manager, 1, model, optimizer)
    real_write = files_module.atomic_write_bytes

    def disk_full(path, data):
        if path.name.startswith("rng_rank"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_write(path, data)

    monkeypatch.setattr(files_module, "atomic_write_bytes", disk_full)
    later, later_optimizer = _training(1)
    with pytest.raises(OSError, match="No space left"):
        _save(manager, 2, later, later_optimizer)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001"]  # nothing half-made
    assert manager.resumable() == [(1, first)] and manager.verify(first) > 0
    assert _loads_exactly(first, model)


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    import torch
    import torch.distributed.checkpoint as dcp
    from hybridflow.checkpoint import files
    sys.path.insert(0, sys.argv[3])
    from test_checkpoint_integrity import CheckpointManager, _save, _training

    run_dir, where = sys.argv[1], sys.argv[2]
    real_dcp_save, real_write = dcp.save, files.atomic_write_bytes

    def die_in_shard(state, checkpoint_id, **options):  # the shard half on disk, no .metadata: a kill mid-write
        real_dcp_save(state, checkpoint_id=checkpoint_id, **options)
        shard = Path(checkpoint_id) / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        (Path(checkpoint_id) / ".metadata").unlink()
        os.kill(os.getpid(), signal.SIGKILL)

    def die_in_rng_file(path, data):  # half the bytes written to the temporary name, then killed
        if not path.name.startswith("rng_rank"):
            return real_write(path, data)
        with open(path.with_name("." + path.name + ".tmp-x"), "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    if where == "shard":
        dcp.save = die_in_shard  # save_training_state imports DCP where it saves: it calls this one
    else:
        files.atomic_write_bytes = die_in_rng_file
    model, optimizer = _training(1)
    _save(CheckpointManager(run_dir, keep_last=1), 2, model, optimizer)
""")


@pytest.mark.parametrize("where", ["shard", "rng_file"])
def test_killed_during_save_the_previous_checkpoint_loads(tmp_path, where):
    manager = CheckpointManager(tmp_path, keep_last=1)
    model, optimizer = _training(0)
    first = _save(manager, 1, model, optimizer)
    here = str(Path(__file__).parent)  # the script imports this module's helpers
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(tmp_path), where, here], capture_output=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-3000:]
    leftovers = [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".step_00000002.tmp-")]
    assert len(leftovers) == 1  # the interrupted save, never mistaken for a checkpoint
    assert manager.latest(clean_stale=True) == (1, first) and not leftovers[0].exists()
    assert manager.resumable() == [(1, first)] and manager.verify(first) > 0
    assert _loads_exactly(first, model)


def test_commit_refuses_a_file_changed_after_its_writer_hashed_it(tmp_path):
    manager = CheckpointManager(tmp_path, required=())
    model, optimizer = _training(0)
    tmp = manager.begin(1)
    save_training_state(tmp / "actor", model=model, optimizer=optimizer, rank=0)
    with open(tmp / "actor" / "rng_rank0.pt", "ab") as f:
        f.write(b"appended by someone else")
    with pytest.raises(CheckpointError, match="rng_rank0.pt: .* bytes, but its writer recorded"):
        manager.commit(tmp, 1, {})
