"""Moving one rank's training state between the device and host memory, and reading its peaks.

A trainable worker that shares its GPU with a colocated rollout engine (the actor) offloads its
parameters and AdamW moments to host memory while the engine generates, and reloads them before
training; the colocated hand-over (hybridflow/resharding/transports/colocated.py) calls the
worker, which delegates here, and reads the device peak of each phase. Nothing here knows the
role: it takes the FSDP2 model, its optimizer and the worker's device. On the CPU nothing moves
(there is nowhere else to put the state) and there is no peak to read.
"""

from __future__ import annotations

import torch


def offload(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: str,
            keep_parameters: bool = False) -> bool:
    """Move parameters and optimizer state to host memory while the colocated engine generates.
    Only on a GPU; returns whether it moved. `keep_parameters`: the parameters stay on the device (the
    exact engine generates with them, workers/rollout/exact_rollout.py); gradients and moments still go."""
    return move_training_state(model, optimizer, "cpu", keep_parameters) if device == "cuda" else False


def reload(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: str,
           keep_parameters: bool = False) -> bool:
    """Bring parameters (unless kept: `offload`) and optimizer state back to `device` before training;
    returns whether it moved."""
    return move_training_state(model, optimizer, device, keep_parameters) if device == "cuda" else False


def device_peak_bytes(device: str) -> int | None:
    """GPUs: this process's device memory peak since the last read (one phase of the colocated
    hand-over; the engine shares the process), then reset; None on the CPU."""
    from hybridflow.controller.memory import phase_peak_bytes

    return phase_peak_bytes() if device == "cuda" else None


def move_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: str,
                        keep_parameters: bool = False) -> bool:
    """Parameters and AdamW moments to `device` at the host link's speed. To the host, gradients
    are freed first (the next update makes new ones) and every tensor is copied into page-locked
    memory: a non-blocking device-to-host copy gets a pinned destination from PyTorch's caching
    host allocator, which keeps the blocks for the next offload, so they are allocated once.
    A pageable copy moved 1.5-2 GB/s on an H200 whose link moves 55 (docs/results/gpu.md "On a
    GPU"). Parameters wait for their own copy before the next one starts: FSDP2 re-pads an
    unevenly sharded parameter on the host as it is moved, which must read a finished copy.
    Back to the device the copies are non-blocking from pinned memory, ordered on the stream.
    `keep_parameters`: only the gradients (freed) and the moments move."""
    if device == "cpu":
        optimizer.zero_grad(set_to_none=True)
    if not keep_parameters:
        _move_parameters(model, device)
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":
                state[key] = value.to(device, non_blocking=True)
    torch.cuda.synchronize()
    if device == "cpu":
        torch.cuda.empty_cache()
    return True


def _move_parameters(model: torch.nn.Module, device: str) -> None:
    if device == "cpu":
        def to_host(tensor: torch.Tensor) -> torch.Tensor:
            moved = tensor.to("cpu", non_blocking=True)
            torch.cuda.current_stream().synchronize()
            return moved

        model._apply(to_host)  # what Module.to does, with a wait per tensor; FSDP2 re-registers its shards
    else:
        model.to(device, non_blocking=True)
