"""The Tinker API's cost: the same work through `forge tinker` (the `tinker` SDK, HTTP, protobuf,
futures) and through forge's own doors, on one trainer and one generator service.

    python -m benchmarks.tinker [--quick]       # or: forge bench tinker

- Training: one `forward_backward` (cross_entropy) + `optim_step` of the same batch (DATUMS
  datums of SEQ tokens, a rank-8 adapter) through the SDK, and straight through the trainer
  service's endpoints (`Trainer.forward_backward` / `optim_step`, the calls the server makes);
  steps alternate, medians compared. Goal: `train_step_fraction_of_direct` >= 0.9.
- Sampling: PROMPTS concurrent sample requests of SAMPLES samples x MAX_TOKENS tokens (EOS
  ignored, so both sides generate as many tokens) on the base model, through the SDK and through
  forge's OpenAI gateway (`/v1/completions`, the prompt as token ids); rounds alternate, token
  rates' medians compared. Goal: `sample_fraction_of_gateway` >= 0.9.
The model is the 60M-parameter one of `forge bench gateway` (the engine's and the trainer's work
dominate, as on a GPU). Clients and server share this process, on both sides alike.
Writes benchmarks/results/tinker.json.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import sys
import time

import numpy as np
import openai
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from apps.schema import TinkerAppConfig
from apps.tinker import adapters
from benchmarks.common import parse_args, tiny_model, write_result
from forge.losses.tinker import Datums
from services import models
from services.gateway import Gateway
from services.generator import Generator
from services.schema import GatewayConfig, GeneratorConfig, TinkerConfig
from services.tinker import TinkerFront
from services.tinker_wire import Limits, decode_forward_backward
from services.trainer import Trainer

GOAL = "SDK ≥ 0.9 of direct (training) and of the gateway (sampling)"  # the target the manual's results page shows beside the figures

DATUMS, SEQ = 16, 128
PROMPTS, SAMPLES, MAX_TOKENS = 32, 4, 32
MID = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 8, "num_attention_heads": 12}
MID["num_key_value_heads"] = 4


def batch(vocab: int) -> tuple[list[types.Datum], Datums]:
    """The training batch, as SDK datums and as the padded tensors the server makes of them."""
    rng = np.random.default_rng(0)
    data = []
    for _ in range(DATUMS):
        tokens = rng.integers(3, vocab, SEQ + 1).tolist()
        inputs = {"target_tokens": tokens[1:], "weights": [1.0] * SEQ}
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs))
    fb = types.ForwardBackwardInput(data=data, loss_fn="cross_entropy")
    wire = forward_backward_request_to_proto(types.ForwardBackwardRequest(fb, model_id="m", seq_id=1))
    (_, datums), *_ = decode_forward_backward(
        wire.SerializeToString(), vocab, Limits(DATUMS, DATUMS * SEQ, SEQ)
    ).batches
    return data, datums  # one batch: every datum is SEQ tokens


async def measure(quick: bool) -> dict:
    model = tiny_model(**({} if quick else MID))
    vocab = models.hf_config(model)["vocab_size"]
    cfg = TinkerAppConfig(tinker=TinkerConfig(port=0))
    lora = adapters(cfg)
    gen_cfg = GeneratorConfig(max_model_len=256, engine={"max_loras": 4})
    trainer = await Trainer.options().as_service(model, dataclasses.replace(cfg.trainer, lora=lora))
    gen = await Generator.options().as_service(model, gen_cfg, None, lora)
    front = TinkerFront(trainer, gen, model, cfg.tinker, "runs/bench-tinker", vocab, 256)
    await front.serve()
    gw = await Gateway.start(gen, model, GatewayConfig(sessions=False, served_model_name="m", max_n=SAMPLES), gen_cfg)
    data, datums = batch(vocab)
    adam = {
        "learning_rate": 1e-4,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-12,
        "weight_decay": 0.0,
        "grad_clip_norm": 0.0,
    }
    rounds = 2 if quick else 3
    try:
        # The SDK's first call opens its session synchronously: in a thread, while this loop serves it.
        sc = tinker.ServiceClient(base_url=front.base_url, api_key="tml-bench")
        tc = await (
            await asyncio.to_thread(sc.create_lora_training_client, base_model=front.base_model, rank=8, seed=0)
        )
        await trainer.add_tenant.route("direct", 8, cfg.tinker.lora_alpha, set(lora.targets), 0)

        async def sdk_step() -> None:
            fb = await tc.forward_backward_async(data, "cross_entropy")
            step = await tc.optim_step_async(types.AdamParams(learning_rate=1e-4))
            await fb.result_async()
            await step.result_async()

        async def direct_step() -> None:
            await trainer.forward_backward.route("direct", datums, "cross_entropy", {}, True)
            await trainer.optim_step.route("direct", adam)

        steps: dict[str, list[float]] = {"sdk": [], "direct": []}
        for i in range(rounds + 1):
            for name, step in (("sdk", sdk_step), ("direct", direct_step)):
                start = time.perf_counter()
                await step()
                if i:  # the first of each: warm-up
                    steps[name].append(time.perf_counter() - start)

        sampler = await (await asyncio.to_thread(sc.create_sampling_client, base_model=front.base_model))
        rng = np.random.default_rng(1)
        prompts = [rng.integers(3, vocab, 16).tolist() for _ in range(PROMPTS)]
        params = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, stop=[])
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="-", max_retries=0)

        async def sdk_one(p: list[int]) -> int:
            r = await sampler.sample_async(types.ModelInput.from_ints(p), num_samples=SAMPLES, sampling_params=params)
            return sum(len(s.tokens) for s in r.sequences)

        async def gateway_one(p: list[int]) -> int:
            r = await client.completions.create(
                model="m", prompt=p, n=SAMPLES, max_tokens=MAX_TOKENS, temperature=1.0, extra_body={"ignore_eos": True}
            )
            return r.usage.completion_tokens

        rates: dict[str, list[float]] = {"sdk": [], "gateway": []}
        for i in range(rounds + 1):
            for name, one in (("sdk", sdk_one), ("gateway", gateway_one)):
                start = time.perf_counter()
                tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
                if i:
                    rates[name].append(tokens / (time.perf_counter() - start))
    finally:
        await gw.shutdown()
        await front.shutdown()
        await gen.shutdown()
        await trainer.shutdown()
    sdk_s, direct_s = statistics.median(steps["sdk"]), statistics.median(steps["direct"])
    sdk_tps, gw_tps = statistics.median(rates["sdk"]), statistics.median(rates["gateway"])
    return {
        "train_step_fraction_of_direct": direct_s / sdk_s,
        "sample_fraction_of_gateway": sdk_tps / gw_tps,
        "train_step_s": {"sdk": sdk_s, "direct": direct_s},
        "sample_tokens_per_s": {"sdk": sdk_tps, "gateway": gw_tps},
        "rounds": {"train_step_s": steps, "sample_tokens_per_s": rates},
        "workload": {
            "model": "tiny_2.4M" if quick else "mid_60M",
            "train": {"datums": DATUMS, "tokens": SEQ, "lora_rank": 8},
            "sample": {"prompts": PROMPTS, "num_samples": SAMPLES, "max_tokens": MAX_TOKENS},
        },
    }


def main(argv: list[str] | None = None) -> dict:
    a = parse_args("tinker", __doc__, "the tiny model, 2 rounds (smoke run)", argv)
    r = asyncio.run(measure(a.quick))
    print(f"{'':<22}{'through the SDK':>17}{'direct / gateway':>18}{'fraction':>10}")
    t, s = r["train_step_s"], r["sample_tokens_per_s"]
    print(f"{'train step (s)':<22}{t['sdk']:>17.3f}{t['direct']:>18.3f}{r['train_step_fraction_of_direct']:>10.2f}")
    print(f"{'sampling (tokens/s)':<22}{s['sdk']:>17.0f}{s['gateway']:>18.0f}{r['sample_fraction_of_gateway']:>10.2f}")
    return write_result(a.out, r)


if __name__ == "__main__":
    sys.exit(main() and 0)
