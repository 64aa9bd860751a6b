"""What a worker process holds before any model: the runtime term of the memory floor.

    PYTHONPATH=. .venv/bin/python bench/runtime_memory.py [--work /tmp/runtime_memory]

Runs the embedded default GRPO (the tiny model, a few MB of weights and optimizer state) for 3
steps with the rollout on a pool of its own (`placement=disaggregated`), twice: with
`rollout.kv_cache_space_gib` 1 and 2. The training pool's resident set at the end of a step is the
runtime without vLLM (Python, torch, Ray, gloo); the rollout pool's, less its KV cache, is the
runtime with vLLM; the difference between the two runs' rollout pools shows how much of the KV
cache is resident. hybridflow/memory_budget.py's RUNTIME_BYTES* are these numbers, rounded down.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(work: Path, kv_gib: int) -> dict[str, float]:
    out = work / f"kv{kv_gib}"
    shutil.rmtree(out, ignore_errors=True)
    command = [str(Path(sys.executable).parent / "hybridflow"), "recipe=grpo", "placement=disaggregated",
               "trainer.total_steps=3", "trainer.val_every_steps=0", "trainer.save_every_steps=0",
               "trainer.export_hf=false", f"rollout.kv_cache_space_gib={kv_gib}", f"logger.output_root={out}",
               "logger.run_name=runtime", "logger.backends=[jsonl]"]
    print(" ".join(command[1:]), flush=True)
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "runtime" / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    return {"train": last["memory/train_rss_gib"], "gen": last["memory/gen_rss_gib"],
            "gen_peak": max(r["memory/gen_peak_gib"] for r in rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/runtime_memory"))
    args = p.parse_args()
    one, two = run(args.work, 1), run(args.work, 2)
    print(f"training process, no engine: {one['train']:.2f} / {two['train']:.2f} GiB resident at the end of step 3")
    print(f"rollout process: {one['gen']:.2f} GiB with a 1 GiB KV cache, {two['gen']:.2f} GiB with 2 GiB "
          f"(resident share of the second GiB: {two['gen'] - one['gen']:.2f})")
    print(f"runtime with vLLM, less a fully resident KV cache: {one['gen'] - 1:.2f} GiB")


if __name__ == "__main__":
    main()
