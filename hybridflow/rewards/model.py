"""Reward model scoring: a Hugging Face sequence-classification model with one output.

The text scored is `prompt + response`, as the data holds them (apply a chat template in the
data when the model expects one). Texts are right-padded, so every sequence starts at
position 0 whatever the model's position encoding, and truncated from the left, so that the
end of the response, where the model reads its score, is always kept.
"""

from __future__ import annotations

import math
from typing import Any


class RewardModelScorer:
    """Scores texts with a loaded model (`num_labels=1`) and its tokenizer, micro-batched."""

    def __init__(self, model: Any, tokenizer: Any, path: str, max_length: int, micro_batch_rows: int) -> None:
        if getattr(model.config, "num_labels", 1) != 1:
            raise ValueError(f"reward.reward_model.path={path!r}: the model has num_labels="
                             f"{model.config.num_labels}; a reward model has a single output (num_labels=1)")
        self.model, self.tokenizer, self.path = model, tokenizer, path
        self.max_length, self.micro_batch_rows = max_length, micro_batch_rows

    def score(self, rows: list[dict[str, Any]], first_index: int = 0) -> list[float]:
        import torch

        texts = [str(row["prompt"]) + str(row["response"]) for row in rows]
        device = next(self.model.parameters()).device
        scores: list[float] = []
        for start in range(0, len(texts), self.micro_batch_rows):
            enc = self.tokenizer(texts[start: start + self.micro_batch_rows], return_tensors="pt", padding=True,
                                 truncation=True, max_length=self.max_length, add_special_tokens=False)
            with torch.inference_mode():
                logits = self.model(input_ids=enc["input_ids"].to(device),
                                    attention_mask=enc["attention_mask"].to(device)).logits  # (b, 1)
            scores.extend(logits[:, 0].float().cpu().tolist())
        bad = [i for i, s in enumerate(scores) if not math.isfinite(s)]
        if bad:
            raise ValueError(f"reward model {self.path} scored sample {first_index + bad[0]} "
                             f"(prompt {str(rows[bad[0]]['prompt'])[:60]!r}) as {scores[bad[0]]}; "
                             "check the model's weights and dtype")
        return scores


def load_reward_model(path: str, max_length: int, micro_batch_rows: int, device: str = "cpu") -> RewardModelScorer:
    """Load the model and tokenizer from the directory `path` onto `device`, in eval mode."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side, tokenizer.truncation_side = "right", "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(path)
    if model.config.pad_token_id is None:
        # The head reads the score at the last non-pad token; it needs to know the pad id.
        model.config.pad_token_id = tokenizer.pad_token_id
    return RewardModelScorer(model.to(device).eval(), tokenizer, path, max_length, micro_batch_rows)
