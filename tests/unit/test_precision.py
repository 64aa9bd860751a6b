"""Mixed precision and dropout in the trained roles (single process, FSDP2 on one CPU rank).

- `model.dtype=bfloat16` computes in bfloat16 while the parameters and AdamW's moments stay float32
  (FSDP2's MixedPrecisionPolicy); the export is written in bfloat16.
- The done-when of issue 19: at lr 1e-6 a bfloat16 SFT run moves the weights as far from the
  same float32 start as a float32 run (within 10%), where pure bfloat16 training
  (`model.master_dtype=bfloat16`) loses most of every update to rounding.
- Dropout is off in every role by default: GPT-2's config carries 0.1 everywhere, yet train-mode
  log-probs equal eval-mode ones; `model.keep_dropout=true` keeps it.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

from hybridflow.batch import Batch
from hybridflow.config import compose
from hybridflow.config.schema import ActorConfig, Dtype, HybridFlowConfig, ModelConfig, OptimConfig
from hybridflow.controller import WorkerContext
from hybridflow.data import ArithmeticSpec, make_arithmetic_rows
from hybridflow.data.prompts import encode_prompts
from hybridflow.training.fsdp import load_model
from hybridflow.training.sequences import log_probs_and_entropy, response_log_probs
from recipes.roles import actor_role, critic_role
from hybridflow.run.stage import prepare_stage

STEPS = 20


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """The actors below make their own one-rank gloo group (mixed precision needs FSDP2); close it."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _batch(model_dir, rows: int = 8) -> Batch:
    tok = AutoTokenizer.from_pretrained(model_dir)
    batch = encode_prompts(make_arithmetic_rows(rows, ArithmeticSpec(), seed=3), tok, 8)
    torch.manual_seed(0)
    return batch.union(Batch({"response_ids": torch.randint(5, 60, (rows, 4)),
                              "response_mask": torch.ones(rows, 4, dtype=torch.bool)}))


def _actor(model_dir, dtype: str, master_dtype: str, lr: float = 1e-6):
    config = HybridFlowConfig(model=ModelConfig(dtype=Dtype(dtype), master_dtype=Dtype(master_dtype)),
                              actor=ActorConfig(optim=OptimConfig(lr=lr)))
    actor = actor_role(prepare_stage(config).config, model_dir).build(WorkerContext())
    actor.start()
    return actor


def _weights(actor) -> dict[str, torch.Tensor]:
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in actor.model.named_parameters()}


def _distance(start: dict, end: dict) -> float:
    return sum(float((end[n].double() - start[n].double()).pow(2).sum()) for n in start) ** 0.5


def test_mixed_precision_computes_in_bf16_keeps_float32_state_and_exports_bf16(tiny_model_dir, tmp_path):
    actor = _actor(tiny_model_dir, "bfloat16", "float32", lr=1e-3)
    batch = _batch(tiny_model_dir)
    actor.model.train()
    assert response_log_probs(actor.model, batch)[0].dtype == torch.float32  # read out in float32 ...
    seen = []
    hook = actor.model.lm_head.register_forward_hook(lambda m, i, o: seen.append((i[0].dtype, o.dtype)))
    actor.train_sft(batch)
    hook.remove()
    assert seen == [(torch.bfloat16, torch.bfloat16)]  # ... computed in bfloat16
    assert {p.dtype for p in actor.model.parameters()} == {torch.float32}
    moments = [s["exp_avg"] for s in actor.optimizer.state.values()]
    assert moments and {m.dtype for m in moments} == {torch.float32}
    out = actor.export_hf(str(tmp_path / "hf"), str(tiny_model_dir))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(f"{out}/model.safetensors").values()} == {torch.bfloat16}


def test_bf16_sft_at_lr_1e6_moves_the_weights_as_far_as_float32(tiny_model_dir):
    batch = _batch(tiny_model_dir)
    moved = {}
    for name, (dtype, master) in {"float32": ("float32", "float32"), "mixed": ("bfloat16", "float32"),
                                  "pure_bf16": ("bfloat16", "bfloat16")}.items():
        actor = _actor(tiny_model_dir, dtype, master)
        start = _weights(actor)
        for _ in range(STEPS):
            actor.train_sft(batch)
        moved[name] = _distance(start, _weights(actor))
    assert 0.9 < moved["mixed"] / moved["float32"] < 1.1, moved
    assert moved["pure_bf16"] / moved["float32"] < 0.5, moved  # what the float32 master weights prevent


def _gpt2_dir(tmp_path):
    config = GPT2Config(vocab_size=80, n_positions=64, n_embd=64, n_layer=2, n_head=2)  # resid/embd/attn_pdrop 0.1
    assert config.resid_pdrop == config.embd_pdrop == config.attn_pdrop == 0.1
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    return tmp_path / "gpt2"


@pytest.mark.parametrize("keep_dropout", [False, True])
def test_dropout_is_off_unless_kept(tmp_path, keep_dropout):
    model = load_model(str(_gpt2_dir(tmp_path)), "float32", keep_dropout=keep_dropout)
    ids = torch.randint(0, 80, (4, 12), generator=torch.Generator().manual_seed(0))
    batch = Batch({"prompt_ids": ids[:, :6], "prompt_mask": torch.ones(4, 6, dtype=torch.bool),
                   "response_ids": ids[:, 6:], "response_mask": torch.ones(4, 6, dtype=torch.bool)})
    eval_lp, _ = log_probs_and_entropy(model, batch, 4)
    model.train()
    with torch.no_grad():
        train_lp, _ = response_log_probs(model, batch)
    gap = float((train_lp - eval_lp).abs().mean())
    assert (gap > 1e-2) if keep_dropout else (gap < 1e-6), gap


def test_critic_head_dropout_is_off(tmp_path):
    """GPT-2's token-classification head adds dropout 0.1 when its config names none."""
    config = HybridFlowConfig()
    critic = critic_role(prepare_stage(config).config, _gpt2_dir(tmp_path)).build(WorkerContext())
    critic.start()
    assert all(m.p == 0 for m in critic.model.modules() if isinstance(m, torch.nn.Dropout))
    assert critic.model.config.resid_pdrop == 0


def test_master_dtype_narrower_than_compute_is_refused():
    with pytest.raises(ValueError, match=r"model.master_dtype='bfloat16' is invalid: float32 \(mixed precision"):
        compose(["model.master_dtype=bfloat16"])
    assert compose(["model.dtype=bfloat16", "model.master_dtype=bfloat16"]).model.master_dtype.value == "bfloat16"


def test_training_workers_on_a_gpu_take_attention_kernels_that_need_no_plan_per_shape():
    """shard_model on CUDA turns cuDNN's scaled_dot_product_attention off for the process (it builds
    a plan per shape, and training shapes change every micro-batch); the switch itself is checked here."""
    from hybridflow.training.fsdp import attention_for_changing_shapes

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        attention_for_changing_shapes()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_one_rank_holds_fsdp2s_gradient_reduction_until_the_last_micro_batch(tiny_model_dir, monkeypatch):
    """`training.fsdp.accumulating` on one rank: FSDP2 reduces once per mini-batch, and the update's
    gradients are those of the mini-batch in one micro-batch (bfloat16 compute, float32 masters)."""
    batch = _batch(tiny_model_dir).union(Batch({"advantages": torch.linspace(-1, 1, 8)[:, None].expand(8, 4)}))
    grads, syncs = {}, {}
    for rows in (8, 2):
        config = HybridFlowConfig(model=ModelConfig(dtype=Dtype.bfloat16, master_dtype=Dtype.float32),
                                  actor=ActorConfig(optim=OptimConfig(lr=1e-6), samples_per_micro_batch=rows))
        actor = actor_role(prepare_stage(config).config, tiny_model_dir).build(WorkerContext())
        actor.start()
        seen = []
        original = type(actor.model).set_requires_gradient_sync
        monkeypatch.setattr(type(actor.model), "set_requires_gradient_sync",
                            lambda self, flag, **kw: (seen.append(flag), original(self, flag, **kw))[1])
        actor.free_gradients = lambda: None  # the update's gradients stay to be compared
        actor.update_policy(batch.union(actor.compute_log_probs(batch)))
        syncs[rows] = seen
        grads[rows] = {n: p.grad.to_local().clone() for n, p in actor.model.named_parameters()}
        monkeypatch.undo()
    assert syncs == {8: [True], 2: [False, False, False, True]}
    for name, grad in grads[8].items():
        torch.testing.assert_close(grads[2][name], grad, atol=2e-3, rtol=0.05, msg=name)
