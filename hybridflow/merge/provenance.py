"""Provenance of a merge: what went in (paths, content hashes, training steps), how it was
combined (method and parameters) and by which code.

Hashes are sha256 of each weight file (what `sha256sum` prints). They are fed by the merge's
own reads and computed on a worker thread (see InputHasher), so the inputs are read once and
the hashing overlaps the merge when a second core is free.
"""

from __future__ import annotations

import hashlib
import json
import queue
import re
import subprocess
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch

from hybridflow.merge.checkpoints import Checkpoint
from hybridflow.merge.methods import MergeParams

HASH_BLOCK_BYTES = 1024 * 1024  # measured: 1 MiB blocks hash as fast as 16 MiB ones
STEP_IN_PATH = re.compile(r"(?:^|[/\\])step_(\d+)(?=$|[/\\])")
STATE_FILES = ("hybridflow_state.json", "trainer_state.json")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(HASH_BLOCK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while got := handle.readinto(view):
            digest.update(view[:got])
    return digest.hexdigest()


class InputHasher:
    """sha256 of every input weight file, fed by the merge's own reads so each input is read once.

    A reader calls `feed(file, offset, data)` after each read. Data at or after the point the
    digest has reached is copied into a pooled buffer and hashed on a worker thread (hashlib
    releases the GIL, so it runs beside the merge); a gap before it (tensors the merge does
    not read from this input, e.g. integer buffers copied from the newest) is read from the
    file first; data before that point (re-reads) is ignored. `result()` reads and hashes
    whatever follows the last fed byte. When the merge reads a file front to back (the usual
    case: inputs written by the same code store tensors in the same order), almost no byte is
    read twice; at worst each byte is read twice, as with a separate sha256 pass.
    The pool bounds the memory to POOL_BUFFERS blocks.
    """

    POOL_BUFFERS = 8

    def __init__(self, files: list[Path]) -> None:
        self.files = list(dict.fromkeys(files))  # each file once, order kept
        self._digests = {f: hashlib.sha256() for f in self.files}
        self._next = {f: self._hash_header(f) for f in self.files}
        self._free: queue.Queue = queue.Queue()
        for _ in range(self.POOL_BUFFERS):
            self._free.put(bytearray(HASH_BLOCK_BYTES))
        self._work: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="merge-hash", daemon=True)
        self._thread.start()

    def _hash_header(self, path: Path) -> int:
        """Hash a safetensors header (the reads feed only tensor data); other files (DCP shards)
        are not fed by the reads and are hashed whole by `result()`."""
        if path.suffix != ".safetensors":
            return 0
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            header = handle.read(int.from_bytes(prefix, "little"))
        self._digests[path].update(prefix + header)
        return len(prefix) + len(header)

    def feed(self, file: Path, offset: int, data: torch.Tensor) -> None:
        """`data` (contiguous uint8) was just read from byte `offset` of `file`."""
        position = self._next.get(file)
        if position is None or offset < position:
            return  # not a hashed file, or bytes already hashed
        if offset > position:  # bytes the merge skips (tensors copied from another input): read them
            self._enqueue_from_file(file, position, offset)
        view = memoryview(data.numpy())
        for start in range(0, len(view), HASH_BLOCK_BYTES):
            piece = view[start:start + HASH_BLOCK_BYTES]
            buffer = self._free.get()  # waits while the worker is POOL_BUFFERS blocks behind
            buffer[: len(piece)] = piece
            self._work.put((file, buffer, len(piece)))
        self._next[file] = offset + len(view)

    def _enqueue_from_file(self, file: Path, start: int, end: int) -> None:
        with open(file, "rb", buffering=0) as handle:
            handle.seek(start)
            while start < end:
                buffer = self._free.get()
                got = handle.readinto(memoryview(buffer)[: min(HASH_BLOCK_BYTES, end - start)])
                if not got:
                    self._free.put(buffer)
                    return
                self._work.put((file, buffer, got))
                start += got

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            file, buffer, size = item
            self._digests[file].update(memoryview(buffer)[:size])
            self._free.put(buffer)

    def close(self) -> None:
        """Stop the worker (idempotent); `result()` calls it."""
        if self._thread.is_alive():
            self._work.put(None)
            self._thread.join()

    def result(self) -> dict[Path, str]:
        self.close()
        buffer = bytearray(HASH_BLOCK_BYTES)
        view = memoryview(buffer)
        for path in self.files:
            with open(path, "rb", buffering=0) as handle:
                handle.seek(self._next[path])
                while got := handle.readinto(view):
                    self._digests[path].update(view[:got])
        return {path: digest.hexdigest() for path, digest in self._digests.items()}


def training_step(path: Path) -> Optional[int]:
    """The training step of a checkpoint: `step_<N>` in its path, else the `step` /
    `global_step` of a hybridflow_state.json or trainer_state.json in it or its parent."""
    match = None
    for match in STEP_IN_PATH.finditer(str(path.resolve())):
        pass
    if match is not None:
        return int(match.group(1))
    for folder in (path, path.parent):
        for name in STATE_FILES:
            state_file = folder / name
            if state_file.is_file():
                try:
                    state = json.loads(state_file.read_text())
                except (OSError, json.JSONDecodeError):
                    continue
                for field in ("step", "global_step"):
                    if isinstance(state.get(field), int):
                        return state[field]
    return None


def code_version() -> dict[str, Optional[str]]:
    """The hybridflow package version and, when run from a git checkout, the commit."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        package = version("hybridflow")
    except PackageNotFoundError:  # run from a source tree that is not installed
        import hybridflow

        package = getattr(hybridflow, "__version__", None)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                                text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"hybridflow": package, "git_commit": commit}


def describe_checkpoint(checkpoint: Checkpoint, digests: dict[Path, str]) -> dict:
    return {
        "path": str(checkpoint.path.resolve()),
        "format": type(checkpoint).__name__,
        "step": training_step(checkpoint.path),
        "sha256": {str(f.resolve()): digests.get(f, "not computed") for f in checkpoint.weight_files()},
    }


def build_provenance(method: str, params: MergeParams, inputs: list[Checkpoint], base: Optional[Checkpoint],
                     dtype: Optional[str], weights: Optional[tuple[float, ...]], digests: dict[Path, str]) -> dict:
    """The record stored in merge_provenance.json and in the safetensors metadata."""
    return {
        "method": method,
        "params": asdict(params),
        "effective_weights": list(weights) if weights is not None else None,
        "inputs": [describe_checkpoint(c, digests) for c in inputs],
        "base": describe_checkpoint(base, digests) if base is not None else None,
        "dtype": dtype,
        "code": code_version(),
        "created_unix_s": round(time.time(), 3),
    }


def safetensors_metadata(provenance: Optional[dict]) -> dict[str, str]:
    """`__metadata__` values must be strings; "format": "pt" is what transformers expects."""
    metadata = {"format": "pt"}
    if provenance is not None:
        metadata["hybridflow_merge"] = json.dumps(provenance, sort_keys=True, separators=(",", ":"))
    return metadata
