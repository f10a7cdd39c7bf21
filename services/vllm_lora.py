"""vLLM's CPU LoRA products, one matmul per adapter in the batch.

Why: vLLM's torch kernels for CPU (vllm/lora/ops/torch_ops, used by punica_cpu) gather every
token's adapter matrices into a [tokens, out, in] copy before one einsum: for a batch on one
adapter that is a copy of the adapter per token, per linear, per step. Grouping the tokens by
adapter computes the same products without the copies. `install()` replaces those kernels in the
process that runs the model (vLLM's worker imports services/vllm_worker.py, which installs it).
"""

from __future__ import annotations

import torch
from vllm.lora.ops.torch_ops import lora_ops
from vllm.lora.punica_wrapper import punica_cpu


def _products(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """inputs [tokens, in] times the adapter matrix each token's index picks (weights [slots, (1,)
    out, in]), as vLLM's kernels index it (-1, no adapter, picks the last slot, which stays zero)."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    inputs = inputs.to(dtype)
    slots = indices.unique()
    if slots.numel() == 1:
        return inputs @ weights[slots[0]].to(dtype).T
    out = inputs.new_empty(inputs.shape[0], weights.shape[1])
    for slot in slots:
        picked = indices == slot
        out[picked] = inputs[picked] @ weights[slot].to(dtype).T
    return out


def bgmv_shrink(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    outputs = _products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    outputs = _products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    common = min(outputs.shape[1], output_tensor.shape[1])  # the adapter and the model may pad differently
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    outputs = _products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs


def install() -> None:
    for module in (lora_ops, punica_cpu):  # sgmv_* call lora_ops' names; punica_cpu imported its own
        for kernel in (bgmv_shrink, bgmv_expand, bgmv_expand_slice):
            setattr(module, kernel.__name__, kernel)
