"""Real Hugging Face and peft formats: a tiny Qwen2 with tied embeddings saved with
save_pretrained, merged, and loaded back; LoRA adapters folded like peft's merge_and_unload."""

import json

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # peft warns about the tied embedding adapter
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from hybridflow.merge import MergeError, merge_checkpoints  # noqa: E402

EMBED = "model.embed_tokens.weight"


def tiny_qwen2(seed):
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, tie_word_embeddings=True)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def qwen_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen")
    base = tiny_qwen2(0)
    base.save_pretrained(root / "base")
    paths = []
    for step in (1, 2, 3):
        model = tiny_qwen2(0)
        torch.manual_seed(step)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.01 * torch.randn_like(parameter))
        model.save_pretrained(root / f"step_{step:08d}")
        paths.append(root / f"step_{step:08d}")
    return root, paths


def test_qwen2_sma_round_trip(qwen_dirs, tmp_path):
    _, paths = qwen_dirs
    out = merge_checkpoints(paths, tmp_path / "merged", "sma", dtype="bfloat16", max_shard_bytes=40_000)
    config = json.loads((out / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    models = [transformers.AutoModelForCausalLM.from_pretrained(p) for p in paths]
    for name, parameter in merged.named_parameters():
        expected = sum(dict(m.named_parameters())[name] for m in models) / len(models)
        assert torch.equal(parameter, expected.to(torch.bfloat16).float()), name
    assert merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()  # still tied
    with torch.no_grad():
        logits = merged(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 64) and torch.isfinite(logits).all()


def make_adapter(base_path, out_path, seed, **lora):
    model = transformers.AutoModelForCausalLM.from_pretrained(base_path)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                             target_modules=["q_proj", "v_proj", "down_proj", "embed_tokens"], **lora)
    torch.manual_seed(seed)
    peft_model = peft.get_peft_model(model, config)
    peft_model.save_pretrained(out_path)
    return peft_model.merge_and_unload().state_dict()


@pytest.mark.parametrize("lora", [{}, {"use_rslora": True, "alpha_pattern": {"v_proj": 2}}])
def test_lora_folding_matches_peft_merge_and_unload(qwen_dirs, tmp_path, lora):
    root, _ = qwen_dirs
    expected = make_adapter(root / "base", tmp_path / "adapter", 5, **lora)
    out = merge_checkpoints([tmp_path / "adapter"], tmp_path / "folded", "sma", base=root / "base")
    folded = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    for key, value in expected.items():
        assert torch.allclose(folded[key], value, atol=1e-6), key
    assert (out / "config.json").exists() and not (out / "adapter_config.json").exists()


def test_sma_of_two_adapters_averages_the_folded_models(qwen_dirs, tmp_path):
    root, _ = qwen_dirs
    first = make_adapter(root / "base", tmp_path / "a1", 1)
    second = make_adapter(root / "base", tmp_path / "a2", 2)
    out = merge_checkpoints([tmp_path / "a1", tmp_path / "a2"], tmp_path / "avg", "sma", base=root / "base")
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    for key in first:
        assert torch.allclose(merged[key], (first[key] + second[key]) / 2, atol=1e-6), key


def test_lora_base_from_adapter_config_or_error(qwen_dirs, tmp_path):
    root, _ = qwen_dirs
    expected = make_adapter(root / "base", tmp_path / "adapter", 1)
    # adapter_config.json names the local base directory: no --base needed
    folded = merge_checkpoints([tmp_path / "adapter"], tmp_path / "out", "sma")
    assert torch.allclose(transformers.AutoModelForCausalLM.from_pretrained(folded).state_dict()[EMBED], expected[EMBED])
    config_path = tmp_path / "adapter" / "adapter_config.json"
    config_path.write_text(json.dumps(dict(json.loads(config_path.read_text()), base_model_name_or_path="org/remote")))
    with pytest.raises(MergeError, match="needs its base model: pass --base BASE_DIR.*'org/remote'"):
        merge_checkpoints([tmp_path / "adapter"], tmp_path / "out2", "sma")


def test_lora_fan_in_fan_out_conv1d_matches_peft(tmp_path):
    # GPT-2's Conv1D stores W as (in, out); peft then folds (B @ A)^T.
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=16)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gpt2")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2")
    lora = peft.LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, target_modules=["c_attn"], fan_in_fan_out=True)
    peft_model = peft.get_peft_model(model, lora)
    peft_model.save_pretrained(tmp_path / "adapter")
    expected = peft_model.merge_and_unload().state_dict()
    out = merge_checkpoints([tmp_path / "adapter"], tmp_path / "out", "sma", base=tmp_path / "gpt2")
    folded = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert torch.allclose(folded["transformer.h.0.attn.c_attn.weight"], expected["transformer.h.0.attn.c_attn.weight"],
                          atol=1e-6)
