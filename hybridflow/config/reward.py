"""Typed reward configuration (`reward.*`), OmegaConf structured-config compatible.

The lead schema nests `RewardConfig` under `reward`. Rules run in `__post_init__`, before
Ray starts; every error names the key, the value and the fix. A function entry is checked
by `RewardConfig` rather than by itself, because only the parent knows its index in
`reward.functions` (the key an error must name).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

ON_ERROR_MODES = ("raise", "fallback")
REWARD_MODEL_NAME = "reward_model"  # the metric name of the reward model's score


def _require(ok: bool, key: str, value: Any, fix: str) -> None:
    if not ok:
        raise ValueError(f"config {key}={value!r} is invalid: {fix}")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def reference_name(reference: str) -> str:
    """The short name of a function reference: 'a/b.py:score' -> 'score', 'exact_match' -> itself."""
    return reference.rpartition(":")[2]


def check_reference(reference: Optional[str], key: str) -> Optional[str]:
    """Check a function reference's form; a `file.py:name` path is made absolute.

    Absolute because the function is loaded inside Ray workers, whose working directory is
    not the driver's. Returns the (possibly rewritten) reference. A bare name is a registered
    function's: that it is registered is checked with the rules that ask the runtime
    (hybridflow/checks/rules.py `check_reward_names`).
    """
    from hybridflow.config.references import absolute_reference

    _require(isinstance(reference, str) and reference.strip() != "", key, reference,
             "name a reward function: a registered name (docs/rewards.md), 'package.module:name' or "
             "'path/to/file.py:name'")
    if ":" not in reference:
        return reference
    try:
        return absolute_reference(reference)
    except ValueError as exc:
        _require(False, key, reference, f"{exc}; a registered reward function is named without a colon")
    except FileNotFoundError as exc:
        _require(False, key, reference, str(exc))


@dataclass
class RewardFunctionConfig:
    # A registered name, 'package.module:name' or 'path/to/file.py:name'.
    fn: str = "exact_match"
    weight: float = 1.0  # the total reward is sum(weight * score) over functions (and the reward model)
    batched: bool = False  # the function takes lists (one entry per sample) and returns a list
    kwargs: Dict[str, Any] = field(default_factory=dict)  # fixed keyword arguments passed on every call
    name: Optional[str] = None  # metric name (reward/<name>/score); null: the function's name

    @property
    def metric_name(self) -> str:
        return self.name or reference_name(self.fn)

    def check(self, key: str) -> None:
        """Validate this entry as config key `key` (e.g. 'reward.functions[1]')."""
        self.fn = check_reference(self.fn, f"{key}.fn")
        _require(_finite(self.weight), f"{key}.weight", self.weight, "must be a finite number")
        _require(self.name is None or (self.name.strip() != "" and self.name != REWARD_MODEL_NAME),
                 f"{key}.name", self.name, f"must be a non-empty name other than {REWARD_MODEL_NAME!r}, or null")
        reserved = sorted({"prompt", "response"} & set(self.kwargs))
        _require(not reserved, f"{key}.kwargs", self.kwargs,
                 f"{reserved} are filled from each sample; remove them from kwargs")


@dataclass
class RewardModelConfig:
    path: Optional[str] = None  # a Hugging Face directory with a sequence-classification model; null: none
    weight: float = 1.0
    max_length: int = 512  # tokens of prompt + response; longer texts lose their start (the response is kept)
    micro_batch_rows: int = 16  # texts per forward pass

    def __post_init__(self) -> None:
        _require(_finite(self.weight), "reward.reward_model.weight", self.weight, "must be a finite number")
        _require(self.max_length >= 1, "reward.reward_model.max_length", self.max_length, "must be >= 1")
        _require(self.micro_batch_rows >= 1, "reward.reward_model.micro_batch_rows", self.micro_batch_rows,
                 "must be >= 1")
        if self.path is not None:
            path = Path(self.path).expanduser().resolve()
            _require(path.is_dir(), "reward.reward_model.path", self.path,
                     "must be a Hugging Face model directory (config.json, weights, tokenizer), or null")
            self.path = str(path)


@dataclass
class RewardConfig:
    # One-function shorthand (`reward.fn=file.py:name`); must be null when `functions` is set.
    fn: Optional[str] = "exact_match"
    functions: List[RewardFunctionConfig] = field(default_factory=list)
    timeout_s: float = 30.0  # per call: one sample, or one whole batch for a batched function
    on_error: str = "raise"  # raise | fallback (the sample gets fallback_score and is counted)
    fallback_score: float = 0.0
    max_concurrency: int = 8  # calls of one function in flight at once (threads, or tasks for async def)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)

    def __post_init__(self) -> None:
        _require(not (self.fn is not None and self.functions), "reward.fn", self.fn,
                 "reward.fn and reward.functions are both set; use one: set reward.fn=null to use "
                 "reward.functions, or drop reward.functions")
        if self.fn is not None:
            self.fn = check_reference(self.fn, "reward.fn")
        for i, spec in enumerate(self.functions):
            spec.check(f"reward.functions[{i}]")
        _require(bool(self.function_specs()) or self.reward_model.path is not None, "reward.fn", self.fn,
                 "no reward source: set reward.fn, reward.functions or reward.reward_model.path")
        seen: Dict[str, int] = {}
        for i, spec in enumerate(self.functions):
            _require(spec.metric_name not in seen, f"reward.functions[{i}].name", spec.name,
                     f"reward.functions[{seen.get(spec.metric_name)}] is also named {spec.metric_name!r}; "
                     f"give reward.functions[{i}].name a distinct name")
            seen[spec.metric_name] = i
        _require(self.timeout_s > 0 and math.isfinite(self.timeout_s), "reward.timeout_s", self.timeout_s,
                 "must be a finite number of seconds > 0")
        _require(self.on_error in ON_ERROR_MODES, "reward.on_error", self.on_error,
                 f"must be one of {list(ON_ERROR_MODES)}")
        _require(_finite(self.fallback_score), "reward.fallback_score", self.fallback_score,
                 "must be a finite number")
        _require(self.max_concurrency >= 1, "reward.max_concurrency", self.max_concurrency, "must be >= 1")

    def function_specs(self) -> List[RewardFunctionConfig]:
        """The functions to run: `functions`, or the `fn` shorthand as one entry of weight 1."""
        if self.fn is not None:
            return [RewardFunctionConfig(fn=self.fn)]
        return list(self.functions)

    def function_keys(self) -> List[str]:
        """The config key of each entry of `function_specs()`, for error messages."""
        return ["reward.fn"] if self.fn is not None else [f"reward.functions[{i}]" for i in range(len(self.functions))]
