"""The actor's log-prob pass and policy update, padded against packed (`model.pack_sequences`), on the CPU.

    python bench/packed_sequences.py [--rows 32] [--prompt 64] [--response 64] [--out bench/results/packed_sequences.json]
    python bench/packed_sequences.py --dry-run      # the tiny model, 8 rows: what tests/unit/test_bench_dry_runs.py runs

The real model (SmolLM2-135M-Instruct, tests/real_model.py; `--model-dir` for another) as a run
builds the actor (float32, one gloo rank, 16 rows a micro-batch), on a GRPO-shaped batch
(bench/gpu_check.py's: prompts left-padded to `--prompt` tokens with real lengths uniform from a
quarter of it, responses right-padded to `--response` from an eighth). Each side builds its own
actor, times `compute_log_probs` and a second `update_policy` (the first warms up), alternated
A B A B `--rounds` times (timings on these machines drift); medians, their ratios and the largest
gap between the two sides' log-probs are printed and written as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_check import grpo_batch  # noqa: E402
from report import emit  # noqa: E402
from hybridflow.precision import cpu_description  # noqa: E402


def one_side(model_dir: Path, batch, packed: bool) -> dict:
    from hybridflow.batch import Batch
    from hybridflow.config.schema import ActorConfig, HybridFlowConfig, ModelConfig, OptimConfig
    from hybridflow.controller import WorkerContext
    from recipes.roles import actor_role
    from hybridflow.run.stage import prepare_stage

    config = HybridFlowConfig(model=ModelConfig(pack_sequences=packed),
                              actor=ActorConfig(optim=OptimConfig(lr=1e-6), samples_per_micro_batch=16))
    actor = actor_role(prepare_stage(config).config, model_dir).build(WorkerContext(device="cpu", backend="gloo"))
    assert actor.start()["packed_sequences"] is packed
    start = time.perf_counter()
    old = actor.compute_log_probs(batch)["old_log_probs"]
    log_prob_s = time.perf_counter() - start
    trained = batch.union(Batch({"old_log_probs": old}))
    actor.update_policy(trained)
    start = time.perf_counter()
    actor.update_policy(trained)
    return {"log_prob_pass_s": log_prob_s, "update_s": time.perf_counter() - start, "old_log_probs": old}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model-dir", default="", help="a Hugging Face directory (default: the real model)")
    parser.add_argument("--dry-run", action="store_true", help="the tiny model, 8 rows of 16 + 16, one round")
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    import torch.distributed as dist

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29543")
    dist.init_process_group("gloo", rank=0, world_size=1)
    if args.dry_run:
        import tempfile

        from hybridflow.builders.tiny_model import build_tiny_model

        args.rows, args.prompt, args.response, args.rounds = 8, 16, 16, 1
        model_dir = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    elif args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        from tests.real_model import real_model_dir

        model_dir = real_model_dir()
    vocab = min(500, json.loads((model_dir / "config.json").read_text())["vocab_size"])
    shape = dict(rows=args.rows, prompt_width=args.prompt, prompt_min=max(1, args.prompt // 4),
                 response_width=args.response, response_min=max(1, args.response // 8))
    batch = grpo_batch(shape, vocab=vocab)
    sides: dict[str, list[dict]] = {"padded": [], "packed": []}
    for _ in range(args.rounds):
        for name in sides:
            sides[name].append(one_side(model_dir, batch, packed=name == "packed"))
    dist.destroy_process_group()
    mask = batch["response_mask"]
    gap = (sides["packed"][0]["old_log_probs"] - sides["padded"][0]["old_log_probs"])[mask].abs().max()
    report = {"cpu": cpu_description(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "model_dir": model_dir.name, "rows": args.rows, "prompt_width": args.prompt,
              "response_width": args.response, "rounds": args.rounds,
              "real_token_fraction": float((batch["prompt_mask"].sum() + mask.sum()) / (args.rows * (args.prompt +
                                                                                                   args.response))),
              "max_log_prob_gap": float(gap)}
    for name, runs in sides.items():
        for key in ("log_prob_pass_s", "update_s"):
            report[f"{name}_{key}"] = statistics.median(r[key] for r in runs)
    for key in ("log_prob_pass_s", "update_s"):
        report[f"speedup_{key}"] = report[f"padded_{key}"] / report[f"packed_{key}"]
    emit(report, args.out)


if __name__ == "__main__":
    main()
