"""Each worker process's memory: its peak since the last read, read per step.

A step's peak is what decides whether a run fits, and the current size after a step is what
shows growth; the operating system keeps the first for us. Linux's `VmHWM` (/proc/self/status)
is a process's peak resident set, and writing "5" to /proc/self/clear_refs resets it, so each
read covers the time since the previous one. On a GPU, torch's allocator peak is read and reset
the same way.

Before reading, the process hands glibc's free heap back to the system (`malloc_trim(0)`). The
processes here allocate from many threads (torch's intra-op pool, vLLM, gloo), and glibc's
per-thread arenas keep freed memory mapped: the resident set of a long run then grows with no
object behind it. Trimming keeps the resident set at what is in use. It is done at most once every
`TRIM_EVERY_S` seconds, not at every read: the next step faults the returned pages back in, which
cost the tiny model's SFT step 15% when it was trimmed every step (0.124 -> 0.143 s).

What grew over a long run on a CPU was neither Python objects nor freed heap: it was the kernel
caches of torch's oneDNN path. Every new matrix shape (here: each step's sequence lengths and row
counts) gets a compiled primitive, with its scratch and reordered weights, kept in two caches of
1,024 entries each (ideep's, sized by `LRU_CACHE_CAPACITY`, and oneDNN's own,
`ONEDNN_PRIMITIVE_CACHE_CAPACITY`); on SmolLM2 in bfloat16 the heap in use rose by about 12 MB a
step for ~125 steps (pytorch/pytorch#27971 is the same effect). CPU workers start with both caches
at `CPU_KERNEL_CACHE_ENTRIES` (a step's shapes still hit), unless the environment sets them.

The read runs on a lane of its own ("monitor", a Ray concurrency group of one thread), so it
answers while the process generates or trains (trainer.max_staleness >= 1 keeps the rollout busy
across the end of a step).
"""

from __future__ import annotations

import ctypes
import os
import re
import time

from hybridflow.controller.errors import WorkerError

MONITOR_LANE = "monitor"
GIB = 2 ** 30
CPU_KERNEL_CACHE_ENTRIES = 64
TRIM_EVERY_S = 30.0
_last_trim_s = [float("-inf")]


def cpu_kernel_cache_env() -> dict[str, str]:
    """The environment a CPU worker starts with: oneDNN's two primitive caches bounded, unless the
    driver's environment sets them."""
    return {name: os.environ.get(name, str(CPU_KERNEL_CACHE_ENTRIES))
            for name in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}


def _status_kib(field: str) -> int:
    try:
        text = open("/proc/self/status").read()
    except OSError:  # not Linux: no numbers rather than wrong ones
        return 0
    found = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(found.group(1)) if found else 0


def trim_heap() -> bool:
    """Return glibc's free heap pages to the system; False where there is no glibc."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


_device_peak_seen = [0]  # the largest phase peak read since the last read_and_reset (phase_peak_bytes)


def phase_peak_bytes() -> int | None:
    """On a GPU: the allocator's peak bytes since the last read (a phase of the colocated hand-over,
    hybridflow/resharding/transports/colocated.py), then reset for the next phase; the step's peak
    that `read_and_reset` reports still covers it. None without CUDA in use."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    peak = int(torch.cuda.max_memory_allocated())
    _device_peak_seen[0] = max(_device_peak_seen[0], peak)
    torch.cuda.reset_peak_memory_stats()
    return peak


def read_and_reset(use_gpu: bool) -> dict[str, int]:
    """This process's peak resident bytes since the last call (then reset), its resident bytes now
    (after trimming the heap, at most every `TRIM_EVERY_S`) and, on a GPU, the allocator's peak bytes
    (then reset)."""
    if time.monotonic() - _last_trim_s[0] >= TRIM_EVERY_S:
        trim_heap()
        _last_trim_s[0] = time.monotonic()
    rss = _status_kib("VmRSS") * 1024  # the kernel updates VmHWM lazily: the peak is at least the resident set now
    out = {"rss_peak_bytes": max(_status_kib("VmHWM") * 1024, rss), "rss_bytes": rss}
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    if use_gpu:
        import torch

        out["device_peak_bytes"] = max(int(torch.cuda.max_memory_allocated()), _device_peak_seen[0])
        torch.cuda.reset_peak_memory_stats()
        _device_peak_seen[0] = 0
    return out


def pool_memory_metrics(groups: dict) -> dict[str, float]:
    """`memory/<pool>_peak_gib` (the largest peak of the pool's processes since the last call),
    `memory/<pool>_rss_gib` (the largest resident set now) and, on GPUs, `memory/<pool>_device_peak_gib`,
    for every pool of `groups` (role -> WorkerGroup; roles sharing a pool share its processes)."""
    pools: dict[str, object] = {}
    for group in groups.values():  # placement.backend=local: no pool, the group's name starts with the pool's
        if group is not None:
            pools.setdefault(group.pool.spec.name if group.pool is not None else group.name.split(":")[0], group)
    calls = {name: [(h, h.submit(None, "memory", (), {}, MONITOR_LANE)) for h in group.hosts]
             for name, group in pools.items()}
    out = {}
    reads_by_pool = {name: _answers(host_calls) for name, host_calls in calls.items()}
    for name, reads in reads_by_pool.items():
        if not reads:
            continue
        out[f"memory/{name}_peak_gib"] = max(r["rss_peak_bytes"] for r in reads) / GIB
        out[f"memory/{name}_rss_gib"] = max(r["rss_bytes"] for r in reads) / GIB
        if all("device_peak_bytes" in r for r in reads):
            out[f"memory/{name}_device_peak_gib"] = max(r["device_peak_bytes"] for r in reads) / GIB
    return out


def _answers(host_calls: list, timeout_s: float = 10.0) -> list[dict]:
    """The reads that came back (`host_calls`: (host, reference) of each process's read, through the host
    protocol, hybridflow/controller/hosts.py). A read never fails a run: a dead, failing or unresponsive
    process is left out (the next stage call to it names it and the restarts handle it), and a pool none of
    whose processes answered within `timeout_s` reports nothing this step."""
    host_of = {ref: host for host, ref in host_calls}
    reads, pending = [], list(host_of)
    deadline = time.monotonic() + timeout_s
    while pending:
        ready, pending = host_calls[0][0].ready(pending, max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        for ref in ready:
            try:
                reads.append(host_of[ref].result(ref, "WorkerHost", "memory"))
            except WorkerError:
                continue
    return reads


def memory_kill(error_text: str) -> str | None:
    """What a dead worker's error says about memory: Ray's memory monitor kills a worker when the
    node passes its memory threshold ("... running low on memory ... memory usage threshold ..."),
    and the kernel's out-of-memory killer sends SIGKILL. None when the text names neither."""
    text = error_text.lower()
    if "low on memory" in text or "memory usage threshold" in text or "outofmemoryerror" in text:
        return ("killed for memory: Ray's memory monitor stopped this worker because the node ran out of memory; "
                "the memory/<pool>_peak_gib metrics of the steps before show what each pool held (docs/memory.md, "
                "\"Memory\"): lower actor.samples_per_micro_batch, turn on actor.gradient_checkpointing, or lower "
                "rollout.kv_cache_space_gib / rollout.max_num_seqs")
    if "sigkill" in text:
        return ("killed by SIGKILL, most often the kernel's out-of-memory killer (dmesg shows it); see the "
                "memory/<pool>_peak_gib metrics of the steps before")
    return None
