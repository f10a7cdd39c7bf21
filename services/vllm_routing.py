"""Routing replay, the generator's half: records, inside vLLM's worker, the experts each MoE layer
routed every computed token of every request to, by the request's position.

vLLM's own RoutedExpertsCapturer needs its V2 model runner, which needs Triton (not on CPU),
so this is the thinnest hook on what runs everywhere: each MoE router's capture callback
(`BaseRouter.set_capture_fn`, the capturer's own hook) fills a step buffer, and the layout of the
step's tokens (requests in the runner's batch order, each from its computed-token count) is read
as the runner prepares its inputs. Prompt tokens served from the prefix cache are not computed,
so they have no record (-1), nor has a request's last sampled token.

Kept free of monarch imports: it runs in vLLM's worker process.
"""

from __future__ import annotations

import collections
import re
from typing import Any

import numpy as np
import torch
from vllm.model_executor.layers.fused_moe.layer import MoERunner

MISSING = -1  # a position the generator computed no routing for
FINISHED_KEPT = 4096  # records of finished requests nobody fetched (aborted ones) are dropped past this


class RoutingRecorder:
    """One per worker: `bind(model_runner)` once (and again after a weight reload rebuilds the
    MoE layers), then `take(request_id)` the records of a finished request."""

    def __init__(self, num_layers: int, top_k: int):
        self.num_layers, self.top_k = num_layers, top_k
        self.records: dict[str, np.ndarray] = {}  # internal request id -> [positions, layers, top_k]
        self.finished: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self._step: np.ndarray | None = None  # the last forward's [tokens, layers, top_k]
        self._layout: list[tuple[str, int, int]] = []  # (request, first position, tokens) in batch order

    def bind(self, runner: Any) -> int:
        """Hook the routers of `runner`'s model and its input preparation; returns the layers bound."""
        bound = 0
        for module in runner.get_model().modules():
            if isinstance(module, MoERunner):
                module.router.set_capture_fn(lambda ids, layer=module.layer_id: self._capture(layer, ids))
                bound += 1
        if not getattr(runner, "_forge_routing", False):
            prepare = runner._prepare_inputs

            def prepare_and_note(scheduler_output: Any, num_scheduled_tokens: np.ndarray, *args: Any, **kw: Any):
                self._note_step(runner, scheduler_output, num_scheduled_tokens)
                return prepare(scheduler_output, num_scheduled_tokens, *args, **kw)

            runner._prepare_inputs = prepare_and_note
            runner._forge_routing = True
        return bound

    def _note_step(self, runner: Any, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> None:
        self._flush()
        for req_id in scheduler_output.finished_req_ids:
            if req_id in self.records:
                self.finished[req_id] = self.records.pop(req_id)
        while len(self.finished) > FINISHED_KEPT:
            self.finished.popitem(last=False)
        batch = runner.input_batch
        ids = batch.req_ids[: batch.num_reqs]
        starts = batch.num_computed_tokens_cpu[: batch.num_reqs]
        self._layout = [(r, int(s), int(n)) for r, s, n in zip(ids, starts, num_scheduled_tokens)]
        total = int(sum(n for _, _, n in self._layout))
        self._step = np.full((total, self.num_layers, self.top_k), MISSING, dtype=np.int16)

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        # More rows than the step's tokens: padding (CUDA graphs); fewer: a forward of no step's
        # (a dummy run), which has nothing to record.
        if self._step is not None and topk_ids.shape[0] >= self._step.shape[0]:
            self._step[:, layer] = topk_ids[: self._step.shape[0]].to("cpu", torch.int16).numpy()

    def _flush(self) -> None:
        """File the last forward's rows under their requests and positions."""
        step, self._step = self._step, None
        if step is None:
            return
        row = 0
        for req_id, start, n in self._layout:
            record = self.records.get(req_id)
            if record is None or record.shape[0] < start + n:
                size = max(start + n, 2 * (0 if record is None else record.shape[0]))
                grown = np.full((size, *step.shape[1:]), MISSING, np.int16)
                if record is not None:
                    grown[: record.shape[0]] = record
                self.records[req_id] = record = grown
            record[start : start + n] = step[row : row + n]
            row += n

    def take(self, request_id: str) -> dict[int, tuple[tuple[int, ...], bytes]]:
        """The records of the engine requests of frontend request `request_id` (vLLM names them
        "<id>-<suffix>", and the n > 1 samples' "<index>_<id>-<suffix>"), by sample index, as
        (shape, bytes): what collective_rpc carries in every executor."""
        self._flush()
        # Exactly its own: a request id that is a prefix of another's must not take that one's.
        name = re.compile(rf"(?:(\d+)_)?{re.escape(request_id)}-[^-]+")
        found = {}
        for table in (self.records, self.finished):
            for key, match in [(k, name.fullmatch(k)) for k in list(table)]:
                if match:
                    record = table.pop(key)
                    found[int(match[1] or 0)] = (record.shape, record.tobytes())
        return found
