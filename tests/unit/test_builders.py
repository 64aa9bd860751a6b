"""Offline builders: tiny model + tokenizer directory, synthetic arithmetic rows, row files."""

from __future__ import annotations

import json

import pytest
import torch

from hybridflow.builders import build_char_tokenizer, build_tiny_model
from hybridflow.config.schema import TinyModelConfig
from hybridflow.data import (ArithmeticSpec, first_operand_below, make_arithmetic_rows, make_arithmetic_split,
                             read_rows, write_rows)
from hybridflow.data.prompts import encode_prompts


def test_tokenizer_round_trips_characters():
    tok = build_char_tokenizer()
    ids = tok("37+45=", add_special_tokens=False)["input_ids"]
    assert len(ids) == 6 and tok.decode(ids) == "37+45="
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == "37+45="


def test_tiny_model_directory_loads_with_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1)
    path = build_tiny_model(tmp_path / "m", spec)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "qwen2" and model.config.vocab_size >= len(tok)
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is True
    out = model(torch.tensor([tok("1+1=")["input_ids"]]))
    assert out.logits.shape[-1] == model.config.vocab_size
    # same spec: reused; the marker records the spec
    assert build_tiny_model(tmp_path / "m", spec) == path


def test_tiny_spec_rejects_bad_heads():
    with pytest.raises(ValueError, match=r"model.tiny.hidden_size=30 is invalid: must be a multiple"):
        TinyModelConfig(hidden_size=30, num_attention_heads=4)


def test_arithmetic_rows_are_correct_distinct_and_seeded():
    spec = ArithmeticSpec(min_digits=1, max_digits=2, operations=("add", "sub", "mul"))
    rows = make_arithmetic_rows(300, spec, seed=3)
    assert rows == make_arithmetic_rows(300, spec, seed=3)
    assert len({r["prompt"] for r in rows}) == 300
    for r in rows:
        expr = r["prompt"].rstrip("=")
        assert str(eval(expr)) == r["ground_truth"]  # noqa: S307 - digits and one operator only
        assert r["data_source"].startswith("arithmetic/")
        assert int(r["ground_truth"]) >= 0  # no negative subtraction results by default


def test_arithmetic_excludes_and_reports_exhaustion():
    spec = ArithmeticSpec(1, 1, ("add",))
    val = make_arithmetic_rows(20, spec, seed=1)
    train = make_arithmetic_rows(50, spec, seed=0, exclude={r["prompt"] for r in val})
    assert not {r["prompt"] for r in val} & {r["prompt"] for r in train}
    with pytest.raises(ValueError, match="only .* distinct problems"):
        make_arithmetic_rows(1000, spec, seed=0)


def test_arithmetic_split_holds_out_the_same_mix_as_training():
    # 1-digit problems are 100 of the 8,200: drawn on its own, a 200-row validation set took 73 of
    # them, so held-out accuracy measured a different mix than training saw. One shuffled pool
    # split in two gives both sides the pool's share.
    train, val = make_arithmetic_split(4000, 400, ArithmeticSpec(), seed=0)
    assert (len(train), len(val)) == (4000, 400)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    share = lambda rows: sum(r["data_source"].endswith("/1d") for r in rows) / len(rows)  # noqa: E731
    assert share(train) < 0.05 and share(val) < 0.05 and abs(share(train) - share(val)) < 0.02
    assert (train, val) == make_arithmetic_split(4000, 400, ArithmeticSpec(), seed=0)


def test_training_rows_shown_in_part_keep_the_whole_held_out_set(tmp_path, tiny_model_dir):
    """data.synthetic.train_first_operand_below: the default pipeline's SFT stage demonstrates first
    operands below 50; its held-out rows, and GRPO's prompts, are the whole task."""
    train, val = make_arithmetic_split(7700, 500, ArithmeticSpec(), seed=0)
    part = first_operand_below(train, 50)
    assert 0.4 < len(part) / len(train) < 0.5 and all(int(r["prompt"].split("+")[0]) < 50 for r in part)
    assert [r for r in train if r in part] == part  # in order, nothing else
    with pytest.raises(ValueError, match="train_first_operand_below=1 leaves none"):
        first_operand_below([r for r in train if not r["prompt"].startswith("0+")], 1)
    from transformers import AutoTokenizer

    from hybridflow.config import compose
    from hybridflow.run.launch import prepare_data

    config = compose(["data.synthetic.train_rows=7700", "data.synthetic.val_rows=500",
                      "data.synthetic.train_first_operand_below=50"])
    sets = prepare_data(config, tmp_path, AutoTokenizer.from_pretrained(tiny_model_dir))
    assert [r["prompt"] for r in sets.train] == [r["prompt"] for r in part]
    assert [r["prompt"] for r in sets.val] == [r["prompt"] for r in val]
    with pytest.raises(ValueError, match="train_first_operand_below"):
        compose(["data.synthetic.train_first_operand_below=0"])


def test_a_few_rows_of_the_rest_are_kept_after_the_part_shown(tmp_path, tiny_model_dir):
    """data.synthetic.train_rows_not_below: an SFT stage that demonstrates first operands below 50 also
    demonstrates the first 200 rows whose first operand is 50 or more, after the others, so every
    seed's model has a foothold there for GRPO to widen (docs/results/default_pipeline.md)."""
    train, _ = make_arithmetic_split(7700, 500, ArithmeticSpec(), seed=0)
    part = first_operand_below(train, 50, rows_not_below=200)
    below = first_operand_below(train, 50)
    rest = [r for r in train if int(r["prompt"].split("+")[0]) >= 50]
    assert part == below + rest[:200] and len(rest) > 200
    # a short run's 200 rows hold fewer than 200 of the rest: all of them are kept, after the others
    short_below = first_operand_below(train[:200], 50)
    assert first_operand_below(train[:200], 50, rows_not_below=200) == \
        short_below + [r for r in train[:200] if r not in short_below]
    from transformers import AutoTokenizer

    from hybridflow.config import compose
    from hybridflow.run.launch import prepare_data

    config = compose(["data.synthetic.train_rows=7700", "data.synthetic.val_rows=500",
                      "data.synthetic.train_first_operand_below=50", "data.synthetic.train_rows_not_below=200"])
    assert [r["prompt"] for r in prepare_data(config, tmp_path, AutoTokenizer.from_pretrained(tiny_model_dir)).train] == \
        [r["prompt"] for r in part]
    with pytest.raises(ValueError, match="train_rows_not_below=5 is invalid: keeps rows past"):
        compose(["data.synthetic.train_rows_not_below=5"])  # no bound: every row is kept already
    with pytest.raises(ValueError, match="train_rows_not_below"):
        compose(["data.synthetic.train_first_operand_below=50", "data.synthetic.train_rows_not_below=-1"])


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_row_files_round_trip(tmp_path, suffix):
    rows = make_arithmetic_rows(10, ArithmeticSpec(), seed=0)
    path = write_rows(rows, tmp_path / f"rows{suffix}")
    assert read_rows(path) == rows


def test_row_file_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1="}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        read_rows(bad)
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"question": "1+1="}\n')
    with pytest.raises(ValueError, match=r"row 0: missing column\(s\) \['prompt'\]"):
        read_rows(missing)
    with pytest.raises(FileNotFoundError, match="data.train_path"):
        read_rows(tmp_path / "nope.parquet")


def test_encode_prompts_left_pads_to_fixed_width():
    tok = build_char_tokenizer()
    rows = [{"prompt": "1+1=", "ground_truth": "2"}, {"prompt": "12+13=", "ground_truth": "25"}]
    batch = encode_prompts(rows, tok, max_prompt_tokens=8)
    assert batch["prompt_ids"].shape == (2, 8)
    assert batch["prompt_mask"].sum(1).tolist() == [4, 6]
    assert tok.decode(batch["prompt_ids"][0][batch["prompt_mask"][0]]) == "1+1="
    assert batch["ground_truth"] == ["2", "25"]
    with pytest.raises(ValueError, match="sample 1 .* more than data.max_prompt_tokens=5"):
        encode_prompts(rows, tok, max_prompt_tokens=5)


def test_the_tiny_model_is_built_once_per_machine_and_copied(tmp_path, monkeypatch):
    """The first build of a spec goes to the cache; a second directory gets the same files, byte for
    byte, without building; another spec is a build of its own."""
    import dataclasses

    from hybridflow.builders.tiny_model import build_tiny_model
    from hybridflow.config.schema import TinyModelConfig

    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path / "cache"))
    first = build_tiny_model(tmp_path / "a")
    builds = list((tmp_path / "cache" / "tiny").iterdir())
    second = build_tiny_model(tmp_path / "b")
    assert list((tmp_path / "cache" / "tiny").iterdir()) == builds and len(builds) == 1
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes()
    other = build_tiny_model(tmp_path / "c", dataclasses.replace(TinyModelConfig(), seed=1))
    assert len(list((tmp_path / "cache" / "tiny").iterdir())) == 2
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()
