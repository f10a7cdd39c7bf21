"""`forge` command line: run an app from a config file, build the tiny model."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import Any

from forge.checkpoint import RunStopped
from forge.config import ConfigError, load_config, read_yaml, require_file


def _fail(msg: str) -> None:
    print(f"forge: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def app_config(config: str | None, overrides: list[str], app: str | None = None) -> tuple[Any, Any]:
    """The app module (named by `app`, else by the config's `app:` key) and its loaded Config."""
    if app is None:
        if config is None:
            raise ConfigError("no config file given")
        app = read_yaml(config).get("app")
        if not app:
            raise ConfigError(f"{config}: no top-level 'app' key (e.g. app: grpo)")
    try:
        module = importlib.import_module(f"apps.{app}")
    except ModuleNotFoundError as e:
        if e.name != f"apps.{app}":
            raise
        raise ConfigError(f"config key 'app': no app named {app!r} (no module apps/{app}.py)") from None
    return module, load_config(config, overrides, module.Config)


def run(config: str | None, overrides: list[str], app: str | None = None, resume: str | None = None):
    """Load `config` (+ overrides) into the app's Config and run the app's main().
    `resume`: a run directory; its saved config.yaml is the default config."""
    try:
        if resume is not None:
            require_file("resume", Path(resume) / "config.yaml")
            config = config or str(Path(resume) / "config.yaml")
            overrides = [*overrides, f"resume={resume}"]
        module, cfg = app_config(config, overrides, app)
    except ConfigError as e:
        _fail(str(e))
    try:
        return module.main(cfg)
    except RunStopped as e:
        _fail(str(e))


def evaluate(config: str, overrides: list[str], model: str, out: str | None) -> dict:
    """`forge eval`: the config's eval of `model`; prints a table, writes JSON."""
    import asyncio
    import json

    from forge.evals import evaluate_model
    from forge.gateway import model_dir

    try:
        _, cfg = app_config(config, overrides)
        if not hasattr(cfg, "eval"):
            raise ConfigError(f"config key 'app': the {cfg.app} app has no eval section")
        path = model_dir(model)
    except (ConfigError, FileNotFoundError) as e:
        _fail(str(e))
    result = asyncio.run(evaluate_model(cfg, str(path)))
    print(f"{'metric':<24}{'value':>10}")
    for key, value in result.items():
        print(f"{key:<24}{value:>10.4g}")
    target = Path(out) if out else path / "eval.json"
    target.write_text(json.dumps({"model": str(path), "config": config, **result}, indent=2) + "\n")
    print(f"forge eval: {len(result)} metrics of {path} -> {target}")
    return result


def run_app(app: str, argv: list[str] | None = None) -> None:
    """Entry point of `python -m apps.NAME --config FILE [key=value ...]`."""
    p = argparse.ArgumentParser(prog=f"python -m apps.{app}")
    p.add_argument("--config", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.lr=1e-4")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run saved in RUN_DIR")
    a = p.parse_args(argv)
    run(a.config, a.overrides, app=app, resume=a.resume)


def _benchmarks() -> list[str]:
    import pkgutil

    import benchmarks

    return sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__) if m.name != "common")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="forge", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="run the app named by a config file's `app` key")
    r.add_argument("config", nargs="?", help="YAML config (default with --resume: the run's saved config)")
    r.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.lr=1e-4")
    r.add_argument("--resume", metavar="RUN_DIR", help="continue the run saved in RUN_DIR (e.g. runs/grpo_tiny)")

    m = sub.add_parser("make-tiny-model", help="build the offline tiny Qwen3 model + tokenizer")
    m.add_argument("--out", required=True, help="output directory (HF format)")
    m.add_argument("--task", default="add", help="toy task for the warm start")
    m.add_argument(
        "--sft-steps", type=int, default=0, help="warm-start steps of the SFT app on the task (0: random init)"
    )
    m.add_argument("--sft-noise", type=float, default=0.0, help="fraction of warm-start answer characters made random")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--force", action="store_true", help="rebuild even if cached")

    d = sub.add_parser("make-dataset", help="write a toy-task dataset as JSON lines")
    d.add_argument("--out", required=True)
    d.add_argument("--task", default="add")
    d.add_argument("-n", type=int, default=10_000)
    d.add_argument("--seed", type=int, default=0)

    v = sub.add_parser("serve", help="serve a model through the OpenAI API (a gateway over generator replicas)")
    v.add_argument("model", help="an HF model directory, or a run directory (its exported model/)")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--host", default="127.0.0.1", help="set it to listen beyond this machine")
    v.add_argument("--replicas", type=int, default=1, help="generator replicas (vLLM engines)")
    v.add_argument(
        "--api-key",
        default=os.environ.get("FORGE_API_KEY"),
        help="the key clients must send (default: $FORGE_API_KEY; none needed on 127.0.0.1, required beyond)",
    )
    v.add_argument("--max-model-len", type=int, help="default: the model's own context length")
    v.add_argument("--dtype", default="float32")
    v.add_argument("--chat-template", help="a Jinja file or string (default: the tokenizer's)")
    v.add_argument("--tool-parser", help="a vLLM tool parser, e.g. hermes")
    v.add_argument("--reasoning-parser", help="a vLLM reasoning parser, e.g. qwen3")

    e = sub.add_parser("eval", help="evaluate a model on a config's eval set: prints a table, writes JSON")
    e.add_argument("config", help="an app's YAML config: its `eval` section, rewards and generator settings")
    e.add_argument("overrides", nargs="*", help="key=value overrides, e.g. eval.n=8 'eval.k=[1,8]'")
    e.add_argument("--model", required=True, help="an HF model directory, or a run directory (its exported model/)")
    e.add_argument("--out", help="the JSON file (default: eval.json in the model directory)")

    b = sub.add_parser("bench", help="run a benchmark: prints a table, writes benchmarks/results/NAME.json")
    b.add_argument("name", choices=_benchmarks())
    b.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options, e.g. --quick")

    a, extra = p.parse_known_args(argv)
    if extra and not (a.cmd == "eval" and all("=" in x and not x.startswith("-") for x in extra)):
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:  # key=value overrides after --model
        a.overrides += extra
    if a.cmd == "bench":
        importlib.import_module(f"benchmarks.{a.name}").main(a.args)
    elif a.cmd == "run":
        if a.config and "=" in a.config:  # `forge run --resume DIR key=value`: no config file given
            a.overrides, a.config = [a.config, *a.overrides], None
        run(a.config, a.overrides, resume=a.resume)
    elif a.cmd == "eval":
        evaluate(a.config, a.overrides, a.model, a.out)
    elif a.cmd == "serve":
        import asyncio

        from forge.gateway import GatewayConfig, serve
        from services.generator import GeneratorConfig

        cfg = GatewayConfig(
            host=a.host,
            port=a.port,
            sessions=False,
            api_key=a.api_key,
            chat_template=a.chat_template,
            tool_parser=a.tool_parser,
            reasoning_parser=a.reasoning_parser,
        )
        try:
            asyncio.run(serve(a.model, cfg, GeneratorConfig(max_model_len=a.max_model_len, dtype=a.dtype), a.replicas))
        except (FileNotFoundError, ValueError) as e:
            _fail(str(e))
    elif a.cmd == "make-tiny-model":
        import json

        from forge import tasks
        from forge.tiny_model import BUILD_FILE, TinyModelSpec, make_tiny_model

        if a.task not in tasks.TASKS:
            _fail(f"--task: unknown task {a.task!r}; known: {', '.join(sorted(tasks.TASKS))}")
        out = make_tiny_model(
            a.out, TinyModelSpec(task=a.task, sft_steps=a.sft_steps, sft_noise=a.sft_noise, seed=a.seed), force=a.force
        )
        info = json.loads((Path(out) / BUILD_FILE).read_text())
        print(f"tiny model in {out}: {info['parameters']:,} parameters, built in {info['build_seconds']} s")
    elif a.cmd == "make-dataset":
        from forge import tasks

        if a.task not in tasks.TASKS:
            _fail(f"--task: unknown task {a.task!r}; known: {', '.join(sorted(tasks.TASKS))}")
        print(tasks.write_dataset(a.out, a.task, a.n, a.seed))


if __name__ == "__main__":
    main()
