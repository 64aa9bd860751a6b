"""Ulysses sequence parallelism measured (issue 82): seconds and peak resident memory per rank of one
policy-loss forward and backward of the actor's training path, at SP 1 and SP 2 on two gloo ranks, beside
the memory model's prediction; then the longest response that trains within a fixed memory per rank.

    PYTHONPATH=. .venv/bin/python bench/sequence_parallel.py --out sp.json
    PYTHONPATH=. .venv/bin/python bench/sequence_parallel.py --dry-run --out x.json  # 64 and 128 tokens, seconds

The model is the tiny one (hybridflow.builders.build_tiny_model: 4 layers, hidden 128, 4 heads and 2 key/value
heads, so SP 2 divides both) with `max_position_embeddings` raised to hold the longest row. Each rank runs
the real ActorWorker (`recipes.roles.actor_role`, FSDP2 over both ranks, packed rows, float32, no activation
checkpointing) and its `run_objective` with the PPO policy loss over one micro-batch of one packed row:
a prompt of 64 tokens and a response of R. The optimizer's step is left out (no AdamW moments: the forward
and backward alone), as tests/unit/test_ulysses.py does.

- **SP 1**: two data-parallel ranks, each with a row of its own (2 rows in all, one a rank);
- **SP 2**: one sequence-parallel group, both ranks handed the same row, each computing half of it (1 row).

So the comparison per rank is one row's forward and backward against half of one: at a given R each rank
of SP 2 holds half the tokens SP 1's ranks hold, and the pair trains one row instead of two (per row, SP 2
costs the pair's time for one row where SP 1 trains two).

Each configuration runs in a fresh pair of processes (`torch.multiprocessing`, spawn, as the SP tests do), so
no peak or freed heap carries over; a rank warms up on a 16-token response first (kernels, FSDP2's lazy
init), then reads its resident memory, runs the measured call, and reads its peak since
(hybridflow.controller.memory `read_and_reset`, Linux's VmHWM). The prediction is
`hybridflow.checks.memory_budget.micro_batch_terms` for the same shapes (one row, sp=SP), as the CPU's
check prices it (attention probabilities included) and without them.

The longest trainable response: the limit is SP 1's measured peak above the start at `--limit-at` tokens
(4096); each SP's lengths are tried upwards in `--step` tokens from the longest measured one that fits,
until one exceeds the limit. The dry run (tests/unit/test_bench_dry_runs_measure.py) runs every
configuration in one pair of processes (the numbers are not the point there), with a 64-token limit.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from report import emit  # noqa: E402

LENGTHS = (512, 2048, 4096, 8192)  # response tokens
DRY_LENGTHS = (64, 128)
PROMPT_TOKENS = 64
WARM_UP_RESPONSE_TOKENS = 16
RANKS = 2
MIB = 2 ** 20
HEAP_POLL_S = 0.002


def _batch(vocab: int, prompt: int, response: int, seed: int):
    """One row: random prompt and response ids, every token real, the policy loss's columns (1, R)."""
    from hybridflow.batch import Batch

    g = torch.Generator().manual_seed(seed)
    return Batch({"prompt_ids": torch.randint(5, vocab, (1, prompt), generator=g),
                  "prompt_mask": torch.ones(1, prompt, dtype=torch.bool),
                  "response_ids": torch.randint(5, vocab, (1, response), generator=g),
                  "response_mask": torch.ones(1, response, dtype=torch.bool),
                  "old_log_probs": -torch.rand(1, response, generator=g) * 3,
                  "advantages": torch.randn(1, response, generator=g)})


def _worker(model_dir: str, rank: int, sp: int):
    """The actor as a run builds it at sequence-parallel size `sp` on this rank of two."""
    from hybridflow.config.schema import ActorConfig, HybridFlowConfig, ModelConfig
    from hybridflow.controller import WorkerContext
    from hybridflow.run.stage import prepare_stage
    from recipes.roles import actor_role

    actor = ActorConfig(samples_per_micro_batch=1, gradient_checkpointing=False)
    config = prepare_stage(HybridFlowConfig(model=ModelConfig(pack_sequences=True, share_prompts=False),
                                            actor=actor)).config
    # set past the plan's checks, which need a 2-rank actor pool for it (as tests/unit/test_ulysses.py does)
    config = dataclasses.replace(config, actor=dataclasses.replace(config.actor, sequence_parallel_size=sp))
    worker = actor_role(config, model_dir).build(WorkerContext(rank=rank, world_size=RANKS))
    worker.start()
    worker.optimizer.step = lambda: None  # the forward and backward alone: no AdamW moments
    return worker


def _measure(model_dir: str, rank: int, response: int, sp: int) -> dict:
    """One configuration on this rank: seconds and resident bytes of `run_objective` on one row."""
    from hybridflow.controller.memory import read_and_reset, trim_heap
    from hybridflow.training.objectives import PolicyObjective

    worker = _worker(model_dir, rank, sp)
    vocab = worker.model.config.vocab_size
    seed = rank if sp == 1 else 0  # SP 1: a row of each rank's own; SP 2: the group's one row
    warm = _batch(vocab, PROMPT_TOKENS, WARM_UP_RESPONSE_TOKENS, seed)
    worker.run_objective(warm, PolicyObjective(worker.cfg, worker.temperature), "actor")
    batch = _batch(vocab, PROMPT_TOKENS, response, seed)
    objective = PolicyObjective(worker.cfg, worker.temperature)
    trim_heap()
    start = read_and_reset(False)["rss_bytes"]
    began = time.perf_counter()
    stats = worker.run_objective(batch, objective, "actor")
    seconds = time.perf_counter() - began
    peak = read_and_reset(False)["rss_peak_bytes"]
    heap = _live_heap_peak(lambda: worker.run_objective(batch, PolicyObjective(worker.cfg, worker.temperature), "actor"))
    return {"response_tokens": response, "sp": sp, "rank": rank, "seconds": seconds, "start_bytes": start,
            "peak_bytes": peak, "peak_above_start_bytes": peak - start, "heap_peak_above_start_bytes": heap,
            "loss": stats["actor/loss"]}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_in_use() -> int:
    """glibc's bytes in use by live allocations, every arena and mmapped block (`mallinfo2`): what the tensors
    hold, without the freed heap the resident set keeps."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def _live_heap_peak(call) -> int:
    """The largest heap in use above its start while `call` runs again, sampled every `HEAP_POLL_S` by a thread:
    the tensors' own peak, where the resident set's also holds freed heap glibc has not handed back. A run of
    its own after the timed one (the sampler takes some of the two cores)."""
    start, peak, done = _heap_in_use(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _heap_in_use())
            time.sleep(HEAP_POLL_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        call()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], _heap_in_use()) - start


def _rank(rank: int, port: int, model_dir: str, jobs: list, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    try:
        results = [_measure(model_dir, rank, response, sp) for response, sp in jobs]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.barrier()  # neither rank tears gloo down while the other still talks to it
    finally:
        dist.destroy_process_group()


def _run(model_dir: Path, jobs: list[tuple[int, int]]) -> list[dict]:
    """`jobs` ((response tokens, SP) each) in order in one fresh pair of processes: per job, both ranks'."""
    import torch.multiprocessing as mp

    from tests.unit.test_gradient_splits import _free_port

    with tempfile.TemporaryDirectory(prefix="sp_bench_") as out:
        try:
            mp.start_processes(_rank, args=(_free_port(), str(model_dir), jobs, out), nprocs=RANKS, join=True,
                               start_method="spawn")
        except mp.ProcessExitedException:  # a rank aborted while gloo shut down, after both wrote their results
            if not all(Path(out, f"rank{rank}.json").exists() for rank in range(RANKS)):
                raise
            print(f"{jobs}: a rank aborted at exit, after both ranks wrote their results", flush=True)
        per_rank = [json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in range(RANKS)]
    return [[ranks[i] for ranks in per_rank] for i in range(len(jobs))]


def _prediction(model_dir: Path, response: int, sp: int) -> dict:
    """The memory model's micro-batch terms for one row of PROMPT_TOKENS + `response` at `sp`, float32."""
    from hybridflow.checks.memory_budget import MemoryInputs, ModelShape, micro_batch_terms

    inputs = MemoryInputs(shape=ModelShape.from_dir(model_dir), compute_bytes=4, master_bytes=4, rollout_bytes=4,
                          rows=1, prompt_tokens=PROMPT_TOKENS, response_tokens=response, checkpointing=False,
                          kv_cache_bytes=0.0)
    cpu = micro_batch_terms(inputs, attention_probabilities=True, sp=sp)
    plain = micro_batch_terms(inputs, attention_probabilities=False, sp=sp)
    return {"terms": cpu, "predicted_bytes": sum(cpu.values()),
            "predicted_without_probabilities_bytes": sum(plain.values())}


def _row(model_dir: Path, ranks: list[dict]) -> dict:
    response, sp = ranks[0]["response_tokens"], ranks[0]["sp"]
    row = {"response_tokens": response, "sp": sp, "ranks": ranks,
           "seconds": max(r["seconds"] for r in ranks),
           "peak_above_start_bytes": max(r["peak_above_start_bytes"] for r in ranks),
           "heap_peak_above_start_bytes": max(r["heap_peak_above_start_bytes"] for r in ranks),
           **_prediction(model_dir, response, sp)}
    for measured in ("peak_above_start_bytes", "heap_peak_above_start_bytes"):
        for predicted in ("predicted_bytes", "predicted_without_probabilities_bytes"):
            row[f"{measured}_over_{predicted}"] = row[measured] / row[predicted]
    print(f"R={response:>6} SP {sp}: {row['seconds']:.2f} s, peak {row['peak_above_start_bytes'] / MIB:.1f} MiB "
          f"above the start (heap in use {row['heap_peak_above_start_bytes'] / MIB:.1f}), "
          f"predicted {row['predicted_bytes'] / MIB:.1f} MiB "
          f"({row['predicted_without_probabilities_bytes'] / MIB:.1f} without attention probabilities)", flush=True)
    return row


def _longest(model_dir: Path, measured: dict, sp: int, limit: int, step: int, tries: int) -> dict:
    """The longest response whose peak above the start stays within `limit` bytes on every rank at `sp`: from
    the longest measured length that fits, up in `step` tokens (each new length in a fresh pair of processes)
    until one does not fit, at most `tries` new lengths (`exceeded` says whether one did)."""
    fits = [r for (r, s), row in measured.items() if s == sp and row["peak_above_start_bytes"] <= limit]
    longest, tried = max(fits, default=0), {}
    while len(tried) < tries or (longest + step, sp) in measured:
        response = longest + step
        if (response, sp) not in measured:
            (ranks,) = _run(model_dir, [(response, sp)])
            measured[(response, sp)] = _row(model_dir, ranks)
        tried[response] = measured[(response, sp)]["peak_above_start_bytes"]
        if tried[response] > limit:
            return {"sp": sp, "longest_response_tokens": longest, "exceeded": True, "tried": tried}
        longest = response
    return {"sp": sp, "longest_response_tokens": longest, "exceeded": False, "tried": tried}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="response tokens")
    parser.add_argument("--limit-at", type=int, default=4096,
                        help="the limit per rank is SP 1's measured peak above the start at this response length")
    parser.add_argument("--step", type=int, default=512, help="the longest-response search's step, in tokens")
    parser.add_argument("--tries", type=int, default=8, help="the search's new lengths per SP, at most")
    parser.add_argument("--dry-run", action="store_true", help="responses of 64 and 128 tokens, one pair of processes")
    parser.add_argument("--out", default="", help="the measurements as JSON")
    args = parser.parse_args()
    from hybridflow.builders import build_tiny_model
    from hybridflow.checks.memory_budget import ModelShape
    from hybridflow.config.schema import TinyModelConfig

    if args.dry_run:
        args.lengths, args.limit_at, args.step, args.tries = list(DRY_LENGTHS), DRY_LENGTHS[0], 64, 0
    positions = PROMPT_TOKENS + max(args.lengths) + (args.tries + 1) * args.step  # room for the search
    with tempfile.TemporaryDirectory(prefix="sp_bench_model_") as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny", TinyModelConfig(max_position_embeddings=positions))
        jobs = [(response, sp) for response in args.lengths for sp in (1, 2)]
        if args.dry_run:  # one pair of processes for all: seconds, not minutes
            measured = {job: _row(model_dir, ranks) for job, ranks in zip(jobs, _run(model_dir, jobs))}
        else:
            measured = {job: _row(model_dir, _run(model_dir, [job])[0]) for job in jobs}
        limit = measured[(args.limit_at, 1)]["peak_above_start_bytes"]
        longest = {sp: _longest(model_dir, measured, sp, limit, args.step, args.tries) for sp in (1, 2)}
        shape = dataclasses.asdict(ModelShape.from_dir(model_dir))
    emit({"model": "tiny", "model_shape": shape, "max_position_embeddings": positions, "prompt_tokens": PROMPT_TOKENS, "ranks": RANKS,
          "threads_per_rank": 1, "results": [measured[job] for job in jobs],
          "search": {"limit_bytes": limit, "limit_at_response_tokens": args.limit_at, "step_tokens": args.step,
                     "longest": longest,
                     "sp2_over_sp1": longest[2]["longest_response_tokens"] / max(longest[1]["longest_response_tokens"], 1)},
          "extra": [row for job, row in measured.items() if job not in jobs]}, args.out)


if __name__ == "__main__":
    main()
