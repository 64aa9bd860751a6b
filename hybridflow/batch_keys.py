"""What a PPO-family step's Batch carries: every key, the one role that writes it, who reads it,
and its shape (B samples, P prompt tokens, R response tokens).

Log-probs are named for the policy that produced them:
- `sampler_log_probs`: the behaviour policy, the rollout engine's weights when it sampled
  (the policy version in `behavior_version`);
- `old_log_probs`: the proximal policy π_old, the actor's weights before this step's update,
  computed by the actor; absent when the recipe clips against the sampler instead (on-policy
  with one update per step, or `trainer.old_log_probs=sampler`): `proximal_key` says which of
  the two the update and the KL penalty read, so no key is ever copied under another's name;
- the current policy's log-probs exist only inside the update (workers/actor.py).

Per-sample stamps (group, seed, policy version) are tensors, never `Batch.meta`, which
`Batch.concat` keeps from the first batch only.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.batch import Batch
from hybridflow.config.engines import rollout_engine


@dataclass(frozen=True)
class Key:
    writer: str
    readers: tuple[str, ...]
    shape: str
    what: str


DRIVER, ROLLOUT, REWARD, ACTOR, REFERENCE, CRITIC, TEACHER = (
    "driver", "rollout", "reward", "actor", "reference", "critic", "teacher")

STEP_KEYS: dict[str, Key] = {
    "prompt_ids": Key(DRIVER, (ROLLOUT, ACTOR, REFERENCE, CRITIC), "(B, P)", "prompt token ids, left-padded"),
    "prompt_mask": Key(DRIVER, (ROLLOUT, ACTOR, REFERENCE, CRITIC), "(B, P)", "True on prompt tokens"),
    "group_ids": Key(DRIVER, (DRIVER,), "(B,)", "the prompt a sample answers (the estimators' groups)"),
    "sample_seed": Key(DRIVER, (ROLLOUT,), "(B,)", "the sampler's seed, from (seed, step, index) only"),
    "prompt_index": Key(DRIVER, (DRIVER,), "(B,)", "the training row a sample answers (its index in the training "
                        "data), recorded per step in trained_prompts.jsonl"),
    "behavior_version": Key(ROLLOUT, (DRIVER,), "(B,)", "the policy version that generated the sample (the "
                            "engine's label, set after each checked load)"),
    "token_versions": Key(ROLLOUT, (DRIVER,), "(B, R)", "rollout.on_update=recompute: the policy version that "
                          "sampled each token, -1 on padding"),
    "weights_wait_s": Key(ROLLOUT, (DRIVER,), "(B,)", "max_staleness >= 2: how long the rollout waited for the "
                          "staged weights the batch needed"),
    "response_ids": Key(ROLLOUT, (ACTOR, REFERENCE, CRITIC), "(B, R)", "sampled tokens, right-padded"),
    "response_mask": Key(ROLLOUT, (ACTOR, REFERENCE, CRITIC, DRIVER), "(B, R)", "True on response tokens"),
    "loss_mask": Key(ROLLOUT, (ACTOR, CRITIC, DRIVER), "(B, R)", "True on sampled tokens (agents: not tool output)"),
    "sampler_log_probs": Key(ROLLOUT, (ACTOR, DRIVER), "(B, R)", "behaviour policy log-probs"),
    "sequence_rewards": Key(REWARD, (DRIVER,), "(B,)", "the reward function's score"),
    "old_log_probs": Key(ACTOR, (ACTOR, DRIVER), "(B, R)", "proximal policy log-probs (actor.compute_log_probs)"),
    "ref_log_probs": Key(REFERENCE, (ACTOR, DRIVER), "(B, R)", "reference policy log-probs (LoRA: the actor's)"),
    "teacher_log_probs": Key(TEACHER, (DRIVER,), "(B, R)", "the teacher's log-probs of the sampled tokens "
                             "(distillation: teacher.path)"),
    "teacher_topk_ids": Key(TEACHER, (ACTOR,), "(B, R, k)", "teacher.objective=topk: the teacher's k likeliest "
                            "tokens at each response position"),
    "teacher_topk_log_probs": Key(TEACHER, (ACTOR,), "(B, R, k)", "their log-probs under the teacher"),
    "values": Key(CRITIC, (CRITIC, DRIVER), "(B, R)", "the critic's value estimates before its update"),
    "baseline_rewards": Key(REWARD, (DRIVER,), "(B,)", "ReMax: the greedy response's reward, per sample"),
    "token_rewards": Key(DRIVER, (), "(B, R)", "sequence reward on the last token minus the KL penalty"),
    "advantages": Key(DRIVER, (ACTOR,), "(B, R)", "the estimator's advantages"),
    "returns": Key(DRIVER, (CRITIC,), "(B, R)", "the critic's targets"),
    "behavior_weights": Key(DRIVER, (ACTOR,), "(B, R)", "the rollout correction's weight of each token (e.g. "
                            "min(exp(old - sampler), C); 0 where it masks), 0 outside loss_mask"),
}


def clips_against_sampler(config) -> bool:
    """Whether the update's π_old is the sampler's log-probs (no actor forward pass): chosen with
    trainer.old_log_probs, or, on 'auto', when the run is on-policy with one update per step and no
    rollout correction preset asks for the actor's π_old (algorithm.rollout_correction). With an exact engine
    'auto' recomputes π_old: the pass that shows the sampler's log-probs are π_old bit for bit
    (`rollout_mismatch/*` 0.0), one forward against the engine's one per response token."""
    t, a = config.trainer, config.actor
    if t.old_log_probs != "auto":
        return t.old_log_probs == "sampler"
    if rollout_engine(config.rollout.backend).exact:
        return False
    if config.algorithm.rollout_correction not in ("auto", "none"):
        return False
    return t.use_sampler_log_probs and a.epochs_per_step == 1 and \
        a.samples_per_mini_batch in (0, t.prompts_per_step * config.rollout.samples_per_prompt)


def proximal_key(clip_against_sampler: bool) -> str:
    """The column the update clips against (π_old) and the KL penalty reads."""
    return "sampler_log_probs" if clip_against_sampler else "old_log_probs"


def require(batch: Batch, keys: list[str], reader: str) -> None:
    """Raise naming each key `reader` needs that `batch` lacks, and the role that writes it."""
    missing = [k for k in keys if k not in batch]
    if missing:
        raise KeyError(f"{reader} needs {', '.join(f'{k!r} (written by {STEP_KEYS[k].writer})' for k in missing)}; "
                       f"the batch has {batch.keys()}")
