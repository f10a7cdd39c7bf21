"""The `forge` command line: runs the app a config file names (apps/NAME.py) or its eval
(apps/evaluate.py), a command that is an app of its own (`COMMANDS`), or a benchmark
(benchmarks/NAME.py); each found by its name. A config is checked (apps/schema.py) before an app,
and torch with it, is imported."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import pkgutil
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

from forge import logs, tasks
from forge.checkpoint import RunStopped
from forge.config import ConfigError, Override, load_config, read_key, read_yaml, require_file


def fail(msg: str) -> NoReturn:
    """Stop the command with `msg` on stderr, as argparse stops on a bad option."""
    print(f"forge: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def app_config(config: str | None, overrides: list[Override], app: str | None = None) -> tuple[str, Any]:
    """The app's name (`app`, else the config's `app:` key) and its loaded Config. Only the apps'
    configs (apps/schema.py) are imported: a bad config is reported before torch loads."""
    named = None if config is None else read_key(read_yaml(config), "app", config)
    if app is None:
        if config is None:
            raise ConfigError("no config file given")
        app = named
        if not app:
            raise ConfigError(f"{config}: no top-level 'app' key (e.g. app: grpo)")
        if not isinstance(app, str):
            raise ConfigError(f"config key 'app' ({config}): expected an app's name (e.g. app: grpo), got {app}")
    elif named not in (None, app):  # checked first: the other app's keys would be reported as unknown ones
        raise ConfigError(f"config key 'app' ({config}) is {named!r}, but this command runs the {app} app")
    apps = importlib.import_module("apps.schema").APPS
    if app not in apps:
        raise ConfigError(f"config key 'app': no app named {app!r}; apps: {', '.join(apps)}")
    cfg = load_config(config, overrides, apps[app])
    if cfg.app != app:  # `app=` on the command line: the config would claim an app that does not run it
        raise ConfigError(
            f"config key 'app' is {cfg.app!r}, but this config runs the {app} app; an override does not change the app"
        )
    return app, cfg


def run(config: str | None, overrides: list[str], app: str | None = None, resume: str | None = None):
    """Load `config` (+ overrides) into the app's Config and run the app's main().
    `resume`: a run directory; its saved config.yaml is the default config."""
    try:
        if resume is not None:
            require_file("resume", Path(resume) / "config.yaml")
            config = config or str(Path(resume) / "config.yaml")
            # It goes on in its own directory, wherever this runs from (its config's runs_dir may be relative).
            found = Path(resume).resolve()  # `.` or a link: the directory itself
            # Not read as YAML: a run named 007 goes on in 007, not in 7.
            here, again = {"runs_dir": str(found.parent), "run_name": found.name}, {"resume": resume}
            overrides = [literal(here), *overrides, literal(again)]
        app, cfg = app_config(config, overrides, app)
    except ConfigError as e:
        fail(str(e))
    try:  # here, where a runs_dir that is a file or not writable is one line, not a traceback
        (cfg.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"config key 'runs_dir': cannot make the run's directory {cfg.run_dir}: {e.strerror or e}")
    logs.capture(cfg.run_dir / "logs")
    try:
        return importlib.import_module(f"apps.{app}").main(cfg)
    except (RunStopped, ConfigError) as e:  # a data file, a checkpoint: read once the run starts
        fail(str(e))


def literal(values: dict[str, str]) -> dict[str, str]:
    """Override values taken as they are: not read as YAML, and `${` not an interpolation (OmegaConf's
    escape: a backslash before it, and each backslash before that doubled)."""
    return {key: re.sub(r"(\\*)\$\{", r"\1\1\\${", value) for key, value in values.items()}


def evaluate(config: str, overrides: list[Override], model: str, out: str | None) -> dict[str, float]:
    """`forge eval`: the config's eval (apps/evaluate.py) of `model`; the config is checked first."""
    try:
        _, cfg = app_config(config, overrides)
        if not hasattr(cfg, "eval"):
            raise ConfigError(f"config key 'app': the {cfg.app} app has no eval section")
        if not cfg.eval.enabled:
            # Checked as an eval that runs: a dataset's run is evaluated on its held-out rows
            # (eval.dataset), not on the toy `task` an eval-less config falls back to.
            _, cfg = app_config(config, [*overrides, {"eval.before_train": True}])
    except ConfigError as e:
        fail(str(e))
    return importlib.import_module("apps.evaluate").main(cfg, config, model, out)


def run_app(app: str, argv: list[str] | None = None) -> None:
    """Entry point of `python -m apps.NAME --config FILE [key=value ...]`."""
    p = argparse.ArgumentParser(prog=f"python -m apps.{app}")
    p.add_argument("--config", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.lr=1e-4")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run saved in RUN_DIR")
    a = p.parse_args(argv)
    run(a.config, a.overrides, app=app, resume=a.resume)


def _benchmarks() -> list[str]:
    """The benchmarks' names, found without importing them (they may import anything)."""
    spec = importlib.util.find_spec("benchmarks")
    found = pkgutil.iter_modules(spec.submodule_search_locations) if spec else []
    return sorted(m.name for m in found if m.name != "common")


# Commands that are apps of their own (apps/NAME.py, each with `main(argv)` and its own options).
COMMANDS = {
    "serve": ("serve", "serve a model through the OpenAI API (a gateway over generator replicas)"),
    "make-tiny-model": ("tiny_model", "build the offline tiny model + tokenizer"),
}


def write_curves(a: argparse.Namespace) -> None:
    window = a.table[1] if a.table else "1"
    if not window.isdigit() or int(window) < 1:  # checked here: a ValueError below is the runs'
        fail(f"--table WINDOW: a number of values >= 1, got {window!r}")
    curves = importlib.import_module("forge.curves")  # its matplotlib and torch only for this command
    keys = a.keys or curves.KEYS
    try:
        if a.out.endswith(".json"):
            table = {"key": a.table[0], "window": int(window)} if a.table else {}
            curves.save(a.out, a.runs, keys, title=a.title, command=a.command, table=table)
        elif a.out.endswith(".png"):
            curves.plot(curves.load(a.runs, keys), a.out, a.title, keys)
        else:
            fail(f"--out {a.out}: a .png (a plot) or a .json (the curves)")
    except ValueError as e:
        fail(f"RUN_DIR: {e}")
    print(a.out)


def make_dataset(a: argparse.Namespace) -> None:
    """`forge make-dataset`: a toy task's rows as JSON lines; a bad option is one line naming it."""
    if a.task not in tasks.TASKS:
        fail(f"--task: unknown task {a.task!r}; known: {', '.join(sorted(tasks.TASKS))}")
    if Path(a.out).suffix not in (".jsonl", ".json"):
        fail(f"--out {a.out}: make-dataset writes JSON lines; name a .jsonl file")
    if a.n < 1:
        fail(f"-n: the number of rows must be at least 1, got {a.n}")
    try:
        print(tasks.write_dataset(a.out, a.task, a.n, a.seed, a.system, a.preferences))
    except OSError as e:
        fail(f"--out {a.out}: cannot write it: {e.strerror or e}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    verbose = bool(argv) and argv[0] in ("-v", "--verbose")
    argv = argv[verbose:]
    if verbose:
        logs.show_everything()
    if argv and argv[0] in COMMANDS:  # its options are its own (`forge NAME --help` lists them)
        importlib.import_module(f"apps.{COMMANDS[argv[0]][0]}").main(argv[1:])
        return
    p = argparse.ArgumentParser(prog="forge", description=__doc__)
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="the libraries' output (vLLM, Monarch, torch) on the console, not in the run's logs/",
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("tinker", help="serve the Tinker API (the tinker SDK, the cookbook) on a config's model")
    t.add_argument("config", help="YAML config of the tinker app, e.g. configs/tinker_tiny.yaml")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. tinker.port=8001")

    r = sub.add_parser("run", help="run the app named by a config file's `app` key")
    r.add_argument("config", nargs="?", help="YAML config (default with --resume: the run's saved config)")
    r.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.lr=1e-4")
    r.add_argument("--resume", metavar="RUN_DIR", help="continue the run saved in RUN_DIR (e.g. runs/grpo_tiny)")

    e = sub.add_parser("eval", help="evaluate a model on a config's eval set: prints a table, writes JSON")
    e.add_argument("config", help="an app's YAML config: its `eval` section, rewards and generator settings")
    e.add_argument("overrides", nargs="*", help="key=value overrides, e.g. eval.n=8 'eval.k=[1,8]'")
    e.add_argument("--model", required=True, help="an HF model directory, or a run directory (its exported model/)")
    e.add_argument("--out", help="the JSON file (default: eval.json in the model directory)")

    for name, (_, help) in COMMANDS.items():
        sub.add_parser(name, help=help)  # listed here, parsed by the app

    d = sub.add_parser("make-dataset", help="write a toy-task dataset as JSON lines")
    d.add_argument("--out", required=True)
    d.add_argument("--task", default="add")
    d.add_argument("-n", type=int, default=10_000)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--system", help="write chat prompts: this system turn, then the task as the user's")
    d.add_argument(
        "--preferences", action="store_true", help="add chosen (the answer) and rejected (a wrong answer) columns"
    )

    c = sub.add_parser("curves", help="runs' learning curves side by side: a PNG, or the JSON the manual draws")
    c.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories, e.g. runs/grpo_tiny")
    c.add_argument("--out", required=True, help="FILE.png: a plot; FILE.json: the curves (the manual's: docs/curves/)")
    c.add_argument("--keys", nargs="+", help="metrics to keep (default: reward_mean, accuracy, eval/accuracy)")
    c.add_argument("--title", default="", help="the plot's title")
    c.add_argument("--command", default="", help="the commands that made the runs (kept in the JSON)")
    c.add_argument(
        "--table",
        nargs=2,
        metavar=("KEY", "WINDOW"),
        help="the manual's table: of KEY, means of WINDOW values (default: reward_mean 20)",
    )

    b = sub.add_parser("bench", help="run a benchmark: prints a table, writes benchmarks/results/NAME.json")
    b.add_argument("name", choices=_benchmarks())
    b.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options, e.g. --quick")

    a, extra = p.parse_known_args(argv)
    if extra and not (a.cmd == "eval" and all("=" in x and not x.startswith("-") for x in extra)):
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if a.cmd == "bench":
        importlib.import_module(f"benchmarks.{a.name}").main(a.args)
    elif a.cmd == "run":
        if a.config and "=" in a.config:  # `forge run --resume DIR key=value`: no config file given
            a.overrides, a.config = [a.config, *a.overrides], None
        run(a.config, a.overrides, resume=a.resume)
    elif a.cmd == "tinker":
        run(a.config, a.overrides, app="tinker")
    elif a.cmd == "eval":
        evaluate(a.config, a.overrides + extra, a.model, a.out)  # key=value overrides after --model too
    elif a.cmd == "curves":
        write_curves(a)
    elif a.cmd == "make-dataset":
        make_dataset(a)


if __name__ == "__main__":
    main()
