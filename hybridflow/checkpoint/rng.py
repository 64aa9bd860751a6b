"""Capture and restore every global random number generator a training process draws from.

The state is a plain JSON-serialisable dict, so the same format goes into a worker's
`rng_rank<r>.pt` and into the driver's `trainer_state.json`:

    {"python": [version, [625 ints], gauss_next],          # random.getstate()
     "numpy":  {"key": [624 ints], "pos", "has_gauss", "cached_gaussian"},  # legacy global MT19937
     "torch":  base64 of torch.get_rng_state(),
     "cuda":   [base64 per visible device]}                 # [] when CUDA was never initialised

CUDA states are captured only when CUDA is already initialised in this process, so the
driver (which never touches a GPU) does not create a CUDA context just by saving.
Generators the program creates itself (`torch.Generator`, `numpy.random.default_rng`) are
not global and are the caller's to save.
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
from typing import Any

import numpy as np
import torch

from hybridflow.checkpoint.errors import CheckpointError

RNG_KEYS = ("python", "numpy", "torch", "cuda")


def capture_rng_state() -> dict[str, Any]:
    """The current state of python `random`, numpy's global generator, torch CPU and CUDA."""
    version, internal, gauss_next = random.getstate()
    name, key, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    cuda = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [_encode(state) for state in torch.cuda.get_rng_state_all()]
    return {
        "python": [version, list(internal), gauss_next],
        "numpy": {"bit_generator": name, "key": key.tolist(), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "torch": _encode(torch.get_rng_state()),
        "cuda": cuda,
    }


def restore_rng_state(state: dict[str, Any], *, source: str = "RNG state") -> None:
    """Put every generator back exactly where `capture_rng_state` found it.

    `source` names where the state came from (a file) for error messages.
    """
    if not isinstance(state, dict) or any(key not in state for key in RNG_KEYS):
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{source}: expected an RNG state with keys {list(RNG_KEYS)}, found {found}; "
                              "the file is not from capture_rng_state (re-save the checkpoint)")
    cuda = state["cuda"]
    if cuda:
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if visible != len(cuda):
            raise CheckpointError(f"{source}: holds CUDA RNG states for {len(cuda)} devices but this process sees "
                                  f"{visible}; resume with the same GPUs per process as the saving run")
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    numpy = state["numpy"]
    np.random.set_state((numpy["bit_generator"], np.asarray(numpy["key"], dtype=np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["cached_gaussian"]))
    torch.set_rng_state(_decode(state["torch"]))
    if cuda:
        torch.cuda.set_rng_state_all([_decode(s) for s in cuda])


def derived_seed(state: dict[str, Any], rank: int) -> int:
    """A seed for a rank that has no saved RNG state of its own (a resume on more ranks than
    saved): the first 8 bytes of sha256(`state` as JSON, `rank`). The same checkpoint and rank
    always give the same seed, and different ranks different ones."""
    text = json.dumps(state, sort_keys=True) + f"/rank{rank}"
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little") >> 1  # < 2**63


def seed_rng(seed: int) -> None:
    """Seed python `random`, numpy's global generator and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.cpu().numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
