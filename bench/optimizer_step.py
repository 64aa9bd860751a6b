"""The actor's optimizer step (`hybridflow.training.fsdp.build_optimizer`) with `optim.fused=true` beside its CPU default.

    python bench/optimizer_step.py --model DIR [--steps 5] [--out bench/results/optimizer_step.json]
    python bench/optimizer_step.py --dry-run      # the tiny model, 2 steps a side: what tests/unit/test_bench_dry_runs.py runs

Every trainer step ends in one AdamW step per mini-batch over every trainable parameter: memory traffic,
no matmul, which no FLOP floor counts (docs/results/performance.md, "The FLOP floor"). `build_optimizer`
gives the actor PyTorch's fused AdamW (one kernel over all parameters) on CUDA, and on the CPU with
`<role>.optim.fused=true`; its CPU default (`optim.fused` null) is PyTorch's default AdamW there, a loop of
per-tensor operations. This times both over the same parameters and gradients of a Hugging Face model
directory (float32, as the actor's masters), alternated A B A B (timings on these machines drift), after
one warm-up step each, and checks that both moved the weights alike: the largest difference after the same
steps, against the largest step.
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


def side(params: list[torch.nn.Parameter], grads: list[torch.Tensor], fused: bool | None, steps: int):
    """A copy of `params` with `grads`, the actor's optimizer over it (`optim.fused`), and a function that
    runs one step and returns its seconds."""
    from hybridflow.config.schema import OptimConfig
    from hybridflow.training.fsdp import build_optimizer

    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for copy, grad in zip(copies, grads):
        copy.grad = grad
    optim = OptimConfig(lr=1e-3, warmup_steps=0, lr_schedule="constant", fused=fused)
    optimizer = build_optimizer(torch.nn.ParameterList(copies), optim, total_steps=steps + 1)[0]

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
    (fused_params, fused_opt, fused_step), (default_params, default_opt, default_step) = (
        side(params, grads, True, steps), side(params, grads, None, steps))
    fused_step(), default_step()  # warm-up
    fused_s, default_s = [], []
    for _ in range(steps):  # A B A B
        fused_s.append(fused_step())
        default_s.append(default_step())
    moved = max((p.detach() - s).abs().max().item() for p, s in zip(fused_params, start))
    gap = max((a.detach() - b.detach()).abs().max().item() for a, b in zip(fused_params, default_params))
    return {"model": str(model_dir), "parameters": sum(p.numel() for p in params), "steps": steps,
            "threads": torch.get_num_threads(), "cpu": cpu_description(),
            "fused_is_fused": bool(fused_opt.defaults.get("fused")),
            "default_is_fused": bool(default_opt.defaults.get("fused")),
            "fused_step_s": statistics.median(fused_s), "default_step_s": statistics.median(default_s),
            "ratio": statistics.median(fused_s) / statistics.median(default_s),
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
