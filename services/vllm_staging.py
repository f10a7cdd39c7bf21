"""New weights prepared beside a live vLLM model, then installed between two engine steps.

vLLM's `reload_weights` restores each layer to checkpoint format, loads it, and re-runs the
layer's post-load processing (on CPU: oneDNN packs every linear weight into a handler) while
generation waits. `stage` runs those same steps on a shadow of the model, which shares the
live modules' code and configuration but has tensors of its own, while generation goes on;
`commit` then installs the results: a copy into each live tensor (as vLLM's reload ends) and
the attributes processing set (such as `cpu_linear`, the packed handler). It relies on what
vLLM's layerwise reload records for each layer (`LAYERWISE_INFO`), so it runs wherever
`reload_weights` does; a model it cannot stage raises StageError, and the caller reloads in
place instead.

Runs in vLLM's worker process (services/vllm_worker.py): torch and vLLM only.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from types import MethodType

import torch
from torch import nn

_MODULE_SLOTS = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


class StageError(RuntimeError):
    """The new weights could not be staged beside the model (reload in place instead)."""


class Staged:
    """A model's new weights, processed, waiting for `commit`: (live layer, shadow) pairs."""

    def __init__(self, pairs: list[tuple[nn.Module, nn.Module]]):
        self.pairs = pairs


def _skeleton(live: nn.Module, pairs: dict[nn.Module, nn.Module]) -> nn.Module:
    """A shallow copy of the module tree with containers of its own: tensors put in the
    shadow never reach the live modules."""
    sh = copy.copy(live)
    sh._parameters, sh._buffers = dict(live._parameters), dict(live._buffers)
    sh._non_persistent_buffers_set = set(live._non_persistent_buffers_set)
    sh._modules = {n: (_skeleton(c, pairs) if c is not None else None) for n, c in live._modules.items()}
    pairs[live] = sh
    return sh


def _shadow_tensor(t: torch.Tensor, live: nn.Module, shadow: nn.Module, device) -> torch.Tensor:
    """An empty tensor like `t` (class and attributes kept), with the weight loaders that are
    bound to the live layer (or to vLLM's stand-in for it) bound to the shadow."""
    from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor, to_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    m = to_meta_tensor(t)  # a copy of its __dict__: vLLM's stored metadata stays as it is
    if getattr(getattr(m, "weight_loader", None), "__name__", "") == "online_process_loader":
        m.weight_loader = _get_original_loader(m)  # a wrapper a previous in-place reload left
    for k, v in list(m.__dict__.items()):
        if isinstance(v, MethodType) and (v.__self__ is layer_ref_sentinel or v.__self__ is live):
            m.__dict__[k] = v.__func__.__get__(shadow)
    with device:
        return materialize_meta_tensor(m)


def _by_layer(weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Checkpoint entries grouped by decoder layer (`*.layers.N.*`), in first-seen order."""
    groups: dict[str, list] = {}
    for name, t in weights:
        groups.setdefault(_layer_of(name), []).append((name, t))
    return [item for group in groups.values() for item in group]


def _layer_of(name: str) -> str:
    parts = name.split(".")
    for i in range(len(parts) - 1):
        if parts[i] == "layers" and parts[i + 1].isdigit():
            return ".".join(parts[: i + 2])
    return ""


def _shadow_tensors(pairs: dict[nn.Module, nn.Module]) -> None:
    """Give each shadow layer empty checkpoint-format tensors of its own, from the metadata
    vLLM recorded at load time; tied parameters (a tied lm_head) share one shadow tensor."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import SKIP_MODULES, SKIP_TENSORS

    first: dict[int, torch.Tensor] = {}
    for live, sh in pairs.items():
        info = LAYERWISE_INFO.get(live)
        if info is None or type(live).__name__ in SKIP_MODULES:
            continue
        restore_params, restore_buffers = info.restore_metadata
        for name, meta in restore_params.items():
            if name in SKIP_TENSORS:
                continue
            lp = live._parameters.get(name)
            if lp is not None and id(lp) in first:
                sh._parameters[name] = first[id(lp)]
                continue
            sh._parameters[name] = _shadow_tensor(meta, live, sh, info.restore_device)
            if lp is not None:
                first[id(lp)] = sh._parameters[name]
        for name, meta in restore_buffers.items():
            if name not in SKIP_TENSORS:
                sh._buffers[name] = _shadow_tensor(meta, live, sh, info.restore_device)
        bias = live._parameters.get("bias")
        if bias is not None:  # vLLM's reload loads biases in place; here they get a copy of their own
            sh._parameters["bias"] = _shadow_tensor(bias, live, sh, info.restore_device).copy_(bias)


class _Processing:
    """vLLM's layerwise post-load processing of shadow layers, each once, recorded with its
    live layer in the order done."""

    def __init__(self, pairs: dict[nn.Module, nn.Module], shadow: nn.Module):
        self.live_of = {sh: live for live, sh in pairs.items()}
        self.modules = dict(shadow.named_modules())
        self.staged: list[tuple[nn.Module, nn.Module]] = []
        self.done: set[nn.Module] = set()

    def process(self, sh: nn.Module) -> None:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

        if sh in self.done or is_deferred_attention_layer(sh):
            return
        self.done.add(sh)
        if hasattr(sh, "_already_called_process_weights_after_loading"):
            delattr(sh, "_already_called_process_weights_after_loading")
        method = getattr(sh, "quant_method", None)
        if isinstance(method, QuantizeMethodBase):
            method.process_weights_after_loading(sh)
        self.staged.append((self.live_of[sh], sh))

    def layer_by_layer(self, items: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """`items`, processing a decoder layer once the next one starts: its checkpoint-format
        tensors are freed then, as in vLLM's reload, rather than all held to the end."""
        current = None
        for name, t in items:
            layer = _layer_of(name)
            if current and layer != current:
                for n, sh in self.modules.items():
                    if n.startswith(current + ".") and any(p is not None for p in sh._parameters.values()):
                        self.process(sh)
            current = layer
            yield name, t


def _check_shapes(staged: list[tuple[nn.Module, nn.Module]]) -> None:
    """Commit must not fail half way: check every copy it will make."""
    for live, sh in staged:
        for kind in ("_parameters", "_buffers"):
            for name, lt in getattr(live, kind).items():
                st = getattr(sh, kind).get(name)
                if lt is not None and st is not None and (st.shape != lt.shape or st.dtype != lt.dtype):
                    raise StageError(
                        f"{type(live).__name__}.{name}: staged {st.dtype}{list(st.shape)}, live {lt.dtype}{list(lt.shape)}"
                    )


@torch.no_grad()
def stage(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> Staged:
    """Load and process `weights` (checkpoint names and format) into a shadow of `model`;
    the live model is not touched."""
    if any(hasattr(m, "w13_weight") for m in model.modules()):
        # Fused MoE experts: their kernel's weights are set up once, with the live layer.
        raise StageError("a fused-MoE model is reloaded in place")
    pairs: dict[nn.Module, nn.Module] = {}
    shadow = _skeleton(model, pairs)
    _shadow_tensors(pairs)
    processing = _Processing(pairs, shadow)
    loaded = set(shadow.load_weights(processing.layer_by_layer(_by_layer(weights))))
    missing = {n for n, _ in shadow.named_parameters()} - loaded
    if missing:  # their shadow tensors hold no values: never install them
        raise StageError(f"the weights lack {sorted(missing)[:5]}")
    # The rest: layers outside the decoder layers, and a tied lm_head (its weight is the
    # loaded embedding's, not in the checkpoint itself).
    loaded_ids = {id(p) for n, p in shadow.named_parameters(remove_duplicate=False) if n in loaded}
    for sh in pairs.values():
        if any(p is not None and id(p) in loaded_ids for p in sh._parameters.values()):
            processing.process(sh)
    _check_shapes(processing.staged)
    return Staged(processing.staged)


@torch.no_grad()
def commit(staged: Staged) -> list:
    """Install staged weights in the live layers: copy each tensor into the live one and take
    the attributes processing set. Call between engine steps; returns what it replaced, to be
    freed after generation resumes."""
    replaced, copied = [], set()
    for live, sh in staged.pairs:
        for name, lp in live._parameters.items():
            sp = sh._parameters.get(name)
            if lp is None or sp is None or sp is lp or id(lp) in copied:
                continue
            lp.data.copy_(sp)
            copied.add(id(lp))
        for name, lb in live._buffers.items():
            sb = sh._buffers.get(name)
            if lb is not None and sb is not None and sb is not lb:
                lb.data.copy_(sb)
        for key, value in sh.__dict__.items():
            if key in _MODULE_SLOTS or key.startswith(("_forward", "_backward")):
                continue
            if live.__dict__.get(key) is not value:
                replaced.append(live.__dict__.get(key))
                live.__dict__[key] = value
    return replaced
