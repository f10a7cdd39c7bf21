import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from forge.config import ConfigError, load_config


@dataclass
class Trainer:
    lr: float = 1e-3
    steps: int = 10


@dataclass
class Schema:
    name: str = "run"
    trainer: Trainer = field(default_factory=Trainer)
    engine: dict = field(default_factory=dict)  # pass-through section

    def validate(self):
        if self.trainer.steps < 1:
            raise ConfigError("config key 'trainer.steps' must be >= 1")


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_yaml_overrides_interpolation(tmp_path):
    p = write(tmp_path, "name: exp\ntrainer:\n  lr: 0.5\nengine:\n  tag: ${name}-x\n  block_size: 16\n")
    cfg = load_config(p, ["trainer.steps=3", "engine.enforce_eager=true"], Schema)
    assert isinstance(cfg, Schema) and isinstance(cfg.trainer, Trainer)
    assert cfg.trainer.lr == 0.5 and cfg.trainer.steps == 3
    assert cfg.engine == {"tag": "exp-x", "block_size": 16, "enforce_eager": True}


def one_line(e):
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


@pytest.mark.parametrize(
    "in_file, on_command_line, message",
    [
        ("trainer:\n  lrr: 1\n", "trainer.step=2", "unknown config key 'trainer.{}'"),  # misspelled: lrr, step
        ("trainer:\n  lr: fast\n", "trainer.steps=1.5", "config key 'trainer.{}'"),  # the wrong type: lr, steps
    ],
)
def test_a_bad_key_is_named_with_where_it_came_from(tmp_path, in_file, on_command_line, message):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, in_file), schema=Schema)
    key = in_file.split()[1].rstrip(":")
    assert message.format(key) in one_line(e) and "c.yaml" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "name: a\n"), [on_command_line], Schema)
    key = on_command_line.split("=")[0].split(".")[1]
    assert message.format(key) in one_line(e) and "command line" in str(e.value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "nope.yaml", schema=Schema)
    assert "config file not found" in one_line(e) and "nope.yaml" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "trainer: [1, 2\n"), schema=Schema)
    assert "invalid YAML" in one_line(e) and "c.yaml" in str(e.value)


def test_bad_override_and_validation_and_interpolation(tmp_path):
    p = write(tmp_path, "name: a\n")
    with pytest.raises(ConfigError, match="not of the form key=value"):
        load_config(p, ["trainer.steps"], Schema)
    with pytest.raises(ConfigError, match="'trainer.steps' must be >= 1"):
        load_config(p, ["trainer.steps=0"], Schema)
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "name: ${nope}\n"), schema=Schema)
    assert "config key 'name'" in one_line(e)


def test_missing_model_dir_is_named(tmp_path):
    from apps.sft import Config

    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.tiny=null", f"model.path={tmp_path}/absent"], Config)
    assert "config key 'model.path'" in one_line(e) and "absent" in str(e.value)


def test_model_family_is_checked_at_load(tmp_path, tiny_model_dir):
    """`model.family` picks the tiny model's family; an unknown one, a tiny spec of another
    family or a checkpoint of another family is one console error naming the key."""
    from apps.grpo import Config

    with pytest.raises(ConfigError) as e:
        load_config("configs/grpo_tiny.yaml", ["model.family=llama9"], Config)
    assert "config key 'model.family': unknown model family 'llama9'; known: qwen3, llama3, qwen3_moe" in one_line(e)
    cfg = load_config("configs/grpo_tiny.yaml", ["model.family=llama3"], Config)
    assert cfg.model.tiny.family == "llama3" and cfg.model.path.endswith("tiny-llama3-reverse-sft600-noise0.3")
    with pytest.raises(ConfigError, match="'model.tiny.family' is 'qwen3_moe', but 'model.family' is 'qwen3'"):
        load_config("configs/grpo_tiny.yaml", ["model.tiny.family=qwen3_moe"], Config)
    with pytest.raises(ConfigError, match=f"'model.family' is 'llama3', but {tiny_model_dir} holds a qwen3 model"):
        load_config(
            "configs/grpo_tiny.yaml", [f"model.path={tiny_model_dir}", "model.tiny=null", "model.family=llama3"], Config
        )


def test_shipped_configs_load(tmp_path, tiny_model_dir):
    from apps.sft import Config

    cfg = load_config("configs/sft_tiny.yaml", ["run_name=x"], Config)
    assert cfg.model.tiny.task == cfg.task and cfg.model.path.endswith(cfg.task)
    # The cookbook's arithmetic start: 400 steps of a 1000-step cosine schedule (docs/guides/tinker.md);
    # its model and rows are that guide's earlier steps' to make.
    rows = tmp_path / "rows.jsonl"
    rows.write_text("{}\n")
    made = [f"model.path={tiny_model_dir}", f"data.path={rows}", f"eval.dataset.path={rows}"]
    cfg = load_config("configs/sft_arithmetic.yaml", made, Config)
    assert (cfg.steps, cfg.trainer.total_steps, cfg.trainer.lr_decay) == (400, 1000, "cosine")
    assert cfg.eval.dataset.messages_key == "prompt" and cfg.model.tiny is None


def test_the_trainer_section_raises_config_errors_like_every_other():
    from services.schema import TrainerConfig

    with pytest.raises(ConfigError, match="config key 'trainer.lr_decay': 'steep' is not one of"):
        TrainerConfig(lr_decay="steep").validate()
    with pytest.raises(ConfigError, match="config key 'trainer.grad_accum' must be >= 1, got 0"):
        TrainerConfig(grad_accum=0).validate()
    with pytest.raises(ConfigError, match="config key 'trainer.publish_dtype': 'int8' is not one of '', 'bfloat16'"):
        TrainerConfig(publish_dtype="int8").validate()


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.lr=-1", "trainer.lr"),
        ("trainer.lr=nan", "trainer.lr"),
        ("eval.max_hold_s=nan", "eval.max_hold_s"),
        ("sample_timeout_s=nan", "sample_timeout_s"),
    ],
)
def test_a_negative_or_nan_setting_is_refused_before_anything_starts(override, key):
    from apps.schema import APPS

    with pytest.raises(ConfigError, match=key):
        load_config("configs/grpo_tiny.yaml", [override], APPS["grpo"])


HEAVY = ("torch", "vllm", "monarch", "torchstore", "torchdata", "transformers", "openai", "numpy")
NO_HEAVY_IMPORTS = """
import sys
from forge.cli import main
for argv in {argvs!r}:
    try:
        main(argv)
    except SystemExit:
        pass
print("LOADED", sorted(m for m in {heavy!r} if m in sys.modules))
"""


def test_forge_help_and_config_errors_print_before_any_heavy_library_loads(tmp_path):
    """`forge --help` and a bad config of `forge run` or `forge eval` (a key, a value, a section's
    check, the app's own) answer without importing torch, vLLM or Monarch: in ~0.2 s of CPU, not
    the ~2.5 s those take."""
    argvs = [
        ["--help"],
        ["run", "configs/grpo_tiny.yaml", "steps=-1"],
        ["run", "configs/grpo_tiny.yaml", "trainer.lrr=1"],
        ["run", "configs/grpo_tiny.yaml", "trainer.loss.name=foo"],
        ["run", "configs/grpo_tiny.yaml", "generator.cpu_threads=-2"],
        ["run", "configs/grpo_tiny.yaml", "rewards.weights={bogus: 1}"],
        ["run", "configs/grpo_tiny.yaml", "task=nope"],
        ["run", "configs/sft_tiny.yaml", "batch_size=0"],
        ["run", str(write(tmp_path, "app: serve"))],
        ["eval", "configs/grpo_tiny.yaml", "--model", "runs/nowhere", "eval.n=0"],
        ["tinker", "configs/tinker_tiny.yaml", "tinker.host=0.0.0.0"],
    ]
    script = NO_HEAVY_IMPORTS.format(argvs=argvs, heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    errors = [line for line in out.stderr.splitlines() if line.startswith("forge: error:")]
    assert [e.split("'")[1] for e in errors] == [
        "steps",
        "trainer.lrr",
        "foo",
        "generator.cpu_threads",
        "bogus",
        "task",
        "batch_size",
        "app",
        "eval.n",
        "tinker.api_keys",
    ], out.stderr
    assert "usage: forge" in out.stdout and "LOADED []" in out.stdout, out.stdout
