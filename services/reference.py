"""Reference model service: the frozen initial policy, for the KL term.

ref = await Reference.options().as_service(model=path)
ref_logprobs = await ref.logprobs.route(batch)   # [rows, seq], token-aligned
"""

from __future__ import annotations

from pathlib import Path

import torch
from monarch.actor import endpoint

from forge.actor import ForgeActor
from forge.config import require_file
from forge.types import Batch


class Reference(ForgeActor):
    """Frozen torchtitan model; `logprobs` runs `chunk_rows` rows at a time (their activations)
    and its head a chunk of tokens at a time (titan.token_logprobs), each token's distribution
    at its sampling temperature (Batch.temperatures), as the policy's are in the trainer."""

    @classmethod
    def check_args(cls, model: str | Path, chunk_rows: int = 8) -> None:
        require_file("model.path", Path(model) / "config.json")
        if chunk_rows < 1:
            raise ValueError(f"Reference: chunk_rows must be >= 1, got {chunk_rows}")

    def __init__(self, model: str | Path, chunk_rows: int = 8):
        self.path, self.chunk_rows = str(model), chunk_rows

    @endpoint
    async def setup(self) -> None:
        from services.titan import default_device, load_hf_model

        self.device = default_device()
        self.model = load_hf_model(self.path, self.device).eval().requires_grad_(False)

    @endpoint
    async def logprobs(self, batch: Batch) -> torch.Tensor:
        from services.titan import token_logprobs

        b = batch.to(self.device)
        with torch.no_grad():
            return token_logprobs(
                self.model,
                b.input_ids,
                chunk_rows=self.chunk_rows,
                positions=b.positions,
                segments=b.segments,
                temperatures=b.temperatures,
            )[0].cpu()
