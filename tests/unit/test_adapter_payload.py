"""The adapter sync's parts without Ray or vLLM (hybridflow/resharding/adapter.py): the payload the
actor sends (scaling folded into B, so the written adapter computes the trained model with scaling
1), the check of the engine's adapter against the actor's checksums (stacked q/k/v included), the
check that every output carries the served adapter, and where `weight_sync.lora` serves an adapter."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from hybridflow.config import compose
from hybridflow.checks.rules import lora_sync
from hybridflow.resharding.adapter import (adapter_payload, check_served, served_rank, verify_adapter,
                                           write_adapter)
from hybridflow.resharding.verify import WeightSyncError, checksum


@pytest.fixture(scope="module")
def peft_model(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                 "down_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.1)  # a trained adapter: B off zero
    return model


def test_the_written_adapter_computes_the_trained_model_with_scaling_one(peft_model, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    payload = adapter_payload(peft_model, rank=0, dtype="float32")
    assert adapter_payload(peft_model, rank=1, dtype="float32") is None  # only rank 0 returns it
    assert payload["config"]["r"] == payload["config"]["lora_alpha"] == 4  # vLLM's scaling: 1
    q = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    torch.testing.assert_close(payload["tensors"][f"{key}.lora_B.weight"], 2.0 * q.lora_B["default"].weight,
                               rtol=0, atol=0)  # alpha / r = 2, folded into B
    assert payload["checksums"]["model.layers.0.self_attn.q_proj"]["B"] == checksum(payload["tensors"][f"{key}.lora_B.weight"])
    layers = peft_model.config.num_hidden_layers
    assert len(payload["tensors"]) == 2 * 4 * layers
    assert payload["bytes"] == sum(t.numel() * 4 for t in payload["tensors"].values())
    written = write_adapter(tmp_path / "v1", payload)
    assert sorted(p.name for p in written.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not (tmp_path / "v1.partial").exists()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, written)
    ids = torch.tensor([[3, 9, 4, 17, 5, 8]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, peft_model(ids).logits, rtol=1e-5, atol=1e-5)


def _expected() -> dict:
    sums = lambda a, b: {"A": (a, a * a), "B": (b, b * b)}  # noqa: E731
    return {"m.0.q_proj": sums(1.0, 2.0), "m.0.k_proj": sums(3.0, 4.0), "m.0.v_proj": sums(5.0, 6.0),
            "m.0.o_proj": sums(7.0, 8.0)}


def _found(**changes) -> dict:
    """The engine's view of `_expected()`: q/k/v stacked into qkv_proj (their sums added)."""
    e = _expected()
    qkv = {f: (sum(e[f"m.0.{p}_proj"][f][0] for p in "qkv"), sum(e[f"m.0.{p}_proj"][f][1] for p in "qkv"))
           for f in "AB"}
    sums = {"m.0.qkv_proj": {**qkv, "scaling": [1, 1, 1]}, "m.0.o_proj": {**e["m.0.o_proj"], "scaling": [1]}}
    for name, entry in changes.items():
        sums[name.replace("__", ".")].update(entry)
    return {"sums": sums, "packed": {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}}


def test_the_engines_adapter_is_compared_with_the_actors_through_stacked_modules():
    assert verify_adapter(_found(), _expected(), "adapter policy-v3 (id 4)", 3, 0) == {
        "weight_sync/verified_tensors": 8.0}
    with pytest.raises(WeightSyncError, match=re.escape(
            "rollout rank 1 after the adapter sync of policy version 3: the adapter the engine serves (adapter "
            "policy-v2 (id 3)) is not the actor's: 1 difference(s): m.0.o_proj.lora_B: engine sum=8.5")):
        verify_adapter(_found(m__0__o_proj={"B": (8.5, 64.0)}), _expected(), "adapter policy-v2 (id 3)", 3, 1)
    with pytest.raises(WeightSyncError, match="vLLM scales it by"):
        verify_adapter(_found(m__0__o_proj={"scaling": [2.0]}), _expected(), "x", 3, 0)
    missing = _found()
    del missing["sums"]["m.0.o_proj"]
    with pytest.raises(WeightSyncError, match=r"1 of the actor's adapted modules are not in the engine's adapter "
                                              r"\(e.g. m.0.o_proj\)"):
        verify_adapter(missing, _expected(), "x", 3, 0)
    with pytest.raises(WeightSyncError, match="the engine serves no adapter, not the actor's adapter: the adapter "
                                              "never reached it"):
        verify_adapter(None, _expected(), "no adapter", 0, 0)


def test_every_output_must_carry_the_served_adapter():
    served = SimpleNamespace(lora_int_id=3, lora_name="policy-v2")
    out = lambda lora: SimpleNamespace(request_id="7", lora_request=lora)  # noqa: E731
    check_served([out(served)], served, 0)
    check_served([out(None)], None, 0)  # no adapter served (weight_sync.lora=folded): none carried
    with pytest.raises(WeightSyncError, match=re.escape("rollout rank 1: request 7 was generated with the base model "
                                                        "(no adapter), while the engine serves adapter policy-v2 (id 3)")):
        check_served([out(served), out(None)], served, 1)
    with pytest.raises(WeightSyncError, match=r"generated with adapter id 2 \(policy-v1\)"):
        check_served([out(SimpleNamespace(lora_int_id=2, lora_name="policy-v1"))], served, 0)


def test_the_engine_rank_is_the_smallest_vllm_accepts():
    assert [served_rank(r) for r in (1, 4, 8, 16, 17, 512)] == [1, 8, 8, 16, 32, 512]
    with pytest.raises(ValueError, match="weight_sync.lora=folded"):
        served_rank(513)


@pytest.mark.parametrize("overrides, mode, why", [
    (["actor.lora.rank=16"], "adapter", "weight_sync.lora=auto: vLLM serves the rank-16 adapter"),
    (["actor.lora.rank=16", "weight_sync.lora=folded"], "folded", "weight_sync.lora=folded"),
    (["actor.lora.rank=16", "rollout=hf"], "folded", "rollout.backend=hf serves no LoRA adapter"),
    (["actor.lora.rank=16", "trainer.max_staleness=2", "trainer.old_log_probs=actor", "placement=disaggregated"],
     "folded", "trainer.max_staleness=2 stages pushes"),
    (["actor.lora.rank=16", "actor.lora.target_modules=[q_proj,embed_tokens]"], "folded",
     "actor.lora.target_modules has ['embed_tokens']"),
    ([], "", ""),
])
def test_auto_serves_an_adapter_where_vllm_can_and_says_why_not(overrides, mode, why):
    got_mode, got_why = lora_sync(compose(["recipe=grpo", *overrides]))
    assert got_mode == mode and got_why.startswith(why)


@pytest.mark.parametrize("overrides, message", [
    (["weight_sync.lora=adapter"], "config weight_sync.lora='adapter' is invalid: serves a LoRA adapter, and "
                                   "actor.lora.rank is 0"),
    (["weight_sync.lora=adapter", "actor.lora.rank=8", "rollout=hf"],
     "config weight_sync.lora='adapter' is invalid: rollout.backend=hf serves no LoRA adapter (it generates with a copy of the whole model): "
     "set weight_sync.lora=folded"),
    (["weight_sync.lora=both"], "config weight_sync.lora='both' is invalid: one of ['auto', 'adapter', 'folded']"),
])
def test_an_adapter_asked_for_where_it_cannot_be_served_is_refused_before_start(overrides, message):
    with pytest.raises(Exception, match=re.escape(message)):
        compose(["recipe=grpo", *overrides])


def test_the_payload_config_is_what_vllm_reads(peft_model, tmp_path):
    config = json.loads((write_adapter(tmp_path / "a", adapter_payload(peft_model, 0, "bfloat16"))
                         / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["use_rslora"] is False and config["bias"] == "none"
    assert config["target_modules"] == ["down_proj", "k_proj", "q_proj", "v_proj"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_live_checksums_read_the_actors_weights_by_another_path_than_the_payload(peft_model, dtype):
    """Equal to the payload's own checksums when the payload is the actor's; a payload built from other
    weights matches its own checksums and not these (what the adapter sync now compares against)."""
    from hybridflow.resharding import faults
    from hybridflow.resharding.adapter import live_adapter_checksums

    live = live_adapter_checksums(peft_model, 0, dtype)
    assert live == adapter_payload(peft_model, 0, dtype)["checksums"]
    faults.adapter_from_other_weights()
    other = faults.before_sending_adapter(adapter_payload(peft_model, 0, dtype))
    changed = [m for m in live if other["checksums"][m] != live[m]]
    assert len(changed) == 1 and other["checksums"][changed[0]]["A"] == live[changed[0]]["A"]
    assert live_adapter_checksums(peft_model, 1, dtype) is None  # rank 0 returns them
