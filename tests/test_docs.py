"""The manual's generated pages: the config reference covers every key of every app with its
default and its comment, and the results page is made from the benchmarks' JSON files."""

import base64
import dataclasses
import fnmatch
import hashlib
import importlib.util
import io
import json
import re
import shlex
import shutil
import sys
import tarfile
import typing
from pathlib import Path

import pytest

from apps.schema import APPS

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("forge_docs_hooks", ROOT / "docs" / "hooks.py")
hooks = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclass looks itself up there
spec.loader.exec_module(hooks)


def every_key(config, prefix=""):
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        yield prefix + f.name, value
        if dataclasses.is_dataclass(value):
            yield from every_key(value, prefix + f.name + ".")


@pytest.mark.parametrize("app", sorted(APPS))
def test_the_config_reference_lists_every_key_with_its_default(app):
    page = hooks.config_page(app)
    for path, value in every_key(APPS[app]()):
        default = "(section)" if dataclasses.is_dataclass(value) else hooks._shown(value)
        row = f"| `{path}` | "
        assert row in page, f"{app}: no row for {path}"
        line = next(line for line in page.splitlines() if line.startswith(row))
        assert f"| `{hooks._cell(default)}` |" in line, (path, default, line)
        assert not line.endswith("|  |"), f"{app}: {path} has no description"


@dataclasses.dataclass
class Undocumented:
    documented: int = 1  # what it is
    bare: int = 2


def test_a_key_without_a_comment_fails_the_reference():
    assert hooks.comment_of(Undocumented, "documented") == "what it is"
    with pytest.raises(hooks.MissingComment, match="'bare' of Undocumented"):
        hooks.keys(Undocumented())


def test_the_results_page_is_made_from_the_json_files(tmp_path):
    """The page's tables come from benchmarks/results/*.json: a value changed in a file changes
    the page; each benchmark shows its module's goal and the date and machine of each run."""
    results = tmp_path / "results"
    shutil.copytree(ROOT / "benchmarks" / "results", results)
    before = hooks.performance_page(results)
    sandbox = json.loads((results / "sandbox.json").read_text())
    sandbox["bash_fraction_of_bare"] = 0.123456
    sandbox["produced"] = {"date": "2031-01-02", "machine": "a test machine"}
    (results / "sandbox.json").write_text(json.dumps(sandbox))
    after = hooks.performance_page(results)
    assert "| `bash_fraction_of_bare` | 0.123 |" in after and "0.123 |" not in before
    assert "| | 2031-01-02 |" in after and "| machine | a test machine |" in after
    _, goal = hooks.benchmark_text("sandbox")
    assert goal and f"**Goal**: {goal}." in after
    assert all(f"## {p.stem}\n" in after for p in results.glob("*.json"))


def test_a_result_keeps_the_headline_figures_of_the_runs_before_it(tmp_path):
    from benchmarks.common import HISTORY, write_result

    out = tmp_path / "x.json"
    for run in range(4):
        write_result(out, {"speedup": float(run), "rows": {"a": {"n": run}}})
    data = json.loads(out.read_text())
    assert data["speedup"] == 3.0 and [p["speedup"] for p in data["previous"]] == [2.0, 1.0][:HISTORY]
    assert all("rows" not in p and p["produced"]["machine"] for p in data["previous"])
    assert "| `speedup` | 3 | 2 | 1 |" in hooks.performance_page(tmp_path)


def _run(directory, rewards, seconds_per_step=0.5):
    directory.mkdir(parents=True)
    rows = [{"step": i + 1, "wall_s": (i + 1) * seconds_per_step, "reward_mean": r} for i, r in enumerate(rewards)]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def test_a_figure_is_drawn_from_its_runs_metrics(tmp_path):
    """`forge curves` saves runs' metrics; the page's placeholder becomes the plot and a table
    computed from them: a value changed in the file changes both."""
    from forge.cli import main

    fast = _run(tmp_path / "runs" / "fast", [0.1, 0.2, 0.3] + [0.85] * 17 + [0.95] * 30)
    slow = _run(tmp_path / "runs" / "slow", [0.0] * 50, seconds_per_step=1.5)
    out = tmp_path / "curves" / "cmp.json"
    main(["curves", str(fast), str(slow), "--out", str(out), "--keys", "reward_mean", "--title", "t", "--command", "c"])
    block = hooks.curves_block("cmp", "guides/page.md", out.parent)
    assert "![t](../curves/cmp.png)" in block and "[curves/cmp.json](../curves/cmp.json): `c`;" in block
    # first 3: 0.2; the 20-step mean over steps 3-22 is 0.83 (steps 2-21: 0.795), over 11-30 0.9
    assert "| `fast` | 50 | 0.200 | step 22 (11 s) | step 30 (15 s) | 0.950 | 0.500 |" in block, block
    assert "| `slow` | 50 | 0.000 | not reached | not reached | 0.000 | 1.500 |" in block, block
    png = hooks.curves_png(out)
    assert png.startswith(b"\x89PNG")
    data = json.loads(out.read_text())
    data["runs"]["slow"]["reward_mean"][-1] = 1.0
    out.write_text(json.dumps(data))
    assert "| `slow` | 50 | 0.000 | not reached | not reached | 0.040 | 1.500 |" in hooks.curves_block(
        "cmp", "x.md", out.parent
    )
    assert hooks.curves_png(out) != png
    evals = tmp_path / "runs" / "evals"  # a key logged every 5 steps: its table unsmoothed, by evals
    _run(evals, [0.5] * 40)
    rows = [json.loads(line) for line in (evals / "metrics.jsonl").read_text().splitlines()]
    for r in rows[4::5]:
        r["eval/accuracy"] = 0.1 * (r["step"] // 5)  # 0.1 at step 5 ... 0.8 at step 40
    (evals / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(["curves", str(evals), "--out", str(out), "--table", "eval/accuracy", "1"])
    block = hooks.curves_block("cmp", "x.md", out.parent)
    assert "| first 3 evals | first eval >= 0.8 | first eval >= 0.9 | last 4 evals |" in block, block
    assert "| `evals` | 40 | 0.200 | step 40 (20 s) | not reached | 0.650 | 0.500 |" in block, block
    with pytest.raises(FileNotFoundError, match="x.md: <!-- curves: nope -->"):
        hooks.curves_block("nope", "x.md", out.parent)


def test_a_tinker_cookbook_log_is_drawn_on_the_seconds_it_logged(tmp_path, capsys):
    """The cookbook's metrics.jsonl has no clock, only each step's `time/total`: its wall time is
    their running sum; a row with neither clock is an error naming the file."""
    from forge.cli import main

    log = tmp_path / "math_rl_seed0"
    log.mkdir()
    rows = [{"step": i, "time/total": 2.0 + i % 2, "env/all/reward/total": 0.9} for i in range(30)]
    (log / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "curves" / "cb.json"
    key = "env/all/reward/total"
    main(["curves", str(log), "--out", str(out), "--keys", key, "--table", key, "20"])
    assert json.loads(out.read_text())["runs"]["math_rl_seed0"]["wall_s"][:3] == [2.0, 5.0, 7.0]
    block = hooks.curves_block("cb", "x.md", out.parent)
    assert "| `math_rl_seed0` | 29 | 0.900 | step 19 (50 s) | step 19 (50 s) | 0.900 | 3.000 |" in block, block
    rows[3].pop("time/total")
    (log / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit):
        main(["curves", str(log), "--out", str(out), "--keys", key])
    assert "math_rl_seed0/metrics.jsonl: a row with neither wall_s" in capsys.readouterr().err


def test_every_figure_file_is_on_a_page_and_every_page_figure_has_its_file():
    named = {m[1] for page in (ROOT / "docs").rglob("*.md") for m in hooks.PLACEHOLDER.findall(page.read_text())}
    files = {p.stem for p in hooks.CURVES.glob("*.json")}
    assert named == files
    pictures = {str(p.relative_to(ROOT)) for ext in ("png", "svg", "jpg") for p in (ROOT / "docs").rglob(f"*.{ext}")}
    assert not pictures, pictures  # figures are drawn from their runs' metrics when the site is built
    page = type("Page", (), {"file": type("File", (), {"src_uri": "guides/x.md"})})
    name = sorted(files)[0]
    text = hooks.on_page_markdown(f"- an item:\n\n    <!-- curves: {name} -->\n", page, None, None)
    assert "    ![" in text and f"](../curves/{name}.png)" in text  # indented as the placeholder: in the item
    assert all(line.startswith("    ") for line in text.splitlines()[2:] if line)


def test_a_measured_section_opens_with_its_benchmarks_last_runs(tmp_path):
    """A guide's "Measured: `forge bench NAME`" section shows the figures of the JSON file."""
    page = type("Page", (), {"file": type("File", (), {"src_uri": "guides/x.md"})})
    text = hooks.on_page_markdown("# X\n\n## Measured: `forge bench sandbox`\n\nWhat it means.\n", page, None, None)
    data = json.loads((ROOT / "benchmarks" / "results" / "sandbox.json").read_text())
    assert f"| `bash_fraction_of_bare` | {hooks._fmt(data['bash_fraction_of_bare'])} |" in text
    assert text.index("## Measured") < text.index("| machine |") < text.index("What it means.")
    assert "[Benchmark results](../results.md#sandbox)" in text
    with pytest.raises(FileNotFoundError, match="guides/x.md: its Measured section names"):
        hooks.on_page_markdown("## Measured: `forge bench nothing`\n", page, None, None)


MOVED = sorted({(app, old) for app, cls in APPS.items() for old in cls.MOVED})


@pytest.mark.parametrize("app,old", MOVED)
def test_a_key_that_moved_says_where_it_lives_now(app, old, tmp_path):
    """Each entry of an app's table of moved keys: a config that sets the old key stops with an
    error naming the key now, and the config reference lists it."""
    from forge.config import ConfigError, load_config

    new, why = APPS[app].MOVED[old]
    key, now = (old.replace("*", "exact"), new.replace("*", "exact")) if old.endswith("*") else (old, new)
    config = tmp_path / "old.yaml"
    config.write_text(f"app: {app}\n")
    with pytest.raises(ConfigError, match=f"config key '{key}' .*{why}; it is '{now}' now"):
        load_config(config, [f"{key}=1"], APPS[app])
    assert f"| `{old}` | `{new}` |" in hooks.config_page(app)


def test_a_number_that_is_a_sections_own_key_is_not_a_moved_weight():
    from forge.config import load_config

    cfg = load_config(ROOT / "configs/grpo_tiny.yaml", ["rewards.replicas=2", "rewards.weights.exact=1"], APPS["grpo"])
    assert cfg.rewards.replicas == 2 and cfg.rewards.weights == {"exact": 1.0}


def test_the_readmes_repl_loop_runs_as_written(tiny_model_dir):
    """The README's GRPO loop, pasted into `python -m asyncio` (2 steps, on the test's tiny model):
    each step trains on its groups and the generators hold the new version before the next."""
    import re
    import subprocess

    block = (ROOT / "README.md").read_text().split("```python\n", 1)[1].split("```", 1)[0]
    config = 'load_config("configs/grpo_tiny.yaml", [], GRPOConfig)'
    assert config in block and "range(30)" in block
    block = block.replace("range(30)", "range(2)")
    block = block.replace(config, config.replace("[]", f'["model.path={tiny_model_dir}", "model.tiny=null"]'))
    out = subprocess.run(
        [sys.executable, "-m", "asyncio"], input=block, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    steps = re.findall(r"step (\d+): reward [\d.]+, version (\d+)", out.stdout)
    assert steps == [("0", "1"), ("1", "2")], out.stdout[-2000:] + out.stderr[-3000:]


def test_the_readme_is_short_and_each_feature_links_to_its_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    table = readme.split("## What forge does", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| **")]
    assert len(rows) >= 10
    for row in rows:
        links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", row.rsplit("|", 2)[1])
        assert links and all((ROOT / link).exists() for link in links), row


def test_a_paragraph_in_a_list_item_is_indented_four_spaces():
    """Python-Markdown ends a list item at a paragraph indented less than 4 spaces: the rest of
    the item, and any figure in it, would leave the list."""
    wrong = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        lines, fenced = page.read_text().splitlines(), False
        for n, line in enumerate(lines):
            fenced ^= line.lstrip().startswith("```")
            if not fenced and n and not lines[n - 1].strip() and re.match(r"^ {1,3}[^ `-]", line):
                wrong.append(f"{page.relative_to(ROOT)}:{n + 1}")
    assert not wrong


def test_a_list_after_a_paragraph_has_a_blank_line_before_it():
    """Python-Markdown reads a list right under a paragraph's line as more of the paragraph."""
    wrong = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        lines, fenced = page.read_text().splitlines(), False
        for n, line in enumerate(lines):
            fenced ^= line.lstrip().startswith("```")
            above = lines[n - 1] if n else ""
            if not fenced and re.match(r"^(- |\d+\. )", line) and re.match(r"^[^\s|#>-]", above):
                wrong.append(f"{page.relative_to(ROOT)}:{n + 1}")
    assert not wrong


def test_the_diagrams_renderer_is_the_pinned_tarballs(tmp_path, monkeypatch):
    """The site ships mermaid.min.js from npm's tarball only if its sha512 is the pinned one."""

    class Response(io.BytesIO):
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    tarball = io.BytesIO()
    with tarfile.open(fileobj=tarball, mode="w:gz") as tar:
        script = b"window.mermaid = {}"
        info = tarfile.TarInfo("package/dist/mermaid.min.js")
        info.size = len(script)
        tar.addfile(info, io.BytesIO(script))
    monkeypatch.setattr(hooks.urllib.request, "urlopen", lambda url, timeout: Response(tarball.getvalue()))
    with pytest.raises(ValueError, match="not the tarball whose sha512"):
        hooks.mermaid_js(tmp_path)
    assert not list(tmp_path.iterdir())
    digest = base64.b64encode(hashlib.sha512(tarball.getvalue()).digest()).decode()
    monkeypatch.setattr(hooks, "MERMAID_SHA512", digest)
    assert hooks.mermaid_js(tmp_path) == script


def test_the_readme_and_the_home_page_draw_the_same_diagram():
    def diagram(path):
        return (ROOT / path).read_text().split("```mermaid\n", 1)[1].split("```", 1)[0]

    assert diagram("README.md") == diagram("docs/index.md")


def test_make_dataset_names_an_out_it_cannot_write(tmp_path, capsys):
    from forge.cli import main

    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as stop:
        main(["make-dataset", "--out", str(tmp_path / "file" / "x.jsonl"), "-n", "2"])
    assert stop.value.code == 2
    assert f"forge: error: --out {tmp_path / 'file' / 'x.jsonl'}: cannot write it" in capsys.readouterr().err


@pytest.mark.parametrize(
    "app,config,other", [("tinker", "configs/grpo_tiny.yaml", "grpo"), ("grpo", "configs/sft_tiny.yaml", "sft")]
)
def test_a_command_given_another_apps_config_says_whose_it_is(app, config, other, capsys):
    """`forge tinker CONFIG` and `python -m apps.NAME --config CONFIG` on a config whose `app:` is
    another app's: the error names the apps, not the first key the command's app lacks."""
    from forge.cli import run_app

    with pytest.raises(SystemExit):
        run_app(app, ["--config", str(ROOT / config)])
    err = capsys.readouterr().err
    assert "config key 'app'" in err and f"is {other!r}" in err and f"runs the {app} app" in err, err


def test_the_reward_model_guides_run_is_the_shipped_config():
    """The guide's figures for `forge run configs/rm_tiny.yaml` are of the config as shipped: its
    warm start's SFT steps, its own steps, its pairs per step and its LR."""
    from forge.config import load_config

    page = (ROOT / "docs/guides/reward-models.md").read_text()
    said = re.search(
        r"`forge run configs/rm_tiny\.yaml`: the (\d+)-step\s+warm start with a fresh score head, "
        r"(\d+) steps of (\d+) pairs, LR (\S+) (\w+);",
        page,
    )
    cfg = load_config(ROOT / "configs/rm_tiny.yaml", [], APPS["rm"])
    shipped = (cfg.model.tiny.sft_steps, cfg.steps, cfg.batch_size, cfg.trainer.lr, cfg.trainer.lr_decay)
    assert said and shipped == (int(said[1]), int(said[2]), int(said[3]), float(said[4]), said[5]), shipped


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CONFIGS = [cls() for cls in APPS.values()]
SECTIONS = {f.name for c in CONFIGS for f in dataclasses.fields(c) if dataclasses.is_dataclass(getattr(c, f.name))}
MOVED = [old for cls in APPS.values() for old in cls.MOVED]  # named by the errors that say where they went


def has_key(config, parts: list[str]) -> bool:
    """Whether the dotted `parts` are a key of `config` (below a dict, any name is)."""
    for part in parts:
        if isinstance(config, dict):
            return True
        if not dataclasses.is_dataclass(config) or part not in {f.name for f in dataclasses.fields(config)}:
            return False
        value = getattr(config, part)
        if value is None:  # an optional section (model.tiny): its class's keys
            hint = typing.get_type_hints(type(config))[part]
            value = next((t() for t in typing.get_args(hint) if dataclasses.is_dataclass(t)), None)
        config = value
    return True


def test_every_config_key_a_page_names_exists():
    """A dotted name whose first part is a config section (`generator.cpu_threads`,
    `trainer.lora.rank=8`) is a key of some app's config."""
    not_keys = {"trainer.train_step"}  # the trainer service's endpoint
    wrong = []
    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(r"(?<![\w./$-])([a-z_]+(?:\.[a-z_0-9]+)+)", text):
            parts = m[1].split(".")
            if parts[0] not in SECTIONS or parts[-1] in ("py", "md", "yaml", "json", "jsonl", "safetensors", "proto"):
                continue
            known = m[1] in not_keys or any(fnmatch.fnmatch(m[1], old) for old in MOVED)
            if not known and not any(has_key(c, parts) for c in CONFIGS):
                wrong.append(f"{page.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}: {m[1]}")
    assert not wrong, wrong


CMD = r"(?:forge (?:run|eval|tinker)|make run|python -m apps\.\w+)\b"
COMMAND = re.compile(rf"`({CMD}[^`]*)|^\s*({CMD}[^`\n#&]*)", re.M)  # inline code, or a line of a block


def page_commands(text: str):
    """Each `forge run|eval|tinker`, `make run` and `python -m apps.NAME` command of a page (a
    continued line joined) whose config is a file: (app or None, config, overrides, the keys of
    placeholders), a placeholder (`seed=S`, `model.path=$MODEL`) read as 1."""
    for m in COMMAND.finditer(re.sub(r"\\\n\s*", " ", text)):
        words = shlex.split(m[1] or m[2])
        app, config, args = None, "configs/grpo_tiny.yaml", []
        if words[:2] == ["make", "run"]:
            for w in words[2:]:
                config = w.removeprefix("CONFIG=") if w.startswith("CONFIG=") else config
                args += shlex.split(w.removeprefix("ARGS=")) if w.startswith("ARGS=") else []
        else:
            app = words[2].removeprefix("apps.") if words[0] == "python" else "tinker" if words[1] == "tinker" else None
            files = [w for w in words[2:] if w.endswith(".yaml")]
            if not files:
                continue  # CONFIG, --resume: no config file of the manual's
            config, args = files[0], words[words.index(files[0]) + 1 :]
        overrides = [a for a in args if "=" in a and not a.startswith("-")]
        placeholders = [a.split("=")[0] for a in overrides if re.search(r"=([A-Z]+|\$\w+)$", a)]
        yield app, config, [re.sub(r"=([A-Z]+|\$\w+)$", "=1", a) for a in overrides], placeholders


def test_every_command_a_page_gives_loads_its_config():
    """The configs and key=value overrides of the manual's commands load (a data file or model
    that an earlier step of its page writes may be missing here, and a placeholder is no value)."""
    from forge.cli import app_config
    from forge.config import ConfigError

    wrong = []
    for page in PAGES:
        for app, config, overrides, placeholders in page_commands(page.read_text()):
            try:
                app_config(str(ROOT / config), overrides, app)
            except ConfigError as e:
                named = re.search(r"config key '([^']+)'", str(e))
                missing = re.search(r"config key '[^']+'.*: (file not found|no HF model)", str(e))
                if not missing and not (named and named[1] in placeholders):
                    wrong.append(f"{page.relative_to(ROOT)}: {config} {' '.join(overrides)}: {e}")
    assert not wrong, wrong
