"""What every benchmark shares: its command line, the tiny model, writing the JSON result."""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

from forge import logs
from forge.curves import machine

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def parse_args(
    name: str, doc: str, quick_help: str, argv: list[str] | None, parents: tuple[argparse.ArgumentParser, ...] = ()
) -> argparse.Namespace:
    """The command line of benchmark `name`: --quick, --out and the options of `parents` (made with add_help=False)."""
    p = argparse.ArgumentParser(description=doc, parents=list(parents))
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument(
        "--out",
        help=f"the JSON result (default: benchmarks/results/{name}.json; with --quick, runs/bench-{name}/{name}.json)",
    )
    # Monarch children import forge and the benchmark module by name.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    a = p.parse_args(argv)
    if a.out is None:  # a smoke run's figures must not replace the full run's, which the manual renders
        a.out = str(Path("runs") / f"bench-{name}" / f"{name}.json" if a.quick else RESULTS / f"{name}.json")
    logs.capture(Path("runs") / f"bench-{name}" / "logs")
    return a


def tiny_model(**dims: int) -> str:
    """The benchmark model: the tiny model untrained, or wider/deeper with `dims` (TinyModelSpec fields)."""
    from services.schema import TinyModelSpec
    from services.tiny_model import make_tiny_model

    name = "bench-tiny" + "".join(f"-{k}{v}" for k, v in sorted(dims.items()))
    return str(make_tiny_model(ROOT / ".cache/forge/models" / name, TinyModelSpec(sft_steps=0, **dims)))


HISTORY = 2  # earlier runs whose headline figures a result keeps (the manual shows the last three)


def headline(result: dict) -> dict:
    """A result's top-level figures and when and where it was produced: what `previous` keeps."""
    kept = {k: v for k, v in result.items() if isinstance(v, (int, float, str, bool)) or v is None}
    return {**kept, "produced": result.get("produced")}


def write_result(out: str | Path, result: dict) -> dict:
    """`result` as JSON at `out`, with when and on what it was produced, and the headline figures
    of the runs before it there (`previous`, newest first)."""
    out = Path(out)
    try:
        before = json.loads(out.read_text())
        previous = [headline(before), *before.get("previous", [])][:HISTORY]
    except (OSError, ValueError, AttributeError):
        previous = []
    produced = {"date": datetime.date.today().isoformat(), "machine": machine()}
    result = {**result, "produced": produced, "previous": previous}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result
