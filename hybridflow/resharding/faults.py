"""Fault injection for the weight sync, per process: corrupt a received bucket on purpose, or
end the receiving or the sending process at a bucket.

Used by tests, and by users checking that the sync check catches a bad transfer on their
cluster. Nothing is injected unless `corrupt_bucket` was called in this process.
"""

from __future__ import annotations

import torch

_CORRUPT: set[int] = set()
_EXIT: set[int] = set()
_EXIT_SENDING: set[int] = set()


def corrupt_bucket(index: int) -> None:
    """The next received bucket with this index gets +1 on its first element."""
    _CORRUPT.add(index)


def exit_at_bucket(index: int) -> None:
    """The process dies (exit status 1, no clean-up) when it receives the bucket with this index."""
    _EXIT.add(index)


def exit_sending_bucket(index: int) -> None:
    """The sending process dies (exit status 1, no clean-up) when it is about to send this bucket."""
    _EXIT_SENDING.add(index)


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
