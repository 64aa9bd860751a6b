"""The merge hooks' config schema (`pipeline.stages[i].init`, `trainer.training_hooks`): a plain
dataclass, importable without torch, so the config schema stays cheap to import. The hooks
themselves are hybridflow/merge/hooks.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict


@dataclass
class HookConfig:
    """A hook in a pipeline config: the registered name (or `module:function`) and its params."""

    name: str = "pma_sma"
    params: Dict[str, Any] = field(default_factory=dict)
