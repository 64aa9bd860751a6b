"""model.dtype=auto / rollout.dtype=auto: bfloat16 where the device computes it, float32 elsewhere
(hybridflow/precision.py), resolved when the config is checked; an explicit dtype is honoured."""

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


def test_the_hardware_chooses_when_the_user_does_not(cpu):
    cpu(NO_BF16)
    config = compose(["recipe=grpo", "placement.device=cpu", "model.dtype=auto"])
    assert (config.model.dtype.value, config.rollout.dtype.value) == ("float32", "float32")
    cpu(BF16)
    config = compose(["recipe=grpo", "placement.device=cpu", "model.dtype=auto"])
    assert (config.model.dtype.value, config.rollout.dtype.value) == ("bfloat16", "bfloat16")
    # the probe's tolerance follows the resolved dtypes (bfloat16 gets the looser one)
    assert config.weight_sync.probe_tolerance > 1e-3


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


def test_gpus_choose_bfloat16_even_when_the_driver_sees_none(cpu):
    cpu(NO_BF16)  # the driver's CPU does not decide for GPU workers
    assert precision.resolve_dtypes("auto", "auto", "cuda") in {("bfloat16", "bfloat16"), ("float32", "float32")}
    native, why = precision.native_bfloat16("cuda")
    assert precision.resolve_dtypes("auto", "auto", "cuda")[0] == ("bfloat16" if native else "float32") and why


def test_master_dtype_auto_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="model.master_dtype"):
        compose(["recipe=grpo", "model.master_dtype=auto"])


def test_the_console_line_says_which_and_why(cpu):
    cpu(NO_BF16)
    line = precision.precision_line("float32", "float32", "cpu")
    assert "model float32, engine float32" in line and "chosen by the hardware" in line and "avx512_bf16" in line
    line = precision.precision_line("bfloat16", "bfloat16", "cpu")
    assert "as configured" in line and "would choose float32" in line
    cpu(BF16)
    assert "computes bfloat16 natively (avx512_bf16)" in precision.precision_line("bfloat16", "bfloat16", "cpu")
