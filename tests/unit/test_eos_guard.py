"""The end-of-sequence guard (hybridflow/data/eos.py), by hand."""

from __future__ import annotations

import pytest
import torch

from hybridflow.data.eos import UntrainedEOSError, check_eos_trained, rows_without_trained_eos

EOS = 2


def test_rows_with_a_trained_token_and_no_trained_eos_are_named():
    ids = torch.tensor([[5, 6, EOS, 0], [5, EOS, 0, 0], [7, 8, 9, EOS], [0, 0, 0, 0]])
    trained = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    # row 0 trains its EOS; row 1's EOS is masked; row 2 trains it; row 3 trains nothing (no target)
    assert rows_without_trained_eos(ids, trained, EOS) == [1]
    with pytest.raises(UntrainedEOSError, match=r"SFT step 3: 1 of 4 targets \(rows \[1\]\) .*EOS id 2"):
        check_eos_trained(ids, trained, EOS, "SFT step 3")
    check_eos_trained(ids[[0, 2, 3]], trained[[0, 2, 3]], EOS, "fine")


def test_the_sft_targets_as_encoded_train_their_eos(tiny_model_dir):
    from transformers import AutoTokenizer

    from hybridflow.data.answers import encode_demonstrations, encode_answers

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    batch = encode_answers(["12", "345"], tok, 8)
    assert rows_without_trained_eos(batch["response_ids"], batch["response_mask"], tok.eos_token_id) == []
    demo = encode_demonstrations([["<calc>1+1</calc>", "<result>2</result>", "2"]], tok, 32)
    assert rows_without_trained_eos(demo["response_ids"], demo["loss_mask"], tok.eos_token_id) == []
