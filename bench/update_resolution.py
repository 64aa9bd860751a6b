"""Does a 16-bit copy of float32 master weights follow the master under small Adam steps? No RL, no
engine: the mechanism of issue 80 alone.

    PYTHONPATH=. .venv/bin/python bench/update_resolution.py [--steps 10] [--lr 1e-5]   # SmolLM2-135M, ~3 min
    PYTHONPATH=. .venv/bin/python bench/update_resolution.py --dry-run                  # the tiny model, 2 steps

A float32 model takes AdamW steps (lr 1e-5, no weight decay) on a supervised loss: 32 chat prompts
"What is a + b?" (tests/real_model.py) answered with their sums. Before each step the master weights
are cast (round to nearest, as FSDP2's mixed precision and the weight sync cast them) to bfloat16 and
to float16, and each copy's loss on the same batch is computed beside the master's; `moved` is the
share of weights whose value in that dtype differs from the start. The copy is what a mixed-precision
actor computes with and what a 16-bit engine samples from.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DTYPES = (torch.bfloat16, torch.float16)


def batch(tokenizer, rows: list[dict]) -> dict:
    texts, prompt_lengths = [], []
    for row in rows:
        prompt = row["prompt"] if isinstance(row["prompt"], str) else \
            tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        texts.append(prompt + str(row["ground_truth"]) + (tokenizer.eos_token or ""))
        prompt_lengths.append(len(tokenizer(prompt)["input_ids"]))
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    labels = enc["input_ids"].clone()
    labels[enc["attention_mask"] == 0] = -100
    for i, n in enumerate(prompt_lengths):
        labels[i, :n] = -100  # the answer's tokens only
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}


@torch.no_grad()
def loss_of(model, inputs: dict) -> float:
    return model(**inputs).loss.item()


def study(model_dir: Path, rows: list[dict], steps: int, lr: float) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    inputs = batch(tokenizer, rows)
    master = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    copies = {d: AutoModelForCausalLM.from_pretrained(model_dir, dtype=d) for d in DTYPES}
    start = {n: p.detach().clone() for n, p in master.named_parameters()}
    optimizer = torch.optim.AdamW(master.parameters(), lr=lr, weight_decay=0.0)
    out = []
    for step in range(steps + 1):
        row = {"step": step, "float32": loss_of(master, inputs)}
        for dtype, copy in copies.items():
            changed = total = 0
            with torch.no_grad():
                for (name, p), (_, q) in zip(master.named_parameters(), copy.named_parameters()):
                    q.copy_(p.to(dtype))
                    changed += int((q != start[name].to(dtype)).sum())
                    total += q.numel()
            name = str(dtype).removeprefix("torch.")
            row[name], row[f"{name}_moved"] = loss_of(copy, inputs), changed / total
        out.append(row)
        print(json.dumps(row), flush=True)
        if step < steps:
            master.train()
            optimizer.zero_grad()
            master(**inputs).loss.backward()
            optimizer.step()
    return out


def render(rows: list[dict]) -> str:
    lines = ["| Adam steps | loss, float32 master | loss, bfloat16 copy | loss, float16 copy | moved, bfloat16 | moved, float16 |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['step']} | {r['float32']:.3f} | {r['bfloat16']:.3f} | {r['float16']:.3f} | "
                     f"{r['bfloat16_moved']:.1%} | {r['float16_moved']:.1%} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--dry-run", action="store_true", help="the tiny model (built offline), 2 steps")
    args = p.parse_args()
    from hybridflow.data import ArithmeticSpec, make_arithmetic_split
    from tests.real_model import chat_rows

    train, _ = make_arithmetic_split(32, 1, ArithmeticSpec(min_digits=2, max_digits=2), 0)
    if args.dry_run:  # the tiny model's tokenizer has no chat template: the plain "51+29=" prompts
        import tempfile

        from hybridflow.builders.tiny_model import build_tiny_model

        with tempfile.TemporaryDirectory() as tmp:
            model_dir = build_tiny_model(Path(tmp) / "tiny")
            print(render(study(model_dir, train[:4], 2, args.lr)))
        return
    from tests.real_model import real_model_dir

    print(render(study(real_model_dir(), chat_rows(train), args.steps, args.lr)))


if __name__ == "__main__":
    main()
