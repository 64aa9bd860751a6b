"""The driver's side of checkpointing: where checkpoints live, when one counts as complete.

Layout (fixed; `hybridflow.merge` reads it):

    RUN_DIR/checkpoints/step_<8-digit step>/      complete only if it holds COMPLETE
        COMPLETE                                  written last
        MANIFEST.json                             size and sha256 of every file (integrity.py)
        trainer_state.json                        the driver's state (step, data position, RNG, ...)
        hf/  actor/  critic/ ...                  written by the workers

Protocol. `begin(step)` makes `checkpoints/.step_<N>.tmp-<uuid>/`; every worker group writes
its part there; `commit` writes `trainer_state.json` and `MANIFEST.json`, fsyncs the whole
tree, renames the directory to `step_<N>` and only then writes `COMPLETE` (itself
atomically). A crash at any point leaves either a hidden temporary directory or a step
directory without `COMPLETE`; both are ignored by `latest()` and removed by `clean_stale()`,
and a later save of the same step replaces an incomplete `step_<N>`. Only one driver may
save into a run directory.

Retention. The newest `keep_last` checkpoints keep everything (enough to resume); older
ones within the newest `keep_weights` become weights-only snapshots (their `hf/` kept for
merges, the training state deleted, `full_state: false` in the manifest); the rest are
deleted. `resumable()` lists only checkpoints with their full state.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence

from hybridflow.checkpoint.errors import RESUME_FIX, CheckpointError
from hybridflow.checkpoint.files import atomic_write_text, fsync_dir, fsync_tree
from hybridflow.checkpoint.integrity import (MANIFEST, build_manifest, manifest_text, read_manifest, strip_manifest,
                                             verify_files)
from hybridflow.checkpoint.training_state import STATE_META, verify_training_state

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
STEP_DIR = re.compile(r"^step_(\d+)$")
HIDDEN_DIR = re.compile(r"^\.step_(\d+)\.(tmp|stale)-[0-9a-f]+$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


class CheckpointManager:
    """Begin, commit, abort, find, verify and prune the checkpoints of one run directory.

    After each commit: the newest `keep_last` complete checkpoints keep their full state
    (None: all do); of the older ones, those among the newest `keep_weights` keep only their
    `weights` parts (None: all older ones do; 0: none), and the rest are deleted.
    `required`: paths, relative to a checkpoint, that `commit` checks the workers wrote
    before declaring the checkpoint complete.
    """

    def __init__(self, run_dir: "str | os.PathLike[str]", keep_last: Optional[int] = None,
                 *, keep_weights: Optional[int] = None, weights: Sequence[str] = ("hf",),
                 required: Sequence[str] = ("hf/config.json",)) -> None:
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"keep_last={keep_last}: must be at least 1 (None keeps every checkpoint)")
        if keep_weights is not None and keep_weights < 0:
            raise CheckpointError(f"keep_weights={keep_weights}: must be at least 0 (None keeps the weights of "
                                  "every checkpoint)")
        self.run_dir = Path(run_dir).expanduser()
        self.root = self.run_dir / "checkpoints"
        self.keep_last, self.keep_weights = keep_last, keep_weights
        self.weights = tuple(weights)
        self.required = tuple(required)

    # ------------------------------------------------------------------------ saving

    def begin(self, step: int) -> Path:
        """A fresh temporary directory for the workers to write checkpoint `step` into."""
        _check_step(step)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp_dir = self.root / f".{step_dir_name(step)}.tmp-{uuid.uuid4().hex}"
        tmp_dir.mkdir()
        return tmp_dir

    def commit(self, tmp_dir: "str | os.PathLike[str]", step: int, trainer_state: dict[str, Any]) -> Path:
        """Declare what the workers wrote into `tmp_dir` checkpoint `step`; returns its directory.

        Every training state under `tmp_dir` is checked for all of its ranks' files first.
        `trainer_state` must be JSON-serialisable; `step` and `saved_at` (unix time) are added.
        """
        tmp_dir = self._own_tmp_dir(tmp_dir, step)
        missing = [name for name in self.required if not (tmp_dir / name).exists()]
        if missing:
            raise CheckpointError(f"{tmp_dir}: the workers did not write {missing}; the checkpoint of step {step} "
                                  "is not committed (call abort() and check the workers' save calls)")
        for meta in sorted(tmp_dir.glob(f"*/{STATE_META}")):
            verify_training_state(meta.parent)  # every rank's files, as seen from the driver
        if trainer_state.get("step", step) != step:
            raise CheckpointError(f"trainer_state['step']={trainer_state['step']} but the checkpoint is for "
                                  f"step {step}; pass the same step to both")
        state = {**trainer_state, "step": step, "saved_at": time.time()}
        try:
            text = json.dumps(state, indent=1, sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"trainer_state for step {step} is not JSON-serialisable ({exc}); "
                                  "convert tensors and numpy values to Python numbers or lists") from None
        atomic_write_text(tmp_dir / TRAINER_STATE, text)
        atomic_write_text(tmp_dir / MANIFEST, manifest_text(build_manifest(tmp_dir)))
        fsync_tree(tmp_dir)
        final = self.root / step_dir_name(step)
        self._move_aside(final)
        os.rename(tmp_dir, final)
        fsync_dir(self.root)
        atomic_write_text(final / COMPLETE, json.dumps({"step": step, "completed_at": time.time()}) + "\n")
        self._prune(keep=final)
        return final

    def abort(self, tmp_dir: "str | os.PathLike[str]") -> None:
        """Delete an uncommitted temporary directory (after a worker failed to save)."""
        tmp_dir = Path(tmp_dir)
        match = HIDDEN_DIR.match(tmp_dir.name)
        if tmp_dir.parent.resolve() != self.root.resolve() or not match or match.group(2) != "tmp":
            raise CheckpointError(f"abort({tmp_dir}): not a temporary directory made by begin() under {self.root}")
        shutil.rmtree(tmp_dir, ignore_errors=True)

    # ----------------------------------------------------------------------- finding

    def all_complete(self) -> list[tuple[int, Path]]:
        """Every complete checkpoint, oldest first."""
        return [(step, path) for step, path in self._step_dirs() if (path / COMPLETE).is_file()]

    def latest(self, *, clean_stale: bool = False) -> Optional[tuple[int, Path]]:
        """The newest complete checkpoint as (step, directory), or None.

        `clean_stale=True` first deletes what interrupted saves left behind (see `clean_stale`);
        use it when (re)starting a run, never while a save is in progress.
        """
        if clean_stale:
            self.clean_stale()
        complete = self.all_complete()
        return complete[-1] if complete else None

    def clean_stale(self) -> list[Path]:
        """Delete temporary directories and step directories without COMPLETE; returns them."""
        if not self.root.is_dir():
            return []
        stale = [p for p in self.root.iterdir() if p.is_dir() and HIDDEN_DIR.match(p.name)]
        stale += [path for _, path in self._step_dirs() if not (path / COMPLETE).is_file()]
        for path in stale:
            log.info("removing incomplete checkpoint directory %s", path)
            shutil.rmtree(path, ignore_errors=True)
        return stale

    def discard_after(self, step: int) -> list[Path]:
        """Delete every checkpoint of a later step than `step`; returns them.

        For a run resumed from a checkpoint older than the newest: the later ones belong to
        the abandoned continuation, and `latest()` and pruning would otherwise prefer them.
        """
        later = [path for s, path in self._step_dirs() if s > step]
        for path in later:
            _delete(path)
        return later

    def resumable(self) -> list[tuple[int, Path]]:
        """Every complete checkpoint that holds its full training state, oldest first (a
        checkpoint whose manifest cannot be read is listed, so that `verify` names the problem)."""
        return [(step, path) for step, path in self.all_complete() if self._full_state(path) is not False]

    def verify(self, path: "str | os.PathLike[str]", *, include_weights: bool = False) -> int:
        """Check the files of checkpoint `path` against its manifest; returns the bytes checked.

        Without `include_weights`, only what a resume loads (the training state and the
        driver's files, not the `weights` parts). Raises CheckpointCorrupt naming the file.
        A checkpoint saved before manifests existed is not checked (a warning says so).
        """
        path = Path(path)
        manifest = read_manifest(path)
        if manifest is None:
            log.warning("checkpoint %s has no %s (saved by an older version): its files are not verified", path,
                        MANIFEST)
            return 0
        parts = None if include_weights else {name.split("/", 1)[0] for name in manifest["files"]} - set(self.weights)
        return verify_files(path, manifest, parts)

    def quarantine(self, path: "str | os.PathLike[str]") -> Path:
        """Move a corrupt checkpoint out of the way (`corrupt-step_<N>-<uuid>`, ignored by every
        lookup and never deleted by the manager) so that it can be inspected; returns its new path."""
        path = Path(path)
        aside = self.root / f"corrupt-{path.name}-{uuid.uuid4().hex[:8]}"
        os.rename(path, aside)
        fsync_dir(self.root)
        return aside

    def load_trainer_state(self, path: "str | os.PathLike[str]", *, config_hash: Optional[str] = None) -> dict:
        """The trainer state of the complete checkpoint at `path` (a step directory)."""
        return read_trainer_state(path, config_hash=config_hash)

    # ---------------------------------------------------------------------- internals

    def _own_tmp_dir(self, tmp_dir: "str | os.PathLike[str]", step: int) -> Path:
        _check_step(step)
        tmp_dir = Path(tmp_dir)
        match = HIDDEN_DIR.match(tmp_dir.name)
        if (tmp_dir.parent.resolve() != self.root.resolve() or not match or match.group(2) != "tmp"
                or int(match.group(1)) != step):
            raise CheckpointError(f"commit({tmp_dir}, step={step}): not the directory begin({step}) returned "
                                  f"under {self.root}")
        if not tmp_dir.is_dir():
            raise CheckpointError(f"commit: {tmp_dir} does not exist (already committed or aborted?)")
        return tmp_dir

    def _step_dirs(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
        return sorted(found)

    def _move_aside(self, final: Path) -> None:
        """Free the name `final` for the new checkpoint.

        An existing directory there is incomplete (a crash between rename and COMPLETE), or a
        complete checkpoint from a run that resumed from an earlier step. Its COMPLETE goes
        first, so no crash from here on leaves a mix that looks complete.
        """
        if not final.exists():
            return
        if (final / COMPLETE).exists():
            log.warning("replacing complete checkpoint %s with a new save of the same step", final)
            (final / COMPLETE).unlink()
            fsync_dir(final)
        aside = self.root / f".{final.name}.stale-{uuid.uuid4().hex}"
        os.rename(final, aside)
        shutil.rmtree(aside, ignore_errors=True)

    def _prune(self, keep: Path) -> None:
        complete = [path for _, path in self.all_complete()]
        full = set(_newest(complete, self.keep_last)) | {keep}  # the checkpoint just committed stays whole
        weights = set(_newest(complete, self.keep_weights))
        for path in complete:
            if path in full:
                continue
            if (path in weights and any((path / part).is_dir() for part in self.weights)
                    and self._full_state(path) is not None):  # an unreadable manifest: deleted, not kept
                self._strip(path)
            else:
                _delete(path)

    def _strip(self, path: Path) -> None:
        """Make `path` a weights-only snapshot: the manifest says so first, so a crash midway
        leaves a snapshot that a resume skips; the next prune deletes what is left over."""
        state_parts = [p for p in path.iterdir() if p.is_dir() and p.name not in self.weights]
        if self._full_state(path) is False and not state_parts:
            return
        manifest = read_manifest(path) or build_manifest(path)
        atomic_write_text(path / MANIFEST, manifest_text(strip_manifest(manifest, self.weights)))
        for part in state_parts:
            shutil.rmtree(part, ignore_errors=True)

    def _full_state(self, path: Path) -> Optional[bool]:
        """True / False from the manifest; None when it cannot be read. Without a manifest (an
        older checkpoint): whether it holds a training-state directory."""
        try:
            manifest = read_manifest(path)
        except CheckpointError:
            return None
        if manifest is None:
            return any(p.is_dir() and p.name not in self.weights for p in path.iterdir())
        return bool(manifest.get("full_state", True))


def read_trainer_state(path: "str | os.PathLike[str]", *, config_hash: Optional[str] = None) -> dict:
    """Read `trainer_state.json` of a complete checkpoint, checking it is one.

    With `config_hash`, the hash recorded at save time must equal it.
    """
    path = Path(path).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist; {RESUME_FIX}")
    if not (path / COMPLETE).is_file():
        raise CheckpointError(f"checkpoint {path} has no {COMPLETE} file: its save was interrupted; {RESUME_FIX}")
    file = path / TRAINER_STATE
    try:
        state = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is missing {TRAINER_STATE}; {RESUME_FIX}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file}: cannot be read as JSON ({exc}); the file is truncated or corrupt; "
                              f"{RESUME_FIX}") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"{file}: expected a JSON object with an integer 'step'; {RESUME_FIX}")
    if config_hash is not None and state.get("config_hash") != config_hash:
        raise CheckpointError(f"{path}: was saved with config hash {state.get('config_hash')!r} but this run's "
                              f"config hashes to {config_hash!r}; resume with the config it was saved with, start "
                              "without resume, or point resume at a checkpoint saved with this config")
    return state


def config_hash(config: Any) -> str:
    """A stable short hash of a JSON-serialisable config (key order does not matter)."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _newest(paths: list[Path], count: Optional[int]) -> list[Path]:
    return list(paths) if count is None else paths[max(0, len(paths) - count):]


def _delete(path: Path) -> None:
    marker = path / COMPLETE
    if marker.exists():
        marker.unlink()  # from here on it is incomplete, whatever rmtree leaves behind
        fsync_dir(path)
    shutil.rmtree(path, ignore_errors=True)


def _check_step(step: int) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"checkpoint step {step!r}: must be a non-negative integer")
