"""DAPO's dynamic sampling and overlong shaping: the pure functions against worked numbers, and the GRPO
recipe's refill (recipes/ppo.py `refill_groups`) driven by stand-in rollout and reward groups that
record their calls (the real end to end run: tests/e2e/test_rl_recipes.py)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algos.rewards import informative_groups, overlong_penalty
from hybridflow.batch import Batch
from hybridflow.config import compose


def test_informative_groups_are_those_whose_rewards_differ_in_order_of_appearance():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 7.0])
    groups = torch.tensor([3, 3, 0, 0, 9, 9, 5])
    assert informative_groups(rewards, groups).tolist() == [0]  # 3: all 1; 9: all 0.5; 5: one sample
    assert informative_groups(torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.tensor([2, 2, 1, 1])).tolist() == [2, 1]
    with pytest.raises(ValueError, match="must be the same"):
        informative_groups(torch.zeros(3), torch.zeros(4, dtype=torch.long))


def test_the_overlong_penalty_is_zero_then_linear_to_the_whole_factor_at_the_limit():
    lengths = torch.tensor([0, 10, 12, 14, 16])  # limit 16, buffer 4: shaping from 12 tokens on
    assert overlong_penalty(lengths, 16, 4).tolist() == [0.0, 0.0, 0.0, -0.5, -1.0]  # DAPO eq. 13
    assert overlong_penalty(lengths, 16, 4, factor=0.5).tolist() == [0.0, 0.0, 0.0, -0.25, -0.5]
    with pytest.raises(ValueError, match="buffer_tokens=17"):
        overlong_penalty(lengths, 16, 17)


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        value = self.fn(*args, **kwargs)
        return type("Ready", (), {"get": lambda _self: value})()


class _Rollout:
    """Answers each prompt's samples with the reward-determining response the test scripted for it."""

    def __init__(self, script):
        self.script, self.calls = script, []
        self.generate = _Remote(self._generate)

    def _generate(self, batch, **kwargs):
        self.calls.append({"prompts": list(dict.fromkeys(batch.objects["prompt"])), **kwargs,
                           "seeds": batch["sample_seed"].tolist()})
        n = len(batch)
        responses = [self.script[p][i % len(self.script[p])] for i, p in enumerate(batch.objects["prompt"])]
        return batch.union(Batch(tensors={"response_mask": torch.ones(n, 4, dtype=torch.bool),
                                          "behavior_version": torch.zeros(n, dtype=torch.long)},
                                 objects={"response": responses}))


class _Reward:
    def __init__(self):
        # score: the response as a number; accuracy: whether it is "1" (so "2" and "0" differ in score only)
        self.compute_rewards = _Remote(lambda batch: Batch(tensors={
            "sequence_rewards": torch.tensor([float(r) for r in batch.objects["response"]]),
            "reward_extra/accuracy": torch.tensor([float(r == "1") for r in batch.objects["response"]]),
            **({"reward_extra/parsed": torch.ones(len(batch))} if "2" in batch.objects["response"] else {})}))


class _Loader:
    """The rows in order; the step's own first draw is already made (the test generates it)."""

    def __init__(self, rows, per_step):
        self.rows, self.per_step, self.drawn = rows, per_step, per_step

    def next_rows(self, step=None):
        picked = self.rows[self.drawn: self.drawn + self.per_step]
        self.last_picked = list(range(self.drawn, self.drawn + len(picked)))  # as PromptLoader records them
        self.drawn += self.per_step
        return picked


def _step(config, script, rows):
    from recipes.ppo import Step

    r = Step.__new__(Step)
    r.config, r.n = config, config.rollout.samples_per_prompt
    r.tokenizer = _step.tokenizer
    r.loader, r.rollout, r.reward = _Loader(rows, config.trainer.prompts_per_step), _Rollout(script), _Reward()
    return r


@pytest.fixture(autouse=True)
def _tokenizer(tiny_model_dir):
    from hybridflow.data.tokenizer import load_tokenizer

    _step.tokenizer = load_tokenizer(tiny_model_dir)


def _config(rounds: int, buffer: int = 0, metric: str = "reward", on_limit: str = "top_up", per_round: int = 0):
    return compose(["recipe=grpo", "trainer.prompts_per_step=2", "rollout.samples_per_prompt=2",
                    f"algorithm.dynamic_sampling_rounds={rounds}", f"algorithm.overlong_buffer_tokens={buffer}",
                    f"algorithm.dynamic_sampling_metric={metric}", f"algorithm.dynamic_sampling_on_limit={on_limit}",
                    f"algorithm.dynamic_sampling_prompts_per_round={per_round}", "rollout.max_response_tokens=4"])


def test_refill_keeps_full_groups_with_a_signal_and_generates_under_the_same_version_bound():
    from recipes.ppo import refill_groups

    # per prompt, the rewards its two samples get: "1+1=" and "2+2=" all agree, the others differ
    script = {"1+1=": ["1"], "2+2=": ["0"], "3+3=": ["0", "1"], "4+4=": ["1", "1"], "5+5=": ["2", "0"],
              "6+6=": ["0", "1"]}
    rows = [{"prompt": p} for p in script]
    r = _step(_config(rounds=3), script, rows)
    first = r.rollout.generate.remote(_samples(r, rows[:2], step=7), min_version=5).get()
    batch = refill_groups(r, 7, 2, first, {"min_version": 5})
    # round 1 draws 3+3= (kept) and 4+4= (dropped); round 2 draws 5+5= (kept): two groups, stop
    assert [c["prompts"] for c in r.rollout.calls] == [["1+1=", "2+2="], ["3+3=", "4+4="], ["5+5=", "6+6="]]
    assert all(c["min_version"] == 5 for c in r.rollout.calls)  # the staleness bound of the step's batch
    seeds = [s for c in r.rollout.calls for s in c["seeds"]]
    assert len(set(seeds)) == len(seeds)  # every round samples with seeds of its own
    assert batch.objects["prompt"] == ["3+3=", "3+3=", "5+5=", "5+5="]
    assert batch["group_ids"].tolist() == [0, 0, 1, 1] and len(batch) == 4  # full size, one id per group
    assert informative_groups(batch["sequence_rewards"], batch["group_ids"]).tolist() == [0, 1]
    assert torch.isnan(batch["reward_extra/parsed"][:2]).all() and (batch["reward_extra/parsed"][2:] == 1).all()
    assert batch.meta["dynamic_sampling/rounds"] == 2 and batch.meta["dynamic_sampling/informative_groups"] == 2
    assert batch.meta["dynamic_sampling/dropped_groups"] == 3 and batch.meta["dynamic_sampling/short_groups"] == 0
    assert batch.meta["dynamic_sampling/generated_groups"] == 6 and batch.meta["dynamic_sampling/kept_groups"] == 3  # 6+6= too


SCRIPT = {"1+1=": ["1"], "2+2=": ["0"], "3+3=": ["0", "1"], "4+4=": ["1", "1"], "5+5=": ["2", "0"], "6+6=": ["0", "1"],
          "7+7=": ["1", "0"], "8+8=": ["0"]}


def test_by_default_the_filter_reads_accuracy_as_verls_dapo_recipe_and_the_round_limit_raises_with_the_numbers():
    """5+5= answers 2 and 0: its rewards differ, its accuracy (both wrong) does not, so the default drops it
    where the reward filter keeps it; with one extra round the step is short, which raises as verl does."""
    from recipes.ppo import refill_groups

    rows = [{"prompt": p} for p in SCRIPT]
    defaults = compose(["recipe=grpo"]).algorithm
    assert (defaults.dynamic_sampling_metric, defaults.dynamic_sampling_on_limit) == ("accuracy", "raise")
    r = _step(_config(rounds=1, metric="accuracy", on_limit="raise"), SCRIPT, rows)
    with pytest.raises(RuntimeError, match=r"dynamic sampling at step 3: 1 of the 2 groups .* differ in their accuracy "
                                           r"after 1 extra rounds \(algorithm.dynamic_sampling_rounds=1\): 4 groups "
                                           r"generated, 3 all alike. Fix: .*dynamic_sampling_on_limit=top_up"):
        refill_groups(r, 3, 2, r.rollout.generate.remote(_samples(r, rows[:2], step=3)).get(), {})
    kept = {}
    for metric in ("accuracy", "reward"):
        r = _step(_config(rounds=2, metric=metric, on_limit="raise"), SCRIPT, rows)
        batch = refill_groups(r, 3, 2, r.rollout.generate.remote(_samples(r, rows[:2], step=3)).get(), {})
        kept[metric] = list(dict.fromkeys(batch.objects["prompt"]))
    assert kept == {"accuracy": ["3+3=", "6+6="], "reward": ["3+3=", "5+5="]}


def test_a_generation_round_larger_than_the_training_batch_draws_whole_loader_batches_and_trains_the_first_kept():
    from recipes.ppo import refill_groups

    rows = [{"prompt": p} for p in SCRIPT]
    r = _step(_config(rounds=2, metric="accuracy", on_limit="raise", per_round=4), SCRIPT, rows)
    batch = refill_groups(r, 5, 2, r.rollout.generate.remote(_samples(r, rows[:2], step=5)).get(), {})
    # one extra round of 4 prompts (two loader batches) holds 3 groups with a signal: the first two train
    assert [c["prompts"] for c in r.rollout.calls][1:] == [["3+3=", "4+4=", "5+5=", "6+6="]]
    assert batch.objects["prompt"] == ["3+3=", "3+3=", "6+6=", "6+6="]
    assert batch.meta["dynamic_sampling/generated_groups"] == 6 and batch.meta["dynamic_sampling/kept_groups"] == 2
    with pytest.raises(ValueError, match=r"dynamic_sampling_prompts_per_round=3 .* a multiple of trainer.prompts_per_step \(2\)"):
        _config(rounds=2, per_round=3)


def test_the_accuracy_filter_without_an_accuracy_says_the_fix():
    from recipes.ppo import filter_values

    with pytest.raises(ValueError, match=r"no reward function returns one; fix: return .*dynamic_sampling_metric=reward"):
        filter_values(Batch(tensors={"sequence_rewards": torch.zeros(2)}), "accuracy")


def test_refill_stops_after_its_rounds_and_tops_up_with_groups_that_agree():
    from recipes.ppo import refill_groups

    script = {"1+1=": ["1"], "2+2=": ["0"], "3+3=": ["0", "1"], "4+4=": ["1", "1"]}
    rows = [{"prompt": p} for p in script]
    r = _step(_config(rounds=1, buffer=2, metric="shaped_reward"), script, rows)
    batch = refill_groups(r, 1, 2, r.rollout.generate.remote(_samples(r, rows[:2], step=1)).get(), {})
    assert len(r.rollout.calls) == 2 and batch.objects["prompt"] == ["3+3=", "3+3=", "1+1=", "1+1="]
    assert batch.meta["dynamic_sampling/short_groups"] == 1 and batch.meta["dynamic_sampling/informative_groups"] == 1
    # the overlong shaping: every response is 4 tokens, the limit: the whole penalty, on the shaped reward
    assert batch["reward_extra/overlong_penalty"].tolist() == [-1.0] * 4
    assert batch["sequence_rewards"].tolist() == [-1.0, 0.0, 0.0, 0.0]


def test_dynamic_sampling_is_refused_where_it_cannot_work():
    with pytest.raises(ValueError, match=r"rollout.samples_per_prompt=1 every group is one sample"):
        compose(["recipe=grpo", "rollout.samples_per_prompt=1", "algorithm.dynamic_sampling_rounds=2"])
    with pytest.raises(ValueError, match=r"ReMax's baseline is a greedy response"):
        compose(["recipe=grpo", "algorithm.advantage_estimator=remax", "algorithm.dynamic_sampling_rounds=2"])
    with pytest.raises(ValueError, match=r"spike_recovery hook puts back whole steps"):
        compose(["recipe=grpo", "algorithm.dynamic_sampling_rounds=2", "trainer.save_every_steps=5",
                 "trainer.training_hooks=[{name: spike_recovery}]"])
    with pytest.raises(ValueError, match=r"overlong_buffer_tokens=9 .* at most rollout.max_response_tokens \(8\)"):
        compose(["recipe=grpo", "rollout.max_response_tokens=8", "algorithm.overlong_buffer_tokens=9"])


def _samples(r, rows, step):
    from hybridflow.data.prompts import encode_prompts
    from hybridflow.run.runner import sample_seeds

    prompts = encode_prompts(rows, r.tokenizer, r.config.data.max_prompt_tokens)
    prompts.tensors["group_ids"] = torch.arange(len(prompts))
    prompts.tensors["prompt_index"] = torch.arange(len(prompts))  # the first rows, as the loader draws them
    samples = prompts.repeat_interleave(r.n)
    samples.tensors["sample_seed"] = sample_seeds(r.config.seed, step, len(samples))
    return samples
