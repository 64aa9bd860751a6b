"""The actor's optimizer step (`hybridflow.training.fsdp.build_optimizer`) beside PyTorch's default AdamW.

    python bench/optimizer_step.py --model DIR [--steps 5] [--out bench/results/optimizer_step.json]
    python bench/optimizer_step.py --dry-run      # the tiny model, 2 steps a side: what tests/unit/test_bench_dry_runs.py runs

Every trainer step ends in one AdamW step per mini-batch over every trainable parameter: memory traffic,
no matmul, which no FLOP floor counts (docs/results/performance.md, "The FLOP floor"). The actor's
optimizer is PyTorch's fused AdamW (one kernel over all parameters) on the CPU as on CUDA; `torch.optim.AdamW`
without arguments, what a plain loop gets, runs a loop of per-tensor operations on the CPU. This times
both over the same parameters and gradients of a Hugging Face model directory (float32, as the actor's
masters), alternated A B A B (timings on these machines drift), after one warm-up step each, and checks
that both moved the weights alike: the largest difference after the same steps, against the largest step.
"""

from __future__ import annotations

import argparse
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


def parameters_of(model_dir: Path) -> list[torch.nn.Parameter]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [p for p in model.parameters() if p.requires_grad]


def side(params: list[torch.nn.Parameter], grads: list[torch.Tensor], ours: bool, steps: int):
    """A copy of `params` with `grads`, an optimizer over it (ours or the default), and a function that
    runs one step and returns its seconds."""
    from hybridflow.config.schema import OptimConfig
    from hybridflow.training.fsdp import build_optimizer

    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for copy, grad in zip(copies, grads):
        copy.grad = grad
    optim = OptimConfig(lr=1e-3, warmup_steps=0, lr_schedule="constant")
    if ours:
        optimizer = build_optimizer(torch.nn.ParameterList(copies), optim, total_steps=steps + 1)[0]
    else:
        optimizer = torch.optim.AdamW(copies, lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas))

    def step() -> float:
        start = time.perf_counter()
        optimizer.step()
        return time.perf_counter() - start

    return copies, optimizer, step


def measure(model_dir: Path, steps: int) -> dict:
    params = parameters_of(model_dir)
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=generator) * 1e-3 for p in params]
    start = [p.detach().clone() for p in params]
    (ours_params, ours_opt, ours_step), (plain_params, plain_opt, plain_step) = (
        side(params, grads, True, steps), side(params, grads, False, steps))
    ours_step(), plain_step()  # warm-up
    ours_s, plain_s = [], []
    for _ in range(steps):  # A B A B
        ours_s.append(ours_step())
        plain_s.append(plain_step())
    moved = max((p.detach() - s).abs().max().item() for p, s in zip(ours_params, start))
    gap = max((a.detach() - b.detach()).abs().max().item() for a, b in zip(ours_params, plain_params))
    return {"model": str(model_dir), "parameters": sum(p.numel() for p in params), "steps": steps,
            "threads": torch.get_num_threads(), "cpu": cpu_description(),
            "ours_fused": bool(ours_opt.defaults.get("fused")), "plain_fused": bool(plain_opt.defaults.get("fused")),
            "ours_step_s": statistics.median(ours_s), "plain_step_s": statistics.median(plain_s),
            "ratio": statistics.median(ours_s) / statistics.median(plain_s),
            "largest_move": moved, "largest_gap": gap}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="a Hugging Face model directory (float32 masters are built from it)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps a side, after one warm-up step")
    parser.add_argument("--dry-run", action="store_true", help="the tiny model, 2 steps a side")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model)
        if args.dry_run:
            from hybridflow.builders.tiny_model import build_tiny_model
            from hybridflow.config.schema import TinyModelConfig

            model_dir = build_tiny_model(Path(tmp) / "tiny", TinyModelConfig())
            args.steps = 2
        elif not args.model:
            parser.error("--model DIR is required (or --dry-run)")
        report = measure(model_dir, args.steps)
    report["dry_run"] = args.dry_run
    emit(report, args.out)


if __name__ == "__main__":
    main()
