"""The manual's pages made from the code, the benchmarks' results and runs' metrics when the site
is built (an MkDocs hook: `make docs`), so they cannot drift from them: the config reference
(every app's keys from its schema dataclasses, with the comment beside each key in the code), the
performance tables (benchmarks/results/*.json) and the learning curves (docs/curves/*.json, what
`forge curves` saved of runs' metrics: a page's `<!-- curves: NAME -->` becomes the plot, a
table of each run's figures and where they came from)."""

from __future__ import annotations

import ast
import base64
import dataclasses
import functools
import hashlib
import inspect
import io
import json
import re
import tarfile
import textwrap
import tokenize
import urllib.request
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File

from apps.schema import APPS
from forge import curves

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CURVES = ROOT / "docs" / "curves"
# Material renders ```mermaid blocks with the page's `mermaid` if there is one, else fetches it from
# a CDN: the site ships its own (npm's tarball of this version, checked), so it renders offline.
MERMAID = "11.17.2"
MERMAID_SHA512 = "V6K3C8EBdEsPFZXSKMJe6ppQOENxuHARr9GvHX4hh47lAbhMRD9qf4oEK7LoaRQxULMa80/qt5gHO73aCleBBg=="
MEASURED = re.compile(r"^## Measured: `forge bench (\w+)`\n", re.MULTILINE)
PLACEHOLDER = re.compile(r"^([ \t]*)<!-- curves: ([\w.-]+) -->", re.MULTILINE)  # indented: in a list item


class MissingComment(ValueError):
    """A config key whose dataclass field has no comment: the reference would not say what it is."""


# ---- the config reference ---------------------------------------------------------------


@functools.cache  # a class's source is parsed once, not once per key
def field_comments(cls: type) -> dict[str, str]:
    """Each field of `cls` (its own, not inherited) -> its comment in the source: the comment
    lines right above it and the comment at the end of its line, joined."""
    source = textwrap.dedent("".join(inspect.getsourcelines(cls)[0]))
    comments = {}  # line -> (text, whether the comment is the whole line)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = (tok.string.lstrip("#").strip(), tok.line.lstrip().startswith("#"))
    found = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, line = [], node.lineno - 1
        while line in comments and comments[line][1]:
            above.insert(0, comments[line][0])
            line -= 1
        beside = [comments[n][0] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        found[node.target.id] = " ".join(above + beside).strip()
    return found


def comment_of(cls: type, name: str) -> str:
    """The comment of key `name` of `cls`: where the nearest class in its MRO that declares the
    field comments it (a subclass that only changes a default keeps its base's words)."""
    for klass in cls.__mro__:
        if dataclasses.is_dataclass(klass) and name in klass.__dict__.get("__annotations__", {}):
            comment = field_comments(klass).get(name)
            if comment:
                return comment
    raise MissingComment(f"config key '{name}' of {cls.__name__} has no comment in {inspect.getsourcefile(cls)}")


@dataclasses.dataclass
class Key:
    path: str  # dotted, from the config's top
    type: str
    default: str
    comment: str


def keys(config: Any, prefix: str = "") -> list[Key]:
    """Every key of dataclass instance `config`, sections expanded after their own row."""
    rows = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        path = f"{prefix}{f.name}"
        section = dataclasses.is_dataclass(value)
        kind = str(f.type).replace(" | ", " or ")  # a | would end the table's cell
        rows.append(Key(path, kind, "(section)" if section else _shown(value), comment_of(type(config), f.name)))
        if section:
            rows += keys(value, path + ".")
    return rows


def _shown(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, list, dict, bool)) or value is None else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_page(app: str) -> str:
    """The reference page of app `app`: its keys, their types, defaults and comments."""
    cls = APPS[app]
    doc = inspect.getdoc(cls) or ""
    doc = "" if doc.startswith(f"{cls.__name__}(") else doc  # dataclass's own: its signature
    lines = [
        f"# `app: {app}`",
        "",
        f"The keys of a config whose `app:` is `{app}` (`{cls.__module__}.{cls.__name__}`), their types and",
        "defaults, and what the comment beside each in the code says. A run's config file and its",
        "`key=value` overrides name them by their dotted path. This page is generated from the code.",
        "",
        *([doc, ""] if doc else []),
        "| key | type | default | what it is |",
        "|---|---|---|---|",
    ]
    for k in keys(cls()):
        lines.append(f"| `{k.path}` | `{_cell(k.type)}` | `{_cell(k.default)}` | {_cell(k.comment)} |")
    if cls.MOVED:
        lines += [
            "",
            "## Keys that moved",
            "",
            "A config that still sets one of these stops with an error naming its key now.",
            "",
        ]
        lines += ["| key of an earlier layout | its key now | why |", "|---|---|---|"]
        lines += [f"| `{old}` | `{new}` | {_cell(why)} |" for old, (new, why) in cls.MOVED.items()]
    return "\n".join(lines) + "\n"


# ---- the performance tables ------------------------------------------------------------


def _scalar(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool)) or value is None


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return _cell(str(value))


def _table(rows: dict[str, dict]) -> list[str]:
    columns = [c for c in dict.fromkeys(c for r in rows.values() for c, v in r.items() if _scalar(v))]
    out = ["| | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, r in rows.items():
        out.append(f"| {_cell(name)} | " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |")
    return out


def _rows_of_scalars(value: dict) -> bool:
    """Whether `value` is rows (dicts) with scalars in them: one table, a row per key."""
    rows = list(value.values())
    return bool(rows) and all(isinstance(r, dict) for r in rows) and any(_scalar(x) for r in rows for x in r.values())


def _render(data: dict, depth: int) -> list[str]:
    """A result as tables: its scalars as one, each dict of dicts of scalars as another."""
    out = []
    scalars = {k: v for k, v in data.items() if _scalar(v)}
    if scalars:
        out += ["| metric | value |", "|---|---|", *(f"| `{k}` | {_fmt(v)} |" for k, v in scalars.items()), ""]
    for key, value in data.items():
        if not isinstance(value, dict) or key == "produced":
            continue
        out.append(f"{'#' * min(depth, 6)} {key}")
        out.append("")
        if _rows_of_scalars(value):
            out += [*_table(value), ""]
            for name, v in value.items():
                nested = {k: x for k, x in v.items() if isinstance(x, dict)}
                if nested:
                    out += [f"{'#' * min(depth + 1, 6)} {key}: {name}", "", *_render(nested, depth + 2)]
        else:
            out += _render(value, depth + 1)
    return out


def benchmark_text(name: str) -> tuple[str, str]:
    """What benchmark `name` measures (its docstring's first paragraph) and its GOAL, read from
    benchmarks/NAME.py (not imported: importing a benchmark imports vLLM)."""
    path = ROOT / "benchmarks" / f"{name}.py"
    if not path.exists():
        return "", ""
    tree = ast.parse(path.read_text())
    goal = next(
        (
            node.value.value
            for node in tree.body
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "GOAL" for t in node.targets)
        ),
        "",
    )
    return (ast.get_docstring(tree) or "").split("\n\n")[0].replace("\n", " "), goal


def _discussed(name: str, docs: Path) -> str:
    """Where the manual discusses benchmark `name`'s figures: its guide's "Measured" section."""
    heading = f"## Measured: `forge bench {name}`"
    for page in sorted(docs.rglob("*.md")):
        text = page.read_text()
        if heading in text:
            title = text.split("\n", 1)[0].lstrip("# ")
            return f" Discussed in [{title}]({page.relative_to(docs).as_posix()}#measured-forge-bench-{name})."
    return ""


def _runs(data: dict) -> list[str]:
    """The top-level figures of the last run and the runs before it (`previous`), side by side."""
    runs = [data, *data.get("previous", [])]
    keys = [k for k in dict.fromkeys(k for r in runs for k, v in r.items() if _scalar(v))]
    heads = [f"{(r.get('produced') or {}).get('date', '?')}" for r in runs]
    out = ["| | " + " | ".join(heads) + " |", "|---" * (len(runs) + 1) + "|"]
    out.append(
        "| machine | "
        + " | ".join(_cell((r.get("produced") or {}).get("machine", "not recorded")) for r in runs)
        + " |"
    )
    out += [f"| `{k}` | " + " | ".join(_fmt(r.get(k, "")) for r in runs) + " |" for k in keys]
    return out


def _up(page_uri: str) -> str:
    """The way from the page at `page_uri` up to the site's root."""
    return "../" * page_uri.count("/")


def measured_block(name: str, page_uri: str, results: Path = RESULTS) -> str:
    """What a guide's "Measured: `forge bench NAME`" section opens with: the top-level figures of
    the benchmark's last runs, from its JSON file."""
    path = results / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"{page_uri}: its Measured section names {path}, which does not exist")
    up = _up(page_uri)
    caption = (
        f"*The top-level figures of the last runs of `forge bench {name}` (newest first), from"
        f" `benchmarks/results/{name}.json` when this site was built; all its tables:"
        f" [Benchmark results]({up}results.md#{name}).*"
    )
    return "\n".join(["", *_runs(json.loads(path.read_text())), "", caption, ""])


def performance_page(results: Path = RESULTS, docs: Path = ROOT / "docs", curves_dir: Path = CURVES) -> str:
    """Every benchmark's result, from its JSON file (what `forge bench NAME` wrote): what it
    measures, its goal, the top-level figures of its last runs, and the last run's tables; then
    the manual's learning curves."""
    lines = [
        "# Benchmark results",
        "",
        "What `forge bench NAME` wrote to `benchmarks/results/NAME.json`, rendered when this site is",
        "built: each benchmark's goal, the top-level figures of its last runs (newest first, with the",
        "date and machine of each), and its last run's tables. [Performance](performance.md) says how",
        "they are run; each guide's *Measured* section discusses its benchmark's figures.",
        "",
    ]
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        what, goal = benchmark_text(path.stem)
        lines += [f"## {path.stem}", "", what, ""]
        lines += [f"**Goal**: {goal or 'none (reported)'}.{_discussed(path.stem, docs)}", ""]
        lines += ["### The last runs", "", *_runs(data), "", "### The last run's tables", ""]
        lines += _render(
            {k: v for k, v in data.items() if isinstance(v, dict) and k not in ("produced", "previous")}, 4
        )
    return "\n".join(lines + learning_curves(curves_dir, docs)) + "\n"


# ---- the learning curves ----------------------------------------------------------------


def curves_png(path: Path) -> bytes:
    """The plot of the curves file at `path`: every run's reward (and accuracy) vs step and time."""
    data = json.loads(path.read_text())
    png = io.BytesIO()
    curves.plot(data["runs"], png, data.get("title", ""), data.get("keys", curves.KEYS))
    return png.getvalue()


def curves_block(name: str, page_uri: str, directory: Path = CURVES) -> str:
    """What `<!-- curves: NAME -->` on the page at `page_uri` becomes: the plot of
    docs/curves/NAME.json, a table of each run's figures, and the commands, date and machine."""
    path = directory / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"{page_uri}: <!-- curves: {name} --> names {path}, which does not exist")
    data = json.loads(path.read_text())
    up = _up(page_uri)
    produced = data.get("produced") or {}
    table = curves.table(data["runs"], **data.get("table", {}))
    lines = [f"![{data.get('title') or name}]({up}curves/{name}.png)", "", *table, ""]
    command = f" `{data['command']}`;" if data.get("command") else ""
    when = f"{produced.get('date', '?')}, {produced.get('machine', 'machine not recorded')}"
    lines.append(f"*Made when this site was built from [curves/{name}.json]({up}curves/{name}.json):{command} {when}.*")
    return "\n".join(lines)


def learning_curves(directory: Path = CURVES, docs: Path = ROOT / "docs") -> list[str]:
    """Every curves file's plot and table, each with the page that discusses it."""
    lines = ["## Learning curves", "", "The runs behind the guides' figures, from their metrics (`forge curves`).", ""]
    for path in sorted(directory.glob("*.json")):
        title = json.loads(path.read_text()).get("title") or path.stem
        lines += [f"### {title}", "", curves_block(path.stem, "results.md", directory), ""]
        for page in sorted(docs.rglob("*.md")):
            text = page.read_text()
            if path.stem in (name for _, name in PLACEHOLDER.findall(text)):
                heading = text.split("\n", 1)[0].lstrip("# ")
                lines += [f"Discussed in [{heading}]({page.relative_to(docs).as_posix()}).", ""]
    return lines


# ---- the diagrams' renderer ---------------------------------------------------------------


def mermaid_js(cache: Path = ROOT / ".cache" / "docs") -> bytes:
    """mermaid.min.js of version MERMAID, from the npm registry's tarball (its sha512 checked),
    kept in `cache`."""
    kept = cache / f"mermaid-{MERMAID}.min.js"
    if not kept.exists():
        url = f"https://registry.npmjs.org/mermaid/-/mermaid-{MERMAID}.tgz"
        with urllib.request.urlopen(url, timeout=120) as response:
            tarball = response.read()
        if base64.b64encode(hashlib.sha512(tarball).digest()).decode() != MERMAID_SHA512:
            raise ValueError(f"{url}: not the tarball whose sha512 docs/hooks.py pins (MERMAID_SHA512)")
        with tarfile.open(fileobj=io.BytesIO(tarball)) as tar:
            script = tar.extractfile("package/dist/mermaid.min.js").read()
        cache.mkdir(parents=True, exist_ok=True)
        kept.write_bytes(script)
    return kept.read_bytes()


# ---- the MkDocs hook ---------------------------------------------------------------------


def on_files(files: Any, config: Any) -> Any:
    for app in APPS:
        files.append(File.generated(config, f"reference/config/{app}.md", content=config_page(app)))
    files.append(File.generated(config, "results.md", content=performance_page()))
    for path in sorted(CURVES.glob("*.json")):
        files.append(File.generated(config, f"curves/{path.stem}.png", content=curves_png(path)))
    files.append(File.generated(config, "javascripts/mermaid.min.js", content=mermaid_js()))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    def block(m: re.Match) -> str:
        return textwrap.indent(curves_block(m.group(2), page.file.src_uri), m.group(1))

    def measured(m: re.Match) -> str:
        return m.group(0) + measured_block(m.group(1), page.file.src_uri)

    return MEASURED.sub(measured, PLACEHOLDER.sub(block, markdown))
