"""The foundation demo: the single controller places a vLLM rollout group and generates.

Builds the tiny model and the arithmetic task offline, starts (or joins) Ray, spawns the
rollout role on its pool, generates answers for a few validation prompts on every rank, and
logs exact-match accuracy. Later recipes (sft, grpo, ppo, pipeline) build on the same steps.
"""

from __future__ import annotations

import time

from hybridflow.batch import Batch
from hybridflow.controller import RoleSpec
from hybridflow.data.prompts import encode_prompts
from hybridflow.run.lifecycle import start_run
from hybridflow.run.stage import Stage
from hybridflow.rewards import exact_match
from hybridflow.output.tracking import MetricsLogger
from workers.rollout.vllm_rollout import VLLMRollout


def run(stage: Stage, run_dir) -> dict:
    config = stage.config
    session = start_run(stage, run_dir, lambda model_dir, tokenizer: {"rollout": RoleSpec(VLLMRollout, dict(
        model_path=str(model_dir), rollout=config.rollout, max_prompt_tokens=config.data.max_prompt_tokens,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        trust_remote_code=config.model.trust_remote_code))})
    print(f"ray: {session.ray_address}", flush=True)
    rollout, tokenizer, data = session.groups["rollout"], session.tokenizer, session.data
    engine_start_s = max(session.started["rollout"])

    prompts = encode_prompts(data.val[: config.recipe.demo_prompts], tokenizer, config.data.max_prompt_tokens,
                             truncation=config.data.prompt_truncation)
    start = time.perf_counter()
    samples: Batch = rollout.generate(prompts.repeat_interleave(config.rollout.samples_per_prompt))
    generate_s = time.perf_counter() - start

    scores = [exact_match(r, g)["score"] for r, g in zip(samples["response"], samples["ground_truth"])]
    response_tokens = int(samples["response_mask"].sum())
    metrics = {
        "demo/accuracy": sum(scores) / len(scores),
        "demo/samples": len(samples),
        "demo/rollout_ranks": rollout.world_size,
        "demo/response_tokens": response_tokens,
        "timing/engine_start_s": engine_start_s,
        "timing/generate_s": generate_s,
        "perf/tokens_per_s": response_tokens / generate_s,
    }
    logger = MetricsLogger(run_dir, config.logger)
    logger.log(0, metrics)
    logger.close()
    for prompt, response, truth in list(zip(samples["prompt"], samples["response"], samples["ground_truth"]))[:4]:
        print(f"  {prompt!r} -> {response!r} (expected {truth!r})", flush=True)
    return metrics
