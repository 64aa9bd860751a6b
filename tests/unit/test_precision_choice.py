"""model.dtype=auto / rollout.dtype=auto: float16 on GPUs, float32 on CPUs of every kind (hybridflow/precision.py:
bfloat16 rounds away most of a small update, docs/results/precision.md), resolved when the config is checked;
an explicit dtype is honoured."""

from __future__ import annotations

import pytest

import hybridflow.precision as precision
from hybridflow.config import ConfigError, compose

NO_BF16 = frozenset({"fpu", "sse2", "avx2", "fma"})  # an AMD EPYC with AVX2 only
BF16 = frozenset({"avx2", "avx512f", "avx512_bf16"})


@pytest.fixture
def cpu(monkeypatch):
    def set_flags(flags: frozenset[str]) -> None:
        monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
    return set_flags


def test_the_device_chooses_when_the_user_does_not(cpu):
    for flags in (NO_BF16, BF16):  # a CPU with bfloat16 arithmetic computes float32 too: it learns (issue 80)
        cpu(flags)
        config = compose(["recipe=grpo", "placement.device=cpu", "model.dtype=auto"])
        assert (config.model.dtype.value, config.rollout.dtype.value) == ("float32", "float32")
        assert config.weight_sync.probe_tolerance <= 1e-3  # the probe's tolerance follows: float32's
    config = compose(["recipe=grpo", "placement.device=cuda", "model.dtype=auto"])
    assert (config.model.dtype.value, config.rollout.dtype.value) == ("float16", "float16")
    assert config.weight_sync.probe_tolerance > 1e-3  # 16 bits: the looser one


def test_an_explicit_dtype_is_honoured_on_any_cpu(cpu):
    for flags in (NO_BF16, BF16):
        cpu(flags)
        config = compose(["recipe=grpo", "placement.device=cpu", "model.dtype=bfloat16", "rollout.dtype=float32"])
        assert (config.model.dtype.value, config.rollout.dtype.value) == ("bfloat16", "float32")
        tiny = compose(["recipe=grpo", "placement.device=cpu"])  # conf/model/tiny.yaml says float32
        assert (tiny.model.dtype.value, tiny.rollout.dtype.value) == ("float32", "float32")


def test_the_local_hf_model_defaults_to_auto():
    from pathlib import Path

    from hybridflow.config import CONF_DIR

    assert "dtype: auto" in (Path(CONF_DIR) / "model" / "local_hf.yaml").read_text()


def test_gpus_choose_float16_whatever_the_driver_sees(cpu):
    cpu(NO_BF16)  # the driver's CPU does not decide for GPU workers
    assert precision.resolve_dtypes("auto", "auto", "cuda") == ("float16", "float16")
    assert precision.resolve_dtypes("auto", "bfloat16", "cuda") == ("float16", "bfloat16")


def test_master_dtype_auto_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="model.master_dtype"):
        compose(["recipe=grpo", "model.master_dtype=auto"])


def test_the_console_line_says_which_and_why(cpu):
    cpu(BF16)
    line = precision.precision_line("float32", "float32", "cpu")
    assert "model float32, engine float32" in line and "chosen for the device" in line
    assert "docs/results/precision.md" in line
    line = precision.precision_line("bfloat16", "bfloat16", "cpu")
    assert "as configured" in line and "would choose float32" in line
    line = precision.precision_line("float16", "float16", "cuda")
    assert "chosen for the device" in line and "loss-scaled" in line
