"""Tokenizers and data as checkpoints ship them: a byte-level BPE tokenizer with no pad token whose
post-processor starts text with BOS (as Llama's and Mistral's do) and a chat template that writes
its own BOS; prompts longer than data.max_prompt_tokens under each data.prompt_truncation; SFT
answers longer than rollout.max_response_tokens. Built with the `tokenizers` library, offline."""

from __future__ import annotations

import pytest

from hybridflow.data.answers import long_sft_targets
from hybridflow.data.checks import InputError
from hybridflow.data.prompts import encode_prompts, fit_prompt_lengths, truncate_left
from hybridflow.data.tokenizer import chat_template_name, load_tokenizer, text_prefix

MISTRAL_LIKE_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} "
                         "[/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


def save_bpe_tokenizer(directory, *, pad: bool = False, eos: bool = True, adds_bos: bool = True):
    """A trained byte-level BPE tokenizer saved as a Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>"]
    core.train_from_iterator([f"{a}+{b}={a + b} what is the sum" for a in range(30) for b in range(30)],
                             trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if adds_bos:
        core.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                            special_tokens=[("<s>", core.token_to_id("<s>"))])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>" if eos else None,
                                        pad_token="<pad>" if pad else None, chat_template=MISTRAL_LIKE_TEMPLATE)
    tokenizer.save_pretrained(directory)
    return directory


def test_no_pad_token_the_eos_serves_said_once(tmp_path, capsys):
    directory = save_bpe_tokenizer(tmp_path / "tok")
    tokenizer = load_tokenizer(directory)
    assert tokenizer.pad_token == "</s>" and tokenizer.pad_token_id == tokenizer.eos_token_id
    load_tokenizer(directory)
    said = [line for line in capsys.readouterr().out.splitlines() if "no pad token" in line]
    assert said == [f"hybridflow: the tokenizer of {directory} has no pad token; its eos token '</s>' "
                    f"(id {tokenizer.eos_token_id}) serves as pad (padding is masked out)"]
    batch = encode_prompts([{"prompt": "1+1="}, {"prompt": "12+13="}], tokenizer, 12)  # raised before
    assert (batch["prompt_ids"][~batch["prompt_mask"]] == tokenizer.eos_token_id).all()


def test_no_pad_and_no_eos_the_unk_serves_and_none_at_all_is_an_error(tmp_path):
    from transformers import AutoTokenizer

    directory = save_bpe_tokenizer(tmp_path / "tok", eos=False)
    bare = AutoTokenizer.from_pretrained(directory)
    bare.unk_token = "<pad>"
    bare.save_pretrained(tmp_path / "unk")
    assert load_tokenizer(tmp_path / "unk").pad_token == "<pad>"
    with pytest.raises(ValueError, match=r"has no pad, EOS or unk token to pad with; fix: add a pad token"):
        load_tokenizer(directory)


def test_text_prompts_get_bos_where_the_tokenizer_adds_one_chat_prompts_only_the_templates(tmp_path):
    tokenizer = load_tokenizer(save_bpe_tokenizer(tmp_path / "tok"))
    bos = tokenizer.bos_token_id
    assert text_prefix(tokenizer) == [bos]
    rows = [{"prompt": "3+4="}, {"prompt": [{"role": "user", "content": "3+4="}]}]
    batch = encode_prompts(rows, tokenizer, 24)
    text, chat = (ids[mask].tolist() for ids, mask in zip(batch["prompt_ids"], batch["prompt_mask"]))
    assert text == [bos] + tokenizer("3+4=", add_special_tokens=False)["input_ids"]
    assert chat[0] == bos and chat.count(bos) == 1  # the template's BOS, not a second one
    assert batch["prompt"][1] == "<s>[INST] 3+4= [/INST]"
    plain = load_tokenizer(save_bpe_tokenizer(tmp_path / "plain", adds_bos=False))
    assert text_prefix(plain) == []  # a tokenizer that adds none (Qwen's) gets none


def test_the_chat_template_is_named(tmp_path):
    directory = save_bpe_tokenizer(tmp_path / "tok")
    name = chat_template_name(load_tokenizer(directory), directory)
    assert name.startswith(f"chat_template.jinja of {directory} (Llama 2 / Mistral, sha256 ")


def rows_with_long(count: int, long_rows: set[int]) -> list[dict]:
    return [{"prompt": ("1+" * 30 + "1=") if i in long_rows else f"{i}+1=", "ground_truth": str(i + 1)}
            for i in range(count)]


@pytest.fixture(scope="module")
def char_tokenizer():
    from hybridflow.builders.tiny_model import build_char_tokenizer

    return build_char_tokenizer()


def test_prompt_truncation_error_names_rows_past_the_first_thousand(char_tokenizer):
    rows = rows_with_long(1200, {1003, 1100})
    with pytest.raises(InputError) as err:
        fit_prompt_lengths(rows, char_tokenizer, 16, "error", "data file t.parquet (data.train_path)")
    assert str(err.value).startswith(
        "data file t.parquet (data.train_path), column 'prompt', row(s) 1003, 1100: row 1003 has 62 tokens, more "
        "than data.max_prompt_tokens=16; fix: raise data.max_prompt_tokens to 62")
    assert "data.prompt_truncation=left" in str(err.value)


def test_prompt_truncation_filter_leaves_rows_out_and_counts_them(char_tokenizer, capsys):
    rows = rows_with_long(50, {3, 7, 40})
    kept = fit_prompt_lengths(rows, char_tokenizer, 16, "filter", "data file t.parquet (data.train_path)")
    assert len(kept) == 47 and all(len(row["prompt"]) <= 16 for row in kept)
    assert ("hybridflow: 3 of 50 rows of data file t.parquet (data.train_path) have prompts longer than "
            "data.max_prompt_tokens=16: left out (data.prompt_truncation=filter; rows 3, 7, 40); 47 rows remain"
            ) in capsys.readouterr().out


def test_prompt_truncation_left_keeps_the_last_tokens_and_the_bos(char_tokenizer, tmp_path):
    rows = rows_with_long(8, {2})
    assert fit_prompt_lengths(rows, char_tokenizer, 16, "left", "data") is rows
    batch = encode_prompts(rows, char_tokenizer, 16, truncation="left")
    assert char_tokenizer.decode(batch["prompt_ids"][2]) == ("1+" * 30 + "1=")[-16:]
    with pytest.raises(ValueError, match="sample 2 .* more than data.max_prompt_tokens=16.*prompt_truncation=left"):
        encode_prompts(rows, char_tokenizer, 16)
    # a leading BOS (a tokenizer that adds one) stays: the model saw every text start with it
    assert truncate_left([1, 10, 11, 12, 13], 3, bos_token_id=1) == [1, 12, 13]
    assert truncate_left([10, 11, 12, 13], 3, bos_token_id=1) == [11, 12, 13]


def test_sft_answers_longer_than_max_response_tokens(char_tokenizer):
    rows = [{"prompt": "1+1=", "ground_truth": "2"}, {"prompt": "9*9=", "ground_truth": "81" * 6}]
    assert long_sft_targets(rows, char_tokenizer, 13, "data file t.jsonl (data.train_path)") is None
    assert long_sft_targets(rows, char_tokenizer, 12, "data file t.jsonl (data.train_path)", indices=[5, 1070]) == (
        "data file t.jsonl (data.train_path), column 'ground_truth', row(s) 1070: the SFT target of row 1070 needs "
        "13 tokens with EOS, more than rollout.max_response_tokens=12; fix: raise rollout.max_response_tokens to "
        "13, or shorten those answers")
    demos = [{"prompt": "2*3=", "demonstration": ["<calc>2*3</calc>", "<result>6</result>", "6"]}]
    # <calc>2*3</calc>: 1 + 3 + 1 tokens (markers are one token); <result>6</result>: 3; "6": 1; EOS: 1
    assert long_sft_targets(demos, char_tokenizer, 10, "rows") is None
    assert "column 'demonstration', row(s) 0: the SFT target of row 0 needs 10 tokens" in \
        long_sft_targets(demos, char_tokenizer, 9, "rows")


def test_filter_leaving_fewer_rows_than_one_step_is_refused(char_tokenizer):
    from hybridflow.config import compose
    from hybridflow.run.launch import fit_data

    config = compose(["recipe=grpo", "data.prompt_truncation=filter", "data.max_prompt_tokens=16",
                      "trainer.prompts_per_step=4"])
    rows = rows_with_long(8, {2, 3, 4, 5, 6})
    assert len(fit_data(config, rows, char_tokenizer, "validation rows")) == 3  # validation: fewer is fine
    with pytest.raises(InputError, match=r"^data file t: 3 rows are left after data.prompt_truncation=filter, fewer "
                                         r"than trainer.prompts_per_step=4; fix: raise data.max_prompt_tokens"):
        fit_data(config, rows, char_tokenizer, "data file t", trained=True)
