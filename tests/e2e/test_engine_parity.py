"""Engine parity with a model whose config carries dropout (GPT-2: resid/embd/attn_pdrop=0.1).

By default every role loads it with dropout off, and the first batch's sampler-vs-actor gap is
float32 noise (tests/unit/test_precision.py::test_dropout_is_off_unless_kept loads GPT-2 as every role
does; every default GRPO run's first-batch check passes; a whole run of GPT-2 to show it again was
CI's time, tests/budget.py). With `model.keep_dropout=true` the actor's update forward is noisy (~0.08), and the
run stops at the first batch naming the architecture and the gap (docs/recipes.md, "Engine parity").
"""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from hybridflow.builders.tiny_model import build_char_tokenizer
from tests.e2e.test_rl_recipes import ONE_RANK, hybridflow, metrics

pytestmark = pytest.mark.usefixtures("shared_ray_head")  # its runs join one Ray head (tests/ray_head.py)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2") / "model"
    tokenizer = build_char_tokenizer()
    config = GPT2Config(vocab_size=128, n_positions=128, n_embd=128, n_layer=2, n_head=4,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _grpo(gpt2_dir, tmp_path, name: str, *extra: str):
    return hybridflow(["recipe=grpo", "trainer.total_steps=1", f"model.path={gpt2_dir}", "trainer.export_hf=false",
                       ONE_RANK, *extra], tmp_path, name)


@pytest.mark.slow  # CI's slow tier, for the default run's 20 minutes on a CPU without bf16 (README "Two commands")
def test_kept_dropout_stops_the_run_at_the_first_batch(gpt2_dir, tmp_path):
    result = _grpo(gpt2_dir, tmp_path, "kept", "model.keep_dropout=true")
    assert result.returncode != 0, "a sampler-vs-actor gap of dropout's size must stop the run"
    out = result.stdout + result.stderr
    assert "engine parity" in out and "GPT2LMHeadModel" in out and "trainer.engine_parity_tolerance" in out, out[-3000:]
    gap = metrics(tmp_path / "kept")[0]["rollout/log_prob_diff"]  # the step is logged before the stop
    assert gap > 1e-2
