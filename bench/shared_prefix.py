"""The actor's log-prob pass and policy update with each prompt computed once per group (`model.share_prompts`)
against once per sample, both packed, on the CPU.

    python bench/shared_prefix.py [--prompts 2] [--samples 8] [--prompt 512] [--response 64] [--out FILE]
    python bench/shared_prefix.py --dry-run      # the tiny model, 2 prompts x 4 samples: tests/unit/test_bench_shared_prefix.py

A GRPO-shaped batch: `--prompts` prompts of exactly `--prompt` tokens, each repeated for `--samples`
samples whose responses are right-padded to `--response` with real lengths uniform from an eighth of
it (bench/gpu_check.py's rule). The model: a Qwen2 built offline at `--hidden`/`--layers` (default
512 x 8, about 30M parameters with the character tokenizer, the 24M class of issue 74's CPU line), or
`--model-dir`. Each side builds its own actor (float32, one gloo rank, the micro-batch token budget
of `--rows-per-micro-batch` full-width rows, the same on both sides), times `compute_log_probs` and a
second `update_policy` (the first warms up), alternated A B A B `--rounds` times; medians, their
ratios, the update's `perf/computed_tokens` on each side and the largest gap between the two sides'
log-probs are printed and written as JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from report import emit  # noqa: E402
from hybridflow.precision import cpu_description  # noqa: E402


def group_batch(prompts: int, samples: int, prompt_tokens: int, response_width: int, vocab: int, seed: int = 0):
    """`prompts` prompts of `prompt_tokens` tokens, `samples` rows each (rows i*samples .. +samples-1),
    responses of uniform real lengths from response_width // 8, advantages per row."""
    from hybridflow.batch import Batch

    g = torch.Generator().manual_seed(seed)
    rows = prompts * samples
    prompt_ids = torch.randint(5, vocab, (prompts, prompt_tokens), generator=g).repeat_interleave(samples, dim=0)
    prompt_mask = torch.ones(rows, prompt_tokens, dtype=torch.bool)
    response_len = torch.randint(max(1, response_width // 8), response_width + 1, (rows,), generator=g)
    response_mask = torch.arange(response_width)[None] < response_len[:, None]
    response_ids = torch.randint(5, vocab, (rows, response_width), generator=g) * response_mask
    advantages = torch.randn(rows, 1, generator=g).expand(rows, response_width) * response_mask
    return Batch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
                  "response_mask": response_mask, "advantages": advantages.contiguous()})


def one_side(model_dir: Path, batch, share: bool, rows_per_micro_batch: int) -> dict:
    from hybridflow.batch import Batch
    from hybridflow.config.schema import ActorConfig, CriticConfig, HybridFlowConfig, ModelConfig, OptimConfig
    from hybridflow.controller import WorkerContext
    from recipes.roles import actor_role

    config = HybridFlowConfig(model=ModelConfig(pack_sequences=True, share_prompts=share),
                              actor=ActorConfig(optim=OptimConfig(lr=1e-6), samples_per_micro_batch=rows_per_micro_batch,
                                                gradient_checkpointing=False),
                              critic=CriticConfig(samples_per_micro_batch=rows_per_micro_batch))
    actor = actor_role(config, model_dir).build(WorkerContext(device="cpu", backend="gloo"))
    assert actor.start()["shared_prompts"] is share
    start = time.perf_counter()
    old = actor.compute_log_probs(batch)["old_log_probs"]
    log_prob_s = time.perf_counter() - start
    trained = batch.union(Batch({"old_log_probs": old}))
    actor.update_policy(trained)
    start = time.perf_counter()
    stats = actor.update_policy(trained)
    return {"log_prob_pass_s": log_prob_s, "update_s": time.perf_counter() - start, "old_log_probs": old,
            "computed_tokens": stats["perf/computed_tokens"], "sharing_saved_tokens": stats["perf/sharing_saved_tokens"]}


def build_model(hidden: int, layers: int, max_tokens: int, out: Path) -> Path:
    from hybridflow.builders.tiny_model import build_tiny_model
    from hybridflow.config.schema import TinyModelConfig

    spec = TinyModelConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                           num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                           max_position_embeddings=max_tokens)
    return build_tiny_model(out, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows-per-micro-batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model-dir", default="", help="a Hugging Face directory (default: the Qwen2 built here)")
    parser.add_argument("--dry-run", action="store_true", help="the tiny model, 2 prompts x 4 samples of 16 + 8, one round")
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    import json
    import tempfile

    import torch.distributed as dist

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29547")
    dist.init_process_group("gloo", rank=0, world_size=1)
    if args.dry_run:
        args.prompts, args.samples, args.prompt, args.response, args.rounds = 2, 4, 16, 8, 1
        args.hidden, args.layers = 64, 2
    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        model_dir = build_model(args.hidden, args.layers, max(256, args.prompt + args.response),
                                Path(tempfile.mkdtemp()) / "model")
    config = json.loads((model_dir / "config.json").read_text())
    batch = group_batch(args.prompts, args.samples, args.prompt, args.response, vocab=min(500, config["vocab_size"]))
    sides: dict[str, list[dict]] = {"unshared": [], "shared": []}
    for _ in range(args.rounds):
        for name in sides:
            sides[name].append(one_side(model_dir, batch, name == "shared", args.rows_per_micro_batch))
    dist.destroy_process_group()
    mask = batch["response_mask"]
    gap = (sides["shared"][0]["old_log_probs"] - sides["unshared"][0]["old_log_probs"])[mask].abs().max()
    parameters = sum(p.numel() for p in _load(model_dir).parameters())
    report = {"cpu": cpu_description(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "model_dir": model_dir.name, "parameters": parameters, "hidden_size": config["hidden_size"],
              "layers": config["num_hidden_layers"], "prompts": args.prompts, "samples_per_prompt": args.samples,
              "prompt_tokens": args.prompt, "response_width": args.response,
              "response_tokens": int(mask.sum()), "rows_per_micro_batch": args.rows_per_micro_batch,
              "rounds": args.rounds, "max_log_prob_gap": float(gap)}
    for name, runs in sides.items():
        for key in ("log_prob_pass_s", "update_s"):
            report[f"{name}_{key}"] = statistics.median(r[key] for r in runs)
        report[f"{name}_computed_tokens"] = runs[0]["computed_tokens"]
    report["shared_sharing_saved_tokens"] = sides["shared"][0]["sharing_saved_tokens"]
    for key in ("log_prob_pass_s", "update_s"):
        report[f"speedup_{key}"] = report[f"unshared_{key}"] / report[f"shared_{key}"]
    report["token_ratio"] = report["unshared_computed_tokens"] / report["shared_computed_tokens"]
    emit(report, args.out)


def _load(model_dir: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))


if __name__ == "__main__":
    main()
