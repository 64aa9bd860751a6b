"""The exact engine (rollout.backend=exact, workers/rollout/exact_rollout.py) in one process with the actor it
generates from: the engine contract's response batch, sampler log-probs equal to the actor's π_old bit for
bit (torch.equal, float32 and bfloat16), a weight path that moves nothing, and the config rules that keep
the equality (hybridflow/checks/rules.py check_exact_engine). The GRPO run that logs
`rollout_mismatch/abs_diff_max == 0.0` is tests/e2e/test_exact_rollout.py."""

from __future__ import annotations

import math
import time

import pytest
import torch

from hybridflow.algos import tempered_log_softmax_at, token_log_probs_and_entropy
from hybridflow.batch import Batch
from hybridflow.config import ConfigError, compose
from hybridflow.controller import WorkerContext
from hybridflow.run.stage import prepare_stage


def test_tempered_log_softmax_at_a_hand_worked_example():
    # logits [0, ln 3]: softmax [1/4, 3/4]; at T = 2 the tempered logits are [0, ln 3 / 2] = [0, ln sqrt 3],
    # softmax [1 / (1 + sqrt 3), sqrt 3 / (1 + sqrt 3)]
    logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, 5.0]]])  # (1, 2, 2): position 1 is another distribution
    torch.testing.assert_close(tempered_log_softmax_at(logits, 0), torch.tensor([[math.log(0.25), math.log(0.75)]]))
    root3 = math.sqrt(3.0)
    torch.testing.assert_close(tempered_log_softmax_at(logits, 0, temperature=2.0),
                               torch.tensor([[-math.log(1 + root3), math.log(root3 / (1 + root3))]]))
    torch.testing.assert_close(tempered_log_softmax_at(logits, 1), torch.tensor([[math.log(0.5)] * 2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_tempered_log_softmax_at_is_bitwise_the_token_log_probs_at_every_position_and_token(dtype, temperature):
    """The engine's row and the trainer's gathered log-prob are the same float32 bits, over several row chunks."""
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 7, 50, generator=generator) * 4).to(dtype)  # (B, T, V)
    tokens = torch.randint(0, 50, (5, 7), generator=generator)
    trainer, _ = token_log_probs_and_entropy(logits, tokens, temperature=temperature, rows_per_chunk=2,
                                             with_entropy=False)
    for t in range(7):
        row = tempered_log_softmax_at(logits, t, temperature=temperature, rows_per_chunk=2)  # (B, V)
        assert torch.equal(row.gather(-1, tokens[:, t, None])[:, 0], trainer[:, t])
        torch.testing.assert_close(row.exp().sum(-1), torch.ones(5))


def _config(*overrides: str):
    return prepare_stage(compose(["recipe=grpo", "rollout.backend=exact", "placement=local",
                                  "rollout.max_response_tokens=6", "actor.samples_per_micro_batch=3",
                                  *overrides])).config


def _pair(model_dir, config, group: str, ctx: WorkerContext | None = None):
    """The actor and the exact engine, started in this process as one worker group (roles fused), introduced to
    each other as the host that builds them does."""
    from transformers import AutoTokenizer

    from hybridflow.controller import introduce
    from recipes.roles import actor_role, rollout_role

    tok = AutoTokenizer.from_pretrained(model_dir)
    ctx = ctx or WorkerContext(group_name=group)
    actor = actor_role(config, model_dir).build(ctx)
    engine = rollout_role(config, model_dir, tok).build(ctx)
    introduce([actor, engine])
    engine.start()  # before the actor: the engine asks for the actor's module when it generates
    actor.start()
    return actor, engine, tok


def _prompts(tok, rows: int = 7) -> Batch:
    from hybridflow.data import ArithmeticSpec, make_arithmetic_rows
    from hybridflow.data.prompts import encode_prompts

    prompts = encode_prompts(make_arithmetic_rows(rows, ArithmeticSpec(), seed=0), tok, 12)
    prompts.tensors["sample_seed"] = torch.arange(rows) + 11
    return prompts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_samples_what_the_actors_old_log_prob_pass_computes_bit_for_bit(tiny_model_dir, dtype):
    """7 rows in forwards of 3 (the last one short): the contract's keys and shapes, and the actor's π_old
    equal to the sampler's log-probs on every response token (the usual trimmed pass only near them)."""
    config = _config(f"model.dtype={dtype}")
    actor, engine, tok = _pair(tiny_model_dir, config, f"exact-{dtype}")
    prompts = _prompts(tok)
    samples = engine.generate(prompts)
    for key in ("response_ids", "response_mask", "sampler_log_probs"):
        assert samples[key].shape == (7, 6), key
    assert samples["sampler_log_probs"].dtype == torch.float32 and samples["behavior_version"].tolist() == [-1] * 7
    assert len(samples["response"]) == 7 and set(samples["finish_reason"]) <= {"stop", "length"}
    mask = samples["response_mask"]
    assert mask[:, 0].all() and (samples["sampler_log_probs"][~mask] == 0).all()
    assert (samples["sampler_log_probs"][mask] < 0).all()
    stopped = [i for i, f in enumerate(samples["finish_reason"]) if f == "stop"]
    for i in stopped:  # a row's EOS is its last response token
        assert samples["response_ids"][i, int(mask[i].sum()) - 1] == tok.eos_token_id
    old = actor.compute_log_probs(samples)["old_log_probs"]
    assert torch.equal(old, samples["sampler_log_probs"])  # 0 outside the mask on both sides
    usual = actor._log_probs(samples, "old_log_probs")["old_log_probs"]  # trimmed, micro-batched by length
    torch.testing.assert_close(usual, old, atol=0.05 if dtype == "bfloat16" else 1e-5, rtol=0)
    again = engine.generate(prompts)  # the batch's first sample seed seeds its sampler
    assert torch.equal(again["response_ids"], samples["response_ids"])


def test_the_old_log_prob_pass_replays_the_decode_on_the_module_it_reads(tiny_model_dir):
    """π_old is computed from the actor's module, not copied from the batch: the module changed after sampling,
    the pass returns other log-probs; the sampler's put back, the same bits again."""
    actor, engine, tok = _pair(tiny_model_dir, _config("rollout.max_response_tokens=12"), "exact-reads")
    samples = engine.generate(_prompts(tok))
    weight = next(p for p in actor.model.parameters() if p.dim() == 2)
    kept = weight.detach().clone()
    with torch.no_grad():
        weight.mul_(1.01)
    moved = actor.compute_log_probs(samples)["old_log_probs"]
    assert not torch.equal(moved, samples["sampler_log_probs"])
    with torch.no_grad():
        weight.copy_(kept)
    assert torch.equal(actor.compute_log_probs(samples)["old_log_probs"], samples["sampler_log_probs"])


def test_a_forward_of_the_whole_sequence_is_not_the_cached_decode_in_bfloat16(tiny_model_dir):
    """Why π_old replays the engine's decode (hybridflow/training/exact_layout.py): the same tokens through one
    forward of the whole sequence — the usual pass, (rows x length) products where a decode step has (rows x 1)
    ones — give other bits (in float32 here 26 of 78 tokens, up to 9.5e-7, on the 2-core AMD EPYC; in bfloat16
    every one, up to 4e-3). Should this ever hold, the replay could give way to the usual pass."""
    from hybridflow.training.exact_layout import trimmed_prompts
    from hybridflow.training.sequences import loss_mask, model_inputs

    actor, engine, tok = _pair(tiny_model_dir, _config("model.dtype=bfloat16", "rollout.max_response_tokens=12"),
                               "exact-whole")
    samples = engine.generate(_prompts(tok))
    whole = []
    for micro in samples.split(3):  # the engine's rows together, the used prompt columns, every response column
        micro = trimmed_prompts(micro)
        prompt_width = micro["prompt_ids"].shape[1]
        with torch.no_grad():
            logits = actor.model(**model_inputs(micro), use_cache=False).logits[:, prompt_width - 1:-1]
        log_probs, _ = token_log_probs_and_entropy(logits, micro["response_ids"], with_entropy=False)
        whole.append(log_probs * loss_mask(micro))
    whole, mask = torch.cat(whole), samples["response_mask"]
    torch.testing.assert_close(whole, samples["sampler_log_probs"], atol=0.05, rtol=0)
    assert (whole != samples["sampler_log_probs"])[mask].float().mean() > 0.5


def test_a_rank_whose_rows_have_all_ended_keeps_one_as_padding_and_still_replays_bit_for_bit(tiny_model_dir,
                                                                                             monkeypatch):
    """Under FSDP every forward is collective: where this rank's rows end while another rank's go on
    (`any_rank` says so), the decode keeps its first row as padding; the real rows' tokens and log-probs are those
    of a decode that stopped, and π_old replays the same steps, the same bits."""
    import hybridflow.training.exact_layout as layout

    actor, engine, tok = _pair(tiny_model_dir, _config("rollout.max_response_tokens=12"), "exact-padding")
    prompts = _prompts(tok)
    alone = engine.generate(prompts)
    forwards = []
    plain_next = layout.LiveRowSteps.next
    monkeypatch.setattr(layout.LiveRowSteps, "next", lambda self, token, position: (
        forwards.append(len(token)), plain_next(self, token, position))[1])
    monkeypatch.setattr(layout, "any_rank", lambda flag: True)  # another rank decodes to the limit
    padded = engine.generate(prompts)
    assert forwards.count(1) > 0 and len(forwards) == 3 * 11  # 3 micro-batches, 11 steps after each prefill
    for key in ("response_ids", "response_mask", "sampler_log_probs"):
        assert torch.equal(padded[key], alone[key]), key
    assert torch.equal(actor.compute_log_probs(padded)["old_log_probs"], padded["sampler_log_probs"])


def test_greedy_generation_and_the_probe_take_the_most_likely_token(tiny_model_dir):
    actor, engine, tok = _pair(tiny_model_dir, _config(), "exact-greedy")
    prompts = _prompts(tok, rows=3)
    greedy = engine.generate(prompts, greedy=True)
    assert torch.equal(greedy["response_ids"], engine.generate(prompts, greedy=True)["response_ids"])
    prompt = prompts["prompt_ids"][0][prompts["prompt_mask"][0]].tolist()
    tokens, log_probs = engine.probe_log_probs([prompt, [5] * 10_000], 3)  # the second cannot be held: skipped
    assert len(tokens[0]) == 3 and tokens[1] == [] and log_probs.dtype == torch.float64 and log_probs.shape == (3,)
    torch.testing.assert_close(log_probs, actor.probe_log_probs([prompt], [tokens[0]]), atol=1e-5, rtol=0)


def test_the_weight_path_moves_nothing(tiny_model_dir):
    """The receiver needs an empty box of every tensor, draws no bucket and holds no parameter of its own."""
    from hybridflow.resharding.layout import Box

    _, engine, _ = _pair(tiny_model_dir, _config(), "exact-weights")
    needs = engine.weight_needs({"a.weight": [4, 3], "b.bias": [4]})
    assert {n: Box.of(b).numel for n, b in needs.items()} == {"a.weight": 0, "b.bias": 0}

    def buckets():
        raise AssertionError("a bucket was drawn")
        yield

    assert engine.receiver.load(buckets(), route=None) == {"received_bytes": 0.0, "load_seconds": 0.0}
    assert engine.verify_weights([{}]) == {"weight_sync/verified_tensors": 0.0}


def test_an_engine_without_an_actor_in_its_process_says_where_it_runs(tiny_model_dir):
    from transformers import AutoTokenizer

    from recipes.roles import rollout_role

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = rollout_role(_config(), tiny_model_dir, tok).build(WorkerContext(group_name="exact-alone"))
    engine.start()
    with pytest.raises(RuntimeError, match="no actor in this process .*'exact-alone'.* offered one"):
        engine.generate(_prompts(tok, rows=2))


def test_an_actor_not_built_for_the_exact_engine_refuses_to_offer_its_module(tiny_model_dir):
    """Its π_old pass would not be computed in the engine's layout: the equality would not hold."""
    from transformers import AutoTokenizer

    from hybridflow.controller import introduce
    from recipes.roles import actor_role, rollout_role

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    config, ctx = _config(), WorkerContext(group_name="exact-unoffered")
    actor = actor_role(config, tiny_model_dir).build(ctx)
    actor.exact_rollout = False  # as an actor built by other code than recipes/roles.py may be
    engine = rollout_role(config, tiny_model_dir, tok).build(ctx)
    introduce([actor, engine])
    with pytest.raises(RuntimeError, match="this actor was built without exact_rollout=True"):
        engine.offered()


@pytest.mark.parametrize("overrides, message", [
    (["trainer.old_log_probs=sampler"], "trainer.old_log_probs='sampler' is invalid: rollout.backend=exact makes"),
    (["rollout.top_p=0.9"], r"rollout.top_p/top_k=\(0.9, -1\) is invalid: .*which no filter cuts"),
    (["algorithm.dynamic_sampling_rounds=2"], "dynamic_sampling_rounds=2 is invalid: .*several generations"),
    (["model.dtype=float32", "rollout.dtype=bfloat16"], "rollout.dtype='bfloat16' is invalid: .*in model.dtype"),
    (["rollout.fp32_lm_head=true"], "computes with the actor's output head: set actor.fp32_lm_head=true"),
    (["rollout.agent=[hybridflow.data.calculator:calc]"], r"agent rollouts \(rollout.agent\) run on an engine that"),
])
def test_what_would_break_the_equality_is_refused_at_compose(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose(["recipe=grpo", "rollout.backend=exact", *overrides])


def test_old_log_probs_auto_recomputes_pi_old_with_the_exact_engine():
    from hybridflow.batch_keys import clips_against_sampler

    assert clips_against_sampler(compose(["recipe=grpo"])) is True  # on-policy, one update: the sampler's
    assert clips_against_sampler(compose(["recipe=grpo", "rollout.backend=exact"])) is False


def _rank_decodes(rank: int, world: int, port: int, model_dir: str, out_file: str) -> None:
    """One of two gloo ranks sharing the actor's FSDP2 shards: rank 0's rows all end after their first token
    while rank 1's decode to the limit, so rank 0 runs its steps on a padding row; each replays its own."""
    import torch.distributed as dist

    from hybridflow.training.exact_layout import layout_decode, layout_log_probs

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ctx = WorkerContext(rank=rank, world_size=world, group_name="exact-two-ranks")
        actor, _, tok = _pair(model_dir, _config("rollout.max_response_tokens=8"), "exact-two-ranks", ctx)
        prompts = _prompts(tok, rows=3)

        def greedy(t, live, log_probs):
            token = log_probs.argmax(-1)
            return token, torch.full_like(token, rank == 1 and t < 7, dtype=torch.bool)

        ids, mask, picked, _ = layout_decode(actor.model, prompts, 8, 1.0, tok.pad_token_id, greedy)
        replayed = layout_log_probs(actor.model, prompts.union(Batch({"response_ids": ids, "response_mask": mask})), 3)
        torch.save({"mask": mask, "picked": picked, "replayed": replayed}, f"{out_file}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # ~25 s: two spawned processes each build the actor (the default tier is at its budget)
def test_two_ranks_decode_and_replay_the_same_number_of_collective_forwards(tiny_model_dir, tmp_path):
    """Over gloo, FSDP2's forwards are collective: a rank whose rows ended goes on with the other (a step short
    would leave the other waiting in its gather); both decodes equal their replays bit for bit."""
    import torch.multiprocessing as mp

    from tests.unit.test_gradient_splits import _free_port

    run = mp.start_processes(_rank_decodes, args=(2, _free_port(), str(tiny_model_dir), str(tmp_path / "out")),
                             nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    while not run.join(timeout=5):
        if time.monotonic() > deadline:
            for process in run.processes:
                process.kill()
            pytest.fail("the two ranks did not finish in 120 s: their collective forwards did not pair up")
    for rank, length in ((0, 1), (1, 8)):
        out = torch.load(tmp_path / f"out.{rank}")
        assert out["mask"].sum(1).tolist() == [length] * 3, rank
        assert torch.equal(out["replayed"], out["picked"]), rank
