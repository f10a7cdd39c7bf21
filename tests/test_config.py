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


def test_shipped_configs_load():
    from apps.sft import Config

    cfg = load_config("configs/sft_tiny.yaml", ["run_name=x"], Config)
    assert cfg.model.tiny.task == cfg.task and cfg.model.path.endswith(cfg.task)


def test_the_trainer_section_raises_config_errors_like_every_other():
    from services.trainer import TrainerConfig

    with pytest.raises(ConfigError, match="config key 'trainer.lr_decay': 'steep' is not one of"):
        TrainerConfig(lr_decay="steep").validate()
    with pytest.raises(ConfigError, match="config key 'trainer.grad_accum' must be >= 1, got 0"):
        TrainerConfig(grad_accum=0).validate()
