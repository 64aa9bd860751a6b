"""Ulysses sequence parallelism: one packed row split along its length over a group of ranks.

A role that runs a training-layout forward (the actor and the reference with `actor.sequence_parallel_size`,
the critic and the teacher with their own) at SP > 1 groups its ranks into sequence-parallel groups of SP
consecutive ranks (`SequenceParallel`); the ranks of one group hold the same micro-batches (the controller
hands every rank of a replica the same part of a data-parallel split) and each computes 1/SP of every
packed row: its slice of the tokens through the embeddings, the
projections, the MLP and the output head. Attention needs every token of a sequence, so around it:

    (1, H, T/SP, D) q/k/v, every head of this rank's tokens
        --all-to-all: scatter heads, gather the sequence-->  (1, H/SP, T, D) H/SP heads of every token
        attention as packing computes it (`packed_attention`: cu_seq_lens, shared prompts, kernels)
        --all-to-all: scatter the sequence, gather heads-->  (1, T/SP, H, D)

(DeepSpeed-Ulysses, Jacobs et al. 2023; verl's `ulysses.py` does the same for FSDP). Position ids stay
global (each rank's slice of the packed row's positions), so rotary embeddings see the positions SP 1
sees. The row is padded at its end to a multiple of SP; the pad tokens are cut off before attention and
get zeros back, so no real token ever sees them, and their logits are never kept.

The hook is transformers' attention interface: the model's packed attention (`PACKED_ATTENTION`) is
switched to `ULYSSES_ATTENTION`, registered here, which wraps it; a forward that carries no
`SEQUENCE_PARALLEL` keyword (generation by the exact engine, a padded batch) passes straight through to
the packed implementation. No model file is edited.

The logits at the response tokens. Each rank keeps the logits of the positions it holds
(`SequenceShard.local_predicting`, transformers' `logits_to_keep`), computes per-token values on them
(log-probs, entropy, top-k) and `SequenceShard.gather` all-gathers those values, so every rank of the
group reads the whole micro-batch's (B, R) values, the same as SP 1: the (N, V) logits never cross ranks.
The critic's value head reads its (n,) values at the same positions and gathers them the same way.

Gradients. Every collective here has its true adjoint as backward (an all-to-all's is the reverse
all-to-all; an all-gather's a reduce-scatter, summing). The SP ranks of a group compute the same loss
from the same gathered values, so autograd differentiates SP copies of each data-parallel group's loss:
the gradients summed over all ranks are SP times the data's. FSDP2 (sharded over the whole world, as at
SP 1: the weight sync's layout does not change) averages over the world's ranks, so the loop multiplies
each loss by the number of data-parallel groups (world / SP), not of ranks, and sums counts over the
data-parallel group (`SequenceParallel.data_group`): tests/unit/test_ulysses.py compares every
gradient with SP 1's and plants both faults.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridflow.training.packing import (PACKED_ATTENTION, ULYSSES_ATTENTION, PackedSequences, packed_attention,
                                         packed_mask)

SEQUENCE_PARALLEL = "sequence_parallel"  # the forward's keyword argument that carries the shard to attention


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place: `size` ranks per sequence-parallel group (consecutive ranks), `rank` its place in
    the group, `group` the group; `data_size` data-parallel groups (world / size) and `data_group` the ranks
    that hold the same place in every sequence-parallel group (each data-parallel group once)."""
    size: int
    rank: int
    group: dist.ProcessGroup
    data_size: int
    data_group: dist.ProcessGroup

    def shard(self, packed: PackedSequences) -> "SequenceShard":
        return SequenceShard.of(packed, self)


def build_sequence_parallel(rank: int, world: int, size: int) -> SequenceParallel | None:
    """Collective over the default group: the sequence-parallel groups of `size` consecutive ranks and the
    data-parallel groups across them (every rank builds every group, in the same order, as
    `torch.distributed.new_group` requires). None at size 1."""
    if size == 1:
        return None
    if world % size:
        raise ValueError(f"sequence_parallel_size={size} does not divide the {world} ranks of the group; "
                         f"use a divisor of {world}")
    mine = data = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    for place in range(size):
        group = dist.new_group(list(range(place, world, size)))
        if rank % size == place:
            data = group
    return SequenceParallel(size, rank % size, mine, world // size, data)


@dataclass(frozen=True)
class SequenceShard:
    """One packed micro-batch as rank `rank` of a sequence-parallel group computes it. The row of `length`
    real tokens is padded to `padded` (a multiple of the group's size) and this rank holds positions
    [rank * width, (rank + 1) * width). `local_predicting` (n,) are the positions of its slice whose logits
    predict response tokens (relative to the slice), `local_items` (n,) which of the packed row's N
    predicted tokens they are, `counts` how many each rank has, and `gather_index` (N,) where each of the
    N lands in the group's gathered (size x max(counts)) values."""
    sp: SequenceParallel
    packed: PackedSequences
    length: int
    padded: int
    width: int
    local_predicting: torch.Tensor
    local_items: torch.Tensor
    counts: tuple[int, ...]
    gather_index: torch.Tensor

    @classmethod
    def of(cls, packed: PackedSequences, sp: SequenceParallel) -> "SequenceShard":
        length = packed.input_ids.shape[1]
        width = -(-length // sp.size)
        predicting = packed.predicting.cpu()  # computed on the host like pack's indices: one read
        owner = torch.div(predicting, width, rounding_mode="floor")
        counts = torch.bincount(owner, minlength=sp.size)
        most = int(counts.max()) if len(predicting) else 0
        ranks_before = torch.zeros_like(owner)  # each item's place among its owner's items, in packed order
        for r in range(sp.size):
            at = (owner == r).nonzero().squeeze(1)
            ranks_before[at] = torch.arange(len(at))
        local_items = (owner == sp.rank).nonzero().squeeze(1)
        device = packed.input_ids.device
        return cls(sp, packed, length, width * sp.size, width,
                   (predicting[local_items] - sp.rank * width).to(device), local_items.to(device),
                   tuple(counts.tolist()), (owner * most + ranks_before).to(device))

    def model_kwargs(self) -> dict:
        """The packed forward's keyword arguments for this rank: its slice of the (padded) token ids and
        position ids, the whole row's sequence boundaries, and this shard for attention."""
        kwargs = self.packed.model_kwargs()
        start, end = self.sp.rank * self.width, (self.sp.rank + 1) * self.width
        for key in ("input_ids", "position_ids"):
            row = kwargs[key]
            if self.padded > self.length:  # pad tokens: id and position 0, cut off before attention
                row = torch.cat([row, row.new_zeros(1, self.padded - self.length)], dim=1)
            kwargs[key] = row[:, start:end]
        kwargs[SEQUENCE_PARALLEL] = self
        return kwargs

    def local(self, values: torch.Tensor) -> torch.Tensor:
        """(N, ...) values in packed order -> (n, ...) those of this rank's predicted tokens."""
        return values.index_select(0, self.local_items)

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """(n, ...) this rank's values -> (N, ...) the whole row's, in packed order, on every rank of the
        group; differentiable (the backward sums each rank's gradient for this rank's values)."""
        return _GatherItems.apply(values, self)


def logits_of(model: torch.nn.Module, shard: SequenceShard, takes_logits_to_keep: bool) -> torch.Tensor:
    """(n, V) logits at this rank's predicting positions, from one forward over its slice of the row."""
    kwargs = shard.model_kwargs()
    if takes_logits_to_keep:
        return model(**kwargs, use_cache=False, logits_to_keep=shard.local_predicting).logits[0]
    return model(**kwargs, use_cache=False).logits[0, shard.local_predicting]


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split `x` into the group's size along `scatter_dim`, send part k to rank k, and concatenate what
    every rank sent along `gather_dim`, in rank order; differentiable."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    sent = torch.stack(x.chunk(size, dim=scatter_dim))  # (size, ...) contiguous: part k goes to rank k
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):  # the adjoint: the reverse all-to-all
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), ctx.group, gather_dim, scatter_dim), None, None, None


class _GatherItems(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, shard: SequenceShard):
        ctx.shard = shard
        most = max(shard.counts)
        padded = values.new_zeros((most, *values.shape[1:]))
        padded[: len(values)] = values
        parts = [torch.empty_like(padded) for _ in range(shard.sp.size)]
        dist.all_gather(parts, padded, group=shard.sp.group)
        return torch.cat(parts).index_select(0, shard.gather_index)

    @staticmethod
    def backward(ctx, grad):  # the adjoint of an all-gather: each rank's part summed over the group
        shard = ctx.shard
        most = max(shard.counts)
        full = grad.new_zeros((shard.sp.size * most, *grad.shape[1:])).index_add_(0, shard.gather_index, grad)
        dist.all_reduce(full, group=shard.sp.group)
        start = shard.sp.rank * most
        return full[start: start + shard.counts[shard.sp.rank]], None


def ulysses_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature over this rank's slice: query (1, H, T/SP, D), key and value
    (1, H_kv, T/SP, D) -> ((1, T/SP, H, D), None); packed attention over the whole row in between, on
    H/SP heads. Without `SEQUENCE_PARALLEL` it is packed attention as it is."""
    shard: SequenceShard | None = kwargs.pop(SEQUENCE_PARALLEL, None)
    if shard is None:
        return packed_attention(module, query, key, value, attention_mask, **kwargs)
    group, length = shard.sp.group, shard.length
    for name, heads in (("attention", query.shape[1]), ("key/value", key.shape[1])):
        if heads % shard.sp.size:
            raise ValueError(f"{type(module).__name__} has {heads} {name} heads, which sequence_parallel_size="
                             f"{shard.sp.size} does not divide; use a divisor of {heads}")
    # (1, H, T/SP, D) -> (1, H/SP, T_padded, D) -> the real tokens only
    q, k, v = (all_to_all(t, group, 1, 2)[:, :, :length] for t in (query, key, value))
    out, _ = packed_attention(module, q, k, v, attention_mask, **kwargs)  # (1, T, H/SP, D)
    if shard.padded > length:
        out = torch.cat([out, out.new_zeros(1, shard.padded - length, *out.shape[2:])], dim=1)
    return all_to_all(out, group, 1, 2), None  # (1, T/SP, H, D)


_REGISTERED = False


def use_sequence_parallel(model: torch.nn.Module, sp: SequenceParallel) -> None:
    """Switch a model running packed attention to `ULYSSES_ATTENTION` (and its sub-configs) and attach
    `sp`, which `sequence_parallel` reads back; the caller checked that it runs packed."""
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention)
        AttentionMaskInterface.register(ULYSSES_ATTENTION, packed_mask)
        _REGISTERED = True
    base = _base(model)
    from transformers import PretrainedConfig

    configs = [base.config]
    while configs:
        config = configs.pop()
        if getattr(config, "_attn_implementation", None) == PACKED_ATTENTION:
            config._attn_implementation = ULYSSES_ATTENTION
        configs += [v for v in vars(config).values() if isinstance(v, PretrainedConfig)]
    base._hybridflow_sequence_parallel = sp


def split_sequences(model: torch.nn.Module, packed: bool, size: int, ctx, pack_setting: bool | None,
                    key: str = "actor.sequence_parallel_size") -> None:
    """A role's `sequence_parallel_size` (`key`, named in every refusal: the actor's and the reference's
    `actor.sequence_parallel_size`, `critic.` and `teacher.`'s own) applied to its loaded model (before FSDP2),
    refused where it cannot run: its groups built (collective over the default group) and its packed attention
    switched to `ULYSSES_ATTENTION`. `packed`: whether the model runs packed (`choose_packing`); `ctx`: the
    worker's context, whose `replica_size` must be `size` (the controller then hands every rank of a group the
    same rows); `pack_setting`: model.pack_sequences, named in the refusal."""
    if size == 1:
        return
    if ctx.replica_size != size:
        raise ValueError(f"{key}={size}, but this role's replicas span {ctx.replica_size} rank(s), so the ranks of "
                         "a sequence-parallel group would get different rows; build the role with recipes/roles.py "
                         "(its RoleSpec's replica_size is the group's size)")
    if not packed:
        raise ValueError(f"{key}={size} splits packed rows, and this model runs padded (model.pack_sequences="
                         f"{pack_setting}, or the model cannot pack); the padded path runs at {key}=1 only in this "
                         "release")
    config = _base(model).config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % size or kv_heads % size:
        raise ValueError(f"{key}={size} must divide the model's {heads} attention heads and {kv_heads} key/value "
                         f"heads ({heads} % {size} = {heads % size}, {kv_heads} % {size} = {kv_heads % size}); use a "
                         "common divisor of them")
    use_sequence_parallel(model, build_sequence_parallel(ctx.rank, ctx.world_size, size))


def sequence_parallel(model: torch.nn.Module) -> SequenceParallel | None:
    """The model's sequence-parallel place (`use_sequence_parallel`), or None (SP 1)."""
    return getattr(_base(model), "_hybridflow_sequence_parallel", None)


def data_parallel_size(model: torch.nn.Module, world: int) -> int:
    """The data-parallel groups of a model on `world` ranks: `world` / its sequence-parallel size."""
    sp = sequence_parallel(model)
    return world if sp is None else sp.data_size


def data_group(model: torch.nn.Module) -> dist.ProcessGroup | None:
    """The group to sum the data's counts and losses over, each sequence-parallel group once (None: the
    whole world, every rank its own rows)."""
    sp = sequence_parallel(model)
    return None if sp is None else sp.data_group


def _base(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model
