"""Runs inside vLLM's worker process (vLLM's `worker_extension_cls`): new weights staged beside
the live model and committed between engine steps (`forge_stage`, `forge_commit`), or, for a
model that cannot be staged, vLLM's own in-place reload (`forge_reload`).

Kept free of monarch imports (forge.shm is torch-only): vLLM imports it in its EngineCore process.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from forge.shm import forget_mapping, read_safetensors
from services import vllm_lora, vllm_seeds
from services.vllm_routing import RoutingRecorder
from services.vllm_staging import commit, stage

vllm_lora.install()  # in the process that runs the model: vLLM imports this module there
vllm_seeds.install()
# vLLM's CPU attention runs AMX tile instructions in bfloat16 without asking Linux for them
# (SIGILL unless a large enough oneDNN matmul asked first, as the 1-token warm-up's do not).
torch.cpu._init_amx()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _exit_with(pid: int) -> None:
    # vLLM's EngineCore outlives a SIGKILLed frontend (the generator actor) and keeps a core
    # busy; its worker (this process, a child of EngineCore) ends both when the actor is gone.
    while _alive(pid):
        time.sleep(1.0)
    os.kill(os.getppid(), signal.SIGKILL)
    os._exit(1)


_owner = int(os.environ.get("FORGE_GENERATOR_PID", "0"))
if _owner and _owner != os.getpid() and os.path.isdir("/proc"):
    threading.Thread(target=_exit_with, args=(_owner,), daemon=True, name="forge-exit-with-generator").start()


def _expected_reload_warning(record: logging.LogRecord) -> bool:
    # On every reload vLLM warns that RotaryEmbedding (no weights in any checkpoint) and the
    # tied ParallelLMHead (refreshed from the embedding below) "failed to load weights".
    return not (
        record.getMessage().endswith("Failed to load weights")
        and record.getMessage().split(":")[0] in ("RotaryEmbedding", "ParallelLMHead")
    )


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_expected_reload_warning)


class WeightReloader:
    """Mixed into vLLM's worker; called through `AsyncLLM.collective_rpc`. Two ways to swap:
    `forge_stage` + `forge_commit` (the new weights are prepared while generation goes on, the
    commit is a copy and a pointer swap) or `forge_reload` (vLLM's own reload, all of it while
    generation waits). With routing replay, `forge_record_routing` then `forge_routed_experts`."""

    _stager: ThreadPoolExecutor | None = None
    _routing: RoutingRecorder | None = None
    _staging: Future | None = None
    _replaced: list = []

    def forge_stage(self, path: str, keep_mapping: bool = True) -> None:
        """Start staging the weights of `path` in a thread of this process and return."""
        if self._stager is None:
            self._stager = ThreadPoolExecutor(1, thread_name_prefix="forge-stage")
        self._replaced = []  # the previous version's handlers, kept past its commit's pause
        self._staging = self._stager.submit(self._stage, path, keep_mapping)

    def _stage(self, path: str, keep_mapping: bool):
        staged = stage(self.model_runner.get_model(), read_safetensors(path).items())
        if not keep_mapping:
            forget_mapping(path)
        return staged

    def forge_staged(self) -> str | None:
        """None while staging runs; then "" if it succeeded, else its error."""
        if self._staging is None or not self._staging.done():
            return None
        error = self._staging.exception()
        return "" if error is None else f"{type(error).__name__}: {error}"

    def forge_commit(self) -> int:
        """Install the staged weights (call while the engine is paused); raises staging's error."""
        staging, self._staging = self._staging, None
        if staging is None:
            raise RuntimeError("forge_commit: nothing staged")
        self._replaced = commit(staging.result())
        self._rebind_routing()
        return len(self._replaced)

    def forge_reload(self, path: str, keep_mapping: bool = True) -> int:
        # Tensors cannot pass through collective_rpc in multiprocess mode ("cannot pickle
        # memoryview"), so the actor passes the path of a safetensors file (in /dev/shm). Its
        # tensors are read as views of the mapped file: the one copy is vLLM's, into the params.
        weights = read_safetensors(path)
        # `reload_weights`, not `model.load_weights`: it re-runs vLLM's post-load processing.
        self.reload_weights(weights_iterator=iter(weights.items()))
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        if getattr(model.config, "tie_word_embeddings", False) and hasattr(head, "quant_method"):
            # A tied lm_head keeps a processed copy of the embedding; refresh it from the new one.
            head.quant_method.process_weights_after_loading(head)
        for layer in model.modules():
            experts = getattr(getattr(getattr(layer, "quant_method", None), "moe_kernel", None), "fused_experts", None)
            if type(experts).__name__ == "CPUUnquantizedExperts":
                # On a weight update vLLM copies the loaded experts into the storage its CPU
                # kernel prepacked at start-up, without prepacking them again: do that here.
                experts.process_weights_after_loading(layer)
        if not keep_mapping:  # a one-off file: its memory goes when it is unlinked
            forget_mapping(path)
        self._rebind_routing()
        return len(weights)

    def forge_record_routing(self) -> int:
        """Record the experts every MoE layer routes each computed token to; returns the layers
        hooked (0: not a MoE model)."""
        config = self.model_runner.model_config
        if config.get_num_experts() <= 0:
            return 0
        if self._routing is None:
            self._routing = RoutingRecorder(config.get_total_num_hidden_layers(), config.get_num_experts_per_tok())
        return self._routing.bind(self.model_runner)

    def forge_routed_experts(self, request_id: str) -> dict[int, tuple[tuple[int, ...], bytes]]:
        """The routing records of a finished request's samples (RoutingRecorder.take), once."""
        return {} if self._routing is None else self._routing.take(request_id)

    def _rebind_routing(self) -> None:
        if self._routing is not None:  # a reload may rebuild the MoE layers and their routers
            self._routing.bind(self.model_runner)
