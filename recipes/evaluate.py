"""Score one model directory on a data file (`recipe=evaluate model.path=DIR`): greedy accuracy on
the validation rows, as training's validation computes it (`val/accuracy`, `val/reward_mean`, ...),
and with `recipe.eval_samples=n` > 0 also n sampled answers per prompt (`rollout.temperature`,
`rollout.top_p`): `val/pass@k` for k = 1, 2, 4, ... up to n (the unbiased estimator of Chen et
al. 2021, eq. 1: 1 - C(n - c, k) / C(n, k) for c correct of n, averaged over prompts),
`val/sampled_reward_mean` and `val/sampled_accuracy`. A sample is correct when its reward's
`accuracy` extra is 1 (else when its score is >= 1). Writes metrics.jsonl (step 0) and a
report.md line."""

from __future__ import annotations

from math import comb
from pathlib import Path

from hybridflow.config.schema import HybridFlowConfig
from hybridflow.data.prompts import encode_prompts
from hybridflow.run.lifecycle import start_run
from hybridflow.run.stage import Stage
from hybridflow.rewards.composer import EXTRA_PREFIX, SCORE_KEY
from hybridflow.run.runner import sample_seeds, validate
from hybridflow.output.tracking import MetricsLogger
from recipes.roles import reward_role, rollout_role


def run(stage: Stage, run_dir: Path) -> dict:
    config = stage.config
    session = start_run(stage, run_dir, lambda model_dir, tokenizer: {
        "rollout": rollout_role(config, model_dir, tokenizer), "reward": reward_role(config)})
    groups, data, tokenizer, model_dir = session.groups, session.data, session.tokenizer, session.model_dir
    metrics = validate(config, groups["rollout"], groups["reward"], data.val, tokenizer, step=0)
    if config.recipe.eval_samples:
        metrics.update(sampled(config, groups["rollout"], groups["reward"], data.val, tokenizer))
    logger = MetricsLogger(run_dir, config.logger)
    logger.log(0, metrics)
    logger.close()
    write_report(run_dir, str(config.model.path or model_dir), config.data.val_path or "the synthetic task", metrics)
    return {"final_model": str(model_dir), **metrics}


def sampled(config: HybridFlowConfig, rollout, reward, rows: list[dict], tokenizer) -> dict[str, float]:
    """n sampled answers per validation prompt: pass@k, mean reward and mean accuracy."""
    n = config.recipe.eval_samples
    rows = rows[: config.trainer.val_prompts]
    prompts = encode_prompts(rows, tokenizer, config.data.max_prompt_tokens, source="validation data",
                             truncation=config.data.prompt_truncation)
    prompts = prompts.repeat_interleave(n)
    prompts.tensors["sample_seed"] = sample_seeds(config.seed, 0, len(prompts))
    samples = rollout.generate(prompts)
    rewards = reward.compute_rewards(samples.select(list(samples.objects)))
    scores = rewards[SCORE_KEY].float()  # (B * n,)
    correct = rewards.tensors.get(EXTRA_PREFIX + "accuracy", (scores >= 1).float()).float().nan_to_num(0.0) >= 1
    per_prompt = correct.view(len(rows), n).sum(dim=1).tolist()
    out = {f"val/pass@{k}": pass_at_k(per_prompt, n, k) for k in _ks(n)}
    out.update({"val/sampled_reward_mean": float(scores.mean()), "val/sampled_accuracy": float(correct.float().mean())})
    return out


def pass_at_k(correct_per_prompt: list[int], n: int, k: int) -> float:
    """Mean over prompts of 1 - C(n - c, k) / C(n, k): the chance that k of the n samples, drawn
    without replacement, hold a correct one. n=4, c=1, k=2: 1 - C(3, 2) / C(4, 2) = 1 - 3/6 = 0.5."""
    return sum(1.0 - comb(n - c, k) / comb(n, k) for c in correct_per_prompt) / len(correct_per_prompt)


def _ks(n: int) -> list[int]:
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def write_report(run_dir: Path, model: str, data: str, metrics: dict[str, float]) -> None:
    shown = ", ".join(f"{k.removeprefix('val/')} {v:.3f}" for k, v in metrics.items()
                      if k in ("val/accuracy", "val/sampled_reward_mean") or k.startswith("val/pass@"))
    (run_dir / "report.md").write_text(f"# Evaluation\n\n{model} on {data}: {shown}\n")


