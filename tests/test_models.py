"""Model families (services/models/): each loads an HF checkpoint of its family into torchtitan
with the logits transformers computes, exports back to the same HF tensors, and is known by its
config.json's model_type. The trainer/generator parity of each family is in test_weight_sync.py."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from services import models, titan
from services.tiny_model import TinyModelSpec, make_tiny_model

FAMILIES = ["qwen3", "llama3", "qwen3_moe"]


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    """A small model of each family, random init."""
    spec = TinyModelSpec(family=request.param, hidden_size=128, intermediate_size=256, num_hidden_layers=2, head_dim=32)
    return make_tiny_model(tmp_path_factory.mktemp(request.param) / "model", spec)


def transformers_logprobs(model_dir, ids: torch.Tensor) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None])[..., 0]


def test_a_family_loads_into_torchtitan_with_transformers_logits_and_exports_back(tiny):
    """fp32 CPU, 120 tokens (past the tiny Llama's original RoPE context, where its scaling
    acts): torchtitan's logprobs within 1e-5 of transformers'; the export is the checkpoint."""
    ids = torch.randint(5, 100, (2, 120), generator=torch.Generator().manual_seed(0))
    model = titan.load_hf_model(tiny).eval()
    with torch.no_grad():
        lp, _ = titan.token_logprobs(model, ids)
    assert (lp[:, 1:] - transformers_logprobs(tiny, ids)).abs().max().item() <= 1e-5

    family = models.of_model(tiny)
    exported = family.adapter(family.titan_config(models.hf_config(tiny), "cpu")).to_hf(model.state_dict())
    original = load_file(str(tiny / "model.safetensors"))
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)


def test_llama3_rope_scaling_is_read_from_the_checkpoint(tmp_path):
    """The tiny Llama's rope scaling changes its logits (so the parity above covers it), and a
    rope type forge cannot build is an error naming it."""
    spec = TinyModelSpec(family="llama3", hidden_size=128, intermediate_size=256, num_hidden_layers=2, head_dim=32)
    model_dir = make_tiny_model(tmp_path / "llama", spec)
    ids = torch.randint(5, 100, (1, 120), generator=torch.Generator().manual_seed(1))
    scaled = transformers_logprobs(model_dir, ids)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["rope_parameters"]["rope_type"] == "llama3"

    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_parameters"]["rope_theta"]}
    (model_dir / "config.json").write_text(json.dumps(config))
    assert (transformers_logprobs(model_dir, ids) - scaled).abs().max().item() > 1e-3
    model = titan.load_hf_model(model_dir).eval()
    with torch.no_grad():
        lp, _ = titan.token_logprobs(model, ids)
    assert (lp[:, 1:] - transformers_logprobs(model_dir, ids)).abs().max().item() <= 1e-5

    config["rope_parameters"]["rope_type"] = "yarn"
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported for llama"):
        titan.load_hf_model(model_dir)


def test_families_are_named_by_forge_and_found_by_model_type(tmp_path):
    assert models.get("llama3").model_type == "llama" and models.of({"model_type": "llama"}).name == "llama3"
    with pytest.raises(
        ValueError, match=r"model.tiny.family: family 'llama' is not supported \(supported: qwen3, llama3, qwen3_moe\)"
    ):
        make_tiny_model(tmp_path / "m", TinyModelSpec(family="llama"))
