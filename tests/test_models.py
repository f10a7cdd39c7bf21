"""Model families (services/models/): each loads an HF checkpoint of its family into torchtitan
with the logits transformers computes, exports back to the same HF tensors, and is known by its
config.json's model_type. The trainer/generator parity of each family is in test_weight_sync.py."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from services import models, titan
from services.schema import TinyModelSpec
from services.tiny_model import make_tiny_model

FAMILIES = ["qwen3", "llama3", "qwen3_moe", "hf"]  # hf: the tiny one is a Qwen2


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


def test_a_sharded_checkpoint_loads_the_files_its_index_lists(tiny_model_dir, tmp_path):
    """A hub snapshot's layout (Mistral's): shards listed by model.safetensors.index.json beside a
    consolidated.safetensors of other key names. The loader reads the listed shards only (the
    model's weights); a listed shard missing, or one safetensors cannot read, is an error naming it."""
    import shutil

    from safetensors.torch import save_file

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    sd = load_file(str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").unlink()
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for name, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(model_dir / name))
    weight_map = {k: name for name, keys in shards.items() for k in keys}
    (model_dir / titan.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_file(
        {k.replace("self_attn", "attention"): v for k, v in sd.items()}, str(model_dir / "consolidated.safetensors")
    )

    exported = titan.load_hf_model(model_dir).state_dict()
    family = models.of_model(model_dir)
    exported = family.adapter(family.titan_config(models.hf_config(model_dir), "cpu")).to_hf(exported)
    assert exported.keys() == sd.keys() and all(torch.equal(exported[k], sd[k]) for k in sd)

    second = model_dir / "model-00002-of-00002.safetensors"
    second.write_bytes(second.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"{second}: not a readable safetensors file"):
        titan.load_hf_model(model_dir)
    second.unlink()
    with pytest.raises(FileNotFoundError, match=r"weight_map lists \['model-00002-of-00002.safetensors'\]"):
        titan.load_hf_model(model_dir)


def test_families_are_named_by_forge_and_found_by_model_type(tmp_path):
    assert models.get("llama3").model_type == "llama" and models.of({"model_type": "llama"}).name == "llama3"
    with pytest.raises(
        ValueError,
        match=r"model.tiny.family: family 'llama' is not supported \(supported: qwen3, llama3, qwen3_moe, hf\)",
    ):
        make_tiny_model(tmp_path / "m", TinyModelSpec(family="llama"))


OTHER_CAUSAL_LMS = {  # model_type: (config class, extra keys): each through the hf family
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "gemma": ("GemmaConfig", {}),
    "phi3": ("Phi3Config", {"pad_token_id": 0}),
}


@pytest.mark.parametrize("model_type", sorted(OTHER_CAUSAL_LMS))
def test_other_causal_lms_load_through_the_transformers_backend(tmp_path, model_type):
    """A dense checkpoint of a model_type forge has no family of its own for is the hf family's:
    transformers' modeling code in torchtitan, its logprobs those of transformers (1e-5, also on
    packed rows), its export the checkpoint's tensors. A MoE or a type transformers lacks is an
    error naming it."""
    import transformers

    config_cls, extra = OTHER_CAUSAL_LMS[model_type]
    sizes = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    config = getattr(transformers, config_cls)(
        **sizes, num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, **extra
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    assert models.of_model(tmp_path).name == "hf"
    ids = torch.randint(5, 100, (2, 40), generator=torch.Generator().manual_seed(0))
    want = transformers_logprobs(tmp_path, ids)
    model = titan.load_hf_model(tmp_path).eval()
    with torch.no_grad():
        lp, _ = titan.token_logprobs(model, ids)
        packed, _ = titan.token_logprobs(  # both rows in one, each attending only to itself
            model, ids.reshape(1, -1), positions=torch.arange(40).repeat(2).reshape(1, -1)
        )
    assert (lp[:, 1:] - want).abs().max().item() <= 1e-5
    assert (packed.reshape(2, 40)[:, 1:] - want).abs().max().item() <= 1e-5
    exported = models.FALLBACK.adapter(models.FALLBACK.titan_config(models.hf_config(tmp_path))).to_hf(
        model.state_dict()
    )
    original = load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(exported[k], original[k]) for k in original)

    with pytest.raises(ValueError, match="model_type 'mixtral' is not supported"):
        models.of({"model_type": "mixtral", "num_local_experts": 8})
    with pytest.raises(ValueError, match="model_type 'vit' is not supported"):
        models.of({"model_type": "vit"})  # transformers has no causal LM of it


def test_a_family_gives_the_same_logprobs_and_gradients_with_its_head_in_chunks(tiny):
    """token_logprobs with the head run 7 tokens at a time (a chunk that does not divide the
    rows, packed rows too) against all at once: logprobs, entropies and every gradient within
    1e-5 (fp32)."""
    ids = torch.randint(5, 100, (2, 40), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(15), torch.arange(25)]).repeat(2).reshape(2, 40)
    model = titan.load_hf_model(tiny)
    got = []
    for chunk in (0, 7):
        model.zero_grad()
        lp, ent = titan.token_logprobs(model, ids, with_entropy=True, positions=positions, chunk_tokens=chunk)
        (lp * torch.linspace(-1, 1, 40)).sum().backward()
        got.append((lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp0, ent0, g0), (lp7, ent7, g7) = got
    assert (lp0 - lp7).abs().max().item() <= 1e-5 and (ent0 - ent7).abs().max().item() <= 1e-5
    assert (lp0[positions == 0] == 0).all() and (lp7[positions == 0] == 0).all()
    assert g0.keys() == g7.keys() and all((g0[n] - g7[n]).abs().max().item() <= 1e-5 for n in g0)


SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def save_random(config, model_dir, edit=None):
    """A random HF checkpoint of `config` in `model_dir`, its config.json then changed by `edit`."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms away from 1, so a wrong eps or a missing norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(model_dir)
    if edit is not None:
        path = model_dir / "config.json"
        config = json.loads(path.read_text())
        edit(config)
        path.write_text(json.dumps(config))
    return model_dir


def forge_logprobs(model_dir, ids: torch.Tensor, positions=None) -> torch.Tensor:
    model = titan.load_hf_model(model_dir).eval()
    with torch.no_grad():
        return titan.token_logprobs(model, ids, positions=positions)[0][:, 1:]


def without(*keys):
    return lambda config: [config.pop(k, None) for k in keys]


def qwen3(**keys):
    from transformers import Qwen3Config

    return Qwen3Config(**SMALL, head_dim=16, **keys)


def llama(**keys):
    from transformers import LlamaConfig

    return LlamaConfig(**SMALL, **keys)


def qwen3_moe(**keys):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**SMALL, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, **keys)


def qwen3_default_head_dim(**keys):
    from transformers import Qwen3Config

    return Qwen3Config(**SMALL, **keys)  # head_dim 128, not hidden_size / num_attention_heads


LIKE_TRANSFORMERS = {  # config.json without a key: transformers' default, not another
    "qwen3 without head_dim": (qwen3_default_head_dim, {}, ("head_dim",)),
    "qwen3_moe without head_dim": (qwen3_moe, {}, ("head_dim",)),  # hidden_size / heads (16), not 128
    "qwen3 without rope_theta": (qwen3, {}, ("rope_parameters", "rope_theta")),
    "llama without rope_theta": (llama, {}, ("rope_parameters", "rope_theta")),
    "qwen3_moe without norm_topk_prob": (qwen3_moe, {"norm_topk_prob": False}, ("norm_topk_prob",)),
}


@pytest.mark.parametrize("case", sorted(LIKE_TRANSFORMERS))
def test_a_key_config_json_leaves_out_is_transformers_default(tmp_path, case):
    make, keys, dropped = LIKE_TRANSFORMERS[case]
    model_dir = save_random(make(**keys), tmp_path, edit=without(*dropped))
    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(0))
    assert (forge_logprobs(model_dir, ids) - transformers_logprobs(model_dir, ids)).abs().max().item() <= 1e-5


REFUSED = {  # what a family's blocks cannot compute as transformers does: an error naming the key
    "qwen3 yarn": (qwen3(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "rope_type 'yarn'"),
    "qwen3 linear": (qwen3(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}), "'linear'"),
    "qwen3 sliding": (qwen3(use_sliding_window=True, sliding_window=8, max_window_layers=0), "use_sliding_window"),
    "qwen3 gelu": (qwen3(hidden_act="gelu"), "hidden_act 'gelu' is not supported for qwen3"),
    "llama gelu": (llama(hidden_act="gelu"), "hidden_act 'gelu' is not supported for llama"),
    "qwen3 bias": (qwen3(attention_bias=True), "attention_bias is not supported for qwen3"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_config_a_family_cannot_compute_is_refused(tmp_path, case):
    config, message = REFUSED[case]
    with pytest.raises(ValueError, match=f"config.json: .*{message}"):
        titan.load_hf_model(save_random(config, tmp_path))


def test_missing_keys_unknown_weights_and_long_sequences_are_named(tmp_path):
    """A key config.json lacks, a weight the family has no place for and a sequence past the
    RoPE table are errors naming the file, the key or the limit, not tracebacks from inside."""
    model_dir = save_random(llama(), tmp_path / "no_eps", edit=without("rms_norm_eps"))
    with pytest.raises(ValueError, match=f"{model_dir / 'config.json'}: key 'rms_norm_eps' is missing"):
        titan.load_hf_model(model_dir)

    model_dir = save_random(qwen3(attention_bias=True), tmp_path / "bias", edit=without("attention_bias"))
    with pytest.raises(
        ValueError, match=f"{model_dir}: weight 'model.layers.0.self_attn.k_proj.bias' is not one the qwen3 family has"
    ):
        titan.load_hf_model(model_dir)

    model_dir = save_random(qwen3(), tmp_path / "short", edit=lambda c: c.update(max_position_embeddings=32))
    model = titan.load_hf_model(model_dir).eval()
    with torch.no_grad():
        titan.token_logprobs(model, torch.zeros(1, 32, dtype=torch.long))
        packed = torch.arange(24).repeat(2).reshape(1, 48)  # two episodes of 24 in a 48-token row
        titan.token_logprobs(model, torch.zeros(1, 48, dtype=torch.long), positions=packed)
        for positions in (None, torch.arange(48).reshape(1, 48)):
            with pytest.raises(
                ValueError, match=r"48-token sequence is longer than the model's max_position_embeddings \(32"
            ):
                titan.token_logprobs(model, torch.zeros(1, 48, dtype=torch.long), positions=positions)


def test_weights_of_other_sizes_than_config_json_gives_are_named(tmp_path):
    """A config.json whose sizes are not its weights' is an error naming the directory and the weight."""
    model_dir = save_random(qwen3(), tmp_path, edit=lambda c: c.update(intermediate_size=96))
    with pytest.raises(
        ValueError, match=rf"{model_dir}: weights of other sizes than config.json gives: .*w1.* \(128, 64\)"
    ):
        titan.load_hf_model(model_dir)


@pytest.mark.parametrize("model_type,key", [("ernie4_5_moe", "moe_num_experts"), ("mixtral", "num_local_experts")])
def test_a_moe_without_a_family_of_its_own_is_refused(model_type, key):
    """Whatever key its config.json counts the experts by (vLLM's), a MoE is not the hf family's:
    its generator would record routing the backend never replays."""
    with pytest.raises(ValueError, match=f"model_type '{model_type}' is not supported"):
        models.of({"model_type": model_type, key: 8})


def test_query_heads_that_do_not_group_over_the_kv_heads_are_named(tmp_path):
    """Grouped-query attention shares each KV head among as many query heads: a config.json whose
    num_attention_heads is not a multiple of num_key_value_heads is an error naming both, at load."""
    spec = TinyModelSpec(hidden_size=64, intermediate_size=64, num_hidden_layers=1, head_dim=16, num_key_value_heads=3)
    model_dir = make_tiny_model(tmp_path / "m", spec)
    with pytest.raises(
        ValueError, match="config.json: num_attention_heads 4 is not a multiple of num_key_value_heads 3"
    ):
        titan.load_hf_model(model_dir)


def test_a_tied_checkpoint_s_stored_head_must_be_its_embeddings(tmp_path):
    """Some exporters store lm_head.weight beside tied embeddings: the same tensor is dropped (the
    model is the checkpoint's); another would overwrite the shared one, and is an error."""
    from safetensors.torch import save_file

    model_dir = save_random(qwen3(tie_word_embeddings=True), tmp_path)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    want = forge_logprobs(model_dir, ids)
    weights = load_file(str(model_dir / "model.safetensors"))
    save_file(
        {**weights, "lm_head.weight": weights["model.embed_tokens.weight"].clone()},
        str(model_dir / "model.safetensors"),
    )
    assert torch.equal(forge_logprobs(model_dir, ids), want)
    other = torch.randn(weights["model.embed_tokens.weight"].shape)
    save_file({**weights, "lm_head.weight": other}, str(model_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=f"{model_dir}: config.json says tie_word_embeddings, but its lm_head.weight"):
        titan.load_hf_model(model_dir)


def test_an_index_names_files_inside_the_model_directory(tmp_path):
    """A weight_map entry that leaves the directory (.., an absolute path) is an error naming the
    index and the entry, before anything is read."""
    from safetensors.torch import save_file

    model_dir = save_random(qwen3(), tmp_path / "m")
    weights = load_file(str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").unlink()
    (tmp_path / "elsewhere").mkdir()
    save_file(weights, str(tmp_path / "elsewhere" / "w.safetensors"))
    for name in ("../elsewhere/w.safetensors", str(tmp_path / "elsewhere" / "w.safetensors")):
        (model_dir / titan.INDEX).write_text(json.dumps({"weight_map": {k: name for k in weights}}))
        with pytest.raises(
            ValueError, match=f"{model_dir / titan.INDEX}: weight_map entry '{name}' is not a file inside"
        ):
            titan.load_hf_model(model_dir)


def test_the_hf_family_runs_no_code_of_the_model_directory(tmp_path):
    """torchtitan's backend loads the config with trust_remote_code: a config.json whose auto_map
    names a .py file there is refused before anything reads it."""
    from transformers import Qwen2Config

    model_dir = save_random(Qwen2Config(**SMALL), tmp_path / "m")
    ran = tmp_path / "ran"
    (model_dir / "configuration_evil.py").write_text(
        f"open({str(ran)!r}, 'w').write('ran')\nfrom transformers import Qwen2Config\nclass EvilConfig(Qwen2Config): pass\n"
    )
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(
        json.dumps({**config, "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"}})
    )
    with pytest.raises(ValueError, match=f"{model_dir}/config.json: key 'auto_map' names code in the model directory"):
        titan.load_hf_model(model_dir)
    assert not ran.exists()


def test_the_hf_family_takes_only_layouts_its_backend_builds(tmp_path):
    """GPT-2's decoder is not at `.model.layers`: not the hf family's. One that passes that check
    but still fails the backend's constructor (MBart's decoder) is an error naming it, and leaves
    transformers' configs as they were (the backend adds a model's key aliases to the class-level
    attribute_map every config shares)."""
    from transformers import GPT2Config, MBartConfig, PretrainedConfig

    save_random(GPT2Config(vocab_size=128, n_embd=64, n_layer=1, n_head=4, n_positions=256), tmp_path / "gpt2")
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        models.of_model(tmp_path / "gpt2")
    sizes = dict(decoder_layers=1, encoder_layers=1, decoder_attention_heads=4, encoder_attention_heads=4)
    mbart = MBartConfig(vocab_size=128, d_model=64, decoder_ffn_dim=128, encoder_ffn_dim=128, **sizes)
    model_dir = save_random(mbart, tmp_path / "mbart")
    with pytest.raises(ValueError, match="MBartForCausalLM: not a layout torchtitan's transformers backend can build"):
        titan.load_hf_model(model_dir)
    assert PretrainedConfig.attribute_map == {}


def test_the_hf_family_refuses_an_episode_past_its_sliding_window(tmp_path):
    """The backend's masks attend whole episodes: within the window, transformers' logprobs
    (packed rows too); an episode past it is an error naming the window."""
    from transformers import MistralConfig

    model_dir = save_random(MistralConfig(**SMALL, sliding_window=8), tmp_path)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    want = transformers_logprobs(model_dir, ids)
    assert (forge_logprobs(model_dir, ids) - want).abs().max().item() <= 1e-5
    packed = forge_logprobs(model_dir, ids.reshape(1, 16), positions=torch.arange(8).repeat(2).reshape(1, 16))
    assert (packed.reshape(1, 15)[:, 8:] - want[1:, :]).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match=r"16-token sequence is longer than the model's sliding_window \(8"):
        forge_logprobs(model_dir, ids.reshape(1, 16))
