"""Shared storage, checked: every node that will host a pool reads the run's inputs and writes its
run directory before any pool is reserved, and code files travel with the job.

On a cluster the model, the data and the run directory must be at the same path on every node
(a shared file system). `check_storage` runs one small task on each node (`num_cpus=0`, pinned
to the node) that opens every path it is given and writes a probe file into the run directory,
and reads back a token the driver wrote there, so a directory that merely exists at the same
path on another disk is caught too. A node that cannot is named with the path and the cause.

Code files named by the config (reward functions, agent tools and environments given as
`path/to/file.py:name`) need not be on every disk: `stage_code_files` copies them, mirrored under
their absolute paths, into one package that the job's runtime environment ships to every node
(Ray's `py_modules`), and `shipped_copy` finds a file's copy there when its own path is missing.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

from hybridflow.registry import CODE_PACKAGE, shipped_copy  # noqa: F401 - where a shipped file is looked for
TOKEN_FILE = ".hybridflow-storage-token"


class StorageError(RuntimeError):
    """A node that will host a pool cannot read an input or write the run directory."""


def stage_code_files(files: list[str], staging: Path) -> Path | None:
    """The package directory holding a copy of each file at <package>/<its absolute path>, for
    the runtime environment's py_modules (None when there is no file to ship)."""
    files = sorted({str(Path(f).expanduser().resolve()) for f in files})
    if not files:
        return None
    package = staging / CODE_PACKAGE
    shutil.rmtree(package, ignore_errors=True)
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('"""Code files of a HybridFlow run, shipped to every node."""\n')
    for f in files:
        target = package / f.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, target)
    return package


def probe(reads: dict[str, str], code_files: dict[str, str], write_dir: str | None, token: str | None
          ) -> list[str]:
    """On this node: a problem line per input it cannot read, code file it cannot load, or a run
    directory it cannot write (or that is not the driver's: the token differs)."""
    problems = []
    for key, path in reads.items():
        why = _unreadable(Path(path).expanduser())
        if why:
            problems.append(f"{key}={path}: {why}")
    for key, path in code_files.items():
        if not (Path(path).is_file() and os.access(path, os.R_OK)) and shipped_copy(Path(path)) is None:
            problems.append(f"{key}={path}: not on this node's disk and not in the job's shipped code")
    if write_dir is not None:
        problems += _write_problems(Path(write_dir), token)
    return problems


def _unreadable(path: Path) -> str | None:
    try:
        if path.is_dir():
            entries = os.listdir(path)
            config = path / "config.json"
            if "config.json" in entries:
                config.open("rb").read(1)
            return None
        with path.open("rb") as f:
            f.read(1)
        return None
    except FileNotFoundError:
        return "no such file or directory"
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"


def _write_problems(run_dir: Path, token: str | None) -> list[str]:
    if not run_dir.is_dir():
        return [f"run directory {run_dir}: no such directory on this node (logger.output_root must be on "
                "storage every node shares)"]
    probe_file = run_dir / f".hybridflow-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        probe_file.write_text("ok")
        probe_file.unlink()
    except OSError as exc:
        return [f"run directory {run_dir}: cannot write ({type(exc).__name__}: {exc.strerror or exc})"]
    if token is not None:
        try:
            seen = (run_dir / TOKEN_FILE).read_text()
        except OSError:
            seen = None
        if seen != token:
            return [f"run directory {run_dir}: exists here but is not the driver's (the token the driver wrote "
                    "there is missing): a local directory at the same path, not shared storage"]
    return []


def check_storage(nodes: dict[str, str], reads: dict[str, str], code_files: dict[str, str],
                  run_dir: str | None, timeout_s: float = 60.0) -> None:
    """Run `probe` on every node of `nodes` (node id -> name) at once; raise StorageError naming each
    node and path that failed, or a node that did not answer within `timeout_s`."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = None
    if run_dir is not None and Path(run_dir).is_dir():  # what each node must read back from the same directory
        token = secrets.token_hex(16)
        (Path(run_dir) / TOKEN_FILE).write_text(token)
    task = ray.remote(num_cpus=0, max_retries=0)(probe)
    refs = {node_id: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
            .remote(reads, code_files, run_dir, token) for node_id in nodes}
    ready, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    lines = []
    for node_id, ref in refs.items():
        if ref in pending:
            lines.append(f"node {nodes[node_id]}: no answer within {timeout_s:g} s")
            continue
        try:
            lines += [f"node {nodes[node_id]}: {p}" for p in ray.get(ref)]
        except Exception as exc:  # noqa: BLE001 - any failure of the probe is the node's problem to report
            lines.append(f"node {nodes[node_id]}: the check failed: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    if lines:
        raise StorageError("shared storage check failed before any pool was reserved:\n  " + "\n  ".join(lines)
                           + "\nFix: put model, data and logger.output_root on storage every node mounts at the "
                             "same path (docs/cluster.md), or set placement.check_storage=false to skip this check")
