"""LoRA GRPO on the real model, the adapter served by vLLM beside the folded whole-model sync.

    PYTHONPATH=. .venv/bin/python bench/lora_adapter_sync.py [--steps 30] [--rank 16] [--lr 1e-4] \
        [--modes adapter,folded] [--out bench/results/lora_adapter_sync.json]
    PYTHONPATH=. .venv/bin/python bench/lora_adapter_sync.py --dry-run   # each mode's command composed and checked
    PYTHONPATH=. .venv/bin/python bench/lora_adapter_sync.py --render-only A.json B.json   # one table, seeds as rows

The same `recipe=grpo` run twice, from the same seed, on SmolLM2-135M-Instruct (tests/real_model.py)
with a LoRA actor (rank `--rank` on every linear layer of the decoder): once with
`weight_sync.lora=adapter` (the factors alone, registered with vLLM under a new id each sync) and
once with `weight_sync.lora=folded` (the whole model with W + (alpha/r)BA folded in). The task and
shapes are docs/results/learning.md's real-model GRPO run (two-digit additions as chat, 8 prompts x 8
samples, answers of up to 64 tokens, bfloat16). Reported per mode, from the runs' own
metrics.jsonl: bytes each rollout rank received per sync, the whole model's bytes
(`weight_sync/engine_bytes_per_rank`) and their ratio, the sync's median seconds, the median step,
held-out accuracy (greedy, `--val-rows` prompts) at every validation, and the minutes; the JSON
goes to `--out` as it runs, the table between the markers in docs/resharding.md. Run nothing else
heavy meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

TARGETS = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"


def command(args, mode: str, inputs: dict, work: Path) -> list[str]:
    """The `hybridflow` overrides of one mode's run."""
    from tests.real_model import real_overrides

    common = [f"weight_sync.lora={mode}", f"actor.lora.rank={args.rank}", f"actor.lora.alpha={args.rank}",
              f"actor.lora.target_modules={TARGETS}", f"actor.optim.lr={args.lr}", f"seed={args.seed}",
              f"trainer.total_steps={args.steps}", f"trainer.val_every_steps={args.val_every}",
              f"trainer.prompts_per_step={args.prompts_per_step}",
              f"rollout.samples_per_prompt={args.samples_per_prompt}", "trainer.export_hf=false",
              "trainer.save_every_steps=0", f"logger.output_root={work / 'runs'}", f"logger.run_name={mode}",
              "logger.backends=[jsonl]"]
    if args.dry_run:  # the tiny model and the synthetic task, float32
        return ["recipe=grpo", *common, "trainer.val_prompts=4", "data.synthetic.val_rows=4",
                "rollout.max_response_tokens=4", "actor.samples_per_micro_batch=8"]
    return [*real_overrides(inputs["model"], inputs["train"], inputs["val"]), "recipe=grpo", *common,
            f"trainer.val_prompts={args.val_rows}", f"actor.samples_per_micro_batch={args.samples_per_micro_batch}",
            "model.dtype=bfloat16", "rollout.dtype=bfloat16"]


def summarize(run_dir: Path, command: list[str], wall_s: float) -> dict:
    """One mode's finished run, from its metrics.jsonl: bytes per sync against the engine's whole model,
    seconds, the checksums and the validations (tests/e2e/test_lora.py reads its own run with it)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    synced = [r for r in rows if "weight_sync/bytes_received_per_rank" in r]
    # the whole model's bytes in the rollout's dtype: the adapter sync logs them with every sync (the
    # folded one does not; main() takes them from the adapter run of the same model)
    engine = next((r["weight_sync/engine_bytes_per_rank"] for r in rows if "weight_sync/engine_bytes_per_rank" in r),
                  None)
    received = max(r["weight_sync/bytes_received_per_rank"] for r in synced)
    return {"command": command, "wall_s": wall_s,
            "steps": max(r["step"] for r in rows), "bytes_per_sync": received, "engine_bytes": engine,
            "fraction_of_full_model": None if engine is None else received / engine,
            "sync_s_median": statistics.median(r["weight_sync/seconds"] for r in synced),
            "step_s_median": statistics.median(r["timing/step_s"] for r in rows if "timing/step_s" in r),
            "verified_tensors": min(r.get("weight_sync/verified_tensors", 0.0) for r in synced),
            # the engine's sampled log-probs against the actor's on the batch trained, per step: a policy
            # served one update behind, or computed differently, shows here (docs/recipes.md)
            "mismatch": [{"step": r["step"], "abs_diff_mean": r["rollout_mismatch/abs_diff_mean"],
                          "k3_kl": r["rollout_mismatch/k3_kl"], "accuracy": r.get("reward/accuracy")}
                         for r in rows if "rollout_mismatch/k3_kl" in r],
            "validation": [{"step": r["step"], "accuracy": r["val/accuracy"], "elapsed_s": r["time/elapsed_s"]}
                           for r in rows if "val/accuracy" in r]}


def dry_run(args, work: Path) -> list[list[str]]:
    """Each mode's command on the tiny model, composed and checked as the command checks it; nothing run."""
    from hybridflow.run.pipeline_stages import compose_command

    commands = []
    for mode in args.modes.split(","):
        overrides = command(args, mode, {}, work)
        config = compose_command(overrides)
        if config.weight_sync.lora != mode or config.actor.lora.rank != args.rank:
            raise SystemExit(f"{mode}: the composed config does not carry weight_sync.lora={mode}, rank {args.rank}")
        print(f"{mode}: hybridflow {' '.join(overrides)}")
        commands.append(overrides)
    return commands


def run(args, mode: str, inputs: dict, work: Path) -> dict:
    overrides = command(args, mode, inputs, work)
    shutil.rmtree(work / "runs" / mode, ignore_errors=True)
    log = work / f"{mode}.log"
    print(f"{mode}: hybridflow {' '.join(overrides)}\n  log: {log}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        subprocess.run([str(Path(sys.executable).parent / "hybridflow"), *overrides], cwd=ROOT, stdout=out,
                       stderr=subprocess.STDOUT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return summarize(work / "runs" / mode, ["hybridflow", *overrides], time.perf_counter() - start)


BEGIN, END = "<!-- lora_adapter_sync:begin -->", "<!-- lora_adapter_sync:end -->"


def render(reports: list[dict]) -> str:
    """The table for docs/resharding.md, one row per report (seed) and mode."""
    a = reports[0]["args"]
    steps = sorted({v["step"] for rep in reports for r in rep["modes"].values() for v in r["validation"]})
    dates = " and ".join(dict.fromkeys(f"{r['date']} (seed {r['args']['seed']})" for r in reports))
    lines = [f"Measured {dates} on this machine ({reports[0]['cpu']}): `bench/lora_adapter_sync.py` "
             f"(SmolLM2-135M-Instruct, LoRA rank {a['rank']} on every linear layer of the decoder, alpha = r, lr "
             f"{a['lr']:g}, {a['prompts_per_step']} prompts x {a['samples_per_prompt']} samples, answers of up to 64 "
             f"tokens, bfloat16, {a['steps']} steps; held-out accuracy greedy on {a['val_rows']} prompts).", "",
             "| seed | `weight_sync.lora` | bytes per sync | of the whole model | sync s (median) | step s (median) | "
             + " | ".join(f"accuracy at step {s}" for s in steps) + " | minutes |",
             "| ---: | --- |" + " ---: |" * (5 + len(steps))]
    for rep in reports:
        for mode, r in rep["modes"].items():
            acc = {v["step"]: v["accuracy"] for v in r["validation"]}
            lines.append(f"| {rep['args']['seed']} | {mode} | {r['bytes_per_sync'] / 2 ** 20:.1f} MiB | "
                         + (f"{r['fraction_of_full_model']:.1%}" if r["fraction_of_full_model"] is not None else "")
                         + f" | {r['sync_s_median']:.2f} | {r['step_s_median']:.1f} | "
                         + " | ".join(f"{acc[s]:.2f}" if s in acc else "" for s in steps)
                         + f" | {r['wall_s'] / 60:.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="adapter,folded")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--val-every", type=int, default=10)
    p.add_argument("--val-rows", type=int, default=100)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--samples-per-micro-batch", type=int, default=16, help="per rank")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="/tmp/lora_adapter_sync")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "lora_adapter_sync.json"))
    p.add_argument("--dry-run", action="store_true", help="compose and check each mode's command on the tiny model; "
                                                          "run nothing")
    p.add_argument("--doc", default=str(ROOT / "docs" / "resharding.md"), help="where the table goes (not in a dry run)")
    p.add_argument("--render-only", nargs="*", metavar="JSON",
                   help="rewrite the doc's table from these reports (one per seed), running nothing")
    args = p.parse_args()
    if args.render_only is not None:
        from doc_markers import write_between

        reports = [json.loads(Path(f).read_text()) for f in args.render_only or [args.out]]
        write_between(Path(args.doc), BEGIN, END, render(reports))
        return
    work = Path(args.work).resolve()
    if args.dry_run:
        args.steps, args.val_every, args.rank = 1, 1, 4
        dry_run(args, work)
        return
    work.mkdir(parents=True, exist_ok=True)
    from tests.real_model import real_model_dir, write_chat_addition

    train, val = write_chat_addition(work / "data", train_rows=2000, val_rows=args.val_rows)
    inputs = {"model": real_model_dir(), "train": train, "val": val}
    from hybridflow.precision import cpu_description

    cpu = cpu_description()
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu, "args": vars(args),
              "modes": {}}
    for mode in args.modes.split(","):
        report["modes"][mode] = run(args, mode, inputs, work)
        engine = next((r["engine_bytes"] for r in report["modes"].values() if r["engine_bytes"]), None)
        for r in report["modes"].values():
            if r["engine_bytes"] is None and engine is not None:
                r["engine_bytes"], r["fraction_of_full_model"] = engine, r["bytes_per_sync"] / engine
        Path(args.out).write_text(json.dumps(report, indent=1))  # as it goes
    print(json.dumps({m: {k: v for k, v in r.items() if k != "command"} for m, r in report["modes"].items()},
                     indent=1))
    from doc_markers import write_between

    write_between(Path(args.doc), BEGIN, END, render([report]))


if __name__ == "__main__":
    main()
