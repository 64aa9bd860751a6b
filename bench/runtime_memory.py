"""What a worker process holds before any model: the runtime term of the memory floor.

    PYTHONPATH=. .venv/bin/python bench/runtime_memory.py [--work /tmp/runtime_memory]
    PYTHONPATH=. .venv/bin/python bench/runtime_memory.py --dry-run --out x.json   # compose and check; run nothing

Runs the embedded default GRPO (the tiny model, a few MB of weights and optimizer state) for 3
steps with the rollout on a pool of its own (`placement=disaggregated`), twice: with
`rollout.kv_cache_space_gib` 1 and 2. The training pool's resident set at the end of a step is the
runtime without vLLM (Python, torch, Ray, gloo); the rollout pool's, less its KV cache, is the
runtime with vLLM; the difference between the two runs' rollout pools shows how much of the KV
cache is resident. hybridflow/checks/memory_budget.py's RUNTIME_BYTES* are these numbers, rounded down.

The measurement is two whole runs (Ray, vLLM, minutes), so the dry run (tests/unit/
test_bench_dry_runs_measure.py) runs neither: it composes both commands and checks them as
`hybridflow` does before anything starts, and checks that the pools whose metrics the summary reads
(`memory/<pool>_rss_gib`) are the placement's pools of the actor and of the rollout, with the KV cache
each run asks for; its JSON names the commands, the metric keys and memory_budget.py's numbers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from report import emit  # noqa: E402

POOLS = {"actor": "train", "rollout": "gen"}  # placement=disaggregated: the role -> its pool, whose metrics are read
KV_CACHE_GIB = (1, 2)


def command(work: Path, kv_gib: int) -> list[str]:
    """The run with a `kv_gib` KV cache: the embedded default GRPO, its rollout on a pool of its own."""
    return [str(Path(sys.executable).parent / "hybridflow"), "recipe=grpo", "placement=disaggregated",
            "trainer.total_steps=3", "trainer.val_every_steps=0", "trainer.save_every_steps=0",
            "trainer.export_hf=false", f"rollout.kv_cache_space_gib={kv_gib}", f"logger.output_root={work / f'kv{kv_gib}'}",
            "logger.run_name=runtime", "logger.backends=[jsonl]"]


def metric_keys() -> dict[str, str]:
    train, gen = POOLS["actor"], POOLS["rollout"]
    return {"train": f"memory/{train}_rss_gib", "gen": f"memory/{gen}_rss_gib", "gen_peak": f"memory/{gen}_peak_gib"}


def run(work: Path, kv_gib: int) -> dict[str, float]:
    out = work / f"kv{kv_gib}"
    shutil.rmtree(out, ignore_errors=True)
    argv = command(work, kv_gib)
    print(" ".join(argv[1:]), flush=True)
    subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "runtime" / "metrics.jsonl").read_text().splitlines()]
    last, keys = rows[-1], metric_keys()
    return {"train": last[keys["train"]], "gen": last[keys["gen"]], "gen_peak": max(r[keys["gen_peak"]] for r in rows)}


def dry_run(work: Path) -> dict:
    """Both runs' commands composed and checked as `hybridflow` checks them, nothing run: each places the
    actor and the rollout on the pools whose metrics `run` reads, with the KV cache it names."""
    from hybridflow.run.pipeline_stages import compose_command
    from hybridflow.checks.memory_budget import RUNTIME_BYTES, RUNTIME_BYTES_WITH_VLLM
    from hybridflow.planning.auto import decide_plan

    commands = {}
    for kv_gib in KV_CACHE_GIB:
        argv = command(work, kv_gib)
        if not Path(argv[0]).exists():
            raise SystemExit(f"{argv[0]} does not exist: install the project into this environment (pip install -e .)")
        config = compose_command(argv[1:])
        plan = decide_plan(config).plan  # the pools a run places its roles on
        placed = {role: plan.pool_of(role).name for role in POOLS}
        rollout = (config.rollout.backend, config.rollout.kv_cache_space_gib)
        if placed != POOLS or rollout != ("vllm", kv_gib):
            raise SystemExit(f"kv {kv_gib}: the command places {placed} with a rollout (backend, KV GiB) of "
                             f"{rollout}; the summary reads the pools {POOLS} of a vLLM rollout with {kv_gib} GiB: "
                             "update POOLS or command() in bench/runtime_memory.py")
        commands[kv_gib] = {"command": " ".join(argv), "roles": placed, "rollout_backend": config.rollout.backend,
                            "total_steps": config.trainer.total_steps}
    return {"dry_run": True, "commands": commands, "metric_keys": metric_keys(),
            "runtime_bytes": RUNTIME_BYTES, "runtime_bytes_with_vllm": RUNTIME_BYTES_WITH_VLLM}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/runtime_memory"))
    p.add_argument("--dry-run", action="store_true", help="compose and check both commands; run nothing")
    p.add_argument("--out", default="", help="the dry run's report as JSON")
    args = p.parse_args()
    if args.dry_run:
        return emit(dry_run(args.work), args.out)
    one, two = (run(args.work, kv_gib) for kv_gib in KV_CACHE_GIB)
    print(f"training process, no engine: {one['train']:.2f} / {two['train']:.2f} GiB resident at the end of step 3")
    print(f"rollout process: {one['gen']:.2f} GiB with a 1 GiB KV cache, {two['gen']:.2f} GiB with 2 GiB "
          f"(resident share of the second GiB: {two['gen'] - one['gen']:.2f})")
    print(f"runtime with vLLM, less a fully resident KV cache: {one['gen'] - 1:.2f} GiB")


if __name__ == "__main__":
    main()
