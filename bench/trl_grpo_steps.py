"""TRL's side of bench/grpo_vs_trl.py: time GRPO steps of TRL's `GRPOTrainer` on the CPU.

Runs in TRL's own environment (bench/trl_env.sh), not HybridFlow's, and imports nothing of
HybridFlow: the model directory and the prompts (in the order HybridFlow's loader draws them)
are prepared by grpo_vs_trl.py and handed over as files.

    bench/.trl-venv/bin/python bench/trl_grpo_steps.py --model DIR --prompts FILE.jsonl --out FILE.json \
        [--steps 7] [--prompts-per-step 16] [--samples-per-prompt 8] [--max-response-tokens 8]

With `--val FILE --val-every N` it also measures learning: held-out accuracy, greedy, on the
validation prompts before the first step and after every N steps (bench/real_learning_vs_trl.py).
`--reward math_answer` scores with HybridFlow's own `math_answer`, loaded from its file (the one
function both sides use); `--dtype bfloat16` computes in bfloat16 over float32 weights (TRL's
`bf16=True`), HybridFlow's `model.dtype=bfloat16` with float32 masters.

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


def hybridflow_reward(name: str):
    """HybridFlow's built-in reward `name` (hybridflow/rewards/builtin.py, loaded from its file: this
    environment has only the dependencies it imports, bench/trl_env.sh) in TRL's batched convention. Chat completions
    arrive as message lists; the assistant's text is scored."""
    import importlib.util
    import sys

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))  # hybridflow/registry.py, which builtin.py imports (standard library only)
    spec = importlib.util.spec_from_file_location("hybridflow_builtin_rewards", root / "hybridflow/rewards/builtin.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = module.REWARD_FUNCTIONS.get(name)

    def reward(completions: list, ground_truth: list[str], **_) -> list[float]:
        return [float(fn(response=completion_text(c), ground_truth=g)["score"]) for c, g in zip(completions, ground_truth)]
    reward.__name__ = name
    return reward


def completion_text(completion) -> str:
    return completion if isinstance(completion, str) else "".join(m["content"] for m in completion)


def held_out_accuracy(model, tokenizer, rows: list[dict], reward, max_new_tokens: int, dtype, rows_per_batch: int = 50
                      ) -> float:
    """Greedy answers to `rows`' chat prompts (the model's chat template), scored by `reward`: the
    same measure as HybridFlow's `val/accuracy`."""
    import torch

    tokenizer.padding_side = "left"
    was_training, scores = model.training, []
    model.eval()
    for i in range(0, len(rows), rows_per_batch):
        batch = rows[i:i + rows_per_batch]
        texts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in batch]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        answers = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        scores += reward(answers, [r["ground_truth"] for r in batch])
    model.train(was_training)
    return sum(scores) / len(scores)


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
    p.add_argument("--reward", default="exact_match", help="exact_match, or a HybridFlow built-in reward name")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    p.add_argument("--max-prompt-tokens", type=int, default=64, help="vLLM's model length is this + the response")
    p.add_argument("--val", help="JSON lines of held-out prompts: held-out accuracy is measured (greedy)")
    p.add_argument("--val-every", type=int, default=0, help="steps between held-out measurements (0: none)")
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
    reward = exact_match if args.reward == "exact_match" else hybridflow_reward(args.reward)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    val_rows = [json.loads(line) for line in Path(args.val).read_text().splitlines() if line.strip()] if args.val else []

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
        def on_train_begin(self, _args, state, _control, model=None, **__):
            times.start()
            if val_rows and args.val_every:
                times.validation(0, held_out_accuracy(model, tokenizer, val_rows, reward, args.max_response_tokens,
                                                      dtype))

        def on_step_begin(self, *_, **__):
            times.begin()

        def on_step_end(self, _args, state, _control, model=None, **__):
            times.end()
            if val_rows and args.val_every and state.global_step % args.val_every == 0:
                times.validation(state.global_step, held_out_accuracy(model, tokenizer, val_rows, reward,
                                                                      args.max_response_tokens, dtype))

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
            bf16=args.dtype == "bfloat16",  # autocast over float32 weights; float32: everywhere
            use_cpu=True,
            use_vllm=args.vllm_colocate,
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=0.3,
            vllm_max_model_length=args.max_prompt_tokens + args.max_response_tokens,
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
        trainer = TimedGRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                                   processing_class=tokenizer, callbacks=[StepClock()])
        trainer.train()

    if int(os.environ.get("RANK", "0")):
        return
    result = {
        "steps": times.steps,
        "validation": times.validations,
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
        self.validations: list[dict] = []  # step, held-out accuracy, seconds since training began
        self._current: dict | None = None
        self._start = self._train_start = 0.0

    def start(self) -> None:
        self._train_start = time.perf_counter()

    def validation(self, step: int, accuracy: float) -> None:
        self.validations.append({"step": step, "accuracy": accuracy,
                                 "elapsed_s": time.perf_counter() - self._train_start})
        print(f"TRL step {step}: held-out accuracy {accuracy:.3f}", flush=True)

    def begin(self) -> None:
        self._current, self._start = {}, time.perf_counter()

    def add(self, key: str, value: float) -> None:
        if self._current is not None:
            self._current[key] = self._current.get(key, 0.0) + value

    def end(self) -> None:
        self._current["step_s"] = time.perf_counter() - self._start
        self._current["elapsed_s"] = time.perf_counter() - self._train_start
        self.steps.append(self._current)
        self._current = None


if __name__ == "__main__":
    main()
