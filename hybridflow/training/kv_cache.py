"""The KV cache of the engines that decode with a Hugging Face module (the hf engine, workers/rollout/hf_rollout.py;
the exact engine and the actor's π_old pass beside it, hybridflow/training/exact_layout.py): one buffer per layer for keys and one for values,
allocated once per batch at the batch's full size (rows x (prompt + rollout.max_response_tokens) positions, what
the memory model prices: hybridflow/checks/memory_budget.py), written in place by each step. Through
transformers' cache interface (`Cache` of layers), so any model that takes `past_key_values` decodes over it.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch
from transformers.cache_utils import Cache, DynamicLayer

from hybridflow.training.sequences import takes_logits_to_keep


class _PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in buffers allocated once at their full size, (B, H, T, D) for the batch's rows
    and every position it can reach: a step writes its token's keys and values in place, where `DynamicLayer`
    concatenates (a copy of the whole layer's cache each step, and memory the allocator must find again). Attention
    reads the filled part only, `keys` being a view of the live rows' first `length` positions — not the padded
    full length a `StaticLayer` hands it (on the CPU attention's cost is then that of the tokens there are). Ended
    rows leave by moving the live ones to the front (`batch_select_indices`), the rows behind them given back to the
    system (`release_rows`: the resident cache is the live rows', as `DynamicLayer`'s was). A subclass of `DynamicLayer`, so that
    transformers builds the masks as for a growing cache (kv length = positions filled + the query's)."""

    def __init__(self, positions: int) -> None:
        super().__init__()
        self.positions, self.length = positions, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        rows, heads = key_states.shape[:2]
        self.dtype, self.device = key_states.dtype, key_states.device
        # (B, H, T, D): empty, not zeroed: a position is read only after a step has written it
        self._keys = key_states.new_empty((rows, heads, self.positions, key_states.shape[-1]))
        self._values = value_states.new_empty((rows, value_states.shape[1], self.positions, value_states.shape[-1]))
        self.keys, self.values = self._keys[:, :, :0], self._values[:, :, :0]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, end = key_states.shape[0], self.length + key_states.shape[-2]
        self._keys[:rows, :, self.length:end] = key_states
        self._values[:rows, :, self.length:end] = value_states
        self.length = end
        self.keys, self.values = self._keys[:rows, :, :end], self._values[:rows, :, :end]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """The rows `indices` (ascending) moved to the front of the buffers, in that order."""
        if not self.is_initialized:
            return
        rows = len(indices)
        self._keys[:rows, :, :self.length] = self.keys[indices]  # the right side is a copy: no overlap
        self._values[:rows, :, :self.length] = self.values[indices]
        self.keys, self.values = self._keys[:rows, :, :self.length], self._values[:rows, :, :self.length]
        release_rows(self._keys, rows)
        release_rows(self._values, rows)


_MADV_DONTNEED = 4  # Linux's madvise advice: the range's pages dropped, read back as zeros if touched again
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def release_rows(buffer: torch.Tensor, rows: int) -> None:
    """The host memory of `buffer`'s rows from `rows` on (a contiguous CPU buffer whose first dimension is the batch's
    rows) given back to the system (Linux `madvise(MADV_DONTNEED)`), the buffer kept: a batch's ended rows' keys and
    values are never read again, and the pages they had written would otherwise stay resident until the batch's
    cache is freed — the whole batch's tokens by its end, where transformers' `DynamicCache` held the live rows'
    only. Whole pages inside the range only; elsewhere (a GPU, another system) nothing."""
    if _libc is None or buffer.device.type != "cpu" or not buffer.is_contiguous() or rows >= len(buffer):
        return
    begin = buffer.data_ptr() + rows * buffer.stride(0) * buffer.element_size()
    end = buffer.data_ptr() + buffer.numel() * buffer.element_size()
    begin = -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE
    end = end // mmap.PAGESIZE * mmap.PAGESIZE
    if end > begin and _libc.madvise(ctypes.c_void_p(begin), ctypes.c_size_t(end - begin), _MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) of an ended row's KV cache pages failed")


def prefill_logits(model, prompt_ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor,
                   cache: Cache) -> torch.Tensor:
    """(B, V) the logits after the last prompt position, the prompt's keys and values into `cache`. Only that
    position's logits are computed (`logits_to_keep=1`) where the model takes it; elsewhere the last position is
    copied out so that no view keeps the (B, P, V) tensor alive through decoding."""
    inputs = dict(input_ids=prompt_ids, attention_mask=attention, position_ids=positions, past_key_values=cache,
                  use_cache=True)
    if takes_logits_to_keep(model):
        return model(**inputs, logits_to_keep=1).logits[:, -1]  # (B, 1, V) computed
    return model(**inputs).logits[:, -1].clone()


def preallocated_cache(model, positions: int) -> Cache:
    """A KV cache for `model` of one preallocated layer per decoder layer, each holding `positions` tokens (the
    prompt's width + rollout.max_response_tokens) for the batch of its first update."""
    layers = model.config.get_text_config().num_hidden_layers
    return Cache(layers=[_PreallocatedLayer(positions) for _ in range(layers)])


class LiveRowSteps:
    """A batch's forward passes over a preallocated cache, the live rows only: `prefill` once, then `next` per
    step with the live rows' tokens; `drop` keeps the rows `keep` (the cache's and the mask's rows moved to the
    front). The CPU's, and a GPU's where the step is not captured."""

    def __init__(self, model, prompt_mask: torch.Tensor, positions: int) -> None:
        rows, self.filled = prompt_mask.shape
        self.model, self.cache = model, preallocated_cache(model, positions)
        self.attention = prompt_mask.new_zeros((rows, positions), dtype=torch.long)  # (B, T): True = attend
        self.attention[:, :self.filled] = prompt_mask

    def prefill(self, prompt_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(B, V) the logits after the last prompt position (`prefill_logits`)."""
        return prefill_logits(self.model, prompt_ids, self.attention[:, :self.filled], positions, self.cache)

    def next(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """(L, V) the next logits of the live rows, given their tokens (L,) at their positions (L, 1)."""
        live = len(token)
        self.attention[:live, self.filled] = 1
        self.filled += 1
        return self.model(input_ids=token[:, None], attention_mask=self.attention[:live, :self.filled],
                          position_ids=position, past_key_values=self.cache, use_cache=True).logits[:, -1]

    def drop(self, keep: torch.Tensor) -> None:
        self.cache.batch_select_indices(keep)
        self.attention[:len(keep)] = self.attention[keep]


class CapturedSteps:
    """A batch's forward passes at one fixed shape, so that a GPU replays one captured graph per step (torch.compile,
    mode reduce-overhead: CUDA graphs): transformers' `StaticCache` of `positions` for `capacity` rows, the attention
    mask (capacity, T) at its full width, ended rows still in the batch (their tokens padding, their logits not read)
    and a batch of fewer rows padded with copies of its first — as vLLM pads a batch to the size its graph was
    captured at. The cache and the compiled model are the engine's, kept across batches and calls (a new cache is
    new tensors, which the compiled step guards on). Given the model itself as `compiled`, the same steps run
    eagerly: the CPU's check of everything but the capture."""

    def __init__(self, model, compiled, cache, capacity: int, positions: int, prompt_mask: torch.Tensor,
                 pad_token_id: int) -> None:
        rows, self.filled = prompt_mask.shape
        self.model, self.compiled, self.cache, self.pad_token_id = model, compiled, cache, pad_token_id
        self.cache.reset()
        self.padded = torch.cat([torch.arange(rows), torch.zeros(capacity - rows, dtype=torch.long)]).to(prompt_mask.device)
        self.attention = prompt_mask.new_zeros((capacity, positions), dtype=torch.long)  # (C, T): True = attend
        self.attention[:, :self.filled] = prompt_mask[self.padded]
        self.live = torch.arange(rows, device=prompt_mask.device)  # the batch's rows still decoding
        self.position = torch.zeros((capacity, 1), dtype=torch.long, device=prompt_mask.device)
        self.token = torch.full((capacity,), pad_token_id, dtype=torch.long, device=prompt_mask.device)

    def prefill(self, prompt_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(B, V) the batch's rows' logits; the padding rows' prompts are the first row's."""
        return prefill_logits(self.model, prompt_ids[self.padded], self.attention, positions[self.padded],
                              self.cache)[:len(prompt_ids)]

    def next(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        self.token.fill_(self.pad_token_id).index_copy_(0, self.live, token)
        self.position.index_copy_(0, self.live, position)
        self.attention[:, self.filled] = 1
        self.filled += 1
        if self.compiled is not self.model:
            torch.compiler.cudagraph_mark_step_begin()  # the last replay's logits are read before this one
        logits = self.compiled(input_ids=self.token[:, None], attention_mask=self.attention,
                               position_ids=self.position, past_key_values=self.cache, use_cache=True).logits
        return logits[self.live, -1]  # (L, V) a copy: the graph's output buffer is rewritten by the next replay

    def drop(self, keep: torch.Tensor) -> None:
        self.live = self.live[keep]


def free_storage(cache: Cache) -> None:
    """A StaticCache's memory returned, its tensors kept: the captured step guards on those very tensors (transformers
    marks them static), so a new cache would compile again, where a new address only records the graph again."""
    for layer in cache.layers:
        if layer.is_initialized:
            layer.keys.untyped_storage().resize_(0)
            layer.values.untyped_storage().resize_(0)


def refill_storage(cache: Cache) -> None:
    """The memory `free_storage` returned allocated again (its values are rewritten by the next prefill)."""
    for layer in cache.layers:
        if layer.is_initialized:
            for t in (layer.keys, layer.values):
                t.untyped_storage().resize_(t.numel() * t.element_size())
