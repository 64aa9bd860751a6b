"""Memory over a long GRPO run on the real model: each step's peak against step 10's and the floor.

    PYTHONPATH=. .venv/bin/python bench/memory_steps.py --steps 200 [--work /tmp/memory_steps] [-- extra overrides]
    PYTHONPATH=. .venv/bin/python bench/memory_steps.py --dry-run [--steps 12]   # compose, check, render; run nothing

Runs `hybridflow recipe=grpo` on SmolLM2-135M-Instruct (tests/real_model.py) with chat prompts of
~46 tokens and answers of up to 64 tokens, in the model's bfloat16 compute over float32 masters
with a bfloat16 engine, micro-batch sizes left to the run (chosen from the memory available), then
reads `memory/global_peak_gib` and `memory/global_rss_gib` of every step from its metrics and
compares them with the floor of hybridflow/checks/memory_budget.py for the configuration the run saved.
The verdict the issue asks for: the last step's peak at most 1.1 x step 10's, every peak at most
1.5 x the floor. The table goes between the markers in docs/results/memory.md.

`--dry-run` composes and checks the command as `hybridflow` checks it (the step count, batch,
validation, dtypes and the `global` pool whose memory metrics the table reads must reach the
composed config) with the tiny model (built into a temporary directory) in place of the real one,
chooses its micro-batch and saves its config.json as the run does before it starts, then writes a
small metrics.jsonl and runs the floor, the table and the write between the markers on them, into a
temporary copy of the doc. It starts no Ray, engine or training and leaves docs/ and --work alone.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from composed import carried, write_metrics  # noqa: E402
from doc_markers import write_between  # noqa: E402

BEGIN, END = "<!-- memory_steps:begin -->", "<!-- memory_steps:end -->"


def varied(args) -> list[str]:
    """What the bench sets and its table reports: the step count, the batch, validation, the dtypes."""
    return [f"trainer.total_steps={args.steps}", f"trainer.prompts_per_step={args.prompts_per_step}",
            f"rollout.samples_per_prompt={args.samples}", f"trainer.val_every_steps={args.val_every}",
            f"trainer.val_prompts={args.val_prompts}", "model.dtype=bfloat16", "rollout.dtype=bfloat16"]


def overrides_of(args, model_dir: Path, train: Path, val: Path, run_dir: Path, extra: list[str]) -> list[str]:
    """The `hybridflow` overrides of the run."""
    from tests.real_model import real_overrides

    return [*real_overrides(model_dir, train, val), "recipe=grpo", *varied(args), "actor.optim.lr=1e-5",
            "trainer.export_hf=false", "trainer.save_every_steps=0", f"logger.output_root={run_dir.parent}",
            "logger.run_name=memory", "logger.backends=[jsonl]", *extra]


def run(args, extra: list[str]) -> tuple[list[str], Path]:
    from tests.real_model import real_model_dir, write_chat_addition

    train, val = write_chat_addition(args.work / "data", train_rows=2000, val_rows=args.val_prompts)
    run_dir = args.work / "runs" / "memory"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = overrides_of(args, real_model_dir(), train, val, run_dir, extra)
    command = [str(Path(sys.executable).parent / "hybridflow"), *overrides]
    print(" ".join(command), flush=True)
    with open(args.work / "memory.log", "w") as log:
        subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    return ["hybridflow", *overrides], run_dir


def floor_gib(run_dir: Path) -> tuple[float, dict]:
    """The floor per process of the configuration the run saved, at the micro-batch it formed (the
    chosen size, or the rows a rank holds when fewer)."""
    from hybridflow.config import compose
    from hybridflow.checks.memory_budget import GIB, ModelShape, actor_pool_roles, process_terms
    from hybridflow.planning.auto import decide_plan

    saved = json.loads((run_dir / "config.json").read_text())
    pool = saved["placement"]["pools"][saved["placement"]["roles"]["actor"]]
    per_rank = saved["trainer"]["prompts_per_step"] * saved["rollout"]["samples_per_prompt"] // (
        pool["nodes"] * pool["devices_per_node"])
    rows = min(saved["actor"]["samples_per_micro_batch"], per_rank)  # the micro-batch the run really formed
    config = compose(["model=local_hf", f"model.path={saved['model']['path']}",
                      f"model.dtype={saved['model']['dtype']}", f"rollout.dtype={saved['rollout']['dtype']}",
                      f"data.max_prompt_tokens={saved['data']['max_prompt_tokens']}",
                      f"rollout.max_response_tokens={saved['rollout']['max_response_tokens']}",
                      f"actor.samples_per_micro_batch={rows}",
                      f"actor.gradient_checkpointing={str(saved['actor']['gradient_checkpointing']).lower()}"])
    plan = decide_plan(config).plan
    terms = process_terms(config, plan, ModelShape.from_dir(saved["model"]["path"]), actor_pool_roles(config, plan))
    return sum(terms.values()) / GIB, {k: v / GIB for k, v in terms.items()}


def render(rows: list[dict], floor: float, terms: dict, command: list[str], args, run_dir: Path) -> str:
    saved = json.loads((run_dir / "config.json").read_text())
    peaks = [r["memory/global_peak_gib"] for r in rows]
    at10, last = peaks[9], peaks[-1]
    shown = sorted({1, 10, 25, 50, 75, 100, 125, 150, 175, len(rows)} & set(range(1, len(rows) + 1)))
    lines = [f"Measured {time.strftime('%Y-%m-%d', time.gmtime())} on this machine, {len(rows)} GRPO steps of "
             f"{args.prompts_per_step} prompts x {args.samples} samples, micro-batch "
             f"{saved['actor']['samples_per_micro_batch']} rows chosen by the run (gradient checkpointing "
             f"{str(saved['actor']['gradient_checkpointing']).lower()}); floor per process {floor:.2f} GiB "
             "(" + ", ".join(f"{k.split(' (')[0]} {v:.2f}" for k, v in terms.items()) + ").", "",
             "| step | peak GiB | resident GiB at the end | peak / floor | held-out accuracy |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for step in shown:
        r = rows[step - 1]
        acc = f"{r['val/accuracy']:.2f}" if "val/accuracy" in r else ""
        lines.append(f"| {step} | {r['memory/global_peak_gib']:.2f} | {r['memory/global_rss_gib']:.2f} | "
                     f"{r['memory/global_peak_gib'] / floor:.2f} | {acc} |")
    rss = [r["memory/global_rss_gib"] for r in rows]
    early, late = statistics.median(peaks[5:15]), statistics.median(peaks[-10:])
    lines += ["", f"Last step's peak / step 10's: **{last / at10:.2f}** (target <= 1.1); median peak of the last 10 "
              f"steps / of steps 6-15: **{late / early:.2f}** (a step's peak follows the rows it trains, so one "
              f"step against another is noisy); resident set at the end of steps 6-15 / the last 10: "
              f"{statistics.median(rss[5:15]):.2f} / {statistics.median(rss[-10:]):.2f} GiB; largest peak / floor: "
              f"**{max(peaks) / floor:.2f}** (target <= 1.5); median peak {statistics.median(peaks):.2f} GiB; resident "
              f"set at the end of a step from {min(rss):.2f} to {max(rss):.2f} GiB; "
              f"{rows[-1]['time/elapsed_s'] / 60:.0f} minutes in all.", "", "```",
              f"PYTHONPATH=. .venv/bin/python bench/memory_steps.py --steps {args.steps} --val-every {args.val_every} "
              f"--val-prompts {args.val_prompts}", "```", "",
              "which ran:", "", "```", " ".join(command).replace(str(ROOT) + "/", ""), "```"]
    return "\n".join(lines)


def dry_run_rows(args) -> list[dict]:
    """A metrics.jsonl's rows as the run logs them: each step's peak 0.01 GiB above the one before (from
    1.01), the resident set 0.2 below, 6 s a step, validations where hybridflow.run.runner.validation_due has them."""
    return [{"step": step, "memory/global_peak_gib": 1.0 + 0.01 * step, "memory/global_rss_gib": 0.8 + 0.01 * step,
             "time/elapsed_s": 6.0 * step,
             **({"val/accuracy": 0.25} if args.val_every and step % args.val_every == 0 or step == args.steps else {})}
            for step in range(1, args.steps + 1)]


def dry_run(args, extra: list[str], work: Path) -> str:
    """The command composed and checked as `hybridflow` checks it, on the tiny model; the run's saved
    config.json as the run writes it before starting; the table rendered from a small metrics.jsonl
    into a copy of the doc under `work`. Returns the table."""
    from hybridflow.builders import build_tiny_model
    from hybridflow.run.pipeline_stages import compose_command
    from hybridflow.checks.memory_budget import resolve_micro_batches
    from hybridflow.planning.auto import decide_plan
    from hybridflow.output.tracking import save_config
    from tests.real_model import write_chat_addition

    train, val = write_chat_addition(work / "data", train_rows=2000, val_rows=args.val_prompts)
    run_dir = work / "runs" / "memory"
    overrides = overrides_of(args, build_tiny_model(work / "model"), train, val, run_dir, extra)
    config = compose_command(overrides)
    missed = [o for o in varied(args) if not carried(config, o)]
    plan = decide_plan(config).plan
    if plan.pool_of("actor").name != "global":  # the table reads memory/global_peak_gib and memory/global_rss_gib
        missed.append(f"the actor on pool 'global' (it is on {plan.pool_of('actor').name!r})")
    if missed:
        raise SystemExit(f"the composed config does not carry {', '.join(missed)}")
    print(f"memory: hybridflow {' '.join(overrides)}")
    config, _ = resolve_micro_batches(config, plan)  # the run's own choice before it starts (hybridflow.run.runner)
    run_dir.mkdir(parents=True)
    save_config(config, run_dir)
    rows = dry_run_rows(args)
    write_metrics(run_dir, rows)
    floor, terms = floor_gib(run_dir)
    text = render(rows, floor, terms, ["hybridflow", *overrides], args, run_dir)
    doc = work / args.doc.name
    shutil.copyfile(args.doc, doc)
    write_between(doc, BEGIN, END, text)
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--val-every", type=int, default=50)
    p.add_argument("--val-prompts", type=int, default=100)
    p.add_argument("--work", type=Path, default=Path("/tmp/memory_steps"))
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "results" / "memory.md")
    p.add_argument("--render-only", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="compose and check the command on the tiny model, "
                                                          "render the table from small metrics into a temporary "
                                                          "copy of the doc")
    args, extra = p.parse_known_args()
    if args.steps < 10:
        p.error(f"--steps {args.steps}: the table compares step 10's peak with the last one's; give 10 or more")
    if args.dry_run:
        import tempfile

        with tempfile.TemporaryDirectory() as work:
            print(dry_run(args, [e for e in extra if e != "--"], Path(work)))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    if args.render_only:
        command, run_dir = json.loads((args.work / "command.json").read_text()), args.work / "runs" / "memory"
    else:
        command, run_dir = run(args, [e for e in extra if e != "--"])
        (args.work / "command.json").write_text(json.dumps(command))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    floor, terms = floor_gib(run_dir)
    text = render(rows, floor, terms, command, args, run_dir)
    write_between(args.doc, BEGIN, END, text)
    print(text)


if __name__ == "__main__":
    main()
