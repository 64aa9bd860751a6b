"""Fitting the cost model's rates on the user's machine: a short profiling run, not guesses.

`calibrate(overrides)` runs the user's own workload (the `hybridflow` command with their overrides)
for `PROFILE_STEPS` steps at two or three sizes of one colocated pool — 1 device, 2 devices with one
engine per device, 2 devices with one engine across both (tensor parallel) — reads each run's
per-stage timings from metrics.jsonl (the steps after the first: the first compiles and warms
caches), times a plain memory copy (the bandwidth a decode step reads weights at), and solves the
analytical model (hybridflow/planning/cost.py) for its rates, stage by stage:

- update and score (forward passes): the seconds per call, per FLOP (one sustained rate for forward
  and backward) and per byte of FSDP's collectives;
- generate: the fixed seconds per engine step, per sequence in a step (c = 2P/F_decode) and per
  extra tensor-parallel rank;
- transition: the fixed seconds per weight sync and per byte the colocated exchange moves, and a
  measured point-to-point send for the weights' trip between pools;
each by least squares over the profiles (`fit_rates` has the equations). The copy bandwidth is
kept as the rate decode reads weights at (it binds only when reading the weights takes longer than
the step's compute).

The fit reproduces the profiled sizes; what it predicts for other plans is the model's claim,
checked in docs/placement.md. Rates are saved as JSON (`--save-rates`) and read back with `--rates`
or `placement.planner.rates`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hybridflow.planning.cost import PRICED_STAGES, Rates
from hybridflow.output.tracking import read_metrics
from hybridflow.planning.workload import Workload

PROFILE_STEPS = 3
STAGE_KEYS = {**{stage: f"timing/{timed}_s" for stage, timed in PRICED_STAGES.items()}, "step": "timing/step_s"}


@dataclass(frozen=True)
class Profile:
    devices: int
    tp: int
    seconds: dict[str, float]  # per stage (STAGE_KEYS), mean over the steps after the first
    sync_bytes: float  # bytes each rollout rank received in a sync


def stage_means(rows: list[dict]) -> dict[str, float]:
    """Each stage's mean seconds (`STAGE_KEYS`) over the metrics `rows`."""
    return {stage: sum(r.get(key, 0.0) for r in rows) / len(rows) for stage, key in STAGE_KEYS.items()}


def profile_overrides(devices: int, tp: int, root: Path, name: str) -> list[str]:
    return ["placement=colocated", f"placement.pools.global.devices_per_node={devices}",
            f"rollout.tensor_parallel_size={tp}", "trainer.max_staleness=0", f"trainer.total_steps={PROFILE_STEPS}",
            "trainer.val_every_steps=0", "trainer.save_every_steps=0", "trainer.export_hf=false",
            f"logger.output_root={root}", f"logger.run_name={name}", "placement.planner.auto=false"]


def run_profile(overrides: list[str], devices: int, tp: int, root: Path) -> Profile:
    """One profiling run through the `hybridflow` command; its metrics' stage means."""
    name = f"profile-{devices}x-tp{tp}"
    command = [sys.executable, "-m", "hybridflow.cli", *overrides, *profile_overrides(devices, tp, root, name)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the profiling run at {devices} device(s), tp {tp} failed (exit {done.returncode}):\n"
                           f"  {' '.join(command)}\n{done.stderr[-3000:]}")
    rows = read_metrics(root / name)
    rows = rows[1:] or rows
    seconds = stage_means(rows)
    sync_bytes = sum(r.get("weight_sync/bytes_received_per_rank", 0.0) for r in rows) / len(rows)
    return Profile(devices, tp, seconds, sync_bytes)


def copy_bytes_per_s(megabytes: int = 256) -> float:
    """A plain copy's bandwidth on one core: read plus write of a `megabytes` buffer, best of three."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(megabytes * 2 ** 20 // 4)
        dst = torch.empty_like(src)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
        return 2 * src.numel() * 4 / best
    finally:
        torch.set_num_threads(threads)


def nonnegative_least_squares(rows: list[list[float]], targets: list[float]) -> list[float]:
    """min |A z - t| over z >= 0, for a handful of unknowns: the best of the unconstrained solutions
    on every subset of them (the rest held at 0) whose values are all >= 0."""
    import itertools

    import numpy as np

    a, t = np.array(rows, dtype=float), np.array(targets, dtype=float)
    best, best_residual = np.zeros(a.shape[1]), float(np.sum(t ** 2))
    for k in range(1, a.shape[1] + 1):
        for subset in itertools.combinations(range(a.shape[1]), k):
            z_sub = np.linalg.lstsq(a[:, subset], t, rcond=None)[0]
            if (z_sub < 0).any():
                continue
            z = np.zeros(a.shape[1])
            z[list(subset)] = z_sub
            residual = float(np.sum((a @ z - t) ** 2))
            if residual < best_residual:
                best, best_residual = z, residual
    return [float(v) for v in best]


def send_bytes_per_s(megabytes: int = 64) -> float:
    """A point-to-point gloo send's bandwidth between two processes of this machine (the route the
    weights take between two pools on one node): the best of three sends of one `megabytes` buffer."""
    import multiprocessing
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    queue = context.SimpleQueue()
    procs = [context.Process(target=_send_worker, args=(rank, port, megabytes, queue)) for rank in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    if any(p.exitcode != 0 for p in procs) or queue.empty():
        raise RuntimeError(f"the point-to-point send benchmark failed (exit codes {[p.exitcode for p in procs]})")
    return float(queue.get())


def _send_worker(rank: int, port: int, megabytes: int, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buffer = torch.ones(megabytes * 2 ** 20 // 4)
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buffer, 1)
        else:
            dist.recv(buffer, 0)
            best = min(best, time.perf_counter() - start)
    dist.barrier()
    if rank == 1:
        queue.put(buffer.numel() * 4 / best)
    dist.destroy_process_group()


def fit_rates(workload: Workload, profiles: list[Profile], copy_rate: float, send_rate: float = 0.0) -> Rates:
    """The analytical model's rates that best reproduce `profiles` (least squares, each unknown >= 0).

    On a CPU FSDP's collectives run after compute on the same cores (`comm_overlap=False`), so each
    training-side stage is linear in three unknowns: a = seconds per call, x = seconds per FLOP,
    y = seconds per byte a device sends or receives in a collective:
      update  = k·(a + W_train/n·x + passes·P·b·(n-1)/n·y)        (k trained roles)
      score   = a + f·(a + W_forward/n·x + P·b·(n-1)/n·y)          (f forward roles; a: the reward call)
    then generation and the transition, with a and x known, in their own unknowns:
      generate   = a + prefill + L·(d + c·s/tp + (tp-1)·e)   (s sequences per engine) -> d, c, e
      transition = sync + moved·y_x                          (moved: bytes its FSDP shard lacks) -> sync, y_x
    `send_rate` (a measured point-to-point send, `send_bytes_per_s`) prices the weights' trip between
    pools; without it, the collectives' rate does.
    """
    w = workload
    P, L, N = w.parameters, w.response_tokens, w.sequences
    trained = 1 + ("critic" in w.roles)
    forwards = int(w.actor_forward) + sum(r in w.roles for r in ("critic", "reference", "reward", "teacher"))
    train_flops = w.epochs * (8 if w.checkpointing else 6) * P * w.tokens
    forward_flops = 2 * P * w.tokens
    passes = w.optimizer_steps * (2 + w.master_bytes / w.compute_bytes)
    rows, targets = [], []
    for p in profiles:
        lacks = P * w.compute_bytes * (p.devices - 1) / p.devices
        rows.append([trained, trained * train_flops / p.devices, trained * passes * lacks])
        targets.append(p.seconds["update"])
        rows.append([1 + forwards, forwards * forward_flops / p.devices, forwards * lacks])
        targets.append(p.seconds["score"])
    call, per_flop, per_byte = nonnegative_least_squares(rows, targets)
    per_flop = per_flop or 1e-18
    prefill_flops = 2 * P * N * w.prompt_tokens
    rows, targets = [], []
    for p in profiles:
        engines = p.devices // p.tp
        per_engine = N / engines
        rows.append([L, L * per_engine / p.tp, L * (p.tp - 1)])
        targets.append(p.seconds["generate"] - call - prefill_flops / engines / p.tp * per_flop)
    step, per_sequence, tp_step = nonnegative_least_squares(rows, targets)
    rows, targets = [], []
    for p in profiles:
        engine_bytes = P * w.rollout_bytes / p.tp
        rows.append([1.0, max(0.0, engine_bytes - P * w.rollout_bytes / p.devices)])
        targets.append(p.seconds["transition"])
    sync, per_sync_byte = nonnegative_least_squares(rows, targets)
    intra = 1 / per_byte if per_byte else 1e12
    return Rates(train_flops_per_s=1 / per_flop, forward_flops_per_s=1 / per_flop, decode_bytes_per_s=copy_rate,
                 decode_flops_per_s=2 * P / per_sequence if per_sequence else 1e18, decode_step_s=step,
                 tp_step_s=tp_step, call_s=call, intra_node_bytes_per_s=intra, inter_node_bytes_per_s=intra,
                 sync_s=sync, exchange_bytes_per_s=1 / per_sync_byte if per_sync_byte else intra,
                 send_bytes_per_s=send_rate or intra, comm_overlap=False,
                 source=f"calibrated {time.strftime('%Y-%m-%d %H:%M')} on {os.uname().nodename} with "
                        f"{len(profiles)} profiling run(s) of {w.name}")


def calibrate(overrides: list[str], workload: Workload, devices: int, root: Path | None = None,
              say=print) -> tuple[Rates, list[Profile]]:
    """Profile the workload at 1 and (if `devices` >= 2) 2 devices, with and without tensor
    parallelism (when the model's heads allow it), and fit the rates."""
    root = Path(root or tempfile.mkdtemp(prefix="hybridflow-calibrate-"))
    sizes = [(1, 1)] + ([(2, 1)] + ([(2, 2)] if workload.heads % 2 == 0 and workload.kv_heads % 2 == 0 else [])
                        if devices >= 2 else [])
    profiles = []
    for n, tp in sizes:
        start = time.perf_counter()
        profiles.append(run_profile(overrides, n, tp, root))
        say(f"hybridflow plan: profiled {n} device(s), tp {tp}: "
            + ", ".join(f"{k} {v:.2f} s" for k, v in profiles[-1].seconds.items())
            + f" ({time.perf_counter() - start:.0f} s)")
    return fit_rates(workload, profiles, copy_bytes_per_s(), send_bytes_per_s()), profiles
