import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from apps.sft import warm_start
from services.schema import TinyModelSpec
from services.tiny_model import BUILD_FILE, make_tiny_model


def test_files_and_size(tiny_model_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", BUILD_FILE):
        assert (tiny_model_dir / name).is_file(), name
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    info = json.loads((tiny_model_dir / BUILD_FILE).read_text())
    assert 1_000_000 < info["parameters"] < 5_000_000


def test_tokenizer_round_trip(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for text in ["12+7=19", "rev abcde=edcba", "Hello, world! ~{}[]", "  two  spaces "]:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert len(ids) == len(text) + 1  # character level: one token per character
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert {tok.bos_token, tok.eos_token, tok.pad_token} == {"<|bos|>", "<|eos|>", "<|pad|>"}
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    chat = tok.apply_chat_template([{"role": "user", "content": "1+1="}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"


def test_tool_tags_are_single_tokens_as_in_qwen3(tiny_model_dir):
    """The chat template's newline is a token of its own (not <|unk|>), and the tool and reasoning
    tags are one token each that decoding keeps (vLLM's tool and reasoning parsers read them):
    a tool result sits one token after its tag, not fifteen."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for tag in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"):
        assert len(tok(tag, add_special_tokens=False)["input_ids"]) == 1, tag
    text = 'a\n<tool_call>{"name": "f"}</tool_call><think>x</think>'
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids and tok.decode(ids, skip_special_tokens=True) == text
    turn = [{"role": "user", "content": "1+1="}, {"role": "tool", "content": "2", "tool_call_id": "c"}]
    ids = tok.apply_chat_template(turn, tokenize=True, return_dict=False)
    tokens = tok.convert_ids_to_tokens(ids)
    assert tok.unk_token_id not in ids and tokens[tokens.index("<tool_response>") + 1 : -2] == ["2", "</tool_response>"]


def test_deterministic_and_cached(tmp_path):
    spec = TinyModelSpec(num_hidden_layers=1, seed=3)
    a = make_tiny_model(tmp_path / "a", spec)
    b = make_tiny_model(tmp_path / "b", spec)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    other = make_tiny_model(tmp_path / "c", TinyModelSpec(num_hidden_layers=1, seed=4))
    assert (a / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()

    stamp = (a / "model.safetensors").stat().st_mtime_ns
    assert make_tiny_model(tmp_path / "a", spec) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rebuilt
    make_tiny_model(tmp_path / "a", TinyModelSpec(num_hidden_layers=1, seed=3, sft_lr=1e-3))
    assert (a / "model.safetensors").stat().st_mtime_ns != stamp  # another spec rebuilds


def test_transformers_and_torchtitan_load_it_alike(tmp_path):
    from transformers import AutoModelForCausalLM

    from services.titan import load_hf_model

    # The warm start, a run of the SFT app through the Trainer service, moves every weight
    # (norms included) off its init value; transformers then reads what torchtitan wrote.
    tiny_model_dir = make_tiny_model(
        tmp_path / "m", TinyModelSpec(sft_steps=3, sft_batch_size=8), warm_start=warm_start
    )
    initial = load_file(make_tiny_model(tmp_path / "init", TinyModelSpec(sft_batch_size=8)) / "model.safetensors")
    trained = load_file(tiny_model_dir / "model.safetensors")
    assert trained.keys() == initial.keys() and not any(torch.equal(trained[k], initial[k]) for k in initial)
    assert json.loads((tiny_model_dir / BUILD_FILE).read_text())["sft_final_loss"] < 5.0

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    titan = load_hf_model(tiny_model_dir).eval()
    assert titan.tok_embeddings.weight is titan.lm_head.weight  # tied, as in the HF config
    ids = torch.randint(0, 101, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = titan(ids), hf(ids).logits
    assert a.shape == b.shape == (2, 24, 128)
    assert (a - b).abs().max().item() < 1e-4


def test_cli_builds_offline(tmp_path):
    out = tmp_path / "m"
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "forge.cli",
            "make-tiny-model",
            "--out",
            str(out),
            "--task",
            "reverse",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "parameters" in r.stdout and (out / "model.safetensors").is_file()
    assert json.loads((out / BUILD_FILE).read_text())["spec"]["task"] == "reverse"

    bad = subprocess.run(
        [sys.executable, "-m", "forge.cli", "make-tiny-model", "--out", str(out), "--task", "mul"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2 and "unknown task 'mul'" in bad.stderr and "Traceback" not in bad.stderr


def test_the_model_registry_is_where_a_family_is_known(tmp_path, tiny_model_dir):
    """A checkpoint's family comes from its config.json's model_type; one forge does not know
    is an error naming the file and the families it knows, before any model is built."""
    from services import models

    family = models.of_model(tiny_model_dir)
    assert (family.name, family.model_type) == ("qwen3", "qwen3")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama9"}))
    supported = r"\(supported: qwen3 \(qwen3\), llama \(llama3\), qwen3_moe \(qwen3_moe\), and any other dense causal"
    with pytest.raises(ValueError, match=r"config.json: model_type 'llama9' is not supported " + supported):
        models.hf_config(tmp_path)
    with pytest.raises(ValueError, match="model.tiny.family: family 'llama9'"):
        make_tiny_model(tmp_path / "m", TinyModelSpec(family="llama9"))


def test_a_turn_ends_where_the_chat_template_ends_it(tiny_model_dir):
    """The token that ends an assistant turn (what SFT trains the model to write, and where the
    tiny models' generation stops) is read from the template: the tiny one's <|im_end|>, a
    Llama 3-shaped one's <|eot_id|>; a template that writes no token of its own there is an error."""
    from transformers import AutoTokenizer

    from forge import tasks

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tasks.end_of_turn(tok) == "<|im_end|>"
    assert json.loads((tiny_model_dir / "generation_config.json").read_text())["eos_token_id"] == [
        tok.eos_token_id,
        tok.convert_tokens_to_ids("<|im_end|>"),
    ]
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = (
        "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] }}<|eot_id|>{% endfor %}"
    )
    assert tasks.end_of_turn(tok) == "<|eot_id|>"
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match="ends an assistant turn with no token of its own"):
        tasks.end_of_turn(tok)


def test_a_build_never_replaces_a_directory_forge_did_not_build(tmp_path):
    """`model.tiny` left set with `model.path` at a real model: a ConfigError naming both keys,
    the directory untouched. A missing or empty directory, or an earlier build, is built into."""
    from forge.config import ConfigError
    from services.schema import ModelConfig
    from services.tiny_model import resolve_model

    spec = TinyModelSpec(num_hidden_layers=1)
    real = tmp_path / "real"
    real.mkdir()
    (real / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=f"config keys 'model.path' and 'model.tiny': {real} is not a tiny model"):
        resolve_model(ModelConfig(path=str(real), tiny=spec))
    assert [p.name for p in real.iterdir()] == ["config.json"]

    (tmp_path / "empty").mkdir()
    built = resolve_model(ModelConfig(path=str(tmp_path / "empty"), tiny=spec))
    assert (built / BUILD_FILE).is_file()
    assert (
        resolve_model(ModelConfig(path=str(built), tiny=TinyModelSpec(num_hidden_layers=1, seed=1))) / BUILD_FILE
    ).is_file()


@pytest.mark.parametrize("flags", [["--sft-steps", "-1"], ["--sft-steps", "1", "--sft-noise", "7"]])
def test_cli_refuses_out_of_range_flags_before_building(tmp_path, capsys, flags):
    """A warm start of negative steps or a noise fraction outside [0, 1] is an error naming the
    flag, before anything is built."""
    from apps.tiny_model import main

    with pytest.raises(SystemExit) as exit:
        main(["--out", str(tmp_path / "m"), *flags])
    assert exit.value.code == 2 and f"{flags[-2]}: must be" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_two_builds_of_one_directory_at_once_leave_a_whole_build(tmp_path):
    """Another build of the same directory (another test session, a run) while one is under way:
    each builds in a directory of its own, and the directory ends up a whole build."""
    from services.tiny_model import spec_key

    out, spec = tmp_path / "models" / "m", TinyModelSpec(num_hidden_layers=1, sft_steps=1)

    def another_build_meanwhile(model_dir, s):  # the first build's warm start
        make_tiny_model(out, spec, force=True, warm_start=lambda d, s: 0.0)
        return 0.0

    make_tiny_model(out, spec, warm_start=another_build_meanwhile)
    assert json.loads((out / BUILD_FILE).read_text())["key"] == spec_key(spec)
    assert load_file(out / "model.safetensors") and sorted(p.name for p in out.parent.iterdir()) == ["m"]


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, ValueError])
def test_an_interrupted_build_leaves_no_directory_behind(tmp_path, interrupt):
    """A build stopped during its warm start (Ctrl-C, an error) leaves neither the model nor its
    half-written copy beside it."""

    def stopped(model_dir, spec):
        raise interrupt("stopped")

    with pytest.raises(interrupt):
        make_tiny_model(tmp_path / "m", TinyModelSpec(num_hidden_layers=1, sft_steps=5), warm_start=stopped)
    assert list(tmp_path.iterdir()) == []
