"""`forge tinker` through the real `tinker` SDK, as users run it: the server is a `forge tinker`
process, the clients are the SDK (in this process, or processes of their own); then the attacks,
each on the check that stops it (raw HTTP, as a hostile client sends it)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import tinker
from roles import role
from test_gateway import forge_serve
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker_client import letter_ids, rl_step, supervised_data

from forge.config import ConfigError
from services.schema import TinkerConfig

KEY_A, KEY_B = "tml-" + "a" * 28, "tml-" + "b" * 28
TESTS = Path(__file__).resolve().parent


def forge_tinker(model: Path, runs: Path, *overrides: str) -> tuple[subprocess.Popen, str, Path]:
    """A `forge tinker` process on a free loopback port, once it says it serves: (process, base URL, its log)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = runs / "server.log"
    args = [f"model.path={model}", "model.tiny=null", f"tinker.port={port}", f"runs_dir={runs}", *overrides]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "forge.cli", "tinker", "configs/tinker_tiny.yaml", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=TESTS.parent,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    deadline = time.monotonic() + 240
    while "forge tinker: base model" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"forge tinker did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return proc, f"http://127.0.0.1:{port}", log


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """One `forge tinker` for the module: two API keys (two owners), small limits to attack."""
    runs = tmp_path_factory.mktemp("tinker")
    limits = ["tinker.max_request_bytes=2000000", "tinker.max_seq_len=200", "tinker.max_samples=16"]
    limits += ["tinker.max_models=32"]  # each key holds half: KEY_A's tests make many, closed at their timeout
    keys = f"tinker.api_keys=[{KEY_A},{KEY_B}]"
    proc, url, log = forge_tinker(tiny_model_dir, runs, keys, "tinker.session_timeout_s=20", "tinker.seed=7", *limits)
    yield url, runs, log, proc
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def client(url: str, key: str = KEY_A):
    sc = tinker.ServiceClient(base_url=url, api_key=key)
    base = tinker.RestClient(base_url=url, api_key=key).get_server_capabilities().result()
    return sc, base.supported_models[0].model_name


def test_supervised_loop_lowers_the_loss_and_forward_is_forward_backward_without_a_step(server):
    url, *_ = server
    sc, base = client(url)
    tc = sc.create_lora_training_client(base_model=base, rank=8, seed=0).result()
    data = supervised_data(tc.get_tokenizer())
    before = tc.forward(data, "cross_entropy").result()
    losses = []
    for _ in range(8):
        out = tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(out.metrics["loss:sum"])
    # A forward of the fresh adapter is the first step's loss and logprobs (no gradient was applied).
    assert before.metrics["loss:sum"] == pytest.approx(losses[0], rel=1e-5)
    lp = np.asarray(before.loss_fn_outputs[0]["logprobs"].tolist())
    assert lp.shape == (len(data[0].loss_fn_inputs["target_tokens"].tolist()),) and (lp <= 0).all()
    # Tinker's cross_entropy is the sum of the weighted token losses.
    weights = np.concatenate([d.loss_fn_inputs["weights"].to_numpy() for d in data])
    logprobs = np.concatenate([o["logprobs"].to_numpy() for o in before.loss_fn_outputs])
    assert before.metrics["loss:sum"] == pytest.approx(-(weights * logprobs).sum(), rel=1e-4)
    assert losses[-1] < 0.5 * losses[0], losses


def test_rl_loop_raises_the_reward(server):
    """sample -> reward -> forward_backward(importance_sampling) -> optim_step ->
    save_weights_and_get_sampling_client: the share of lowercase letters a random model writes rises."""
    url, *_ = server
    sc, base = client(url)
    tc = sc.create_lora_training_client(base_model=base, rank=8, seed=0).result()
    tok = tc.get_tokenizer()
    prompt, good = tok.encode("x=", add_special_tokens=False), letter_ids(tok)
    rewards = [rl_step(tc, tc.save_weights_and_get_sampling_client().result(), tok, prompt, good) for _ in range(12)]
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.3, rewards


def test_save_then_resume_in_a_new_process_continues_where_it_stopped(server, tmp_path):
    url, runs, *_ = server
    sc, base = client(url)
    tc = sc.create_lora_training_client(base_model=base, rank=8, seed=3).result()
    tok = tc.get_tokenizer()
    first, second, probe = supervised_data(tok, 4), supervised_data(tok, 4, offset=4), supervised_data(tok, 4, offset=8)
    for _ in range(3):
        tc.forward_backward(first, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("resume-me").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/resume-me")
    tc.forward_backward(second, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    went_on = tc.forward(probe, "cross_entropy").result().metrics["loss:sum"]
    # A new process loads the checkpoint (weights and Adam's state) and takes the same step.
    script = (
        "import sys, json, tinker; from tinker import types; sys.path.insert(0, sys.argv[3]);"
        "from tinker_client import supervised_data;"
        "sc = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2]);"
        "tc = sc.create_training_client_from_state_with_optimizer(sys.argv[4]).result(); tok = tc.get_tokenizer();"
        "tc.forward_backward(supervised_data(tok, 4, offset=4), 'cross_entropy').result();"
        "tc.optim_step(types.AdamParams(learning_rate=1e-2)).result();"
        "print(json.dumps(tc.forward(supervised_data(tok, 4, offset=8), 'cross_entropy').result().metrics['loss:sum']))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, url, KEY_A, str(TESTS), path], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    resumed = json.loads(out.stdout.strip().splitlines()[-1])
    assert abs(resumed - went_on) < 1e-5 * max(1.0, abs(went_on)), (resumed, went_on)
    # Without the optimizer's state, the same step is another one.
    tc2 = sc.create_training_client_from_state(path).result()
    tc2.forward_backward(second, "cross_entropy").result()
    tc2.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert abs(tc2.forward(probe, "cross_entropy").result().metrics["loss:sum"] - went_on) > 1e-3
    rest = tinker.RestClient(base_url=url, api_key=KEY_A)
    assert path in [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
    assert (runs / "tinker_tiny" / "tinker").is_dir()
    rest.set_checkpoint_ttl_from_tinker_path(path, 3600).result()  # the SDK's own calls
    (listed,) = [c for c in rest.list_user_checkpoints().result().checkpoints if c.tinker_path == path]
    assert listed.expires_at is not None
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert path not in [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]


def test_two_clients_in_two_processes_each_sample_with_their_own_adapter(server):
    """Two processes train at once (one toward 'abc', one toward 'xyz'): what each one's sampler
    draws has its own trainer's logprobs, and the two trainers' differ."""
    url, *_ = server
    procs = [
        subprocess.Popen(
            [sys.executable, str(TESTS / "tinker_client.py"), url, key, letters, "6"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for key, letters in ((KEY_A, "abc"), (KEY_B, "xyz"))
    ]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-2000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    for out in outs:
        assert np.allclose(out["sampler"], out["trainer"], atol=2e-3), (out["sampler"], out["trainer"])
    assert np.abs(np.subtract(outs[0]["probe"], outs[1]["probe"])).max() > 0.05


def test_prompt_logprobs_are_each_samplers_own_in_a_batch_of_several_adapters(server):
    """Two samplers of two differently trained adapters, and a long generation of a third policy, in
    the generators' batches at once: each sampler's prompt logprobs (`compute_logprobs`) are its
    trainer's. vLLM alone takes the batch's adapters for prompt logits: wrong values, a dead engine."""
    url, *_ = server
    sc, base = client(url)
    trained = []
    for offset in (0, 40):
        tc = sc.create_lora_training_client(base_model=base, rank=4, seed=offset).result()
        data = supervised_data(tc.get_tokenizer(), offset=offset)
        for _ in range(3):
            tc.forward_backward(data, "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=3e-2)).result()
        trained.append((tc, tc.save_weights_and_get_sampling_client().result()))
    tok = trained[0][0].get_tokenizer()
    probes = [tok.encode(f"{i}+{i}={2 * i}", add_special_tokens=False) for i in (3, 41)]
    busy = trained[1][1].sample(
        types.ModelInput.from_ints(probes[0]), num_samples=8, sampling_params=types.SamplingParams(max_tokens=60)
    )
    asked = [(tc, p, s.compute_logprobs(types.ModelInput.from_ints(p))) for tc, s in trained for p in probes]
    got = [(tc, p, f.result()) for tc, p, f in asked]
    busy.result()
    for tc, probe, prompt_lps in got:
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(probe[:-1]),
            loss_fn_inputs={"target_tokens": probe[1:], "weights": [1.0] * (len(probe) - 1)},
        )
        own = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        assert prompt_lps[0] is None and np.allclose(prompt_lps[1:], own, atol=2e-3), (prompt_lps, own)
    # The two adapters differ where it is checked.
    assert np.abs(np.subtract(got[0][2][1:], got[2][2][1:])).max() > 0.05
    last = trained[0][1].compute_logprobs(types.ModelInput.from_ints(probes[0]), prompt_logprobs_last_n=2).result()
    assert all(lp is None for lp in last[:-2]) and np.allclose(last[-2:], got[0][2][-2:], atol=1e-4)


def test_a_seed_on_a_prompt_prefilled_in_chunks_costs_nothing(server):
    """16 seeded samples of 150-token prompts at once, more than vLLM prefills in one step (2048
    tokens): some prompts are prefilled in chunks, where vLLM rewinds a seeded generator by an
    offset only CUDA generators have (on CPU the engine died, with every request in it). All
    answer, and the seed gives the same tokens alone."""
    url, *_ = server
    sc, base = client(url)
    sampler = sc.create_sampling_client(base_model=base).result()
    prompts = [[(7 * i + j) % 90 + 3 for j in range(150)] for i in range(16)]
    params = types.SamplingParams(max_tokens=4, seed=11, temperature=1.0)
    asked = [sampler.sample(types.ModelInput.from_ints(p), 1, params) for p in prompts]
    first = [f.result().sequences[0].tokens for f in asked]
    alone = sampler.sample(types.ModelInput.from_ints(prompts[-1]), 1, params).result().sequences[0].tokens
    assert all(first) and alone == first[-1], (first, alone)
    # Without a seed, each request draws the next of the server's (tinker.seed): not one for all.
    params = types.SamplingParams(max_tokens=8, temperature=1.0)
    drawn = [sampler.sample(types.ModelInput.from_ints(prompts[0]), 4, params).result() for _ in range(2)]
    assert [s.tokens for s in drawn[0].sequences] != [s.tokens for s in drawn[1].sequences]


# ---- bad input and hostile clients (raw HTTP, as they send it) ------------------------


def api(url: str, key: str | None = KEY_A) -> httpx.Client:
    return httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": key} if key else {}, timeout=60)


def new_session(http: httpx.Client) -> str:
    return http.post("/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "x"}).json()["session_id"]


def session_and_model(http: httpx.Client, rank: int = 4) -> tuple[str, str]:
    sid = new_session(http)
    base = http.get("/get_server_capabilities").json()["supported_models"][0]["model_name"]
    body = {"session_id": sid, "model_seq_id": 0, "base_model": base, "lora_config": {"rank": rank}}
    handle = http.post("/create_model", json=body).json()
    assert wait(http, handle["request_id"])["model_id"] == handle["model_id"]
    return sid, handle["model_id"]


def wait(http: httpx.Client, rid: str) -> dict | bytes:
    for _ in range(20):
        r = http.post("/retrieve_future", json={"request_id": rid})
        if r.headers["content-type"].startswith("application/x-protobuf"):
            return r.content
        if r.json().get("type") != "try_again":
            return r.json()
    raise AssertionError(f"{rid} never finished")


def fwdbwd(model_id: str, seq: int, tokens: list[int], **inputs: tuple[int, np.ndarray]) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens, dtype="<i4").tobytes()
    for name, (dtype, arr) in inputs.items():
        datum.loss_fn_inputs[name].CopyFrom(pb.Tensor(dense=arr.tobytes(), dtype=dtype, shape=[len(arr)]))
    return msg.SerializeToString()


def good_inputs(n: int) -> dict:
    return {"target_tokens": (pb.DTYPE_INT64, np.full(n, 5, "<i8")), "weights": (pb.DTYPE_FLOAT32, np.ones(n, "<f4"))}


PROTO = {"content-type": "application/x-protobuf"}


def test_a_key_is_required_and_only_its_owner_reaches_a_session(server):
    url, *_ = server
    assert api(url, None).post("/create_session", json={}).status_code == 401
    assert api(url, "tml-" + "c" * 28).post("/create_session", json={}).status_code == 401
    assert api(url, None).get("/healthz").json() == {"status": "ok"}
    a, b = api(url, KEY_A), api(url, KEY_B)
    sid, model = session_and_model(a)
    # B knows A's ids (a log, a shared path): still no way in to A's session, model, checkpoint, sampler.
    assert b.post("/session_heartbeat", json={"session_id": sid}).status_code == 410
    r = b.post("/forward_backward", content=fwdbwd(model, 1, [1, 2, 3], **good_inputs(3)), headers=PROTO)
    assert r.status_code == 400 and "no model" in r.json()["detail"]
    own = a.post("/forward_backward", content=fwdbwd(model, 1, [1, 2, 3], **good_inputs(3)), headers=PROTO).json()
    assert b.post("/retrieve_future", json={"request_id": own["request_id"]}).status_code == 404
    assert isinstance(wait(a, own["request_id"]), bytes)  # A's own step went through
    saved = wait(a, a.post("/save_weights", json={"model_id": model, "path": "mine", "seq_id": 2}).json()["request_id"])
    sampler = wait(
        a,
        a.post("/save_weights_for_sampler", json={"model_id": model, "sampling_session_seq_id": 0, "seq_id": 3}).json()[
            "request_id"
        ],
    )
    b_sid = new_session(b)
    load = {"session_id": b_sid, "model_seq_id": 0, "path": saved["path"], "optimizer": True}
    r = b.post("/load_weights", json=load)
    assert r.status_code == 400 and "no checkpoint" in r.json()["detail"]
    for path in ("tinker://../weights/mine", f"tinker://{model}/weights/..", "../../etc/passwd"):  # no way out of runs/
        r = a.post("/load_weights", json={**load, "session_id": sid, "path": path})
        assert r.status_code == 400 and "expected tinker://MODEL_ID/weights/NAME" in r.json()["detail"], path
    prompt = {"chunks": [{"tokens": [1, 2], "type": "encoded_text"}]}
    sample = {
        "sampling_session_id": sampler["sampling_session_id"],
        "seq_id": 0,
        "prompt": prompt,
        "sampling_params": {"max_tokens": 2},
    }
    r = b.post("/asample", json=sample)
    assert r.status_code == 400 and "no sampling session" in r.json()["detail"]
    assert saved["path"] not in json.dumps(b.get("/checkpoints").json())
    assert saved["path"] in json.dumps(a.get("/checkpoints").json())


def test_bad_requests_are_named_and_cost_nothing_else(server):
    url, *_ = server
    a = api(url)
    sid, model = session_and_model(a)

    def refused(path: str, status: int, text: str, **kw) -> None:
        r = a.post(path, **kw)
        assert r.status_code == status and text in r.json()["detail"], (r.status_code, r.text)

    refused("/forward_backward", 400, "not a ForwardBackwardRequest protobuf", content=b"\xff\xff\xff", headers=PROTO)
    unknown = fwdbwd(model, 1, [1, 2], **good_inputs(2)) + bytes([0xF8, 0x07, 0x01])  # field 127
    refused("/forward_backward", 400, "unknown protobuf field(s) [127]", content=unknown, headers=PROTO)
    short = good_inputs(2)
    short["weights"] = (pb.DTYPE_FLOAT32, np.ones(1, "<f4"))
    refused(
        "/forward_backward",
        400,
        "1 values for 2 input tokens",
        content=fwdbwd(model, 1, [1, 2], **short),
        headers=PROTO,
    )
    refused(
        "/forward_backward",
        400,
        "outside the vocabulary",
        content=fwdbwd(model, 1, [1, 100000], **good_inputs(2)),
        headers=PROTO,
    )
    bad_target = good_inputs(2)
    bad_target["target_tokens"] = (pb.DTYPE_INT64, np.array([5, 100000], "<i8"))
    content = fwdbwd(model, 1, [1, 2], **bad_target)
    refused("/forward_backward", 400, "target_tokens: token ids outside the vocabulary", content=content, headers=PROTO)
    content = fwdbwd(model, 1, [-1, 2], **good_inputs(2))
    refused("/forward_backward", 400, "model_input: token ids outside the vocabulary", content=content, headers=PROTO)
    nan = good_inputs(2)
    nan["weights"] = (pb.DTYPE_FLOAT32, np.array([1, np.nan], "<f4"))
    refused("/forward_backward", 400, "NaN", content=fwdbwd(model, 1, [1, 2], **nan), headers=PROTO)
    refused(
        "/forward_backward",
        400,
        "a datum has 1 to 200",
        content=fwdbwd(model, 1, [1] * 201, **good_inputs(201)),
        headers=PROTO,
    )
    refused("/forward_backward", 413, "tinker.max_request_bytes", content=b"\0" * 3_000_000, headers=PROTO)
    # Without a Content-Length (chunked), the limit holds as the body streams in.
    chunked = (b"\0" * 100_000 for _ in range(30))
    refused("/forward_backward", 413, "tinker.max_request_bytes", content=chunked, headers=PROTO)
    refused(
        "/forward_backward", 415, "compressed", content=b"(\xb5/\xfd", headers={**PROTO, "content-encoding": "zstd"}
    )
    refused(
        "/optim_step",
        400,
        "Extra inputs are not permitted",
        json={"model_id": model, "seq_id": 1, "adam_params": {}, "lr": 1},
    )
    refused("/save_weights", 400, "a checkpoint name is", json={"model_id": model, "seq_id": 1, "path": "../../escape"})
    prompt = {"chunks": [{"tokens": [1, 2], "type": "encoded_text"}]}
    sampler = wait(
        a,
        a.post("/save_weights_for_sampler", json={"model_id": model, "sampling_session_seq_id": 0, "seq_id": 1}).json()[
            "request_id"
        ],
    )
    sample = {
        "sampling_session_id": sampler["sampling_session_id"],
        "seq_id": 0,
        "prompt": prompt,
        "sampling_params": {"max_tokens": 2},
    }
    refused("/asample", 400, "tinker.max_samples", json={**sample, "num_samples": 17})
    refused("/asample", 400, "sampling_params.max_tokens", json={**sample, "sampling_params": {"max_tokens": 100000}})
    refused("/asample", 400, "topk_sample_logprobs is not supported", json={**sample, "topk_sample_logprobs": 2})
    refused("/asample", 400, "topk_prompt_logprobs 21; 0 to 20", json={**sample, "topk_prompt_logprobs": 21})
    refused("/asample", 400, "prompt_logprobs_last_n 9", json={**sample, "prompt_logprobs_last_n": 9})
    # A loss or loss input forge does not serve fails the request (its future), naming it.
    msg = pb.ForwardBackwardRequest.FromString(fwdbwd(model, 2, [1, 2], **good_inputs(2)))
    msg.loss_fn = "dro"
    refused("/forward_backward", 400, "unknown loss 'dro'", content=msg.SerializeToString(), headers=PROTO)
    # Nothing above cost the model anything: its next request (seq 2) trains.
    out = pb.ForwardBackwardOutput.FromString(
        wait(
            a,
            a.post("/forward_backward", content=fwdbwd(model, 2, [1, 2], **good_inputs(2)), headers=PROTO).json()[
                "request_id"
            ],
        )
    )
    assert np.isfinite(out.metrics["loss:sum"])


def test_requests_apply_in_seq_id_order_and_once(server):
    url, *_ = server
    a = api(url)
    _, model = session_and_model(a)
    # seq 2 arrives before seq 1 (the SDK sends a forward_backward's first chunk last): it waits.
    second = a.post("/forward_backward", content=fwdbwd(model, 2, [1, 2, 3], **good_inputs(3)), headers=PROTO).json()
    early = a.post("/retrieve_future", json={"request_id": second["request_id"]}, timeout=60).json()
    assert early.get("type") == "try_again", early
    first = a.post("/forward_backward", content=fwdbwd(model, 1, [1, 2, 3], **good_inputs(3)), headers=PROTO).json()
    # A retry of seq 1 (same seq_id, new idempotency key) is the same request, not a second one.
    again = a.post("/forward_backward", content=fwdbwd(model, 1, [1, 2, 3], **good_inputs(3)), headers=PROTO).json()
    assert again["request_id"] == first["request_id"]
    losses = [
        pb.ForwardBackwardOutput.FromString(wait(a, h["request_id"])).metrics["loss:sum"] for h in (first, second)
    ]
    assert losses[0] == pytest.approx(losses[1])  # no step between them
    step = a.post("/optim_step", json={"model_id": model, "seq_id": 3, "adam_params": {"learning_rate": 0.01}}).json()
    assert "grad_norm:mean" in wait(a, step["request_id"])["metrics"]


def test_a_session_without_heartbeats_is_closed_and_its_adapter_freed(server):
    url, _, log, _ = server
    a = api(url)
    sid, model = session_and_model(a)
    time.sleep(30)  # session_timeout_s=20, no heartbeat
    r = a.post("/forward_backward", content=fwdbwd(model, 1, [1, 2], **good_inputs(2)), headers=PROTO)
    assert r.status_code == 400 and "no model" in r.json()["detail"]
    assert a.post("/session_heartbeat", json={"session_id": sid}).status_code == 410


@pytest.mark.slow  # 60 s: a generator's respawn
def test_a_respawned_generator_serves_the_samplers_it_had(server):
    """SIGKILL the generator's process: its replacement loads every live sampler's adapter again
    (the server keeps them as the generator service's restore point), so a sampler made before
    the crash samples as it did; without that, its policy is unknown to the new replica."""
    url, _, _, proc = server
    sc, base = client(url)
    tc = sc.create_lora_training_client(base_model=base, rank=4, seed=3).result()
    tok = tc.get_tokenizer()
    data = supervised_data(tok)
    for _ in range(3):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=3e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    probe = types.ModelInput.from_ints(tok.encode("7+7=14", add_special_tokens=False))
    before = sampler.compute_logprobs(probe).result()
    role(psutil.Process(proc.pid), "generator").kill()
    after = sampler.compute_logprobs(probe).result()
    assert np.allclose(before[1:], after[1:], atol=1e-4), (before, after)


@pytest.mark.slow  # 60 s: a `forge serve` process and its engine
def test_forge_serve_serves_a_sampler_checkpoint(server):
    """`forge serve BASE --lora NAME=DIR` of a `save_weights_for_sampler` directory: the OpenAI API
    answers with that adapter as the Tinker sampler does (prompt logprobs, with requests of the
    base model in the same batches)."""
    import openai

    url, runs, *_ = server
    sc, base = client(url)
    tc = sc.create_lora_training_client(base_model=base, rank=4, seed=5).result()
    tok = tc.get_tokenizer()
    for _ in range(3):
        tc.forward_backward(supervised_data(tok), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=3e-2)).result()
    path = tc.save_weights_for_sampler("served").result().path
    where = (
        runs / "tinker_tiny" / "tinker" / path.removeprefix("tinker://").split("/")[0] / "sampler_weights" / "served"
    )
    probe = tok.encode("7+7=14", add_special_tokens=False)
    want = (
        sc.create_sampling_client(model_path=path).result().compute_logprobs(types.ModelInput.from_ints(probe)).result()
    )
    proc, port, _ = forge_serve(base, "--prompt-logprobs", "--lora", f"mine={where}")
    try:
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        names = ["mine", Path(base).name] * 2
        with ThreadPoolExecutor(len(names)) as pool:
            asked = [
                pool.submit(api.completions.create, model=m, prompt=probe, max_tokens=1, echo=True, logprobs=0)
                for m in names
            ]
            got = [f.result().choices[0].logprobs.token_logprobs[1 : len(probe)] for f in asked]
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out[-2000:]
    for lps in got[::2]:
        assert np.allclose(lps, want[1:], atol=1e-4), (lps, want)
    for lps in got[1::2]:  # the base model answers otherwise, also batched with the adapter's requests
        assert np.abs(np.subtract(lps, want[1:])).max() > 1e-2


def test_beyond_loopback_a_key_is_required():
    with pytest.raises(ConfigError, match="tinker.api_keys"):
        TinkerConfig(host="0.0.0.0").validate()
    with pytest.raises(ConfigError, match="tml-"):
        TinkerConfig(api_keys=["secret"]).validate()
    TinkerConfig(host="0.0.0.0", api_keys=[KEY_A]).validate()


COOKBOOK = TESTS.parent / ".venv-cookbook" / "bin" / "python"


def cookbook(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """A tinker-cookbook recipe, unmodified, in its own venv (`make cookbook`), offline."""
    env = {**os.environ, "TINKER_API_KEY": KEY_A, "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0"}
    return subprocess.run([str(COOKBOOK), "-m", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_the_cookbook_recipes_train_unmodified(server, tmp_path):
    """`make cookbook`, then its supervised recipe on its own example conversations (the loss
    falls) and its RL recipe on arithmetic (it runs: sampling with a stop token, importance
    sampling, checkpoints with a ttl) against the server, on the tiny model."""
    url, *_ = server
    subprocess.run(["make", "cookbook"], cwd=TESTS.parent, check=True, capture_output=True, timeout=1200)
    model = tinker.RestClient(base_url=url, api_key=KEY_A).get_server_capabilities().result()
    common = [f"base_url={url}", f"model_name={model.supported_models[0].model_name}", "renderer_name=qwen3_instruct"]
    common.append("behavior_if_log_dir_exists=delete")
    find = (
        "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('tinker_cookbook').origin).parent)"
    )
    package = subprocess.run([str(COOKBOOK), "-c", find], capture_output=True, text=True, check=True).stdout.strip()
    sl = cookbook(
        "tinker_cookbook.recipes.chat_sl.train",
        *common,
        f"dataset={package}/example_data/conversations.jsonl",
        "batch_size=32",
        "max_length=200",  # the server's tinker.max_seq_len here
        "num_epochs=3",
        "learning_rate=1e-3",
        "save_every=0",
        "eval_every=0",
        f"log_path={tmp_path / 'sl'}",
        cwd=tmp_path,
    )
    assert sl.returncode == 0, sl.stderr[-3000:]
    nll = [json.loads(line)["train_mean_nll"] for line in (tmp_path / "sl" / "metrics.jsonl").read_text().splitlines()]
    assert len(nll) == 12 and nll[-1] < 0.8 * nll[0], nll
    rl = cookbook(
        "tinker_cookbook.recipes.math_rl.train",
        *common,
        "env=arithmetic",
        "loss_fn=importance_sampling",
        "group_size=4",
        "groups_per_batch=4",
        "max_steps=3",
        "save_every=2",
        "learning_rate=1e-3",
        f"log_path={tmp_path / 'rl'}",
        cwd=tmp_path,
    )
    assert rl.returncode == 0, rl.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all("env/all/reward/total" in r for r in rows)
    saved = [json.loads(line) for line in (tmp_path / "rl" / "checkpoints.jsonl").read_text().splitlines()]
    assert [s["name"] for s in saved] == ["000002", "final"], saved
