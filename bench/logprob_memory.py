"""Peak memory of one micro-batch's policy-loss forward and backward: log-probs and entropy from the
full logits (the path before 2026-11-25: every position's logits, a float32 copy, log-softmax and
softmax kept for the backward pass) against `response_log_probs` (response positions only, one
row at a time, recomputed in backward). Process peak resident memory, reset between the two
(hybridflow.controller.memory).

    for p in full rows; do PYTHONPATH=. .venv/bin/python bench/logprob_memory.py --path $p; done
    PYTHONPATH=. .venv/bin/python bench/logprob_memory.py --dry-run --out x.json  # the tiny model, 4 rows of 16 + 16

The dry run (tests/unit/test_bench_dry_runs_measure.py runs it in a process of its own: the peaks are
the process's) measures both paths, in that order, on the tiny model (hybridflow.builders). With `--out`
each path's resident bytes at the start, its peak and the bytes of the parameters (the gradients the
backward pass allocates) are also written as JSON.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from report import emit  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Hugging Face directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=46)
    parser.add_argument("--response-tokens", type=int, default=64)
    parser.add_argument("--path", choices=["full", "rows", "both"], default="both",
                        help="measure one path per process for numbers that do not depend on the order")
    parser.add_argument("--dry-run", action="store_true", help="the tiny model, 4 rows of 16 + 16 tokens, both paths")
    parser.add_argument("--out", default="", help="the measurements as JSON")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from hybridflow.algos import entropy_from_logits, log_probs_from_logits
    from hybridflow.batch import Batch
    from hybridflow.controller.memory import GIB, read_and_reset
    from hybridflow.training.sequences import response_log_probs

    if args.dry_run:
        from hybridflow.builders import build_tiny_model

        args.rows, args.prompt_tokens, args.response_tokens, args.path = 4, 16, 16, "both"
        with tempfile.TemporaryDirectory(prefix="logprob_memory_") as tmp:
            model = AutoModelForCausalLM.from_pretrained(build_tiny_model(Path(tmp) / "tiny"), dtype=torch.float32)
        args.model = "tiny"
    else:
        if args.model is None:
            from tests.real_model import real_model_dir

            args.model = str(real_model_dir())
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    p, r = args.prompt_tokens, args.response_tokens
    batch = Batch({"prompt_ids": torch.randint(0, vocab, (args.rows, p), generator=g),
                   "prompt_mask": torch.ones(args.rows, p, dtype=torch.bool),
                   "response_ids": torch.randint(0, vocab, (args.rows, r), generator=g),
                   "response_mask": torch.ones(args.rows, r, dtype=torch.bool)})

    def before() -> torch.Tensor:  # the old path, as workers/actor.py had it
        ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
        logits = model(input_ids=ids, use_cache=False).logits[:, p - 1: p - 1 + r].float()
        return log_probs_from_logits(logits, batch["response_ids"]).sum() + entropy_from_logits(logits).sum()

    def after() -> torch.Tensor:
        log_probs, entropy = response_log_probs(model, batch)
        return log_probs.sum() + entropy.sum()

    paths = {"full": ("full logits", before), "rows": ("response_log_probs", after)}
    measured = {}
    for key in (["full", "rows"] if args.path == "both" else [args.path]):
        name, loss_fn = paths[key]
        model.zero_grad(set_to_none=True)
        start = read_and_reset(False)["rss_bytes"]
        loss_fn().backward()
        peak = read_and_reset(False)["rss_peak_bytes"]
        print(f"{name}: peak {peak / GIB:.2f} GiB, {(peak - start) / GIB:.2f} GiB above the start")
        measured[key] = {"name": name, "start_bytes": start, "peak_bytes": peak, "peak_above_start_bytes": peak - start}
    if args.out:
        emit({"model": Path(args.model).name, "rows": args.rows, "prompt_tokens": p, "response_tokens": r,
              "vocab": vocab, "parameter_bytes": sum(t.numel() * t.element_size() for t in model.parameters()),
              "response_logits_bytes": args.rows * r * vocab * 4, "paths": measured}, args.out)


if __name__ == "__main__":
    main()
