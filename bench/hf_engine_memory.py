"""The `hf` engine's generation peak beside transformers' plain `generate` (which can only return the
log-probs it sampled from by keeping every step's scores), on SmolLM2-135M at 128 rows x 256 response
tokens, against the floor the engine needs: its weights + the KV cache + one step's logits.

    python bench/hf_engine_memory.py [--rows 128] [--tokens 256] [--out bench/results/hf_engine_memory.json]
    python bench/hf_engine_memory.py --dry-run --out x.json   # the tiny model, 4 rows x 8 tokens (a test runs it)

Each side runs in a process of its own (the peak resident set of a process is its own, and freed
memory does not come back to a later reading): the model loaded, then one generation of the same
prompts (greedy), the process's peak resident set before and after; the generation's own peak is the
weights plus what generating added to the peak (the process's runtime is in neither side's floor). The plain side asks `generate`
for `output_scores=True`, as the engine did before it had its own loop (its scores: rows x tokens x
vocabulary floats). Results: docs/results/memory.md "The hf engine's generation peak". Its pieces (the
prompts, a started engine, plain `generate`, a side in a process of its own) serve bench/engine_speed.py too.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


THREADS = 2  # torch's threads in each side's process (the 2-core machines these results come from)
MAX_PROMPT_TOKENS = 32  # the arithmetic prompts are up to ~10 tokens, left-padded to this


def peak_bytes() -> int:
    """This process's peak resident set so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def arithmetic_prompts(model_dir: str, rows: int):
    """(tokenizer, the prompts' batch): `rows` prompts of the arithmetic task, left-padded."""
    from transformers import AutoTokenizer

    from hybridflow.data import ArithmeticSpec, make_arithmetic_rows
    from hybridflow.data.prompts import encode_prompts

    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok, encode_prompts(make_arithmetic_rows(rows, ArithmeticSpec(), seed=0), tok, MAX_PROMPT_TOKENS)


def started_engine(engine_class, model_dir: str, tok, tokens: int):
    """A rollout engine (`workers.rollout`) of one rank on the CPU, in float32, started."""
    from hybridflow.config.schema import Dtype, RolloutConfig
    from hybridflow.controller import WorkerContext

    ctx = WorkerContext(rank=0, world_size=1, replica_size=1, device="cpu", group_name="bench")
    engine = engine_class(ctx, model_dir, RolloutConfig(max_response_tokens=tokens, dtype=Dtype.float32),
                          MAX_PROMPT_TOKENS, tok.eos_token_id, tok.pad_token_id)
    engine.start()
    return engine


def plain_generate(model, prompts, tok, tokens: int, full_length: bool):
    """transformers' `generate`, greedy, keeping every step's scores for the sampler's log-probs (what a
    rollout needs from it); `full_length`: every row runs to `tokens` (`min_new_tokens`). Returns the
    stacked scores (B, R, V), the response ids (B, R) and their mask, True up to and with each row's EOS."""
    import torch

    out = model.generate(prompts["prompt_ids"], attention_mask=prompts["prompt_mask"].long(), max_new_tokens=tokens,
                         min_new_tokens=tokens if full_length else None, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
    scores = torch.stack(out.scores, dim=1)  # (B, R, V): what the sampler log-probs were read from
    response = out.sequences[:, prompts["prompt_ids"].shape[1]:]
    ended = (response == tok.eos_token_id).long().cumsum(1)
    return scores, response, (ended == 0) | ((ended == 1) & (response == tok.eos_token_id))


def one_side(side: str, model_dir: str, rows: int, tokens: int) -> dict:
    """In this process: load, generate once, and report the peak resident set before and after."""
    import torch

    from workers.rollout.hf_rollout import HFRollout

    torch.set_num_threads(THREADS)
    tok, prompts = arithmetic_prompts(model_dir, rows)
    engine = started_engine(HFRollout, model_dir, tok, tokens)
    loaded = peak_bytes()
    start = time.perf_counter()
    with torch.no_grad():
        if side == "engine":
            out = engine.generate(prompts, greedy=True)
            generated = int(out["response_mask"].sum())
        else:  # transformers' generate, keeping every step's scores for the sampler's log-probs
            scores, _, _ = plain_generate(engine.model, prompts, tok, tokens, full_length=True)
            generated = int(scores.shape[0] * scores.shape[1])
    seconds = time.perf_counter() - start
    config = engine.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * rows * (prompts["prompt_ids"].shape[1]
                                                                                        + tokens) * 4
    logits = rows * config.vocab_size * 4
    return {"side": side, "rows": rows, "tokens": tokens, "seconds": round(seconds, 2), "generated_tokens": generated,
            "peak_after_load_gib": loaded / 2 ** 30, "peak_after_generate_gib": peak_bytes() / 2 ** 30,
            "generation_growth_gib": (peak_bytes() - loaded) / 2 ** 30,
            "floor_gib": {"weights": weights / 2 ** 30, "kv_cache": kv / 2 ** 30, "one_step_logits": logits / 2 ** 30},
            "plain_scores_gib": rows * tokens * config.vocab_size * 4 / 2 ** 30}


def run_side(script: str, side: str, model: str, rows: int, tokens: int, env: dict | None = None) -> dict:
    """`script --side <side> ...` in a process of its own (its peak resident set is its own); the JSON
    line it prints last."""
    import os

    done = subprocess.run([sys.executable, script, "--side", side, "--model", model, "--rows", str(rows),
                           "--tokens", str(tokens)], capture_output=True, text=True, timeout=3600,
                          env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise SystemExit(f"{side}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--side", choices=["engine", "plain"], help=argparse.SUPPRESS)  # one side, in a child
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.side:
        print(json.dumps(one_side(args.side, args.model, args.rows, args.tokens)))
        return
    if args.dry_run:
        import tempfile

        from hybridflow.builders.tiny_model import build_tiny_model

        model, args.rows, args.tokens = str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny")), 4, 8
    else:
        from tests.real_model import real_model_dir

        model = str(real_model_dir())
    report = {"model": model, "rows": args.rows, "tokens": args.tokens}
    for side in ("engine", "plain"):
        report[side] = run_side(__file__, side, model, args.rows, args.tokens)
    for side in ("engine", "plain"):  # the generation's own memory: the weights and what generating added
        terms = report[side]["floor_gib"]
        report[f"{side}_peak_over_floor"] = (terms["weights"] + report[side]["generation_growth_gib"]) / sum(terms.values())
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
