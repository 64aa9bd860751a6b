"""DPO on a real model, HybridFlow beside TRL: SmolLM2-135M-Instruct on a preference set built here.

    PYTHONPATH=. .venv/bin/python bench/dpo_vs_trl.py [--steps 40] [--val-every 10] [--sides hybridflow,trl]
    PYTHONPATH=. .venv/bin/python bench/dpo_vs_trl.py --dry-run --out F   # compose and check HybridFlow's command; build the data

The preference set: two-digit additions asked as chat messages (tests/real_model.py, ~46 prompt
tokens under the model's ChatML template); the chosen response is the right number, the rejected one
a near miss (one digit off by one: hybridflow/data/preference.py), both in TRL's conversational form.
Both sides get the same inputs: the real model, the training pairs in the order HybridFlow's loader
draws them (TRL reads them unshuffled), the same pairs per step, one optimizer step per batch,
learning rate (constant, no warm-up), beta, the sigmoid loss, and the compute dtype. Each side's
held-out numbers are on the same validation pairs, before the first step and every `--val-every`
steps: the DPO loss, TRL's implicit-reward accuracy and margin, and the preference accuracy (the
share of held-out pairs whose chosen answer the policy itself gives the higher log-probability,
computed the same plain way on both sides for TRL, by the recipe for HybridFlow). Wall time is the
seconds since training began, validation included on both sides.

HybridFlow runs its real `recipe=dpo` (Ray, one FSDP2 rank on 2 cores, the reference role beside it);
TRL runs bench/trl_dpo_steps.py in its own environment (bench/trl_env.sh), one process on 2 threads.
Results go to `<work>/results.json` (and `--out`), the table between the markers in docs/recipes.md.
Run nothing else heavy meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from doc_markers import write_between  # noqa: E402
from trl_side import trl_process_env  # noqa: E402

BEGIN, END = "<!-- dpo_vs_trl:begin -->", "<!-- dpo_vs_trl:end -->"
LABELS = {"hybridflow": "HybridFlow recipe=dpo (1 FSDP2 rank + reference, 2 cores)",
          "trl": "TRL DPOTrainer (1 process, 2 threads)"}
METRICS = ("preference_accuracy", "reward_accuracy", "reward_margin", "preference_loss")
# the run's held-out metric of each (TRL's names: rewards/accuracies, rewards/margins)
RUN_METRICS = {"preference_accuracy": "val/preference_accuracy", "reward_accuracy": "val/rewards/accuracies",
               "reward_margin": "val/rewards/margins", "preference_loss": "val/preference_loss"}


def as_pairs(rows: list[dict], seed: int) -> list[dict]:
    """Chat-addition rows as TRL conversational preference rows: the right number chosen, a near miss rejected."""
    from hybridflow.data.preference import synthetic_pairs

    return [{"prompt": row["prompt"], "chosen": [{"role": "assistant", "content": row["chosen"]}],
             "rejected": [{"role": "assistant", "content": row["rejected"]}]} for row in synthetic_pairs(rows, seed)]


def prepare(work: Path, args) -> dict:
    """The pair files, and the training pairs in the order HybridFlow's loader draws them."""
    from hybridflow.data.loader import PromptLoader
    from hybridflow.data.rows import read_rows, write_rows
    from tests.real_model import real_model_dir, write_chat_addition

    data = work / "data"
    train_rows, val_rows = write_chat_addition(data / "rows", train_rows=args.train_rows, val_rows=args.val_rows)
    train = write_rows(as_pairs(read_rows(train_rows), seed=0), data / "train.jsonl")
    val = write_rows(as_pairs(read_rows(val_rows), seed=1), data / "val.jsonl")
    loader = PromptLoader(read_rows(train), args.pairs_per_step, seed=args.seed)
    ordered = [row for _ in range(args.steps) for row in loader.next_rows()]
    in_order = write_rows(ordered, data / "train_in_step_order.jsonl")
    return {"model": None if args.dry_run else real_model_dir(), "train": train, "val": val, "in_order": in_order}


def hybridflow_overrides(args, inputs: dict, work: Path) -> list[str]:
    return ["recipe=dpo", "model=local_hf", f"model.path={inputs['model'] or '/models/SmolLM2-135M-Instruct'}",
            "data=files", f"data.train_path={inputs['train']}", f"data.val_path={inputs['val']}",
            "data.max_prompt_tokens=64", "rollout.max_response_tokens=8", f"trainer.total_steps={args.steps}",
            f"trainer.val_every_steps={args.val_every}", f"trainer.val_prompts={args.val_rows}",
            f"trainer.prompts_per_step={args.pairs_per_step}", f"actor.optim.lr={args.lr}",
            "actor.optim.lr_schedule=constant", "actor.optim.warmup_steps=0", f"dpo.beta={args.beta}",
            f"actor.samples_per_micro_batch={2 * args.pairs_per_step}", "actor.gradient_checkpointing=false",
            f"model.dtype={args.dtype}",
            "trainer.save_every_steps=0", "trainer.export_hf=false", f"seed={args.seed}",
            f"logger.output_root={work / 'runs'}", "logger.run_name=hybridflow", "logger.backends=[jsonl]"]


def run_hybridflow(args, inputs: dict, work: Path) -> dict:
    overrides = hybridflow_overrides(args, inputs, work)
    shutil.rmtree(work / "runs" / "hybridflow", ignore_errors=True)  # a fresh run each time
    log = work / "hybridflow.log"
    print(f"HybridFlow: hybridflow {' '.join(overrides)}\n  log: {log}", flush=True)
    with open(log, "w") as out:
        subprocess.run([str(Path(sys.executable).parent / "hybridflow"), *overrides], cwd=ROOT, stdout=out,
                       stderr=subprocess.STDOUT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    rows = [json.loads(line) for line in (work / "runs" / "hybridflow" / "metrics.jsonl").read_text().splitlines()]
    started = rows[0].get("time/elapsed_s", 0.0)  # the step-0 validation, before training
    curve = [{"step": r["step"], **{m: r[RUN_METRICS[m]] for m in METRICS},
              "elapsed_s": r["time/elapsed_s"] - started if r["step"] else 0.0}
             for r in rows if "val/preference_loss" in r]
    return {"command": ["hybridflow", *overrides], "validation": curve,
            "step_s": [r["timing/update_s"] for r in rows if "timing/update_s" in r]}


def run_trl(args, inputs: dict, work: Path) -> dict:
    python = Path(args.trl_venv) / "bin" / "python"
    out = work / "trl.json"
    command = [str(python), str(ROOT / "bench" / "trl_dpo_steps.py"), "--model", str(inputs["model"]),
               "--train", str(inputs["in_order"]), "--val", str(inputs["val"]), "--out", str(out),
               "--steps", str(args.steps), "--pairs-per-step", str(args.pairs_per_step), "--lr", str(args.lr),
               "--beta", str(args.beta), "--val-every", str(args.val_every), "--dtype", args.dtype, "--threads", "2"]
    log = work / "trl.log"
    print(f"TRL: {' '.join(command)}\n  log: {log}", flush=True)
    env = trl_process_env()
    with open(log, "w") as f:
        subprocess.run(command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, check=True)
    result = json.loads(out.read_text())
    return {"command": command, **result}


def render(results: dict) -> str:
    a = results["args"]
    sides = results["sides"]
    steps = sorted({p["step"] for r in sides.values() for p in r["validation"]})
    lines = [f"Measured {results['date']} on this machine ({results['cpu']}): {a['pairs_per_step']} pairs per step, "
             f"lr {a['lr']} constant, beta {a['beta']}, sigmoid loss, {a['dtype']}, {a['steps']} steps; held-out "
             f"numbers on {a['val_rows']} pairs.", ""]
    for metric, title in (("preference_accuracy", "preference accuracy (the policy's own log-probs)"),
                          ("reward_accuracy", "implicit-reward accuracy (TRL's rewards/accuracies)"),
                          ("reward_margin", "implicit-reward margin (TRL's rewards/margins)")):
        lines += [f"| {title} at step | " + " | ".join(str(s) for s in steps) + " |", "| --- |" + " ---: |" * len(steps)]
        for side, r in sides.items():
            by_step = {p["step"]: p[metric] for p in r["validation"]}
            lines.append(f"| {LABELS[side]} | " + " | ".join(f"{by_step[s]:.3f}" if s in by_step else "" for s in steps)
                         + " |")
        lines.append("")
    lines.append("Minutes from the first step to the last validation: " + ", ".join(
        f"{LABELS[side]} {r['validation'][-1]['elapsed_s'] / 60:.1f}" for side, r in sides.items()) + ".")
    lines += ["", "The commands the script ran:", ""]
    for side, r in sides.items():
        cmd = " ".join(str(c) for c in r["command"]).replace(str(ROOT) + "/", "")
        lines += [f"{LABELS[side]}:", "", "```", cmd, "```", ""]
    return "\n".join(lines).rstrip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sides", default="hybridflow,trl", help="comma-separated; empty: run none, finish the results")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--val-every", type=int, default=10)
    p.add_argument("--train-rows", type=int, default=2000)
    p.add_argument("--val-rows", type=int, default=200)
    p.add_argument("--pairs-per-step", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-6)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="compute dtype over float32 weights on both sides (no activation checkpointing on either)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="/tmp/dpo_vs_trl")
    p.add_argument("--trl-venv", default=str(ROOT / "bench" / ".trl-venv"))
    p.add_argument("--doc", default=str(ROOT / "docs" / "recipes.md"))
    p.add_argument("--out", default=None, help="also write the results JSON here")
    p.add_argument("--dry-run", action="store_true", help="build the data and check HybridFlow's command; run nothing")
    p.add_argument("--render-only", action="store_true", help="rewrite the doc from <work>/results.json")
    args = p.parse_args()
    work = Path(args.work).resolve()
    results_path = work / "results.json"
    if args.dry_run:
        from hybridflow.config import compose

        args.steps, args.train_rows, args.val_rows = 2, 64, 8
        work.mkdir(parents=True, exist_ok=True)
        inputs = prepare(work, args)
        overrides = hybridflow_overrides(args, inputs, work)
        config = compose(overrides)  # the schema's rules, as `hybridflow` checks them
        report = {"overrides": overrides, "recipe": config.recipe.name, "needs_reference": config.needs_reference,
                  "train_pairs": sum(1 for _ in open(inputs["train"])),
                  "ordered_pairs": sum(1 for _ in open(inputs["in_order"])),
                  "first_pair": json.loads(Path(inputs["train"]).read_text().splitlines()[0])}
        Path(args.out or work / "dry_run.json").write_text(json.dumps(report, indent=1))
        print(json.dumps(report, indent=1))
        return
    if not args.render_only:
        work.mkdir(parents=True, exist_ok=True)
        if "trl" in args.sides:
            subprocess.run(["bash", str(ROOT / "bench" / "trl_env.sh"), args.trl_venv], check=True)
        inputs = prepare(work, args)
        from hybridflow.precision import cpu_description

        old = json.loads(results_path.read_text())["sides"] if results_path.exists() else {}
        results = {"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "cpu": cpu_description(), "sides": old}
        for side in filter(None, args.sides.split(",")):
            results["sides"][side] = run_hybridflow(args, inputs, work) if side == "hybridflow" else \
                run_trl(args, inputs, work)
            results_path.write_text(json.dumps(results, indent=1))
    results = json.loads(results_path.read_text())
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    write_between(Path(args.doc), BEGIN, END, render(results))
    print(render(results))


if __name__ == "__main__":
    main()
