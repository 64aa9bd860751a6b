"""Fault injection for the weight sync, per process: corrupt a received bucket on purpose, end
the receiving or the sending process at a bucket, hold a staged push back after it arrived, or write
one weight wrong in the reload that follows a level-2 sleep.

Used by tests, and by users checking that the sync check catches a bad transfer on their
cluster. Nothing is injected unless `corrupt_bucket` was called in this process.
"""

from __future__ import annotations

import torch

_CORRUPT: set[int] = set()
_EXIT: set[int] = set()
_EXIT_SENDING: set[int] = set()
_HOLD_STAGED: dict[int, float] = {}
_DROP_ADAPTER: set[int] = set()
_BASE_ONLY: list[bool] = [False]
_OTHER_WEIGHTS: list[bool] = [False]
_WRONG_AFTER_WAKE: set[str] = set()


def corrupt_bucket(index: int) -> None:
    """The next received bucket with this index gets +1 on its first element."""
    _CORRUPT.add(index)


def exit_at_bucket(index: int) -> None:
    """The process dies (exit status 1, no clean-up) when it receives the bucket with this index."""
    _EXIT.add(index)


def exit_sending_bucket(index: int) -> None:
    """The sending process dies (exit status 1, no clean-up) when it is about to send this bucket."""
    _EXIT_SENDING.add(index)


def hold_staged(version: int, seconds: float) -> None:
    """A staged push of this policy version, once received, is registered `seconds` later (the
    rank lags the other ranks of its engine, as a slow link would make it)."""
    _HOLD_STAGED[version] = seconds


def drop_adapter(version: int) -> None:
    """The adapter of this policy version arrives and is written, but never registered with the
    engine (weight_sync.lora=adapter): the engine keeps serving what it served before."""
    _DROP_ADAPTER.add(version)


def serve_base_model() -> None:
    """Every request from now on is sent without the adapter (the base model generates)."""
    _BASE_ONLY[0] = True


def adapter_from_other_weights() -> None:
    """The next adapter payload the actor sends is built from other weights than it holds (+1 on its
    first B factor), its own checksums recomputed to match it: consistent with itself, not the actor."""
    _OTHER_WEIGHTS[0] = True


def garble_after_level_2_wake(name: str) -> None:
    """The next weight load that follows a level-2 sleep (rollout.sleep_level=2 discarded the engine's
    weights) writes the weight `name` wrong, +1 on its first element, as a faulty reload would; once."""
    _WRONG_AFTER_WAKE.add(name)


def after_level_2_wake(buckets):
    """`buckets` ((name, full tensor) lists) as the load that follows a level-2 sleep receives them: a
    weight `garble_after_level_2_wake` named comes garbled (a copy; the sender's tensor is left alone)."""
    if not _WRONG_AFTER_WAKE:
        return buckets
    return ([(name, _garbled(name, tensor)) for name, tensor in bucket] for bucket in buckets)


def _garbled(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if name not in _WRONG_AFTER_WAKE:
        return tensor
    _WRONG_AFTER_WAKE.discard(name)
    wrong = tensor.clone()
    wrong.view(-1)[0] += 1.0
    return wrong


def before_sending_adapter(payload: dict | None) -> dict | None:
    if payload is None or not _OTHER_WEIGHTS[0]:
        return payload
    from hybridflow.resharding.verify import checksum

    _OTHER_WEIGHTS[0] = False
    name = next(n for n in payload["tensors"] if n.endswith(".lora_B.weight"))
    payload["tensors"][name] = payload["tensors"][name] + 1
    module = name.removeprefix("base_model.model.").removesuffix(".lora_B.weight")
    payload["checksums"][module]["B"] = checksum(payload["tensors"][name])
    return payload


def adapter_registered(version: int) -> bool:
    return version not in _DROP_ADAPTER


def request_adapter(adapter):
    """The adapter a request is sent with: `adapter`, unless `serve_base_model` was called."""
    return None if _BASE_ONLY[0] else adapter


def before_registering_staged(version: int) -> None:
    seconds = _HOLD_STAGED.pop(version, 0.0)
    if seconds:
        import time

        time.sleep(seconds)


def before_sending(index: int) -> None:
    if index in _EXIT_SENDING:
        import os

        os._exit(1)


def apply_to_bucket(index: int, flat: torch.Tensor) -> None:
    if index in _EXIT:
        import os

        os._exit(1)
    if index in _CORRUPT and flat.numel():
        _CORRUPT.discard(index)
        flat[0] += 1.0
