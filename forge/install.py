"""Install forge and its pinned stack into the running interpreter (the Makefile's venv).

Stdlib only: it runs before anything else is installed. Every version comes from
pyproject.toml; this file only knows the order that keeps the CPU torch in place:

1. torch alone first (here the CPU wheel on disk; on GPU hosts the CUDA build),
2. forge with its extra (`cpu` by default, FORGE_EXTRA=gpu on GPU hosts), with
   torch pinned by a constraints file so no dependency can swap it out,
3. the `no_deps` packages, whose own metadata pins other torch/monarch versions,
4. removal of the packages vLLM drags in that break imports on CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args]
    print("+ pip " + " ".join(args), flush=True)
    subprocess.run(cmd, check=True)


def cookbook() -> None:
    """The tinker-cookbook, a client of `forge tinker`, in an environment of its own (its pins
    differ from forge's: [tool.forge.cookbook]), with the CPU torch pinned as forge's."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    torch_pin = next(d for d in project["project"]["dependencies"] if d.replace(" ", "").startswith("torch=="))
    pip("install", torch_pin)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(torch_pin + "\n")
    pip("install", "-c", f.name, *project["tool"]["forge"]["cookbook"]["packages"])
    os.unlink(f.name)
    print("forge install: the tinker-cookbook is installed")


def main() -> None:
    if sys.argv[1:] == ["--cookbook"]:
        return cookbook()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps: list[str] = project["project"]["dependencies"]
    spec = project["tool"]["forge"]["install"]
    torch_pin = next(d for d in deps if d.replace(" ", "").startswith("torch=="))
    extra = os.environ.get("FORGE_EXTRA", "cpu")

    pip("install", torch_pin)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(torch_pin + "\n")
        constraints = f.name
    pip("install", "-c", constraints, "-e", f"{ROOT}[{extra},dev]")
    pip("install", "--no-deps", *spec["no_deps"])
    pip("uninstall", "-y", *spec["remove_after"])
    os.unlink(constraints)

    import importlib.metadata as md

    have = md.version("torch")
    want = torch_pin.split("==")[1]
    if not have.startswith(want):
        sys.exit(f"forge install: torch {have} replaced the pinned torch {want}")
    print(f"forge install: done (torch {have}, extra '{extra}')")


if __name__ == "__main__":
    main()
