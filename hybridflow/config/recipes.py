"""What each recipe is: one registered description that every check reads.

The CLI finds a recipe's function here; the schema's cross-field rules, the step hooks' checks,
the input checks (hybridflow/checks/preflight.py) and the pipeline's routing of command-line overrides
to stages read what a recipe can do from its `RecipeSpec` instead of comparing names. A new
recipe is one `RECIPE_SPECS.add(...)` below. A custom recipe ('module:function') gets
`custom_spec`: it may read any key and claims no ability.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.registry import Registry

ALL_SECTIONS = ("recipe", "model", "data", "algorithm", "rollout", "weight_sync", "reward", "actor", "critic",
                "trainer", "placement", "logger", "ray", "pipeline", "pretrain", "dpo", "teacher", "seed")
# The sampling settings of training rollouts: a recipe that generates only greedily (validation) ignores them.
# The guards of a step loop that trains on its own samples (docs/reliability.md)
RL_GUARD_KEYS = ("trainer.max_steps_without_signal", "rollout.max_env_failure_fraction")
SAMPLING_KEYS = ("rollout.temperature", "rollout.top_p", "rollout.top_k", "rollout.samples_per_prompt")


@dataclass(frozen=True)
class RecipeSpec:
    name: str
    function: str  # 'module:function' taking (config: HybridFlowConfig, run_dir: Path) -> dict
    reads: tuple[str, ...]  # the config sections (or dotted key prefixes) the recipe reads
    ignores: tuple[str, ...] = ()  # keys under `reads` it does not read after all
    trains: bool = False  # a step loop drawing trainer.prompts_per_step training rows per step
    validates: bool = False  # greedy validation on trainer.val_prompts held-out rows (val/accuracy)
    reference: bool = False  # can run a reference model (the reference training hooks need one)
    step_hooks: bool = False  # runs trainer.training_hooks' step hooks around its actor update
    rl_reward: bool = False  # has a training reward (reward/score per step)
    needs_critic: bool = False  # trains a critic: algorithm.use_critic must be true
    answers: bool = False  # trains on each row's ground_truth as the answer
    preference: bool = False  # trains on (prompt, chosen, rejected) pairs (dpo.*)
    packs_sequences: bool = False  # steps are pretrain.sequences_per_step packed text sequences
    stage: bool = False  # can be a stage of recipe=pipeline
    pipeline: bool = False  # runs other recipes as stages (its own training sections are unused)
    overlaps_generation: bool = False  # can generate the next batch while training (trainer.max_staleness)
    needs_teacher: bool = False  # distils from a teacher: teacher.path must be set

    def reads_key(self, key: str) -> bool:
        """Whether the recipe reads `key` (a dotted key, or a config group's name)."""
        def under(prefixes: tuple[str, ...]) -> bool:
            return any(key == p or key.startswith(p + ".") for p in prefixes)

        return under(self.reads) and not under(self.ignores)


RECIPE_SPECS: Registry[RecipeSpec] = Registry("recipe", signature="run(stage: Stage, run_dir: Path) -> dict")

_RUN = ("model", "data", "placement", "logger", "ray", "seed")
_TRAIN = (*_RUN, "trainer", "actor", "rollout", "weight_sync", "reward")

for _spec in (
    RecipeSpec("demo", "recipes.demo:run", reads=(*_RUN, "rollout", "recipe.demo_prompts")),
    RecipeSpec("sft", "recipes.sft:run", reads=_TRAIN, ignores=(*SAMPLING_KEYS, *RL_GUARD_KEYS), trains=True,
               validates=True,
               step_hooks=True, answers=True, stage=True),
    RecipeSpec("grpo", "recipes.ppo:run", reads=(*_TRAIN, "algorithm", "critic", "teacher"), trains=True,
               validates=True, reference=True, step_hooks=True, rl_reward=True, stage=True, overlaps_generation=True),
    # GRPO's loop with the teacher's signal as the advantage (conf/recipe/distill.yaml: teacher.reward_weight=0)
    RecipeSpec("distill", "recipes.ppo:run", reads=(*_TRAIN, "algorithm", "critic", "teacher"), trains=True,
               validates=True, reference=True, step_hooks=True, rl_reward=True, stage=True, overlaps_generation=True,
               needs_teacher=True),
    RecipeSpec("ppo", "recipes.ppo:run", reads=(*_TRAIN, "algorithm", "critic", "teacher"), trains=True, validates=True,
               reference=True, step_hooks=True, rl_reward=True, needs_critic=True, stage=True,
               overlaps_generation=True),
    RecipeSpec("evaluate", "recipes.evaluate:run", reads=(*_RUN, "rollout", "reward", "trainer.val_prompts",
                                                          "recipe.eval_samples"), ignores=RL_GUARD_KEYS,
               validates=True),
    RecipeSpec("pipeline", "recipes.pipeline:run", reads=("pipeline", "logger", "model.path"), pipeline=True),
    RecipeSpec("pretrain", "recipes.pretrain:run", reads=("model", "placement", "logger", "ray", "seed", "trainer",
                                                          "actor", "pretrain"),
               ignores=("actor.policy_loss", "actor.clip_ratio_low", "actor.clip_ratio_high", "actor.kl_loss_coef",
                        "trainer.stop_at_val_accuracy", *RL_GUARD_KEYS),
               step_hooks=True, packs_sequences=True, stage=True),
    RecipeSpec("dpo", "recipes.dpo:run", reads=(*_RUN, "trainer", "actor", "dpo", "rollout.max_response_tokens"),
               ignores=("actor.policy_loss", "actor.clip_ratio_low", "actor.clip_ratio_high", "actor.dual_clip_c",
                        "actor.kl_loss_coef", "actor.kl_loss_estimator", "actor.entropy_coef", "actor.epochs_per_step",
                        "actor.loss_aggregation",
                        "actor.samples_per_mini_batch", "actor.skip_zero_advantage_samples", "trainer.max_staleness",
                        "trainer.stop_at_val_accuracy", "trainer.max_steps_without_signal"),
               trains=True, reference=True, step_hooks=True, preference=True, stage=True),
):
    RECIPE_SPECS.add(_spec.name, _spec)


def recipe_spec(name: str) -> RecipeSpec:
    """The spec of a built-in recipe, or `custom_spec` for a 'module:function' reference."""
    return RECIPE_SPECS.get(name) if name in RECIPE_SPECS else custom_spec(name)


def custom_spec(reference: str) -> RecipeSpec:
    return RecipeSpec(reference, reference, reads=ALL_SECTIONS)


def stage_recipes() -> list[str]:
    return [name for name in RECIPE_SPECS.names() if RECIPE_SPECS.get(name).stage]
