"""Off-policy correction for trainer.max_staleness > 0 (docs/async.md): the truncated
importance weight min(π_old/μ, C) by hand, its direction, that a weight of 1 leaves the loss
bit for bit as it was, that it multiplies the clipped per-token loss, and that the step's
advantages carry it only when the run is stale and clips against the actor."""

import math
import re

import pytest
import torch

from hybridflow.algos.policy_loss import compute_policy_loss
from hybridflow.algos.rollout_correction import rollout_correction
from hybridflow.config import compose
from recipes.ppo import add_advantages

LN = math.log


def test_truncated_weight_by_hand():
    # π_old / μ per token: a 0.5/0.25 = 2 -> capped at 1.5 ; b 0.2/0.4 = 0.5 ; c: padding -> 0
    old = torch.tensor([[LN(0.5), LN(0.2), LN(0.9)]])
    sampler = torch.tensor([[LN(0.25), LN(0.4), LN(0.1)]])
    mask = torch.tensor([[True, True, False]])
    weights, stats = rollout_correction("token_tis", old_log_probs=old, sampler_log_probs=sampler,
                                        response_mask=mask, cap=1.5)
    torch.testing.assert_close(weights, torch.tensor([[1.5, 0.5, 0.0]]))
    assert stats["weight_mean"] == pytest.approx(1.0)  # (1.5 + 0.5) / 2
    assert stats["clipped_fraction"] == pytest.approx(0.5)
    # direction: a token the sampler under-sampled relative to π_old (μ < π_old) weighs more than 1
    assert weights[0, 0] > 1 > weights[0, 1]


def test_a_weight_of_one_leaves_the_loss_bit_for_bit_and_a_weight_multiplies_the_clipped_loss():
    torch.manual_seed(0)
    log_probs, old = torch.randn(4, 6) * 0.1, torch.randn(4, 6) * 0.1
    adv, mask = torch.randn(4, 6), torch.rand(4, 6) > 0.2
    for name in ("ppo_clip", "gspo"):
        plain, _ = compute_policy_loss(name, log_probs=log_probs, old_log_probs=old, advantages=adv, response_mask=mask)
        ones, _ = compute_policy_loss(name, log_probs=log_probs, old_log_probs=old, advantages=adv, response_mask=mask,
                                      behavior_weights=torch.ones(4, 6))
        assert torch.equal(plain, ones), name
    # ratio 1 (log_probs == old): the clipped loss is -Â per token; Â = [1, -1], w = [1.5, 0.5]
    # token-mean of [-1.5, 0.5] = -0.5
    zeros, one_row = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    loss, _ = compute_policy_loss("ppo_clip", log_probs=zeros, old_log_probs=zeros, advantages=torch.tensor([[1.0, -1.0]]),
                                  response_mask=one_row, behavior_weights=torch.tensor([[1.5, 0.5]]))
    assert loss.item() == pytest.approx(-0.5)


def batch(config):
    from hybridflow.batch import Batch

    mask = torch.tensor([[True, True], [True, False], [True, True], [True, True]])
    return Batch({"response_mask": mask, "sequence_rewards": torch.tensor([1.0, 0.0, 0.5, 0.0]),
                  "group_ids": torch.tensor([0, 0, 1, 1]), "old_log_probs": torch.full((4, 2), LN(0.5)),
                  "sampler_log_probs": torch.full((4, 2), LN(0.25))})


def test_with_rollout_correction_auto_the_step_carries_weights_only_when_stale_and_clipping_against_the_actor():
    sync = compose(["recipe=grpo"])
    assert "behavior_weights" not in add_advantages(batch(sync), sync, 0.0)[0]
    stale = compose(["recipe=grpo", "placement=disaggregated", "trainer.max_staleness=1", "trainer.old_log_probs=actor"])
    samples, metrics = add_advantages(batch(stale), stale, 0.0, "old_log_probs")
    expected = torch.tensor([[2.0, 2.0], [2.0, 0.0], [2.0, 2.0], [2.0, 2.0]])  # 0.5/0.25 = 2 = the default cap
    torch.testing.assert_close(samples["behavior_weights"], expected)
    assert metrics["rollout_correction/weight_mean"] == pytest.approx(2.0)
    assert metrics["rollout_correction/clipped_fraction"] == 0.0
    sampler = compose(["recipe=grpo", "placement=disaggregated", "trainer.max_staleness=1",
                       "trainer.old_log_probs=sampler"])
    assert "behavior_weights" not in add_advantages(batch(sampler), sampler, 0.0, "sampler_log_probs")[0]


@pytest.mark.parametrize("overrides, key", [
    (["trainer.max_staleness=1", "placement=disaggregated"], "trainer.old_log_probs"),
    (["trainer.max_staleness=1", "trainer.old_log_probs=actor"], "placement.roles.rollout"),
    (["trainer.max_staleness=1", "trainer.old_log_probs=actor", "placement=disaggregated", "rollout=hf"],
     "rollout=hf receives weights only in the actor's processes"),
    (["trainer.max_staleness=-1"], "trainer.max_staleness"),
    (["algorithm.behavior_is_cap=-1"], "algorithm.behavior_is_cap"),
    (["trainer.max_staleness=2", "trainer.old_log_probs=actor", "placement=disaggregated",
      "trainer.save_every_steps=1", "trainer.training_hooks=[{name: spike_recovery}]"],
     "trainer.training_hooks=['spike_recovery'] is invalid: spike_recovery reloads the actor's weights"),
    (["rollout.on_update=recompute", "trainer.max_staleness=1", "trainer.old_log_probs=actor",
      "placement=disaggregated"], "rollout.on_update='recompute' is invalid: weights land while requests run only"),
    (["rollout.on_update=keep"], "rollout.on_update"),
])
def test_a_stale_config_without_what_it_needs_is_refused_naming_the_key(overrides, key):
    """As the command refuses them: the config's own rules at compose, its plan's when the stage is prepared."""
    from hybridflow.run.pipeline_stages import compose_command

    with pytest.raises(Exception, match=re.escape(key)):
        compose_command(["recipe=grpo", *overrides])


def test_a_missing_key_is_named_with_the_role_that_writes_it():
    from hybridflow.batch import Batch
    from hybridflow.batch_keys import STEP_KEYS, require

    with pytest.raises(KeyError, match=r"'behavior_weights' \(written by driver\)"):
        require(Batch({"advantages": torch.zeros(2, 3)}), ["advantages", "behavior_weights"], "actor.update_policy")
    assert STEP_KEYS["old_log_probs"].writer == "actor" and STEP_KEYS["sampler_log_probs"].writer == "rollout"


def test_spike_recovery_one_step_off_is_accepted():
    config = compose(["recipe=grpo", "trainer.max_staleness=1", "trainer.old_log_probs=actor", "placement=disaggregated",
                      "trainer.save_every_steps=1", "trainer.training_hooks=[{name: spike_recovery}]"])
    assert config.trainer.max_staleness == 1 and config.trainer.training_hooks[0].name == "spike_recovery"
