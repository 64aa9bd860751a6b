"""The `hf` engine's own decode loop (workers/rollout/hf_rollout.py): greedy output equals transformers'
`generate`, the sampler log-probs of sampled tokens equal a full forward pass's tempered, top-p filtered
log-probs of the same tokens (what the trainer's ratio reads), and the top-p filter keeps the smallest
set reaching top_p, worked by hand. The references are the model as transformers loads it, with its own
kernels: the engine's CPU kernels (hybridflow/training/decode_kernels.py) are held to them."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.config.schema import Dtype, RolloutConfig
from hybridflow.controller import WorkerContext


def _engine(tiny_model_dir, **rollout):
    from transformers import AutoTokenizer

    from workers.rollout.hf_rollout import HFRollout

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ctx = WorkerContext(rank=0, world_size=1, device="cpu", group_name="hf-engine")
    engine = HFRollout(ctx, str(tiny_model_dir), RolloutConfig(dtype=Dtype.float32, **rollout), 8, tok.eos_token_id,
                       tok.pad_token_id)
    engine.start()
    return engine, tok


def _plain_model(tiny_model_dir):
    """The model as transformers loads it: its SDPA attention and `F.linear`, not the engine's kernels."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _prompts(tok, rows: int):
    from hybridflow.data import ArithmeticSpec, make_arithmetic_rows
    from hybridflow.data.prompts import encode_prompts

    batch = encode_prompts(make_arithmetic_rows(rows, ArithmeticSpec(), seed=3), tok, 8)
    batch.tensors["sample_seed"] = torch.arange(rows)
    return batch


def test_greedy_output_equals_transformers_generate(tiny_model_dir):
    engine, tok = _engine(tiny_model_dir, max_response_tokens=6)
    prompts = _prompts(tok, 5)
    out = engine.generate(prompts, greedy=True)
    reference = _plain_model(tiny_model_dir).generate(prompts["prompt_ids"], attention_mask=prompts["prompt_mask"].long(),
                                      max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id,
                                      pad_token_id=tok.pad_token_id)[:, prompts["prompt_ids"].shape[1]:]
    width = reference.shape[1]
    mask = out["response_mask"][:, :width]
    assert torch.equal(out["response_ids"][:, :width][mask], reference[mask])


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_sampler_log_probs_are_the_full_forwards_tempered_top_p_log_probs(tiny_model_dir, top_p):
    engine, tok = _engine(tiny_model_dir, max_response_tokens=5, temperature=0.8, top_p=top_p)
    prompts = _prompts(tok, 4)
    out = engine.generate(prompts)
    again = engine.generate(prompts)
    assert torch.equal(out["response_ids"], again["response_ids"])  # the batch's seed: reproducible
    ids = torch.cat([prompts["prompt_ids"], out["response_ids"]], 1)
    mask = torch.cat([prompts["prompt_mask"], out["response_mask"]], 1).long()
    with torch.no_grad():
        logits = _plain_model(tiny_model_dir)(input_ids=ids, attention_mask=mask,
                                              position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    width, start = out["response_ids"].shape[1], prompts["prompt_ids"].shape[1]
    full = engine._processed_log_probs(logits[:, start - 1:start - 1 + width].float().reshape(-1, logits.shape[-1]),
                                       sample=True).reshape(len(prompts), width, -1)
    expected = full.gather(-1, out["response_ids"][..., None])[..., 0]
    m = out["response_mask"]
    torch.testing.assert_close(out["sampler_log_probs"][m], expected[m], atol=1e-4, rtol=1e-4)
    assert out.objects["finish_reason"] == ["length" if bool(r[-1]) and int(i[-1]) != tok.eos_token_id else "stop"
                                            for r, i in zip(m, out["response_ids"])]


def test_top_p_keeps_the_smallest_set_that_reaches_it_by_hand(tiny_model_dir):
    engine, _ = _engine(tiny_model_dir, temperature=1.0, top_p=0.6)
    # probabilities 0.5, 0.3, 0.2: the mass before each token is 0, 0.5, 0.8; tokens with mass before
    # them >= 0.6 go: the third. Kept 0.5, 0.3 renormalised: 0.625, 0.375.
    logits = torch.log(torch.tensor([[0.3, 0.5, 0.2]]))
    torch.testing.assert_close(engine._processed_log_probs(logits, sample=True).exp(),
                               torch.tensor([[0.375, 0.625, 0.0]]))
    assert math.isinf(float(engine._processed_log_probs(logits, sample=True)[0, 2]))


def test_top_k_keeps_the_k_likeliest_before_top_p_by_hand(tiny_model_dir):
    engine, _ = _engine(tiny_model_dir, temperature=1.0, top_k=2, top_p=0.7)
    # probabilities 0.3, 0.5, 0.2: top-k=2 keeps 0.5 and 0.3, renormalised 0.625, 0.375; top-p 0.7 over
    # those: mass before each is 0, 0.625, so both stay (vLLM's order: top-k, then top-p over the rest)
    logits = torch.log(torch.tensor([[0.3, 0.5, 0.2]]))
    torch.testing.assert_close(engine._processed_log_probs(logits, sample=True).exp(),
                               torch.tensor([[0.375, 0.625, 0.0]]))


def _recording(engine):
    """Each forward call's (rows, positions in, logits_to_keep, positions of logits out)."""
    calls = []

    def hook(module, args, kwargs, output):
        calls.append((kwargs["input_ids"].shape[0], kwargs["input_ids"].shape[1], kwargs.get("logits_to_keep"),
                      output.logits.shape[1]))

    engine.model.register_forward_hook(hook, with_kwargs=True)
    return calls


def test_the_prefill_computes_the_last_positions_logits_only(tiny_model_dir):
    """Issue 83 item 1: the prefill asks for one position's logits (`logits_to_keep=1`) and gets (B, 1, V), not
    (B, P, V); the greedy output is unchanged (the test above compares it with `generate`, which computes the
    padding columns too). Issue 86: the columns that are padding in every row are neither computed nor cached."""
    engine, tok = _engine(tiny_model_dir, max_response_tokens=3)
    prompts = _prompts(tok, 4)
    calls = _recording(engine)
    engine.generate(prompts, greedy=True)
    width = int(prompts["prompt_mask"].sum(1).max())  # the columns that are padding in every row are not computed
    assert 1 < width < prompts["prompt_ids"].shape[1] and calls[0] == (4, width, 1, 1)  # every position in, one out
    assert all(c[1] == 1 and c[3] == 1 for c in calls[1:])  # decode steps: one token in, one out


def test_a_model_without_logits_to_keep_keeps_no_view_of_every_positions_logits(tiny_model_dir, monkeypatch):
    """Where the model does not take `logits_to_keep`, the last position is copied out: the tensor the prefill
    returns owns (B, V) floats, not a view into (B, P, V); the greedy output is the same."""
    import hybridflow.training.kv_cache as kv_cache
    from transformers import DynamicCache

    engine, tok = _engine(tiny_model_dir, max_response_tokens=4)
    prompts = _prompts(tok, 3)
    kept = engine.generate(prompts, greedy=True)
    monkeypatch.setattr(kv_cache, "takes_logits_to_keep", lambda model: False)
    calls = _recording(engine)
    mask = prompts["prompt_mask"].long()
    logits = kv_cache.prefill_logits(engine.model, prompts["prompt_ids"], mask, (mask.cumsum(1) - 1).clamp(min=0), DynamicCache())
    assert calls[0][3] == prompts["prompt_ids"].shape[1]  # every position computed, then
    assert logits.untyped_storage().nbytes() == logits.numel() * logits.element_size()  # only the last kept
    assert torch.equal(engine.generate(prompts, greedy=True)["response_ids"], kept["response_ids"])


@pytest.mark.parametrize("greedy", [True, False])
def test_rows_decode_in_batches_of_max_num_seqs_with_the_one_batch_output(tiny_model_dir, greedy):
    """Issue 83 item 2: 5 rows at rollout.max_num_seqs=2 decode as batches of 2, 2 and 1 (each prefill
    recorded), in order, and give what one batch of 5 gives: greedy, and sampled too, since each sample draws
    from its own seed's stream."""
    one, tok = _engine(tiny_model_dir, max_response_tokens=6, temperature=0.9)
    split, _ = _engine(tiny_model_dir, max_response_tokens=6, temperature=0.9, max_num_seqs=2)
    prompts = _prompts(tok, 5)
    calls = _recording(split)
    whole, parts = one.generate(prompts, greedy=greedy), split.generate(prompts, greedy=greedy)
    assert [c[0] for c in calls if c[1] > 1] == [2, 2, 1]  # the prefills: one per batch
    assert max(c[0] for c in calls) <= 2
    for key in ("response_ids", "response_mask"):
        assert torch.equal(parts[key], whole[key]), key
    torch.testing.assert_close(parts["sampler_log_probs"], whole["sampler_log_probs"], atol=1e-5, rtol=1e-5)
    assert parts.objects["finish_reason"] == whole.objects["finish_reason"]
    if not greedy:  # another seed draws another sample: the seeds, not the batch, decide
        reseeded = _prompts(tok, 5)
        reseeded.tensors["sample_seed"] = torch.arange(5) + 100
        assert not torch.equal(split.generate(reseeded)["response_ids"], parts["response_ids"])


def test_inverse_cdf_sampling_by_hand():
    from workers.rollout.hf_rollout import _inverse_cdf

    # probabilities 0.2, 0, 0.5, 0.3: cumulative 0.2, 0.2, 0.7, 1.0; a uniform u takes the first token whose
    # cumulative sum passes u: 0.1 -> 0, 0.2 -> 2 (token 1 adds nothing, so never), 0.69 -> 2, 0.95 -> 3
    probs = torch.tensor([[0.2, 0.0, 0.5, 0.3]]).expand(4, 4)
    assert _inverse_cdf(probs, torch.tensor([0.1, 0.2, 0.69, 0.95], dtype=torch.float64)).tolist() == [0, 2, 2, 3]
    # trailing zeros (top-p dropped them): a uniform at the total takes the last token with any mass
    assert _inverse_cdf(torch.tensor([[0.5, 0.5, 0.0, 0.0]]), torch.tensor([1.0], dtype=torch.float64)).tolist() == [1]
    # and the draws follow the distribution: 0.1, 0.6, 0.3 over 20,000 uniforms
    counts = torch.bincount(_inverse_cdf(torch.tensor([[0.1, 0.6, 0.3]]).expand(20000, 3),
                                         torch.rand(20000, generator=torch.Generator().manual_seed(0),
                                                    dtype=torch.float64)), minlength=3) / 20000
    torch.testing.assert_close(counts, torch.tensor([0.1, 0.6, 0.3]), atol=0.015, rtol=0)


@pytest.mark.parametrize("greedy", [True, False])
def test_the_gpus_fixed_shape_steps_give_the_live_rows_steps_output(tiny_model_dir, greedy, monkeypatch):
    """Issue 86 item 1: on a GPU each step runs at one shape (transformers' StaticCache at full width, ended rows
    kept in the batch as padding) so that torch.compile captures it once; run here eagerly (the capture is the GPU's
    own), those steps — a batch padded to the cache's rows too — give the tokens, mask and log-probs of the CPU's
    live-row steps over the preallocated cache."""
    from transformers import StaticCache

    from hybridflow.training.kv_cache import CapturedSteps

    engine, tok = _engine(tiny_model_dir, max_response_tokens=6, temperature=0.9)
    prompts = _prompts(tok, 5)
    engine.eos_token_id = int(engine.generate(prompts, greedy=greedy)["response_ids"][0, 2])  # a row ends early
    live_rows = engine.generate(prompts, greedy=greedy)

    def fixed(prompt_mask):  # 7 rows of cache for a batch of 5: two rows of padding too
        positions = engine.max_prompt_tokens + engine.cfg.max_response_tokens
        cache = StaticCache(config=engine.model.config, max_cache_len=positions)
        return CapturedSteps(engine.model, engine.model, cache, 7, positions, prompt_mask, engine.pad_token_id)

    monkeypatch.setattr(engine, "_steps", fixed)
    calls = _recording(engine)
    out = engine.generate(prompts, greedy=greedy)
    assert {c[0] for c in calls} == {7}  # every step at the cache's full size
    assert not bool(out["response_mask"].all())  # a row ended early and stayed in the batch
    for key in ("response_ids", "response_mask"):
        assert torch.equal(out[key], live_rows[key]), key
    torch.testing.assert_close(out["sampler_log_probs"], live_rows["sampler_log_probs"], atol=1e-5, rtol=1e-5)


def test_a_static_caches_storage_is_freed_and_refilled_in_its_own_tensors(tiny_model_dir):
    """What the GPU's sleep does to the captured step's StaticCache: no bytes held while asleep, the same tensor
    objects (their guards hold) and full size again at wake-up, and the next batch decodes as before."""
    from transformers import StaticCache

    from hybridflow.training.kv_cache import CapturedSteps, free_storage, refill_storage

    engine, tok = _engine(tiny_model_dir, max_response_tokens=4)
    prompts = _prompts(tok, 3)
    positions = engine.max_prompt_tokens + 4
    cache = StaticCache(config=engine.model.config, max_cache_len=positions)
    engine._steps = lambda mask: CapturedSteps(engine.model, engine.model, cache, 3, positions, mask, engine.pad_token_id)
    before = engine.generate(prompts, greedy=True)
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    free_storage(cache)
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    refill_storage(cache)
    assert all(a is b for a, b in zip([t for layer in cache.layers for t in (layer.keys, layer.values)], tensors))
    assert all(t.untyped_storage().nbytes() == t.numel() * 4 for t in tensors)
    assert torch.equal(engine.generate(prompts, greedy=True)["response_ids"], before["response_ids"])
