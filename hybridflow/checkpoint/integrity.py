"""Checksums of a checkpoint's files: recorded at save, verified before a resume loads anything.

Every complete checkpoint holds `MANIFEST.json`, written by the driver's commit before the
checkpoint is declared complete:

    {"format": 1, "algorithm": "sha256", "full_state": true,
     "files": {"actor/__0_0.distcp": {"bytes": 1234, "sha256": "..."}, "hf/config.json": {...}, ...}}

Cost. The bytes are hashed by whoever writes them, where that is cheap: files written from
memory (RNG, scheduler, the driver's trainer state) are hashed from the bytes before they
go to disk; each rank hashes the DCP shard it just wrote (from the page cache, every rank in
parallel, the bulk of a training state). They leave their digests in a hidden sidecar
(`.checksums-rank<r>.json`) that the commit folds into the manifest and deletes; the commit
hashes only what no sidecar covers (the Hugging Face export, a custom worker's files).
Verification reads every file it checks once: sizes first (a truncated file fails without
hashing anything), then sha256.

`full_state: false` marks a weights-only snapshot (its training state was pruned; see
`CheckpointManager`): a merge reads it, a resume never does.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Optional

from hybridflow.checkpoint.errors import RESUME_FIX, CheckpointCorrupt, CheckpointError

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = 1
ALGORITHM = "sha256"
SIDECAR_PREFIX = ".checksums-"
BLOCK_BYTES = 8 * 2**20  # streaming read size: large enough to amortise syscalls, small in memory

Digests = dict[str, dict]  # relative path -> {"bytes": int, "sha256": hex}


def digest_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digest_file(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK_BYTES):
            sha.update(block)
    return sha.hexdigest()


def entry(size: int, sha256: str) -> dict:
    return {"bytes": size, ALGORITHM: sha256}


def sidecar_name(rank: int) -> str:
    return f"{SIDECAR_PREFIX}rank{rank}.json"


def build_manifest(root: Path, *, full_state: bool = True) -> dict:
    """The manifest of every file under `root`: digests from the writers' sidecars (which are
    then deleted), the rest hashed here. A file whose size changed since its writer hashed it
    fails the commit."""
    recorded: Digests = {}
    for sidecar in sorted(root.rglob(f"{SIDECAR_PREFIX}*.json")):
        prefix = sidecar.parent.relative_to(root).as_posix()
        for name, value in _read_json(sidecar, CheckpointError)["files"].items():
            recorded[f"{prefix}/{name}" if prefix != "." else name] = value
        sidecar.unlink()
    files: Digests = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST):
        name = path.relative_to(root).as_posix()
        size = path.stat().st_size
        if name in recorded:
            if recorded[name]["bytes"] != size:
                raise CheckpointError(f"{path}: {size} bytes, but its writer recorded {recorded[name]['bytes']}; "
                                      "the file changed after it was written (two writers on one path?)")
            files[name] = recorded[name]
        else:
            files[name] = entry(size, digest_file(path))
    return {"format": MANIFEST_FORMAT, "algorithm": ALGORITHM, "full_state": full_state, "files": files}


def read_manifest(checkpoint: Path) -> Optional[dict]:
    """The checkpoint's manifest, or None for a checkpoint saved before manifests existed."""
    path = checkpoint / MANIFEST
    if not path.exists():
        return None
    manifest = _read_json(path, CheckpointCorrupt)
    if manifest.get("format") != MANIFEST_FORMAT or manifest.get("algorithm") != ALGORITHM:
        raise CheckpointCorrupt(f"{path}: format {manifest.get('format')!r} / algorithm "
                                f"{manifest.get('algorithm')!r}, this code reads {MANIFEST_FORMAT} / {ALGORITHM}")
    return manifest


def verify_files(checkpoint: Path, manifest: dict, parts: Optional[Iterable[str]] = None) -> int:
    """Check every file the manifest lists under `parts` (top-level names; None: all) against
    its recorded size and sha256; returns the bytes checked. Raises CheckpointCorrupt naming
    every missing or truncated file, or the first whose contents differ."""
    wanted = None if parts is None else set(parts)
    listed = {name: value for name, value in manifest["files"].items()
              if wanted is None or name.split("/", 1)[0] in wanted}
    sizes = {name: (checkpoint / name).stat().st_size if (checkpoint / name).is_file() else None
             for name in listed}
    bad = [f"{checkpoint / name} ({_size_problem(size, listed[name]['bytes'])})"
           for name, size in sizes.items() if size != listed[name]["bytes"]]
    if bad:
        raise CheckpointCorrupt(f"checkpoint {checkpoint}: truncated or missing files: {'; '.join(bad)}")
    for name, value in listed.items():
        if digest_file(checkpoint / name) != value[ALGORITHM]:
            raise CheckpointCorrupt(f"checkpoint {checkpoint}: {checkpoint / name} is corrupt (its {ALGORITHM} "
                                    f"differs from the one recorded in {MANIFEST} when it was saved)")
    return sum(value["bytes"] for value in listed.values())


def strip_manifest(manifest: dict, keep_parts: Iterable[str]) -> dict:
    """The manifest of a weights-only snapshot: top-level files and `keep_parts` only."""
    keep = set(keep_parts)
    files = {name: value for name, value in manifest["files"].items()
             if "/" not in name or name.split("/", 1)[0] in keep}
    return {**manifest, "full_state": False, "files": files}


def manifest_text(manifest: dict) -> str:
    return json.dumps(manifest, indent=1, sort_keys=True) + "\n"


def _size_problem(size: Optional[int], expected: int) -> str:
    return "missing" if size is None else f"{size} bytes, {expected} when saved"


def _read_json(path: Path, error: type[CheckpointError]) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{path}: cannot be read as JSON ({exc}); the file is truncated or corrupt; {RESUME_FIX}") from None
    if not isinstance(value, dict) or not isinstance(value.get("files"), dict):
        raise error(f"{path}: expected a JSON object with 'files'; {RESUME_FIX}")
    return value
