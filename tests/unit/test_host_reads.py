"""The training loop never makes the host wait for the device inside a micro-batch, checked on the CPU.

On a GPU, reading a tensor's value (`float()`, `.item()`, `.tolist()`, `bool()`), asking for a
data-dependent shape (`nonzero`, boolean-mask indexing) or copying to the host makes the host wait
until the GPU has finished everything queued before it; between two such waits the host cannot run
ahead, and a model whose kernels are short runs at the host's launch speed (docs/results/gpu.md,
"On a GPU": 172 waits in one policy update at Qwen2.5-0.5B shapes, the plain loop none). On the CPU
nothing waits, so `DeviceReads` counts what would: every such read of a tensor that would live on the
device. A tensor is a host tensor when it came from a copy to the host (`cpu()`, `tolist()`), was made
by a factory with no device (`torch.tensor(rows)`), or was computed from host tensors alone.

The claim: a mini-batch's reads do not grow with its micro-batches beyond one per micro-batch (the
masks read once to lay out its packed or trimmed tokens); the statistics are read together at its end
(`hybridflow.training.fsdp.read_floats`).
"""

from __future__ import annotations

import sys
import weakref

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from hybridflow.batch import Batch
from hybridflow.config.schema import ActorConfig, CriticConfig, HybridFlowConfig, ModelConfig, OptimConfig
from hybridflow.controller import WorkerContext
from hybridflow.training.sequences import micro_batch_rows
from recipes.roles import actor_role, critic_role
from hybridflow.run.stage import prepare_stage

Tensor = torch.Tensor
READS = {Tensor.item, Tensor.__float__, Tensor.__int__, Tensor.__bool__, Tensor.__index__, Tensor.tolist,
         Tensor.nonzero, torch.nonzero, Tensor.masked_select, torch.masked_select, Tensor.numpy, Tensor.cpu,
         torch.unique, Tensor.unique}
REPEATS = {Tensor.repeat_interleave, torch.repeat_interleave}  # a read when its repeats are a tensor and no output_size
INDEXING = {Tensor.__getitem__, Tensor.__setitem__, Tensor.index_put_, Tensor.index_put, torch.index_put}


class DeviceReads(TorchFunctionMode):
    """Counts the reads of device tensors (see the module docstring) while active."""

    def __init__(self):
        super().__init__()
        self.host: dict[int, weakref.ref] = {}  # id -> the host tensor (a tensor's == is elementwise)
        self.count = 0
        self.in_transformers = 0  # reads inside the model's own code: a plain loop pays them too

    def _on_host(self, value) -> bool:
        return isinstance(value, Tensor) and id(value) in self.host and self.host[id(value)]() is value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        # a copy to the host is cpu() (the code under test copies that way): on the CPU every device
        # is "cpu", so to() cannot tell a move to the run's device (a worker's batch.to(ctx.device))
        # from one to the host
        to_host = func in (Tensor.cpu, Tensor.numpy, Tensor.tolist)
        read = False
        if func in READS or to_host:
            read = not self._on_host(args[0])
        elif func in REPEATS:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if func is torch.repeat_interleave else None)
            read = isinstance(repeats, Tensor) and not self._on_host(repeats) and kwargs.get("output_size") is None
        elif func in INDEXING:
            index = args[1] if len(args) > 1 else kwargs.get("indices")
            masks = [t for t in tree_flatten(index)[0] if isinstance(t, Tensor) and t.dtype == torch.bool]
            read = any(not self._on_host(m) for m in masks)
        if read and _caller_package() == "transformers":
            self.in_transformers += 1
        elif read:
            self.count += 1
        result = func(*args, **kwargs)
        made_here = not tensors and kwargs.get("device") is None  # torch.tensor(rows), torch.zeros(n)
        if to_host or made_here or (tensors and all(self._on_host(t) for t in tensors)):
            if isinstance(result, Tensor) and any(result is t for t in tensors):
                result = result.clone()  # on the CPU .cpu() is the tensor itself, which stays on the "device"
            for out in tree_flatten(result)[0]:
                if isinstance(out, Tensor):
                    self.host[id(out)] = weakref.ref(out)
        return result


def _caller_package() -> str:
    """The top-level package of the innermost caller outside torch and this file."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not name.startswith("torch") and name != __name__:
            return name.split(".")[0]
        frame = frame.f_back
    return ""


def test_the_counter_sees_reads_of_device_tensors_and_not_of_host_ones():
    device = torch.arange(6.0)
    with DeviceReads() as reads:
        float(device.sum()), device[device > 2], device.nonzero(), device.tolist()
        assert reads.count == 4
        host = device.cpu()  # one more: the copy itself
        lengths = host[host > 0]
        float(lengths.max()), int(torch.tensor([3, 4]).sum()), lengths.tolist()
        assert reads.count == 5
        device.index_select(0, torch.tensor([1, 2]))  # a host index moved to the device: no read
        assert reads.count == 5


ROWS, PROMPT, RESPONSE = 24, 8, 12


def _batch(seed: int = 0) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(1, PROMPT + 1, (ROWS,), generator=generator)
    response_len = torch.randint(1, RESPONSE + 1, (ROWS,), generator=generator)
    prompt_mask = torch.arange(PROMPT)[None] >= PROMPT - prompt_len[:, None]
    response_mask = torch.arange(RESPONSE)[None] < response_len[:, None]
    advantages = torch.randn(ROWS, 1, generator=generator).expand(ROWS, RESPONSE).contiguous()
    return Batch({"prompt_ids": torch.randint(3, 40, (ROWS, PROMPT), generator=generator) * prompt_mask,
                  "prompt_mask": prompt_mask,
                  "response_ids": torch.randint(3, 40, (ROWS, RESPONSE), generator=generator) * response_mask,
                  "response_mask": response_mask, "advantages": advantages * response_mask,
                  "returns": advantages * response_mask})


def _config(rows_per_micro_batch: int, packed: bool) -> HybridFlowConfig:
    return HybridFlowConfig(model=ModelConfig(pack_sequences=packed),
                            actor=ActorConfig(optim=OptimConfig(lr=1e-3), samples_per_micro_batch=rows_per_micro_batch,
                                              kl_loss_coef=0.01),
                            critic=CriticConfig(optim=OptimConfig(lr=1e-3), samples_per_micro_batch=rows_per_micro_batch))


@pytest.mark.parametrize("packed", [True, False])
def test_a_mini_batchs_reads_grow_by_at_most_one_per_micro_batch(tiny_model_dir, packed):
    """Transformers' own reads are left out: on the padded path its sdpa mask asks whether every
    token is real (`padding_mask.all()`) once per forward, as it does in a plain loop."""
    batch = _batch()
    reads, micro_batches = {}, {}
    for rows in (ROWS, 2):  # one micro-batch, then several
        micro_batches[rows] = len(micro_batch_rows(batch, rows, packed=packed))
        config = _config(rows, packed)
        actor = actor_role(prepare_stage(config).config, tiny_model_dir).build(WorkerContext())
        actor.start()
        critic = critic_role(prepare_stage(config).config, tiny_model_dir).build(WorkerContext())
        critic.start()
        with DeviceReads() as counted:
            out = actor.compute_log_probs(batch)
            log_probs_reads = counted.count
            update = actor.update_policy(batch.union(out).union(Batch({"ref_log_probs": out["old_log_probs"]})))
            update_reads = counted.count - log_probs_reads
            values = critic.compute_values(batch)
            critic.update_critic(batch.union(values))
            critic_reads = counted.count - log_probs_reads - update_reads
        assert update["actor/grad_norm"] > 0
        reads[rows] = (log_probs_reads, update_reads, critic_reads)
    assert micro_batches[ROWS] == 1 and micro_batches[2] >= 6
    extra = micro_batches[2] - 1
    for part, name in enumerate(("log-prob pass", "policy update", "critic values and update")):
        grown = reads[2][part] - reads[ROWS][part]
        passes = 1 if part < 2 else 2  # the critic: its values, then its update
        assert grown <= extra * passes, (name, reads)
