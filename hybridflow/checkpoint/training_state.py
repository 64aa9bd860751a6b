"""A worker's share of a training checkpoint: model, optimizer, scheduler and RNG states.

Called collectively on every rank of one worker group, each rank passing the same
`directory` (on a filesystem all ranks share). Inside it:

    .metadata, __<r>_0.distcp      torch.distributed.checkpoint (DCP): model + optimizer,
                                   each rank writing only its own FSDP shards
    scheduler.pt                   the LR scheduler's state_dict (rank 0; ranks share one)
    rng_rank<r>.pt                 each rank's python / numpy / torch / CUDA RNG states
    extra_rank<r>.pt               a rank's `extra` dict, when one was given
    training_state.json            world size and what was saved (rank 0)
    .checksums-rank<r>.json        sha256 of the files rank r wrote, folded into the
                                   checkpoint's MANIFEST.json by the driver's commit

The state dicts come from `get_state_dict` / `set_state_dict`, which know FSDP2's DTensor
shards. Frozen parameters (a LoRA model's base weights) are not saved
(`ignore_frozen_params`): they never change, so a resumed run takes them from the model it
was built from, which must be the same base model.

Another rank count. A state saved by N ranks loads on M: DCP reshards the model and optimizer
to the loading ranks' layout (a plain module on one CPU rank, FSDP2 shards on several). RNG
states are per rank, so rank r < N gets saved rank r's, the states of saved ranks >= M are
dropped, and a rank r >= N is seeded with `derived_seed(saved rank 0's state, r)`. A rank's
`extra` is its own saved one, or rank 0's when it has none; if the saved ranks' extras differ
the load is refused (a per-rank value cannot be spread over another rank count).

One rank saves and loads without DCP's collectives (`no_dist`): on a one-rank group they exchange
nothing, and on a CPU they cost every later step. DCP gathers the save plans over gloo; gloo
copies the pickled plans in its own thread, and that copy, large enough to run
on torch's OpenMP threads, gives that thread an OpenMP team of its own. From then on libgomp
counts more threads than cores and stops spinning at its barriers: each parallel region of the
training thread waits for a sleeping thread to wake (~80 us on these VMs), and the default
pipeline's SFT step went from 0.10 to 0.15 s after its first checkpoint, for the rest of the
stage (docs/results/performance.md, "The SFT step beside a plain loop").
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from hybridflow.checkpoint.errors import RESUME_FIX, CheckpointError
from hybridflow.checkpoint.files import atomic_torch_save, atomic_write_text
from hybridflow.checkpoint.integrity import Digests, digest_file, entry, sidecar_name
from hybridflow.checkpoint.rng import capture_rng_state, derived_seed, restore_rng_state, seed_rng

FORMAT_VERSION = 1
STATE_META = "training_state.json"
DCP_METADATA = ".metadata"
SCHEDULER = "scheduler.pt"
# torch.distributed.checkpoint is imported where it is used: it costs 1.9 s to import on a 2-core CPU,
# and the driver imports this module (CheckpointManager verifies a training state's files) but never saves one.
# Frozen parameters are absent from the checkpoint, so loading is not strict about them; every other key is
# still required, because dcp.load fails for a key of the template it cannot find.
OPTIONS = {"ignore_frozen_params": True}
LOAD_OPTIONS = {"ignore_frozen_params": True, "strict": False}


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def extra_file(rank: int) -> str:
    return f"extra_rank{rank}.pt"


def save_training_state(directory: "str | os.PathLike[str]", *, model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer, scheduler: Optional[Any] = None, rank: int,
                        extra: Optional[dict] = None) -> Path:
    """Save this rank's shard of the model and optimizer, the scheduler and this rank's RNG.

    Collective: every rank of the group calls it with the same `directory`. `extra` is any
    picklable per-rank dict (returned by `load_training_state`). Draws no random numbers.
    """
    rng = capture_rng_state()
    world_size = _world_size(rank)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(**OPTIONS))
    with _single_process_quiet():
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory, no_dist=world_size == 1)
    digests = _hash_own_shards(directory, rank)
    digests[rng_file(rank)] = atomic_torch_save(directory / rng_file(rank), rng)
    if extra is not None:
        digests[extra_file(rank)] = atomic_torch_save(directory / extra_file(rank), extra)
    if rank == 0:
        if scheduler is not None:
            digests[SCHEDULER] = atomic_torch_save(directory / SCHEDULER, scheduler.state_dict())
        text = json.dumps({"format": FORMAT_VERSION, "world_size": world_size, "scheduler": scheduler is not None},
                          indent=1) + "\n"
        digests[STATE_META] = entry(len(text.encode()), atomic_write_text(directory / STATE_META, text))
    write_sidecar(directory, rank, digests)
    return directory


def write_sidecar(directory: Path, rank: int, digests: Digests) -> None:
    """Leave the digests of the files this rank wrote into `directory` (names relative to it)."""
    atomic_write_text(directory / sidecar_name(rank), json.dumps({"files": digests}, sort_keys=True))


def _hash_own_shards(directory: Path, rank: int) -> dict:
    """Digests of the DCP files this rank wrote (`__<rank>_<i>.distcp`; rank 0 also `.metadata`),
    read back right after the write, from the page cache, on every rank in parallel."""
    files = sorted(directory.glob(f"__{rank}_*.distcp")) + ([directory / DCP_METADATA] if rank == 0 else [])
    return {path.name: entry(path.stat().st_size, digest_file(path)) for path in files}


def load_training_state(directory: "str | os.PathLike[str]", *, model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer, scheduler: Optional[Any] = None,
                        rank: int) -> Optional[dict]:
    """Restore what `save_training_state` wrote, RNG states last; returns this rank's `extra`.

    Collective, like the save, on any number of ranks (see the module docstring for what
    changes when it differs from the saving run's). `model` and `optimizer` are built (and
    `model` sharded) as for a fresh start; any gradients are dropped. Returns None when no
    `extra` was saved.
    """
    directory = Path(directory)
    world_size = _world_size(rank)
    meta = _check_files(directory, rank=rank, want_scheduler=scheduler is not None)
    if meta["scheduler"] and scheduler is None:
        raise CheckpointError(f"{directory}: holds an LR scheduler state but no scheduler was passed to "
                              "load_training_state; pass the run's scheduler")
    extra = _read_extra(directory, rank=rank, saved=meta["world_size"], world_size=world_size)
    _load_sharded(directory, model, optimizer, rank=rank, saved=meta["world_size"], world_size=world_size)
    if scheduler is not None:
        # Files this run wrote: full unpickling, like any torch checkpoint you trust.
        scheduler.load_state_dict(torch.load(directory / SCHEDULER, weights_only=False))
    _restore_rank_rng(directory, rank=rank, saved=meta["world_size"])
    return extra


def saved_world_size(directory: "str | os.PathLike[str]") -> int:
    """The number of ranks that saved the training state in `directory`."""
    return _read_meta(Path(directory))["world_size"]


def rank_change_note(saved: int, world_size: int) -> Optional[str]:
    """What a load on `world_size` ranks of a state saved by `saved` ranks restores, or None when
    the counts are equal (everything is restored exactly)."""
    if saved == world_size:
        return None
    kept = min(saved, world_size)
    parts = [f"saved by {saved} ranks, loaded on {world_size}: model and optimizer resharded by "
             f"torch.distributed.checkpoint; RNG states of {_ranks(0, kept)} restored"]
    if saved > world_size:
        parts.append(f"those of saved {_ranks(world_size, saved)} dropped")
    else:
        parts.append(f"{_ranks(saved, world_size)} seeded from sha256(saved rank 0's RNG state, rank)")
    return "; ".join(parts)


def _ranks(first: int, end: int) -> str:
    return f"rank {first}" if end - first == 1 else f"ranks {first}-{end - 1}"


def _load_sharded(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, rank: int,
                  saved: int, world_size: int) -> None:
    """DCP reads, for each tensor of this rank's layout, the pieces any saved rank wrote of it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    options = StateDictOptions(**LOAD_OPTIONS)
    optimizer.zero_grad(set_to_none=True)  # get_state_dict only initialises a gradient-free optimizer
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optim": optim_state}
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=directory, no_dist=world_size == 1)
    except (Exception, CheckpointException) as exc:  # DCP wraps every rank's failure in one, a BaseException
        counts = f" (saved by {saved} ranks, loading on {world_size})" if saved != world_size else ""
        raise CheckpointError(f"{directory}: loading the sharded model/optimizer state failed on rank {rank}"
                              f"{counts}: {exc}\nIs this a checkpoint of the same model and optimizer? "
                              f"{RESUME_FIX}") from exc
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)


def _read_extra(directory: Path, *, rank: int, saved: int, world_size: int) -> Optional[dict]:
    """This rank's `extra`. On another rank count every saved rank's must be equal (checked
    before any collective, so a refusal cannot hang the other ranks); rank 0's serves a new rank."""
    if saved == world_size:
        path = directory / extra_file(rank)
        return torch.load(path, weights_only=False) if path.is_file() else None
    paths = [directory / extra_file(r) for r in range(saved)]
    present = [path.is_file() for path in paths]
    if not any(present):
        return None
    if not all(present):
        missing = [path.name for path, here in zip(paths, present) if not here]
        raise CheckpointError(f"training state {directory} is missing {missing}; {RESUME_FIX}")
    extras = [torch.load(path, weights_only=False) for path in paths]
    differing = [r for r in range(1, saved) if not _same_value(extras[r], extras[0])]
    if differing:
        raise CheckpointError(f"training state {directory} was saved by {saved} ranks and is being loaded by "
                              f"{world_size}: the per-rank values in extra_rank<r>.pt of ranks {differing} differ "
                              f"from rank 0's, and per-rank values cannot be spread over another rank count; "
                              f"resume with {saved} ranks")
    return extras[rank] if rank < saved else extras[0]


def _same_value(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # tensors inside: compare what was saved, byte for byte
        return _pickled(a) == _pickled(b)


def _pickled(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _restore_rank_rng(directory: Path, *, rank: int, saved: int) -> None:
    """Saved rank `rank`'s RNG states; a rank the saving run did not have gets a derived seed."""
    if rank < saved:
        path = directory / rng_file(rank)
        restore_rng_state(torch.load(path, weights_only=True), source=str(path))
    else:
        seed_rng(derived_seed(torch.load(directory / rng_file(0), weights_only=True), rank))


def verify_training_state(directory: "str | os.PathLike[str]") -> None:
    """Check that every rank's files of a saved training state exist and are whole.

    For the driver before it commits: it sees what all nodes wrote (on a shared
    filesystem), so a rank that wrote elsewhere, or a truncated shard, fails the commit.
    """
    directory = Path(directory)
    meta = _read_meta(directory)
    ranks = range(meta["world_size"])
    needed = [DCP_METADATA] + [rng_file(r) for r in ranks] + ([SCHEDULER] if meta["scheduler"] else [])
    missing = [name for name in needed if not (directory / name).is_file()]
    if missing:
        raise CheckpointError(f"training state {directory} is missing {missing}; every rank must write into the "
                              "same directory on a filesystem shared by all nodes and the driver")
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(directory).read_metadata().storage_data
    except Exception as exc:
        raise CheckpointError(f"{directory / DCP_METADATA}: cannot be read ({exc})") from exc
    ends: dict[str, int] = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    short = [name for name, end in sorted(ends.items())
             if not (directory / name).is_file() or (directory / name).stat().st_size < end]
    if short:
        raise CheckpointError(f"training state {directory}: shard files {short} are missing or shorter than "
                              f"{DCP_METADATA} says; every rank must write into the same shared directory")


@contextlib.contextmanager
def _single_process_quiet():
    """Without a process group DCP saves and loads in one process, as meant; it need not warn."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _world_size(rank: int) -> int:
    if not dist.is_initialized():
        if rank != 0:
            raise CheckpointError(f"rank={rank} but torch.distributed is not initialised (a single process is rank 0)")
        return 1
    if dist.get_rank() != rank:
        raise CheckpointError(f"rank={rank} but this process is rank {dist.get_rank()} of the default process "
                              "group; pass the worker's rank in its group")
    return dist.get_world_size()


def _read_meta(directory: Path) -> dict:
    if not directory.is_dir():
        raise CheckpointError(f"training state {directory} does not exist; {RESUME_FIX}")
    if not (directory / STATE_META).is_file():
        raise CheckpointError(f"training state {directory} is missing {STATE_META} (not written by "
                              f"save_training_state, or its save was interrupted); {RESUME_FIX}")
    try:
        meta = json.loads((directory / STATE_META).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{directory / STATE_META}: cannot be read as JSON ({exc}); {RESUME_FIX}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{directory / STATE_META}: format {found!r}, this code reads "
                              f"{FORMAT_VERSION}; {RESUME_FIX}")
    if not isinstance(meta.get("world_size"), int) or not isinstance(meta.get("scheduler"), bool):
        raise CheckpointError(f"{directory / STATE_META}: needs an integer 'world_size' and a boolean 'scheduler', "
                              f"found {meta}; {RESUME_FIX}")
    return meta


def _check_files(directory: Path, *, rank: int, want_scheduler: bool) -> dict:
    """Every file this rank needs, checked before any collective so a bad path fails fast."""
    meta = _read_meta(directory)
    if want_scheduler and not meta["scheduler"]:
        raise CheckpointError(f"training state {directory} was saved without an LR scheduler but one was passed; "
                              "pass scheduler=None or resume from a checkpoint saved with one")
    rng = rng_file(rank if rank < meta["world_size"] else 0)
    needed = [DCP_METADATA, rng] + ([SCHEDULER] if meta["scheduler"] else [])
    missing = [name for name in needed if not (directory / name).is_file()]
    if missing:
        raise CheckpointError(f"training state {directory} is missing {missing}; {RESUME_FIX}")
    return meta
