"""GRPO with a LoRA actor end to end: real Ray, FSDP2 on 2 ranks, vLLM on the CPU, colocated; at
TP 2 on a model as checkpoints ship (a byte-level BPE tokenizer with no pad token, chat prompts).

Each run trains for 2 steps with a reward that varies between samples (so the adapter learns),
with the checks on at every step: at TP 2 the engine serves the actor's adapter (weight_sync.lora=auto
chooses the adapter sync; its checksums compared every sync), at TP 1 it holds the actor's weights with
the adapter folded in (W + s * B @ A, weight_sync.lora=folded), or the run stops. The assertions then take the LoRA
factors from the run's own training state (the DCP checkpoint of step 2), fold them onto the base
by hand, and compare every tensor with what the run exported: the whole model (TP 1), or the peft
adapter (`actor.lora.save_adapter_only`, TP 2) folded by hybridflow-merge's LoRA reader.
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch

from tests.e2e import cli_in_one_process

pytestmark = pytest.mark.usefixtures("shared_ray_head")  # its runs join one Ray head (tests/ray_head.py)

ROOT = Path(__file__).resolve().parents[2]
RANK, ALPHA = 4, 8.0
TARGETS = ("q_proj", "v_proj")
SMALL = ["recipe=grpo", "trainer.total_steps=2", "trainer.prompts_per_step=4", "rollout.samples_per_prompt=4",
         "rollout.max_response_tokens=4", "trainer.val_prompts=4", "data.synthetic.train_rows=64",
         "data.synthetic.val_rows=4", "actor.samples_per_micro_batch=8", "actor.optim.lr=1e-2",
         f"actor.lora.rank={RANK}", f"actor.lora.alpha={ALPHA}", f"actor.lora.target_modules=[{','.join(TARGETS)}]",
         "weight_sync.checksum_every_steps=1", "trainer.save_every_steps=2"]
SPREAD_REWARD = "def score(response):\n    return float(sum(map(ord, response)) % 5)\n"


@pytest.fixture(scope="module")
def bpe_model_and_chat_data(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A tiny Qwen2 with a byte-level BPE tokenizer as many checkpoints ship it (no pad token, BOS
    added to text, a chat template), and chat-message prompts to train on."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from hybridflow.data import write_rows
    from tests.unit.test_tokenizers_as_they_come import save_bpe_tokenizer

    root = tmp_path_factory.mktemp("bpe")
    model_dir = save_bpe_tokenizer(root / "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.pad_token is None
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(
        vocab_size=448, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)).save_pretrained(model_dir)
    rows = [{"prompt": [{"role": "user", "content": f"what is the sum {a}+{b}="}], "ground_truth": str(a + b)}
            for a in range(16) for b in range(4)]
    return model_dir, write_rows(rows, root / "train.parquet"), write_rows(rows[:4], root / "val.parquet")


def grpo_lora(tmp_path: Path, name: str, *extra: str) -> Path:
    reward = tmp_path / "spread.py"
    reward.write_text(SPREAD_REWARD)
    result = cli_in_one_process.run([*SMALL, f"reward.fn={reward}:score", *extra, f"logger.output_root={tmp_path}",
                                     f"logger.run_name={name}"])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    run_dir = tmp_path / name
    (run_dir / "console.txt").write_text(result.stdout)
    for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        assert row["weight_sync/verified_tensors"] > 0  # engine == actor's adapter / folded weights, each step
        assert row["rollout/log_prob_diff"] < 1e-3  # vLLM samples from the adapted model the actor trains
        assert row["actor/grad_norm"] > 0
    return run_dir


def trained_factors(run_dir: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module name -> (A (r, in), B (out, r)) from the run's step-2 training state (DCP)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    saved = run_dir / "actor.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / "step_00000002" / "actor", saved)
    model = torch.load(saved)["model"]
    factors = {}
    for key, a in model.items():
        if ".lora_A.default.weight" in key:
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.default.weight")
            factors[module] = (a, model[key.replace(".lora_A.", ".lora_B.")])
    assert len(factors) == len(TARGETS) * 4  # 4 layers of the tiny model
    assert all(b.abs().max() > 0 for _, b in factors.values())  # B starts at 0: the adapter learned
    return factors


def folded_by_hand(run_dir: Path, base_dir: Path) -> dict[str, torch.Tensor]:
    """The base model's weights with W + (alpha / r) * B @ A on every adapted module, in fp32."""
    from safetensors.torch import load_file

    weights = load_file(base_dir / "model.safetensors")
    for module, (a, b) in trained_factors(run_dir).items():
        weights[f"{module}.weight"] = weights[f"{module}.weight"].float() + (ALPHA / RANK) * (b.float() @ a.float())
    return weights


@pytest.mark.slow  # CI's slow tier, for the default run's 20 minutes on a CPU without bf16 (README "Two commands")
def test_lora_grpo_at_tp2_saves_the_adapter_that_folds_to_the_trained_model(tmp_path, bpe_model_and_chat_data):
    """On a checkpoint as they come: a BPE tokenizer without a pad token, chat prompts."""
    from safetensors.torch import load_file

    from hybridflow.merge.lora import LoraCheckpoint

    model_dir, train, val = bpe_model_and_chat_data
    run_dir = grpo_lora(tmp_path, "tp2", "rollout.tensor_parallel_size=2", "actor.lora.save_adapter_only=true",
                        f"model.path={model_dir}", "data=files", f"data.train_path={train}", f"data.val_path={val}",
                        "data.max_prompt_tokens=32")
    # bench/lora_adapter_sync.py reads this run as it reads its own: the adapter alone is the bytes of a sync
    report = runpy.run_path(str(ROOT / "bench" / "lora_adapter_sync.py"))["summarize"](run_dir, ["hybridflow"], 0.0)
    assert report["steps"] == 2 and report["verified_tensors"] > 0 and report["sync_s_median"] > 0
    assert report["fraction_of_full_model"] == report["bytes_per_sync"] / report["engine_bytes"] < 0.05
    console = (run_dir / "console.txt").read_text()
    assert "LoRA weight sync: the adapter alone (weight_sync.lora=auto: vLLM serves the rank-4 adapter)" in console
    assert console.count(f"the tokenizer of {model_dir} has no pad token; its eos token '</s>'") == 1
    assert f"chat prompts are rendered with chat_template.jinja of {model_dir} (Llama 2 / Mistral" in console
    final = run_dir / "final_model"
    assert sorted(p.name for p in final.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (run_dir / "checkpoints" / "step_00000002" / "hf" / "adapter_model.safetensors").is_file()
    saved = load_file(final / "adapter_model.safetensors")
    for module, (a, b) in trained_factors(run_dir).items():  # peft's names, the trained values
        torch.testing.assert_close(saved[f"base_model.model.{module}.lora_A.weight"], a, rtol=0, atol=0)
        torch.testing.assert_close(saved[f"base_model.model.{module}.lora_B.weight"], b, rtol=0, atol=0)
    expected = folded_by_hand(run_dir, model_dir)
    adapter = LoraCheckpoint(final)  # the base from adapter_config.json's base_model_name_or_path
    try:
        assert set(adapter.keys()) == set(expected)
        for key in expected:
            torch.testing.assert_close(adapter.read(key).float(), expected[key].float(), rtol=0, atol=1e-6)
    finally:
        adapter.close()


@pytest.mark.slow
def test_lora_grpo_at_tp1_exports_base_plus_the_folded_adapter(tmp_path):
    from safetensors.torch import load_file

    run_dir = grpo_lora(tmp_path, "tp1", "rollout.tensor_parallel_size=1", "weight_sync.lora=folded")
    exported = load_file(run_dir / "final_model" / "model.safetensors")
    expected = folded_by_hand(run_dir, run_dir / "base_model")
    base = load_file(run_dir / "base_model" / "model.safetensors")
    assert set(exported) == set(expected)
    changed = [key for key in exported if not torch.equal(exported[key], base[key])]
    assert changed and all(any(t in key for t in TARGETS) for key in changed)
    for key in expected:
        torch.testing.assert_close(exported[key].float(), expected[key].float(), rtol=0, atol=1e-6)
