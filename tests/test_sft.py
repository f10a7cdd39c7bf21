"""The SFT app: eval chunks do not reset its optimizer or its data stream."""

import torch
from safetensors.torch import load_file

from apps.sft import Config, main
from forge.config import load_config


def test_eval_chunks_keep_one_optimizer(tmp_path, tiny_model_dir):
    """Training 4 steps in chunks of 2 (an eval between) ends on the same weights as 4 steps in
    one chunk: the AdamW state and the data carry over. A new optimizer per chunk would differ."""

    def train(eval_every: int) -> dict:
        over = [
            f"runs_dir={tmp_path}",
            f"run_name=e{eval_every}",
            "model.tiny=null",
            f"model.path={tiny_model_dir}",
            "steps=4",
            f"eval_every={eval_every}",
            "batch_size=8",
            "eval_samples=4",
            "metrics=[jsonl]",
        ]
        main(load_config("configs/sft_tiny.yaml", over, Config))
        return load_file(tmp_path / f"e{eval_every}" / "model" / "model.safetensors")

    chunked, whole = train(2), train(4)
    assert chunked.keys() == whole.keys()
    assert all(torch.allclose(chunked[k], whole[k], atol=1e-6) for k in whole)
    initial = load_file(tiny_model_dir / "model.safetensors")
    assert not torch.equal(whole["model.norm.weight"], initial["model.norm.weight"])
