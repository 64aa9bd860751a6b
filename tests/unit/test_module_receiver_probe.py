"""The weight-sync probe (hybridflow/resharding/verify.py): the Hugging Face receiver's probe gives
the model's own log-probs (not generation scores a logits processor has reshaped), and the
actor's side scores the probe prompts as one left-padded batch, so a padding or position mismatch
between the engines shows in the gap, where the old single unpadded prompt saw none."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from hybridflow.config.schema import HybridFlowConfig, ModelConfig
from hybridflow.controller import WorkerContext
from hybridflow.resharding.receiver import ModuleReceiver
from hybridflow.resharding.verify import PROBE_NEW_TOKENS, PROBE_PROMPTS, PROBE_TOLERANCE, probe_batch, probe_fits
from recipes.roles import actor_role
from hybridflow.run.stage import prepare_stage


def _plain_log_probs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0]


def test_probe_log_probs_equal_a_plain_forward(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokens, log_probs = ModuleReceiver(model, pad_token_id=0).probe(PROBE_PROMPTS, PROBE_NEW_TOKENS)
    assert [len(t) for t in tokens] == [PROBE_NEW_TOKENS] * len(PROBE_PROMPTS)
    expected = torch.cat([_plain_log_probs(model, p, t) for p, t in zip(PROBE_PROMPTS, tokens) if t])
    # with min_new_tokens, generate's `scores` drop EOS and renormalise (off by ~1e-2 on this model)
    torch.testing.assert_close(log_probs, expected, atol=1e-6, rtol=0)


def test_a_prompt_the_engine_cannot_hold_is_skipped(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    model.config.max_position_embeddings = 64
    tokens, log_probs = ModuleReceiver(model, pad_token_id=0).probe(PROBE_PROMPTS, PROBE_NEW_TOKENS)
    n = PROBE_NEW_TOKENS
    assert [len(t) for t in tokens] == [n, n, 0, 0] and len(log_probs) == 2 * n  # 61 + n and 200 + n > 64
    assert not probe_fits([1] * 61, 64, 4) and probe_fits([1] * 60, 64, 4) and probe_fits([1] * 999, None, 4)


def test_probe_batch_is_left_padded_with_one_row_per_continuation():
    batch = probe_batch([[5, 6], [7, 8, 9], [4]], [[1, 2], [], [3]])
    assert batch["prompt_ids"].tolist() == [[5, 6], [0, 4]] and batch["prompt_mask"].tolist() == [[True, True], [False, True]]
    assert batch["response_ids"].tolist() == [[1, 2], [3, 0]] and batch["response_mask"].tolist() == [[True, True], [True, False]]


def test_the_probe_sees_a_padding_mismatch(tmp_path):
    """GPT-2 (learned absolute positions): an actor that drops the position ids reads left padding as
    positions. The padded probe prompts show it; a single unpadded prompt would not."""
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=80, n_positions=256, n_embd=64, n_layer=2, n_head=2)).save_pretrained(tmp_path)
    engine = ModuleReceiver(AutoModelForCausalLM.from_pretrained(tmp_path).eval(), pad_token_id=0)
    tokens, engine_lp = engine.probe(PROBE_PROMPTS, PROBE_NEW_TOKENS)
    # the padded path: the fault simulated below (position ids dropped, left padding read as positions)
    actor = actor_role(prepare_stage(HybridFlowConfig(model=ModelConfig(pack_sequences=False))).config, tmp_path).build(WorkerContext())
    actor.start()
    assert (actor.probe_log_probs(PROBE_PROMPTS, tokens) - engine_lp).abs().max() < 1e-4

    forward = actor.model.forward
    actor.model.forward = lambda **kw: forward(**{k: v for k, v in kw.items() if k != "position_ids"})
    gap = (actor.probe_log_probs(PROBE_PROMPTS, tokens) - engine_lp).abs().max()
    assert gap > PROBE_TOLERANCE, gap
    longest = len(PROBE_PROMPTS) - 1  # the one row without padding agrees: an unpadded probe sees nothing
    alone = actor.probe_log_probs(PROBE_PROMPTS[longest:], tokens[longest:])
    assert (alone - engine_lp[-PROBE_NEW_TOKENS:]).abs().max() < 1e-4
