"""vLLM's seeded sampling on CPU when a prompt is prefilled in chunks.

Why: a request whose prompt is split over engine steps gets a token sampled at each partial step,
which vLLM discards, rewinding the request's seeded generator by its Philox offset
(`set_offset(get_offset() - 4)`). Only CUDA generators have an offset: on CPU that call raises and
the engine dies with every request in it, so one client's `seed` on a long prompt ended everyone's.
Here a CPU generator is rewound by restoring its state from before the step's sampling instead.
`install()` patches the model runner in the process that runs the model (services/vllm_worker.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

_vllm_sample = GPUModelRunner._sample
_vllm_bookkeeping = GPUModelRunner._bookkeeping_sync


def _sample(runner: Any, *args: Any, **kwargs: Any) -> Any:
    gens = runner.input_batch.generators
    runner._forge_cpu_states = {i: g.get_state() for i, g in gens.items() if g.device.type == "cpu"}
    return _vllm_sample(runner, *args, **kwargs)


def _bookkeeping_sync(runner: Any, *args: Any, **kwargs: Any) -> Any:
    saved, gens = getattr(runner, "_forge_cpu_states", {}), runner.input_batch.generators
    discarded = np.nonzero(runner.discard_request_mask.np[: runner.input_batch.num_reqs])[0]
    held = {int(i): gens.pop(int(i)) for i in discarded if int(i) in saved and int(i) in gens}
    try:
        return _vllm_bookkeeping(runner, *args, **kwargs)
    finally:
        for i, gen in held.items():
            gen.set_state(saved[i])  # the discarded draw never happened
            gens[i] = gen


def install() -> None:
    GPUModelRunner._sample = _sample
    GPUModelRunner._bookkeeping_sync = _bookkeeping_sync
