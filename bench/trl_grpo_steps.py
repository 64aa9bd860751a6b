"""TRL's side of bench/grpo_vs_trl.py: time GRPO steps of TRL's `GRPOTrainer` on the CPU.

Runs in TRL's own environment (bench/trl_env.sh), not HybridFlow's, and imports nothing of
HybridFlow: the model directory and the prompts (in the order HybridFlow's loader draws them)
are prepared by grpo_vs_trl.py and handed over as files.

    bench/.trl-venv/bin/python bench/trl_grpo_steps.py --model DIR --prompts FILE.jsonl --out FILE.json \
        [--steps 7] [--prompts-per-step 16] [--samples-per-prompt 8] [--max-response-tokens 8]

TRL generates with plain transformers `generate` (`use_vllm=False`), or with `--vllm-colocate`
TRL's colocated vLLM mode, which needs vLLM in TRL's environment (`bench/trl_env.sh --vllm`).
One step is one optimizer step: one generation of prompts x samples completions, then a
forward and backward pass over them in micro-batches of `--samples-per-micro-batch`. With
`beta=0` there is no reference model and with `num_iterations=1` TRL takes the old log-probs
from the training forward pass (no extra forward), as HybridFlow's on-policy step does.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def exact_match(completions: list[str], ground_truth: list[str], **_) -> list[float]:
    """HybridFlow's `exact_match` reward in TRL's batched convention (lists in, list out)."""
    return [1.0 if str(c).strip() == str(g).strip() else 0.0 for c, g in zip(completions, ground_truth)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, help="JSON lines with prompt and ground_truth, in step order")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=7, help="optimizer steps, warm-up included")
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--samples-per-micro-batch", type=int, default=128)
    p.add_argument("--max-response-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--threads", type=int, default=2, help="torch threads per process")
    p.add_argument("--vllm-colocate", action="store_true",
                   help="TRL's vLLM generation in the training process (needs vLLM in TRL's environment)")
    args = p.parse_args()

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    needed = args.steps * args.prompts_per_step
    if len(rows) < needed:
        raise SystemExit(f"{args.prompts} has {len(rows)} prompts; {args.steps} steps need {needed}")
    dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in rows[:needed]])

    world = int(os.environ.get("WORLD_SIZE", "1"))  # under torchrun: data parallel over `world` processes
    samples_per_step = args.prompts_per_step * args.samples_per_prompt
    micro = min(args.samples_per_micro_batch, samples_per_step) // world  # per process
    if micro < 1 or samples_per_step % (micro * world):
        raise SystemExit(f"--samples-per-micro-batch {args.samples_per_micro_batch} over {world} process(es) must "
                         f"divide prompts x samples = {samples_per_step}")
    times = StepTimes()

    class TimedGRPOTrainer(GRPOTrainer):
        """Records the seconds of generation, and of generation + scoring, inside each step."""

        def _generate(self, prompts):
            start = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                times.add("generate_s", time.perf_counter() - start)

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            try:
                out = super()._generate_and_score_completions(inputs)
            finally:
                times.add("generate_and_score_s", time.perf_counter() - start)
            local = torch.tensor([float(out["completion_mask"].sum()), float(out["prompt_mask"].sum()),
                                  float(out["completion_mask"].shape[0])])
            if torch.distributed.is_initialized():  # each process holds its slice of the step's samples
                torch.distributed.all_reduce(local)
            for key, value in zip(("response_tokens", "prompt_tokens", "samples"), local.tolist()):
                times.add(key, value)
            return out

    class StepClock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            times.begin()

        def on_step_end(self, *_, **__):
            times.end()

    with tempfile.TemporaryDirectory(prefix="trl-grpo-bench-") as output_dir:
        config = GRPOConfig(
            output_dir=output_dir,
            max_steps=args.steps,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=samples_per_step // (micro * world),  # one generation, one optimizer step
            num_generations=args.samples_per_prompt,
            max_completion_length=args.max_response_tokens,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            beta=0.0,  # no reference model, as HybridFlow's GRPO without a KL term
            num_iterations=1,
            loss_type="dapo",  # token-mean over the step, HybridFlow's default aggregation
            scale_rewards="group",
            bf16=False,  # float32 everywhere, as HybridFlow's tiny model
            use_cpu=True,
            use_vllm=args.vllm_colocate,
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=0.3,
            vllm_max_model_length=64,
            shuffle_dataset=False,  # the prompts in the order HybridFlow's loader drew them
            seed=0,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        trainer = TimedGRPOTrainer(model=model, reward_funcs=exact_match, args=config, train_dataset=dataset,
                                   processing_class=tokenizer, callbacks=[StepClock()])
        trainer.train()

    if int(os.environ.get("RANK", "0")):
        return
    result = {
        "steps": times.steps,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "threads": torch.get_num_threads(),
        "processes": world,
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "samples_per_micro_batch": micro,
        "generation": "vLLM colocate" if args.vllm_colocate else "transformers generate (use_vllm=False)",
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"TRL: {len(times.steps)} steps timed -> {args.out}")


class StepTimes:
    """Per optimizer step: wall seconds and the sums recorded inside it."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self._current: dict | None = None
        self._start = 0.0

    def begin(self) -> None:
        self._current, self._start = {}, time.perf_counter()

    def add(self, key: str, value: float) -> None:
        if self._current is not None:
            self._current[key] = self._current.get(key, 0.0) + value

    def end(self) -> None:
        self._current["step_s"] = time.perf_counter() - self._start
        self.steps.append(self._current)
        self._current = None


if __name__ == "__main__":
    main()
