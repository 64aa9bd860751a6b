"""The `dpo.*` config schema (`recipe=dpo`): plain dataclasses, importable without torch, so the
config schema and the `hybridflow` command's checks stay cheap to import. The losses themselves are
hybridflow/algos/preference.py; the pairs, their formats and their truncation hybridflow/data/preference.py.
TRL's DPOConfig names are given beside each key (docs/recipes.md "DPO" has the whole table)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def _require(ok: bool, key: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"config {key}={value!r} is invalid: {allowed}")


# The built-in losses of hybridflow.algos.preference.PREFERENCE_LOSSES (a test keeps the two the same;
# the schema names them without importing torch); the reference-free ones need no reference model.
PREFERENCE_LOSS_NAMES = ("sigmoid", "robust", "hinge", "ipo", "simpo")
REFERENCE_FREE_LOSSES = ("simpo",)
# The beta each loss runs with when dpo.beta is not set: its paper's. DPO (Rafailov et al. 2023)
# and the losses built on it use 0.1 (TRL's default for all of them); SimPO's beta is a reward
# scale, 2.0-2.5 in its paper (Meng et al. 2024, section 4): the low end. A test keeps these
# equal to each loss function's own default.
PREFERENCE_LOSS_BETAS = {"sigmoid": 0.1, "robust": 0.1, "hinge": 0.1, "ipo": 0.1, "simpo": 2.0}
# What happens to a pair longer than its limits: refused naming the rows, or cut as TRL's
# truncation_mode cuts (hybridflow/data/preference.py, `fit_pair`).
TRUNCATION_MODES = ("error", "keep_start", "keep_end")


@dataclass
class DPOConfig:
    # recipe=dpo's loss (TRL's loss_type; docs/algorithms.md, "Preference losses"): sigmoid (DPO;
    # conservative DPO with label_smoothing > 0), robust, hinge (SLiC), ipo, simpo (reference-free)
    loss: str = "sigmoid"
    # TRL's beta: the strength of the tie to the reference (SimPO: its reward scale). null: the
    # loss's own default from its paper (sigmoid, robust, hinge, ipo 0.1; simpo 2.0); the console says which runs
    beta: Optional[float] = None
    label_smoothing: float = 0.0  # assumed share of flipped preference labels (sigmoid, robust), in [0, 0.5)
    simpo_gamma: float = 0.5  # SimPO's target reward margin
    # TRL's reference_free: the reference log-ratio taken as 0 (the loss on the policy's log-probs
    # alone); no reference model is started
    reference_free: bool = False
    # TRL's precompute_ref_log_probs: the reference log-probs of each training pair are computed the
    # first time the pair is drawn and reused after (the reference is frozen: the same numbers);
    # recomputed after a reference hook changes the reference. false: computed every step
    reuse_reference_log_probs: bool = True
    # TRL's max_length: the most tokens of prompt + response in one sequence; null: no limit beyond
    # data.max_prompt_tokens and rollout.max_response_tokens
    max_length: Optional[int] = None
    # TRL's truncation_mode, for a pair over its limits: error (refused, naming the file and rows),
    # keep_start (the sequence's first tokens: the response's end is cut), keep_end (its last
    # tokens: the prompt's start is cut first)
    truncation_mode: str = "error"

    def __post_init__(self) -> None:
        _require(self.loss in PREFERENCE_LOSS_NAMES, "dpo.loss", self.loss, f"one of {list(PREFERENCE_LOSS_NAMES)}")
        _require(self.beta is None or self.beta > 0, "dpo.beta", self.beta,
                 "must be > 0, or null for the loss's own default")
        _require(0 <= self.label_smoothing < 0.5, "dpo.label_smoothing", self.label_smoothing, "must be in [0, 0.5)")
        _require(not (self.reference_free and self.loss in REFERENCE_FREE_LOSSES), "dpo.reference_free",
                 self.reference_free, f"dpo.loss={self.loss} is reference-free already: drop dpo.reference_free")
        _require(self.truncation_mode in TRUNCATION_MODES, "dpo.truncation_mode", self.truncation_mode,
                 f"one of {list(TRUNCATION_MODES)}")
        _require(self.max_length is None or self.max_length >= 2, "dpo.max_length", self.max_length,
                 "must be >= 2 tokens (a prompt token and a response token), or null")

    @property
    def beta_in_use(self) -> float:
        """`dpo.beta`, or when it is not set the loss's own default (`PREFERENCE_LOSS_BETAS`)."""
        return PREFERENCE_LOSS_BETAS[self.loss] if self.beta is None else self.beta

    def beta_line(self) -> str:
        """The console's line saying which beta runs and where it comes from."""
        if self.beta is None:
            return (f"hybridflow: dpo.loss={self.loss} runs with beta={self.beta_in_use} (the loss's own default, "
                    "from its paper; set dpo.beta to change it)")
        return f"hybridflow: dpo.loss={self.loss} runs with beta={self.beta} (dpo.beta)"

    @property
    def needs_reference(self) -> bool:
        return self.loss not in REFERENCE_FREE_LOSSES and not self.reference_free
