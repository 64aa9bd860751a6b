"""The actor's SFT step beside a plain PyTorch loop on the same model, batch and optimizer.

    python bench/sft_step.py [--steps 40] [--rows 128] [--save-every 25] [--out bench/results/sft_step.json]
    python bench/sft_step.py --dry-run      # 2 steps of 8 rows, a save after the first: what tests/unit/test_bench_dry_runs.py runs

The default pipeline's SFT stage (conf/recipe/pipeline.yaml: the tiny model, 128 arithmetic rows a
step in one micro-batch, lr 3e-3, one rank with both cores) spends nearly all its time in
`ActorWorker.train_sft`. This times that call in-process (FSDP2 on one gloo rank, as the recipe
runs it) against the loop a user writes without a framework: the same float32 model, the same
inputs with all-padding columns trimmed, cross-entropy on the answer tokens, `clip_grad_norm_`,
AdamW. Each side runs `--steps` updates on the same batches, alternated A B A B (timings on these
machines drift), and the medians and their ratio are printed and written as JSON. The actor saves
a checkpoint every `--save-every` steps (25, as the stage does; not timed): a save once left every
later step 1.5x slower (docs/results/performance.md, "The step after a checkpoint"), so the bench runs the
step as the stage does and also reports the actor's median after its first save, and its ratio to
the median before it (the plain loop runs in the same process and would slow alike).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from hybridflow.precision import cpu_description  # noqa: E402
from report import emit  # noqa: E402


def sft_batches(model_dir: Path, rows: int, steps: int):
    """The SFT recipe's batches: arithmetic prompts (left-padded) and their answers (right-padded)."""
    from transformers import AutoTokenizer

    from hybridflow.data import ArithmeticSpec, make_arithmetic_rows
    from hybridflow.data.answers import encode_sft_targets
    from hybridflow.data.prompts import encode_prompts

    tok = AutoTokenizer.from_pretrained(model_dir)
    all_rows = make_arithmetic_rows(rows * steps, ArithmeticSpec(), seed=0)
    return [encode_prompts(part, tok, 64).union(encode_sft_targets(part, tok, 32))
            for part in (all_rows[i * rows:(i + 1) * rows] for i in range(steps))]


def plain_step(model, optimizer, batch) -> float:
    """One SFT step as a user writes it: trimmed inputs, cross-entropy on the answer tokens."""
    from hybridflow.training.sequences import trimmed_inputs

    inputs, prompt_len, width = trimmed_inputs(batch)
    optimizer.zero_grad(set_to_none=True)
    logits = model(**inputs, use_cache=False).logits[:, prompt_len - 1: prompt_len - 1 + width]  # (B, r, V)
    targets = batch["response_ids"][:, :width].masked_fill(~batch["response_mask"][:, :width], -100)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(loss.detach())


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--save-every", type=int, default=25,
                        help="the actor saves a checkpoint every N steps, as the SFT stage does (0: never)")
    parser.add_argument("--dry-run", action="store_true", help="2 steps of 8 rows, no warm-up, a save after the first")
    parser.add_argument("--padded", action="store_true", help="the actor with model.pack_sequences=false")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.dry_run:
        args.steps, args.rows, args.warmup, args.save_every = 2, 8, 0, 1

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hybridflow.builders.tiny_model import build_tiny_model
    from hybridflow.config.schema import ActorConfig, Dtype, HybridFlowConfig, ModelConfig, OptimConfig
    from hybridflow.controller import WorkerContext
    from recipes.roles import actor_role
    from hybridflow.run.stage import prepare_stage

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo", rank=0, world_size=1)
    lr = 3e-3
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny")
        config = HybridFlowConfig(model=ModelConfig(dtype=Dtype.float32, pack_sequences=False if args.padded else None),
                                  actor=ActorConfig(optim=OptimConfig(lr=lr), samples_per_micro_batch=args.rows))
        actor = actor_role(prepare_stage(config).config, model_dir).build(WorkerContext(device="cpu", backend="gloo"))
        actor.start()
        plain = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        plain.train()
        optimizer = torch.optim.AdamW(plain.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
        batches = sft_batches(model_dir, args.rows, args.warmup + args.steps)
        ours, theirs, losses, saved_at = [], [], [], None
        for i, batch in enumerate(batches):
            t_ours = timed(lambda: losses.append(actor.train_sft(batch)["actor/loss"]))
            t_plain = timed(lambda: plain_step(plain, optimizer, batch))
            if i >= args.warmup:
                ours.append(t_ours)
                theirs.append(t_plain)
            if args.save_every and (i + 1) % args.save_every == 0 and i + 1 < len(batches):
                actor.save_checkpoint(str(Path(tmp) / f"step_{i + 1}"))
                if saved_at is None:
                    saved_at = len(ours)  # the steps timed before the first save
    dist.destroy_process_group()
    report = {"cpu": cpu_description(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "rows_per_step": args.rows, "steps": args.steps, "actor_packed": not args.padded,
              "actor_sft_step_s": statistics.median(ours), "plain_loop_step_s": statistics.median(theirs),
              "first_loss": losses[0], "last_loss": losses[-1], "save_every": args.save_every}
    report["ratio"] = report["actor_sft_step_s"] / report["plain_loop_step_s"]
    if saved_at:  # the plain loop shares the process, so a save that slows it too leaves `ratio` at 1: this does not
        after = statistics.median(ours[saved_at:])
        report["actor_sft_step_s_after_first_save"] = after
        report["actor_after_over_before_first_save"] = after / statistics.median(ours[:saved_at])
    emit(report, args.out)


if __name__ == "__main__":
    main()
