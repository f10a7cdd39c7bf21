"""Weight versions across hosts as deltas (forge.delta) against whole fetches, for
`forge bench weight_sync`.

The 60M model of `forge bench gateway`, published in bf16 (`trainer.publish_dtype`) by a
WeightStore with `deltas`: versions alternate between its weights and the same after one AdamW
step of a GRPO-style loss at the learning rate of `configs/grpo_qwen3_1.7b_gsm8k.yaml`, so each
version is one step from the last. A reader of another host (a process of its own, holding the
version before) fetches each version as a delta, then, beside it, whole into a file of its own
(pages already allocated, checked against the same digest). Publish -> live is the writer's
publish plus the reader's fetch, up to the version's host copy checked and named (the swap
after it is the same for both).

Links: loopback, and a link to a network namespace this benchmark creates (a veth pair, the
writer's side shaped by `tc tbf` to each rate in LINK_RATES), where the root and iproute2 can
make one; traffic goes to no other address. Run as `python -m benchmarks.weight_deltas`, this
module is the reader: one JSON request a line on stdin, one JSON answer a line on stdout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from benchmarks.common import ROOT

LINK_RATES = ("1gbit", "10gbit")  # tc's units: bits per second
NETNS, SUBNET = f"forge-bench-{os.getpid()}", "10.213.77"
LR_CONFIG = "configs/grpo_qwen3_1.7b_gsm8k.yaml"


def stepped_versions(model_dir: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float]:
    """The model's weights in bf16 before and after one AdamW step (a GRPO-style loss: random
    sequences' logprobs times +-1 advantages) at LR_CONFIG's learning rate; and that rate."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    lr = float(OmegaConf.load(ROOT / LR_CONFIG).trainer.lr)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    before = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    tokens = torch.randint(0, model.config.vocab_size, (8, 64))
    logp = torch.log_softmax(model(tokens).logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
    advantages = torch.tensor([1.0, -1.0] * 4)[:, None]
    (-(advantages * logp).mean()).backward()
    opt.step()
    after = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    return before, after, lr


# ---- the link ------------------------------------------------------------------------


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", "netns", "exec", netns, *args] if netns else list(args)
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def shaped_link(rate: str) -> Iterator[tuple[str, list[str]]]:
    """A network namespace joined to this one by a veth pair whose side here sends at `rate`:
    the address to serve on (this side's) and the command prefix that runs a reader there."""
    here, there = f"fb{os.getpid() % 100000}a", f"fb{os.getpid() % 100000}b"
    _ip("ip", "netns", "add", NETNS)
    try:
        _ip("ip", "link", "add", here, "type", "veth", "peer", "name", there)
        _ip("ip", "link", "set", there, "netns", NETNS)
        _ip("ip", "addr", "add", f"{SUBNET}.1/30", "dev", here)
        _ip("ip", "link", "set", here, "up")
        _ip("ip", "addr", "add", f"{SUBNET}.2/30", "dev", there, netns=NETNS)
        _ip("ip", "link", "set", there, "up", netns=NETNS)
        _ip("ip", "link", "set", "lo", "up", netns=NETNS)
        _ip("tc", "qdisc", "add", "dev", here, "root", "tbf", "rate", rate, "burst", "4mb", "latency", "100ms")
        yield f"{SUBNET}.1", ["ip", "netns", "exec", NETNS]
    finally:
        subprocess.run(["ip", "netns", "del", NETNS], capture_output=True, timeout=30)  # the veth pair goes with it
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=30)


def can_shape() -> str | None:
    """Why no shaped link can be made here (None: it can)."""
    if os.geteuid() != 0:
        return "not root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "no iproute2"
    try:
        with shaped_link("1gbit"):
            return None
    except (subprocess.SubprocessError, OSError) as e:
        return f"cannot make a network namespace: {e}"


# ---- the reader ----------------------------------------------------------------------


class Reader:
    """A reader of another host: this module run as a process (in `prefix`, e.g. a namespace)."""

    def __init__(self, prefix: list[str]):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "benchmarks.weight_deltas"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )

    def ask(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        if "error" in answer:
            raise RuntimeError(f"weight_deltas reader: {answer['error']}")
        return answer

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def serve_requests() -> None:
    """The reader's loop: each request a version to fetch, as `host_copy` does (delta or whole)
    or whole into a scratch file of its own (`whole`); answers the seconds and bytes moved."""
    from forge.transfer import fetch_file, host_cache_dir, host_copy, version_of

    scratch = host_cache_dir() / "bench-whole.safetensors"
    for line in sys.stdin:
        r = json.loads(line)
        addr, version = tuple(r["addr"]), r["version"]
        start = time.perf_counter()
        try:
            if r["whole"]:
                spare = scratch.with_name("bench-whole-old.safetensors")
                reuse = spare if spare.exists() else None
                moved = fetch_file(addr, r["name"], scratch, r["key"], reuse, size=r["size"], digest=r["digest"])
                os.replace(scratch, spare)
            else:
                stale = lambda name, v=version: version_of(name) < v - 1  # noqa: E731
                _, moved = host_copy(addr, r["name"], r["key"], stale, size=r["size"], digest=r["digest"], deltas=True)
            answer = {"s": time.perf_counter() - start, "moved": moved}
        except Exception as e:  # noqa: BLE001  (the benchmark's process reports it)
            answer = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), flush=True)


# ---- the measurement -----------------------------------------------------------------


async def measure_link(versions: list[dict[str, torch.Tensor]], serve_on: str, prefix: list[str], repeats: int):
    """Versions alternate between the two; per version after the first two: publish seconds,
    the delta fetch's seconds and bytes, the whole fetch's."""
    from forge.store import WeightStore

    store = WeightStore(f"bench-delta{os.getpid()}", serve_on=serve_on, deltas=True)
    reader = Reader(prefix)
    rows = []
    try:
        for v in range(1, repeats + 3):
            start = time.perf_counter()
            await store.publish(v, versions[v % 2])
            published = time.perf_counter() - start
            rec = await store.record(v)
            ask = dict(addr=rec["addr"], name=Path(rec["path"]).name, key=rec["key"], version=v)
            ask.update(size=rec["size"], digest=rec["digest"])
            got = await asyncio.to_thread(reader.ask, whole=False, **ask)
            whole = await asyncio.to_thread(reader.ask, whole=True, **ask)
            rows.append({"publish_s": published, "delta": got, "whole": whole, "size": rec["size"]})
            await store.drop_older_than(v - 1)
    finally:
        reader.close()
        await store.clear()
    steady = rows[2:]  # from the third: a delta from the version before, both into allocated files
    med = lambda f: statistics.median(f(r) for r in steady)  # noqa: E731
    publish, delta_s, whole_s = (
        med(lambda r: r["publish_s"]),
        med(lambda r: r["delta"]["s"]),
        med(lambda r: r["whole"]["s"]),
    )
    return {
        "file_mb": steady[0]["size"] / 2**20,
        "publish_s": publish,
        "delta_fetch_s": delta_s,
        "whole_fetch_s": whole_s,
        "delta_publish_to_live_s": publish + delta_s,
        "whole_publish_to_live_s": publish + whole_s,
        "delta_bytes": med(lambda r: r["delta"]["moved"]),
        "delta_bytes_ratio": med(lambda r: r["delta"]["moved"] / r["size"]),
        "delta_time_ratio": (publish + delta_s) / (publish + whole_s),  # publish -> live
        "delta_fetch_time_ratio": delta_s / whole_s,
        "runs": rows,
    }


async def measure(model_dir: str, repeats: int, shaped: bool = True) -> dict:
    """Deltas against whole fetches over loopback and (`shaped`) each shaped link, where one can be made."""
    before, after, lr = stepped_versions(model_dir)
    changed = sum(int((before[k].view(torch.int16) != after[k].view(torch.int16)).sum()) for k in before)
    result = {
        "lr": lr,
        "lr_from": LR_CONFIG,
        "changed_elements_frac": changed / sum(t.numel() for t in before.values()),
        "links": {"loopback": await measure_link([before, after], "127.0.0.1", [], repeats)},
    }
    why_not = can_shape() if shaped else "not asked for (--quick)"
    result["shaped_links_skipped"] = why_not
    if why_not is None:
        for rate in LINK_RATES:
            with shaped_link(rate) as (serve_on, prefix):
                result["links"][rate] = await measure_link([before, after], serve_on, prefix, repeats)
    return result


if __name__ == "__main__":
    serve_requests()
