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
    tmp_path.mkdir(exist_ok=True)
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


def test_forge_help_and_config_errors_print_before_any_heavy_library_loads(tmp_path, monkeypatch):
    """`forge --help` and a bad config of `forge run` or `forge eval` (a key, a value, a section's
    check, the app's own) answer without importing torch, vLLM or Monarch: in ~0.2 s of CPU, not
    the ~2.5 s those take."""
    monkeypatch.delenv("FORGE_TEST_UNSET", raising=False)
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
        ["run", "configs/grpo_tiny.yaml", "trainer_procs=0"],
        ["run", str(write(tmp_path / "list", "app: [grpo]"))],
        ["run", str(write(tmp_path / "unset", "base: ${oc.env:FORGE_TEST_UNSET}"))],
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
        "trainer_procs",
        "app",
        "base",
        "eval.n",
        "tinker.api_keys",
    ], out.stderr
    assert "usage: forge" in out.stdout and "LOADED []" in out.stdout, out.stdout


GRPO, SFT, DPO, TINKER = (f"configs/{app}_tiny.yaml" for app in ("grpo", "sft", "dpo", "tinker"))
PPO, CODE, TOOL = (f"configs/{name}_tiny.yaml" for name in ("ppo", "grpo_code", "grpo_tool"))


def refused(config, overrides, key):
    """Loading `config` (its app's Config) with `overrides` is one line naming config key `key`."""
    from forge.cli import app_config

    with pytest.raises(ConfigError) as e:
        app_config(config, overrides)
    assert f"config key '{key}'" in one_line(e) and type(e.value) is ConfigError
    return str(e.value)


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf"])
@pytest.mark.parametrize("config", [GRPO, SFT])
def test_max_norm_must_be_a_positive_finite_number(config, value):
    """Clipping scales the gradients by max_norm / their norm: a negative one turns them around,
    0 stops every update, NaN makes NaN weights."""
    assert refused(config, [f"trainer.max_norm={value}"], "trainer.max_norm").endswith(f"got {float(value)}")


@pytest.mark.parametrize(
    "config, overrides, key",
    [
        (DPO, ["trainer.lr_decay=linear", "steps=100", "trainer.total_steps=50"], "trainer.total_steps"),
        (GRPO, ["trainer.lr_decay=sqrt", "trainer.total_steps=299"], "trainer.total_steps"),
        (PPO, ["ppo.critic.lr_decay=cosine", "ppo.critic.total_steps=300"], "ppo.critic.total_steps"),
        (SFT, ["trainer.total_steps=0"], "trainer.total_steps"),
    ],
)
def test_a_decaying_lr_schedule_is_no_shorter_than_the_run(config, overrides, key):
    """Past the schedule's end the LR of a linear or sqrt decay goes below 0 (cosine's comes back up)."""
    refused(config, overrides, key)


def test_ppo_s_policy_schedule_spans_the_steps_it_trains():
    """During `ppo.critic_warmup` the policy takes no optimizer step: its schedule is the rest."""
    from apps.schema import APPS

    cfg = load_config(PPO, ["steps=100", "ppo.critic_warmup=50", "trainer.lr_decay=linear"], APPS["grpo"])
    assert (cfg.trainer.total_steps, cfg.ppo.critic.total_steps) == (50, 100 * cfg.ppo.critic_updates)


def test_dynamic_sampling_with_groups_of_one_is_refused():
    """It drops groups whose rewards are all equal, which a group of one's always are."""
    refused(PPO, ["group_size=1", "groups_per_step=64", "dynamic_sampling=true"], "dynamic_sampling")


def test_a_resumed_run_with_more_steps_stretches_its_lr_schedule(tmp_path):
    """The schedule's length that `steps` gave is not saved with the run (`forge run --resume DIR
    steps=400` would keep the old one), one the config set is."""
    from apps.schema import APPS
    from forge.config import to_yaml

    for given, saved, resumed in (([], None, 400), (["trainer.total_steps=500"], 500, 500)):
        cfg = load_config(DPO, ["trainer.lr_decay=linear", "steps=300", *given], APPS["dpo"])
        assert cfg.trainer.total_steps == (saved or 300)
        (tmp_path / "config.yaml").write_text(to_yaml(cfg))
        assert load_config(tmp_path / "config.yaml", [], APPS["dpo"]).trainer.total_steps == (saved or 300)
        again = load_config(tmp_path / "config.yaml", ["steps=400"], APPS["dpo"])
        assert again.trainer.total_steps == resumed


@pytest.mark.parametrize("name", ["007", "yes", "1e3", "null", "run #2", "a ${b} c", "x\\${y}"])
def test_a_resumed_run_goes_on_in_its_directory_whatever_its_name(tmp_path, monkeypatch, name):
    """`--resume DIR` sets run_name to DIR's name as it is, not read as YAML (007 would be run 7,
    `run #2` run `run`) or as an interpolation."""
    import types

    from apps.schema import APPS
    from forge import cli
    from forge.config import to_yaml

    run_dir = tmp_path / name
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(to_yaml(load_config(SFT, [f"runs_dir={tmp_path}"], APPS["sft"])))
    seen = []
    monkeypatch.setitem(sys.modules, "apps.sft", types.SimpleNamespace(main=seen.append))
    cli.run(None, ["steps=7"], resume=str(run_dir))
    assert seen[0].run_dir == run_dir and seen[0].resume == str(run_dir) and seen[0].steps == 7


def test_trainer_procs_zero_is_refused_before_the_batch_is_split():
    refused(GRPO, ["trainer_procs=0"], "trainer_procs")  # was a ZeroDivisionError
    refused(SFT, ["trainer_procs=0"], "trainer_procs")


@pytest.mark.parametrize(
    "override",
    ["groups_per_step=0", "groups_per_step=-1", "trainer_procs=-1", "generator_replicas=0", "trainer_restores=-1"],
)
def test_grpo_counts_below_their_minimum_are_refused(override):
    key, value = override.split("=")
    assert refused(GRPO, [override], key).endswith(f"got {value}")


@pytest.mark.parametrize(
    "config, override, key",
    [
        (GRPO, "trainer.lr=inf", "trainer.lr"),
        (GRPO, "trainer.weight_decay=nan", "trainer.weight_decay"),
        (DPO, "trainer.loss.beta=nan", "trainer.loss.beta"),
        (GRPO, "trainer.loss.is_cap=nan", "trainer.loss.is_cap"),
        (DPO, "trainer.loss.rpo_alpha=nan", "trainer.loss.rpo_alpha"),
        (GRPO, "trainer.lora.alpha=nan", "trainer.lora.alpha"),
        (GRPO, "rewards.weights.exact=nan", "rewards.weights.exact"),
        (GRPO, "eval.rewards.exact=-inf", "eval.rewards.exact"),
        (GRPO, "distill.coef=nan", "distill.coef"),
        (GRPO, "rewards.judge.timeout_s=nan", "rewards.judge.timeout_s"),
        (CODE, "rewards.code_tests.sandbox.run_timeout=nan", "rewards.code_tests.sandbox.run_timeout"),
        (TOOL, "agentic.step_timeout_s=nan", "agentic.step_timeout_s"),
        (TINKER, "tinker.poll_s=nan", "tinker.poll_s"),
    ],
)
def test_nan_and_inf_are_refused_wherever_a_number_is_checked(config, override, key):
    assert "must be a finite number" in refused(config, [override], key)


@pytest.mark.parametrize(
    "config, override, key",
    [
        (GRPO, "trainer.transport=shmm", "trainer.transport"),
        (GRPO, "trainer.param_dtype=float33", "trainer.param_dtype"),
        (GRPO, "generator.dtype=float33", "generator.dtype"),
        (GRPO, "trainer.betas=[0.9]", "trainer.betas"),
        (GRPO, "trainer.betas=[0.9,1.0]", "trainer.betas[1]"),
        (GRPO, "trainer.warmup_steps=-3", "trainer.warmup_steps"),
        (GRPO, "trainer.keep_versions=0", "trainer.keep_versions"),  # it dropped the version just published
        (GRPO, "generator.sampling.temperature=-1", "generator.sampling.temperature"),
        (GRPO, "generator.sampling.top_p=0", "generator.sampling.top_p"),
        (GRPO, "generator.sampling.max_tokens=0", "generator.sampling.max_tokens"),
        (GRPO, "generator.max_num_seqs=0", "generator.max_num_seqs"),
        (GRPO, "generator.request_timeout_s=0", "generator.request_timeout_s"),
        (SFT, "data.noise=5", "data.noise"),
        (GRPO, "model.tiny.task=nope", "model.tiny.task"),
        (GRPO, "model.tiny.sft_steps=-1", "model.tiny.sft_steps"),  # was named 'steps', its warm start's
        (SFT, "model.tiny.sft_noise=2", "model.tiny.sft_noise"),
    ],
)
def test_a_value_out_of_its_range_or_choices_is_refused_before_anything_starts(config, override, key):
    refused(config, [override], key)


def test_a_config_runs_its_own_app():
    """`app=` on the command line would be saved with the run (whose resume then fails) while
    the config's own app runs."""
    assert "this config runs the grpo app" in refused(GRPO, ["app=sft"], "app")


@pytest.mark.parametrize(
    "text", ["app: [grpo]\n", "app: ${oc.env:FORGE_TEST_UNSET}\n", "base: ${oc.env:FORGE_TEST_UNSET}\napp: grpo\n"]
)
def test_a_config_s_app_is_a_name_and_its_base_resolves(tmp_path, monkeypatch, text):
    monkeypatch.delenv("FORGE_TEST_UNSET", raising=False)
    refused(str(write(tmp_path, text)), [], text.split(":")[0])


def test_errors_of_nested_sections_name_the_full_key():
    """The gateway's (agentic.gateway) and the critic's adapters' (ppo.critic.lora) are named where they sit."""
    refused(TOOL, ["agentic.gateway.max_n=0"], "agentic.gateway.max_n")
    refused(PPO, ["ppo.critic.lora.rank=-1"], "ppo.critic.lora.rank")
    refused(PPO, ["ppo.critic.lora.alpha=0"], "ppo.critic.lora.alpha")


@pytest.mark.parametrize(
    "rule, good, bad",
    [(">= 0", [0, 2.5], [-1, float("nan"), float("inf")]), ("(0, 1]", [1, 0.5], [0, 1.5]), ("", [-3], [float("nan")])],
)
def test_check_range(rule, good, bad):
    from forge.config import check_range

    for value in good:
        check_range("x", value, rule)
    for value in bad:
        with pytest.raises(ConfigError, match=rf"config key 'x' must be .*got {value}"):
            check_range("x", value, rule)


@pytest.mark.parametrize("name", ["../escape", "../../tmp/x", "/tmp/abs", ".", "..", "a/b"])
def test_a_run_name_is_one_directory_inside_runs_dir(name):
    """runs_dir/run_name is where a run writes (and clears its earlier metrics): a name that is
    a path would put it outside runs_dir, or make runs_dir itself the run's directory."""
    refused(GRPO, [{"run_name": name}], "run_name")


@pytest.mark.parametrize(
    "text, override, key",
    [
        ("app: grpo\nmetrics: {a: 1}\n", None, "metrics"),  # a mapping for a list
        ("app: grpo\n", "eval.k.0=3", "eval.k"),
        ("app: grpo\n", "eval.k[0]=3", "eval.k"),
        ("app: grpo\n", "dataset.mix.0.task=add", "dataset.mix"),
    ],
)
def test_a_mapping_where_a_list_goes_is_one_line_naming_the_key(tmp_path, text, override, key):
    refused(str(write(tmp_path, text)), [override] if override else [], key)


@pytest.mark.parametrize("config", [GRPO, SFT])
@pytest.mark.parametrize("value", ["0", "-5"])
def test_an_eval_s_max_tokens_is_at_least_one(config, value):
    """vLLM refuses max_tokens < 1: every eval prompt would fail, counted in eval/errors."""
    refused(config, [f"eval.max_tokens={value}"], "eval.max_tokens")


@pytest.mark.parametrize("value", ["007", "010", "0x1F", "1_000", "yes", "1e3"])
def test_a_text_key_on_the_command_line_keeps_its_text(value):
    """run_name=010 names the run 010: not YAML's octal 8 (nor `yes` True, 1e3 1000.0), a
    directory that `forge run --resume runs/010` would not find."""
    from forge.cli import app_config

    _, cfg = app_config(GRPO, [f"run_name={value}", "steps=3"])
    assert cfg.run_name == value
    _, cfg = app_config(GRPO, ["run_name=${app}_x", "steps=3"])  # an interpolation is one still
    assert cfg.run_name == "grpo_x" and cfg.steps == 3


def test_a_run_directory_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    cmd = [sys.executable, "-m", "forge.cli", "run", GRPO, f"runs_dir={tmp_path / 'file'}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith("forge: error: config key 'runs_dir'"), out.stderr


def test_a_missing_base_is_named_with_the_file_that_names_it(tmp_path):
    p = write(tmp_path, "base: gone.yaml\nname: a\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, schema=Schema)
    assert "config key 'base'" in one_line(e) and "c.yaml" in str(e.value) and "gone.yaml" in str(e.value)


def test_a_mapping_on_a_base_s_list_is_one_line_naming_the_key(tmp_path):
    (tmp_path / "base.yaml").write_text("app: grpo\nmetrics: [jsonl]\n")
    (tmp_path / "c.yaml").write_text("base: base.yaml\nmetrics: {a: 1}\n")
    assert "c.yaml" in refused(str(tmp_path / "c.yaml"), [], "metrics")


@pytest.mark.parametrize("window", ["abc", "0", "-2"])
def test_forge_curves_names_a_bad_table_window(tmp_path, capsys, window):
    """Not 'RUN_DIR: invalid literal for int()', which blames the run directories."""
    from forge import cli

    with pytest.raises(SystemExit):
        cli.main(["curves", str(tmp_path), "--out", str(tmp_path / "c.json"), "--table", "reward_mean", window])
    assert capsys.readouterr().err.strip().startswith("forge: error: --table WINDOW")


@pytest.mark.parametrize("override, key", [("trainer.betas=[0.9", "trainer.betas"), ("eval.k=[1, 2", "eval.k")])
def test_an_override_that_is_not_yaml_is_one_line_naming_its_key(override, key):
    refused(GRPO, [override], key)


@pytest.mark.parametrize("value", ["{question}", "{question} is", "[x]: {question}"])
def test_a_template_on_the_command_line_is_its_text(tmp_path, value):
    """A text key's value is the text given, braces and all, not YAML's mapping (or a parse error)."""
    from forge.cli import app_config

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "q", "answer": "a"}\n')
    _, cfg = app_config(GRPO, [f"dataset.path={rows}", f"dataset.template={value}"])
    assert cfg.dataset.template == value


@pytest.mark.parametrize(
    "override", ["agentic.sampling.n=2", "agentic.sampling.model=other", "agentic.sampling.stream=true"]
)
def test_environment_sampling_the_loop_cannot_honour_is_refused(override):
    """The environment loop asks for one reply a turn from the run's model with the env's own
    messages and tools: sampling that names those (or more choices, which would train as the
    episode's without the environment seeing them) is a config error, not every episode failing."""
    refused(TOOL, [override], override.split("=")[0])
