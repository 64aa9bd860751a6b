"""Packed sequences: a micro-batch's real tokens in one row, attention kept inside each sequence.

A padded micro-batch computes every column up to its longest prompt and response for every row;
in a GRPO batch whose lengths vary that is 40-50% padding (docs/results/gpu.md "On a GPU").
Packed, the model sees one row of T real tokens (the rows' prompt and response tokens,
concatenated), positions that restart at 0 for each sequence, and attention that never crosses
a sequence boundary, so every matrix product runs on real tokens only. The results are the
padded path's: the same tokens, the same positions, the same causal attention within each
sequence (tests/unit/test_packing.py, for every architecture in the zoo).

How the model learns the boundaries. transformers routes attention through
`AttentionInterface` and passes the forward's extra keyword arguments down to it. A training
worker's model is switched (`use_packed_attention`) to one attention implementation,
`PACKED_ATTENTION`, which attends within the sequences that `cu_seq_lens_q` (cumulative lengths,
the flash-attention convention transformers uses too) delimits when the forward passes it, and
is the model's own implementation (sdpa) when it does not (the padded path, generation). The
switch is permanent, not per call, so that activation checkpointing's recomputation in the
backward pass takes the same path as the forward did. Its mask function builds no mask for a
packed call (a T x T mask is what packing avoids) and is sdpa's otherwise.

Kernels. On CUDA in a 16-bit dtype, PyTorch's variable-length flash attention
(`torch.nn.attention.varlen.varlen_attn`) takes the whole packed row at once. Elsewhere (the CPU,
float32, dropout) the sequences are laid out right-padded for one causal
`scaled_dot_product_attention` call and read back: attention alone runs padded (n x L^2, nothing
quadratic in T), the projections and the MLP on real tokens only. flash-attention's own package
(transformers' `flash_attention_2`) would do the CUDA part too, but it needs a CUDA build step that
the machines here cannot do; PyTorch's kernel is the same algorithm and is already installed.

Not packed: a model whose attention is not sdpa (transformers picks eager for a few
architectures), attention with logit soft-capping, and a model with an active sliding window
(Mistral's; Qwen2's is off by `use_sliding_window`): `packing_unsupported` names the reason;
`model.pack_sequences` left null then stays padded, and `true` refuses at start.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from hybridflow.batch import host_to_device
from hybridflow.training.shared_prompts import (SHARED_PROMPTS, SharedPrompts, prompt_groups, shared_attention,
                                                shared_layout, shared_varlen_attention)

PACKED_ATTENTION = "hybridflow_packed"
# packed attention with the row split over a sequence-parallel group: registered by hybridflow/training/ulysses.py,
# which wraps `packed_attention`; a model switched to it runs packed as well
ULYSSES_ATTENTION = "hybridflow_packed_ulysses"
PACKED_IMPLEMENTATIONS = (PACKED_ATTENTION, ULYSSES_ATTENTION)


@dataclass(frozen=True)
class PackedSequences:
    """One micro-batch packed: `input_ids` and `position_ids` (1, T); `cu_seq_lens` (n + 1,) int32,
    the cumulative lengths of the n non-empty sequences; `max_length` the longest; `predicting`
    (N,) the packed positions whose logits predict the N response tokens (row-major order of
    the response mask); `response_index` (N,) where those tokens sit in the flattened (B, R)
    response, and `response_shape` (B, R), to gather and scatter them."""
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seq_lens: torch.Tensor
    max_length: int
    predicting: torch.Tensor
    response_index: torch.Tensor
    response_shape: tuple[int, int]
    shared: SharedPrompts | None = None

    def model_kwargs(self) -> dict:
        if self.shared is not None:  # virtual sequences (hybridflow/training/shared_prompts.py)
            s = self.shared
            return {"input_ids": self.input_ids, "position_ids": self.position_ids,
                    "cu_seq_lens_q": s.cu_seq_lens_q, "cu_seq_lens_k": s.cu_seq_lens_k,
                    "max_length_q": s.max_length_q, "max_length_k": s.max_length_k, SHARED_PROMPTS: s}
        return {"input_ids": self.input_ids, "position_ids": self.position_ids,
                "cu_seq_lens_q": self.cu_seq_lens, "cu_seq_lens_k": self.cu_seq_lens,
                "max_length_q": self.max_length, "max_length_k": self.max_length}

    def gather(self, response_values: torch.Tensor) -> torch.Tensor:
        """(B, R, ...) -> (N, ...): the values at the response tokens, in packed order."""
        return response_values.reshape(-1, *response_values.shape[2:]).index_select(0, self.response_index)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """(N, ...) values at the response tokens -> (B, R, ...) with zeros past every response."""
        rows, width = self.response_shape
        out = values.new_zeros((rows * width, *values.shape[1:])).index_copy(0, self.response_index, values)
        return out.view(rows, width, *values.shape[1:])


def pack(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
         response_mask: torch.Tensor, share: bool = False) -> PackedSequences | None:
    """The real tokens of a left-padded prompt + right-padded response batch as one packed row, or
    None when a row has response tokens but no prompt token (its first response token would be
    predicted by the previous row's last token; the padded path serves such a batch). With `share`,
    rows with equal prompt tokens have their prompt once (hybridflow/training/shared_prompts.py).

    The masks are read to the host once and every index is computed there, then sent to the
    device in one copy: on a GPU, boolean-mask indexing and `int()` each make the host wait for the
    device, and a micro-batch had nine such waits here (bench/gpu_check.py --diagnose)."""
    device = prompt_ids.device
    prompt_width = prompt_ids.shape[1]
    host = torch.cat([prompt_mask.long(), response_mask.long(), *([prompt_ids.long()] if share else [])], dim=1)
    host = host.cpu()  # the one wait
    mask = host[:, :prompt_width + response_mask.shape[1]].bool()
    host_prompt, host_response = mask[:, :prompt_width], mask[:, prompt_width:]
    if bool((host_response.any(dim=1) & ~host_prompt.any(dim=1)).any()):
        return None
    if share:
        packed = _pack_shared(prompt_ids, response_ids, host_prompt, host_response,
                              prompt_groups(host[:, mask.shape[1]:], host_prompt))
        if packed is not None:
            return packed
    positions = mask.long().cumsum(dim=1) - 1
    tokens = mask.reshape(-1).nonzero().squeeze(1)  # where each real token sits in the flattened (B, P+R)
    packed_index = (mask.reshape(-1).long().cumsum(dim=0) - 1).view(mask.shape)  # where each real token lands
    lengths = mask.sum(dim=1)
    lengths = lengths[lengths > 0]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.long)
    cu[1:] = lengths.cumsum(dim=0)
    predicting = packed_index[:, prompt_width:][host_response] - 1  # the token before each response token
    response_index = host_response.reshape(-1).nonzero().squeeze(1)
    parts = (tokens, positions.reshape(-1)[tokens], cu, predicting, response_index)
    on_device = host_to_device(torch.cat(parts), device).split([len(p) for p in parts])
    ids = torch.cat([prompt_ids, response_ids], dim=1).reshape(-1)
    return PackedSequences(input_ids=ids.index_select(0, on_device[0])[None], position_ids=on_device[1][None],
                           cu_seq_lens=on_device[2].to(torch.int32), max_length=int(lengths.max()) if len(lengths) else 0,
                           predicting=on_device[3], response_index=on_device[4],
                           response_shape=(response_mask.shape[0], response_mask.shape[1]))


def _pack_shared(prompt_ids: torch.Tensor, response_ids: torch.Tensor, host_prompt: torch.Tensor,
                 host_response: torch.Tensor, groups: list[int]) -> PackedSequences | None:
    """`pack` with each group's prompt once (`shared_layout`); None where nothing is shared."""
    from hybridflow.training.shared_prompts import on_device

    layout = shared_layout(host_prompt, host_response, groups)
    if layout is None:
        return None
    tokens, positions, predicting, parts = layout
    response_index = host_response.reshape(-1).nonzero().squeeze(1)
    device = prompt_ids.device
    flat = (tokens, positions, predicting, response_index)
    moved = host_to_device(torch.cat(flat), device).split([len(t) for t in flat])
    ids = torch.cat([prompt_ids, response_ids], dim=1).reshape(-1)
    shared = on_device(parts, device)
    return PackedSequences(input_ids=ids.index_select(0, moved[0])[None], position_ids=moved[1][None],
                           cu_seq_lens=shared.cu_seq_lens_q, max_length=shared.max_length_q, predicting=moved[2],
                           response_index=moved[3], response_shape=tuple(host_response.shape), shared=shared)


def packing_unsupported(model: torch.nn.Module) -> str | None:
    """Why `model` cannot run packed (None: it can): its attention implementation or config."""
    config = _config(model)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("sdpa", *PACKED_IMPLEMENTATIONS):
        return (f"its attention implementation is {implementation!r} (packing wraps sdpa; transformers "
                f"chose {implementation!r} for {type(config).__name__})")
    for sub in _configs(config):
        if getattr(sub, "attn_logit_softcapping", None):
            return f"{type(sub).__name__}.attn_logit_softcapping={sub.attn_logit_softcapping} (soft-capped attention)"
        if getattr(sub, "sliding_window", None) and getattr(sub, "use_sliding_window", True) is not False:
            return f"{type(sub).__name__}.sliding_window={sub.sliding_window} (attention within a window)"
    return None


def runs_packed(model: torch.nn.Module) -> bool:
    """Whether `model` was switched to packed attention (`use_packed_attention`): its forwards in
    `hybridflow.training.sequences` and the critic then pack every micro-batch."""
    return getattr(_config(model), "_attn_implementation", None) in PACKED_IMPLEMENTATIONS


def choose_packing(model: torch.nn.Module, setting: bool | None) -> bool:
    """`model.pack_sequences` for a loaded model: None (auto) packs wherever the model can, True
    insists (an unsupported model is an error naming why), False keeps the padded path. Switches the
    model when it packs; returns whether it does."""
    reason = packing_unsupported(model)
    if setting is True and reason:
        raise ValueError(f"model.pack_sequences=true, but this model cannot run packed: {reason}; "
                         "set model.pack_sequences=false (or null: packed where the model allows)")
    if setting is False or reason:
        return False
    use_packed_attention(model)
    return True


def use_packed_attention(model: torch.nn.Module) -> None:
    """Switch `model` (and its sub-configs) to `PACKED_ATTENTION`; callers check `packing_unsupported`."""
    _register()
    for sub in _configs(_config(model)):
        if getattr(sub, "_attn_implementation", None) in ("sdpa", PACKED_ATTENTION):
            sub._attn_implementation = PACKED_ATTENTION


def _config(model: torch.nn.Module):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.config


def _configs(config) -> list:
    from transformers import PretrainedConfig

    subs = [value for value in vars(config).values() if isinstance(value, PretrainedConfig)]
    return [config, *[s for sub in subs for s in _configs(sub)]]


_REGISTERED = False


def _register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, packed_mask)
    _REGISTERED = True


def packed_mask(*args, attention_mask=None, **kwargs):
    """The mask function of packed attention: no 2D mask for a packed call (its sequences come as
    cu_seq_lens) or an unpadded one (causal); sdpa's for a padded batch."""
    from transformers.masking_utils import sdpa_mask

    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     sliding_window: int | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                     max_length_q: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query (1, H, T, D), key and value (1, H_kv, T, D) ->
    ((1, T, H, D), None). Without `cu_seq_lens_q` it is transformers' sdpa."""
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one packed row, got a batch of {query.shape[0]}")
    dropout = dropout if module.training else 0.0
    span = max(max_length_q or 0, kwargs.get("max_length_k") or 0)  # shared prompts: keys run longer
    if sliding_window is not None and span > sliding_window:
        raise ValueError(f"a packed sequence of {span} tokens is longer than the model's sliding window "
                         f"({sliding_window}); set model.pack_sequences=false for this model")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads in a row
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    shared = kwargs.get(SHARED_PROMPTS)
    if shared is not None:  # shared prompts: virtual sequences (hybridflow/training/shared_prompts.py)
        if _varlen_serves(query, dropout, scaling) and "window_size" in _VARLEN_PARAMS:
            return shared_varlen_attention(query, key, value, shared, scaling, _varlen_keys), None
        return shared_attention(query, key, value, shared, scaling, dropout), None
    if kwargs.get("cu_seq_lens_k") is not None and kwargs["cu_seq_lens_k"] is not cu_seq_lens_q:
        raise ValueError(f"{type(module).__name__} passed packed attention cu_seq_lens_k but not `{SHARED_PROMPTS}`: "
                         "this model's layers drop keyword arguments; set model.share_prompts=false")
    if _varlen_serves(query, dropout, scaling):
        out = _varlen(*(t[0].transpose(0, 1).contiguous() for t in (query, key, value)),
                      cu_seq_lens_q, int(max_length_q), scaling)  # (T, H, D)
        return out[None], None
    longest = int(max_length_q) if max_length_q is not None else int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
    return _padded_attention(query, key, value, cu_seq_lens_q, longest, scaling, dropout), None


def _padded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_lens: torch.Tensor,
                      longest: int, scaling: float | None, dropout: float) -> torch.Tensor:
    """Attention of packed (1, H, T, D) tensors as one `scaled_dot_product_attention` call: the
    sequences laid out right-padded in (n, H, L, D), causal, and read back (1, T, H, D). Right
    padding under a causal mask changes no real token's output (a real query sees only earlier
    positions of its own row), so only attention runs padded; the projections and the MLP ran on
    the T real tokens. One call rather than one per sequence: on the CPU a call per sequence and
    layer made the tiny model's 128-row SFT step 1.6x slower than padded (bench/sft_step.py). `longest`
    is the longest sequence (the caller's `max_length_q`), given so that nothing reads the device."""
    lengths = cu_seq_lens[1:] - cu_seq_lens[:-1]
    sequence = torch.repeat_interleave(torch.arange(len(lengths), device=query.device), lengths.long(),
                                       output_size=query.shape[2])  # sizes given: no wait for the device
    position = torch.arange(query.shape[2], device=query.device) - cu_seq_lens[:-1].long()[sequence]

    def laid_out(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(len(lengths), x.shape[1], longest, x.shape[3])
        out[sequence, :, position] = x[0].transpose(0, 1)  # (T, H, D) into each row's first positions
        return out

    attended = torch.nn.functional.scaled_dot_product_attention(
        laid_out(query), laid_out(key), laid_out(value), dropout_p=dropout, scale=scaling, is_causal=True)
    return attended[sequence, :, position][None]  # (1, T, H, D)


def _find_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


# PyTorch's kernel and its keyword arguments, looked up by the first CUDA call: importing it pulls in
# torch._dynamo (1.6 s on a 2-core CPU), which no CPU run and no driver needs. None: not available.
_VARLEN = _UNSET = object()
_VARLEN_PARAMS: frozenset = frozenset()


def varlen_kernel():
    """`torch.nn.attention.varlen.varlen_attn`, or None where this PyTorch has none (looked up once)."""
    global _VARLEN, _VARLEN_PARAMS
    if _VARLEN is _UNSET:
        _VARLEN = _find_varlen()
        _VARLEN_PARAMS = frozenset(inspect.signature(_VARLEN).parameters) if _VARLEN is not None else frozenset()
    return _VARLEN


def _varlen_serves(query: torch.Tensor, dropout: float, scaling: float | None) -> bool:
    """Whether PyTorch's flash kernel takes this call: CUDA, a 16-bit dtype, no dropout, and a scale
    it can be told (releases before `scale` existed apply 1/sqrt(head_dim) only)."""
    if not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16) or dropout:
        return False
    if varlen_kernel() is None:
        return False
    params = _VARLEN_PARAMS
    if "window_size" not in params and "is_causal" not in params:
        return False  # a release whose causal switch is unknown here: the padded layout is causal for sure
    default = scaling is None or abs(scaling - query.shape[-1] ** -0.5) < 1e-9
    return default or "scale" in params


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_length: int,
            scale: float | None) -> torch.Tensor:
    """PyTorch's variable-length flash attention, causal, over (T, H, D) tensors. Its causal switch
    changed name between releases (`is_causal` in 2.9-2.11, `window_size=(-1, 0)` later)."""
    return _varlen_keys(q, k, v, cu, cu, max_length, max_length, scale)


def _varlen_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                 max_q: int, max_k: int, scale: float | None) -> torch.Tensor:
    """`_varlen` with key sequences of their own (longer than the queries': causal at the bottom right,
    flash attention's convention for `window_size`; shared prompts call it only where that is the switch)."""
    params = _VARLEN_PARAMS
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    extra = {"scale": scale} if "scale" in params else {}
    return _VARLEN(q, k, v, cu_q, cu_k, max_q, max_k, **causal, **extra)
