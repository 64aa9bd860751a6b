"""Durable file writes: what a crash can and cannot leave behind.

A file written with `atomic_write_bytes` is either absent or complete: the bytes go to a
temporary name in the same directory, are fsynced, and `os.replace` moves them into place
(rename is atomic within one filesystem); the directory is fsynced so the new name
survives a power loss too. `fsync_tree` makes everything a checkpoint's writers produced
durable before the checkpoint is declared complete.
"""

from __future__ import annotations

import errno
import io
import os
import uuid
from pathlib import Path
from typing import Any

import torch

from hybridflow.checkpoint.integrity import digest_bytes, entry


# Some filesystems (FUSE mounts of object stores, some network filesystems) refuse fsync on
# a directory or a read-only descriptor; there it cannot be had, and the rename order still holds.
UNSUPPORTED = (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (creations, renames, deletions) durable."""
    _fsync_path(path)


def fsync_file(path: Path) -> None:
    _fsync_path(path)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (files first, then their directories)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fsync_file(Path(dirpath) / name)
        fsync_dir(Path(dirpath))


def atomic_write_bytes(path: Path, data: bytes) -> str:
    """Write `data` to `path` atomically; returns its sha256 (hashed from memory, never re-read)."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return digest_bytes(data)


def atomic_write_text(path: Path, text: str) -> str:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_torch_save(path: Path, obj: Any) -> dict:
    """torch.save `obj` to `path` atomically; returns its manifest entry (bytes and sha256)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    return entry(len(data), atomic_write_bytes(path, data))
