"""TRL's side of bench/dpo_vs_trl.py: DPO steps of TRL's `DPOTrainer` on the CPU, with held-out numbers.

Runs in TRL's own environment (bench/trl_env.sh) and imports nothing of HybridFlow: the model
directory and the pairs (the training pairs in the order HybridFlow's loader draws them) are prepared
by dpo_vs_trl.py and handed over as files.

    bench/.trl-venv/bin/python bench/trl_dpo_steps.py --model DIR --train PAIRS.jsonl --val PAIRS.jsonl \
        --out FILE.json [--steps 60] [--pairs-per-step 32] [--lr 5e-6] [--beta 0.1] [--val-every 10]

One step is one optimizer step on `--pairs-per-step` pairs, read in file order (no shuffling), with
TRL's sigmoid loss against a frozen copy of the starting model. The held-out numbers are computed
here the plain way, as HybridFlow's recipe=dpo defines them, on the same validation pairs: each
response's log-probability is the sum over its tokens (its text, then EOS) after the prompt rendered
with the chat template and the generation prompt, one full forward per response; the preference
accuracy is the share of pairs whose chosen response has the higher log-probability under the policy;
the implicit rewards are beta x (log pi - log pi_ref) with the reference's log-probs taken once before
training; the loss is -log sigmoid(chosen reward - rejected reward), averaged.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path


def response_log_probs(model, tokenizer, rows: list[dict], dtype) -> list[tuple[float, float]]:
    """(log pi(chosen), log pi(rejected)) per row: one forward per response, no padding."""
    import torch

    out = []
    was_training = model.training
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        for row in rows:
            prompt = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            pair = []
            for column in ("chosen", "rejected"):
                text = row[column][-1]["content"] if isinstance(row[column], list) else row[column]
                response = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                ids = torch.tensor([prompt_ids + response])
                log_probs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
                picked = log_probs.gather(1, ids[0, 1:, None])[:, 0]
                pair.append(float(picked[-len(response):].sum()))
            out.append(tuple(pair))
    model.train(was_training)
    return out


def held_out(policy: list[tuple[float, float]], reference: list[tuple[float, float]], beta: float) -> dict:
    margins, losses = [], []
    chosen_rewards, rejected_rewards = [], []
    for (c, r), (rc, rr) in zip(policy, reference):
        chosen_rewards.append(beta * (c - rc))
        rejected_rewards.append(beta * (r - rr))
        margin = chosen_rewards[-1] - rejected_rewards[-1]
        margins.append(margin)
        losses.append(math.log1p(math.exp(-margin)) if margin > -30 else -margin)
    n = len(policy)
    return {"preference_accuracy": sum(c > r for c, r in policy) / n,
            "reward_accuracy": sum(m > 0 for m in margins) / n, "reward_margin": sum(margins) / n,
            "preference_loss": sum(losses) / n, "chosen_reward": sum(chosen_rewards) / n,
            "rejected_reward": sum(rejected_rewards) / n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--train", required=True, help="JSON lines of prompt, chosen, rejected, in step order")
    p.add_argument("--val", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--pairs-per-step", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-6)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--val-every", type=int, default=10)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in Path(args.train).read_text().splitlines() if line.strip()]
    needed = args.steps * args.pairs_per_step
    if len(rows) < needed:
        raise SystemExit(f"{args.train} has {len(rows)} pairs; {args.steps} steps need {needed}")
    val_rows = [json.loads(line) for line in Path(args.val).read_text().splitlines() if line.strip()]
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    reference = response_log_probs(model, tokenizer, val_rows, dtype)  # the starting model, once
    validation, step_s = [], []
    clock = {}

    class Clock(TrainerCallback):
        def on_train_begin(self, _args, state, _control, model=None, **__):
            validation.append({"step": 0, **held_out(response_log_probs(model, tokenizer, val_rows, dtype), reference,
                                                     args.beta), "elapsed_s": 0.0})
            clock["start"] = time.perf_counter()

        def on_step_begin(self, *_, **__):
            clock["step"] = time.perf_counter()

        def on_step_end(self, _args, state, _control, model=None, **__):
            step_s.append(time.perf_counter() - clock["step"])
            if state.global_step % args.val_every == 0 or state.global_step == args.steps:
                validation.append({"step": state.global_step,
                                   **held_out(response_log_probs(model, tokenizer, val_rows, dtype), reference,
                                              args.beta),
                                   "elapsed_s": time.perf_counter() - clock["start"]})

    class InOrder(DPOTrainer):
        """The pairs in file order: the order HybridFlow's loader drew them."""

        def _get_train_sampler(self, *_, **__):
            return SequentialSampler(self.train_dataset)

    dataset = Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows[:needed]])
    with tempfile.TemporaryDirectory(prefix="trl-dpo-bench-") as output_dir:
        config = DPOConfig(output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.pairs_per_step,
                           gradient_accumulation_steps=1, learning_rate=args.lr, lr_scheduler_type="constant",
                           warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, beta=args.beta, loss_type="sigmoid",
                           bf16=args.dtype == "bfloat16", use_cpu=True, seed=0, logging_steps=1, report_to=[],
                           save_strategy="no", dataloader_num_workers=0, gradient_checkpointing=False)
        trainer = InOrder(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                          callbacks=[Clock()])
        trainer.train()
    Path(args.out).write_text(json.dumps({"validation": validation, "step_s": step_s, "versions": {
        "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__}}, indent=1))


if __name__ == "__main__":
    main()
