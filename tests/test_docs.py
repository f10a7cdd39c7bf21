"""The manual's generated pages: the config reference covers every key of every app with its
default and its comment, and the results page is made from the benchmarks' JSON files."""

import dataclasses
import importlib.util
import json
import shutil
import sys
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
    results = tmp_path / "results"
    shutil.copytree(ROOT / "benchmarks" / "results", results)
    before = hooks.performance_page(results)
    sandbox = json.loads((results / "sandbox.json").read_text())
    sandbox["fraction_of_bare_exec"] = 0.123456
    sandbox["produced"] = {"date": "2031-01-02", "machine": "a test machine"}
    (results / "sandbox.json").write_text(json.dumps(sandbox))
    after = hooks.performance_page(results)
    assert "| `fraction_of_bare_exec` | 0.123 |" in after and "0.123" not in before
    assert "`forge bench sandbox` on a test machine, 2031-01-02." in after
    assert all(f"## {p.stem}\n" in after for p in results.glob("*.json"))
