"""vLLM's CPU LoRA products, one matmul per adapter in the batch; prompt logprobs under each
request's own adapter.

Why: vLLM's torch kernels for CPU (vllm/lora/ops/torch_ops, used by punica_cpu) gather every
token's adapter matrices into a [tokens, out, in] copy before one einsum: for a batch on one
adapter that is a copy of the adapter per token, per linear, per step. Grouping the tokens by
adapter computes the same products without the copies, and gives a token of no adapter (index
-1) nothing, where vLLM's picked the last slot's adapter. `install()` replaces those kernels in the
process that runs the model (vLLM's worker imports services/vllm_worker.py, which installs it).

Prompt logprobs: vLLM computes a request's prompt logits through the LoRA head with the adapter
indices of the batch's sampled rows (one per request), not of that request's prompt rows: the
logits of another adapter, or a shape error that kills the engine. `_prompt_logprobs_per_request`
runs vLLM's own code one request at a time with the head's indices set to that request's adapter.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.lora.ops.torch_ops import lora_ops
from vllm.lora.punica_wrapper import punica_cpu
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

_vllm_prompt_logprobs = GPUModelRunner._get_prompt_logprobs_dict


def _products(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """inputs [tokens, in] times the adapter matrix each token's index picks (weights [slots, (1,)
    out, in]); a token of index -1 (no adapter) gets zeros. vLLM's own CPU kernels index the last
    slot with -1, which holds an adapter whenever every slot is in use: a base-model request
    batched with an adapter's then ran under that adapter."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    inputs = inputs.to(dtype)
    slots = indices.unique().tolist()
    if len(slots) == 1 and slots[0] >= 0:
        return inputs @ weights[slots[0]].to(dtype).T
    out = inputs.new_zeros(inputs.shape[0], weights.shape[1])
    for slot in slots:
        if slot >= 0:
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


def _prompt_logprobs_per_request(runner: Any, hidden_states: torch.Tensor, num_scheduled_tokens: dict[str, int]):
    wanted = runner.num_prompt_logprobs
    manager = getattr(runner.model, "lora_manager", None)
    if not wanted or manager is None:
        return _vllm_prompt_logprobs(runner, hidden_states, num_scheduled_tokens)
    punicas = list(manager.punica_wrapper_mapping.values())
    saved = [(p._sampler_indices[0].clone(), p.indices_len[1]) for p in punicas]
    out = {}
    try:
        for req_id, k in list(wanted.items()):
            at = runner.input_batch.req_id_to_index.get(req_id)
            if at is not None and req_id in num_scheduled_tokens:
                first_token = int(runner.query_start_loc.np[at])
                for p in punicas:  # the head's rows: this request's prompt, under its own adapter
                    p._sampler_indices[0] = p._token_lora_indices[first_token]
                    p.indices_len[1] = 1
            one = {req_id: k}
            runner.num_prompt_logprobs = one
            out.update(_vllm_prompt_logprobs(runner, hidden_states, num_scheduled_tokens))
            if not one:  # vLLM drops a request whose prompt is done
                del wanted[req_id]
    finally:
        runner.num_prompt_logprobs = wanted
        for p, (first, length) in zip(punicas, saved):
            p._sampler_indices[0], p.indices_len[1] = first, length
    return out


def install() -> None:
    for module in (lora_ops, punica_cpu):  # sgmv_* call lora_ops' names; punica_cpu imported its own
        for kernel in (bgmv_shrink, bgmv_expand, bgmv_expand_slice):
            setattr(module, kernel.__name__, kernel)
    GPUModelRunner._get_prompt_logprobs_dict = _prompt_logprobs_per_request
