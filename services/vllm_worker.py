"""Runs inside vLLM's worker process (vLLM's `worker_extension_cls`): in-place weight reload.

Kept free of monarch imports (forge.shm is torch-only): vLLM imports it in its EngineCore process.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from forge.shm import forget_mapping, read_safetensors


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
    """Mixed into vLLM's worker; called through `AsyncLLM.collective_rpc`."""

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
        if not keep_mapping:  # a one-off file: its memory goes when it is unlinked
            forget_mapping(path)
        return len(weights)
