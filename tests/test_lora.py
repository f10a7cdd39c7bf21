"""LoRA: only the adapters train, checkpoint and travel; the generator samples with the
published adapter; the base model is the reference; the export is PEFT's."""

import asyncio

import pytest
import torch
from test_gateway import forge_serve
from test_trainer import fixed_batch, on_policy

from forge.config import ConfigError
from forge.schema import ALL_LINEAR, LoRAConfig, LossConfig
from forge.store import WeightStore, start_store, stop_store
from forge.types import Episode, collate
from forge.weight_sync import WeightSync
from services.generator import Generator, RunGenerator
from services.lora import adapters_off, is_adapter
from services.schema import GeneratorConfig, TrainerConfig
from services.titan import load_hf_model, token_logprobs
from services.trainer import Trainer, build_optimizers


def test_a_step_changes_only_the_adapters_and_adapters_off_is_the_base(tiny_llama_dir):
    model = load_hf_model(tiny_llama_dir, lora=LoRAConfig(rank=8))
    base = load_hf_model(tiny_llama_dir)
    ids = fixed_batch().input_ids
    # Fresh adapters (B = 0) leave the model's outputs exactly the checkpoint's.
    assert torch.equal(token_logprobs(model, ids)[0], token_logprobs(base, ids)[0])
    optimizers, _ = build_optimizers(model, TrainerConfig(lr=1e-2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(2):  # the first step moves B only (A's gradient is B^T ... = 0)
        optimizers.zero_grad()
        (-token_logprobs(model, ids)[0].mean()).backward()
        optimizers.step()
    params = dict(model.named_parameters())
    frozen = [n for n in params if not is_adapter(n)]
    assert frozen and all(torch.equal(params[n], before[n]) for n in frozen)  # the base: bit-identical
    assert all(not torch.equal(params[n], before[n]) for n in params if is_adapter(n))
    state = optimizers.optimizers[0].state
    assert {id(p) for p in state} == {id(p) for n, p in params.items() if is_adapter(n)}  # Adam's state: adapters only
    after = token_logprobs(model, ids)[0]
    assert not torch.equal(after, token_logprobs(base, ids)[0])
    with adapters_off(model):
        assert torch.equal(token_logprobs(model, ids)[0], token_logprobs(base, ids)[0])
    assert torch.equal(token_logprobs(model, ids)[0], after)  # and back on


def test_a_lora_score_head_trains_and_checkpoints_with_its_adapters(tiny_llama_dir):
    """A critic or reward model with LoRA: its new score head trains beside the adapters (the
    base is frozen) and is in the checkpoint's state, else a resumed critic would lose its head."""
    from services.lora import AdapterState

    model = load_hf_model(tiny_llama_dir, lora=LoRAConfig(rank=8), head="score")
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "lm_head.weight" in trains and all(is_adapter(n) for n in trains - {"lm_head.weight"})
    assert set(AdapterState(model).state_dict()) == trains


@pytest.mark.parametrize(
    "lora, message",
    [
        (LoRAConfig(rank=8, targets=["q_prj"]), "'trainer.lora.targets': ['q_prj'] are not linears of a llama3 model"),
        (LoRAConfig(rank=8, targets=["k_proj"]), "k_proj and v_proj are adapted together"),
    ],
)
def test_bad_targets_are_named(tiny_llama_dir, lora, message):
    with pytest.raises(ConfigError) as e:
        load_hf_model(tiny_llama_dir, lora=lora)
    assert message in str(e.value)


def test_targets_that_adapt_no_linear_are_named(tiny_moe_dir):
    """A MoE's MLP is its grouped experts, not linears: targets naming only MLP linears would
    adapt nothing and train nothing, an error naming the key and what the model can adapt."""
    with pytest.raises(ConfigError) as e:
        load_hf_model(tiny_moe_dir, lora=LoRAConfig(rank=8, targets=["gate_proj", "up_proj"]))
    assert "'trainer.lora.targets': ['gate_proj', 'up_proj'] adapt no linear of this qwen3_moe model" in str(e.value)
    assert "k_proj, lm_head" in str(e.value)


def test_lora_config_keys_are_checked():
    for bad, key in ((LoRAConfig(rank=-1), "trainer.lora.rank"), (LoRAConfig(rank=8, dropout=1.0), "dropout")):
        with pytest.raises(ConfigError, match=key):
            bad.validate()


@pytest.mark.slow  # 70 s: a LoRA trainer and a generator, exports, a resume
def test_adapter_sync_reference_peft_export_and_resume(tiny_llama_dir, tmp_path):
    """On the llama3 family (its adapter permutes q and k's rows, and B's follow; its head is
    tied to the embeddings, and takes an adapter of its own): three GRPO
    steps with the KL term train the adapter against the base model's logprobs (no reference
    service); the published version is the adapter alone, which the generator samples with
    (its logprobs the trainer's within 1e-4, tagged with the version); the PEFT export loads in
    peft + transformers with the trainer's logits, the merged one in transformers; a trainer
    restored from a checkpoint of step 1 takes steps 2-4 exactly as the one that went on."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lora = LoRAConfig(rank=8, alpha=16, targets=[*ALL_LINEAR, "lm_head"])  # the head: tied to the embeddings
    cfg = TrainerConfig(lr=1e-2, loss=LossConfig(name="grpo", kl_coef=0.5), lora=lora)

    async def steps(trainer, n):
        out = []
        for _ in range(n):
            b = fixed_batch()
            out.append(await trainer.train_step.route(on_policy(b, await trainer.logprobs.route(b))))
        return out

    async def main():
        store = await start_store()
        weights = WeightStore("lora")
        trainer = await Trainer.options(procs=1).as_service(str(tiny_llama_dir), cfg, weights)
        gen = await Generator.options().as_service(
            str(tiny_llama_dir), GeneratorConfig(max_model_len=256), weights, lora
        )
        sync = WeightSync(trainer, gen)
        await sync.start()
        try:
            initial = await trainer.logprobs.route(fixed_batch())
            first = await steps(trainer, 1)
            await trainer.save.route(str(tmp_path / "ckpt"))
            went_on = await steps(trainer, 3)
            assert await sync.push() == 4
            await sync.wait_held(4, timeout_s=60)
            groups = await asyncio.gather(
                *(gen.generate.route(p, n=4, sampling={"max_tokens": 16}) for p in ("rev abc=", "12+7=", "sort cba="))
            )
            batch = collate([Episode.from_completion(c) for g in groups for c in g], pad_id=0)
            trainer_lp = await trainer.logprobs.route(batch)
            published = await weights.fetch(4)
            await trainer.export_hf.route(str(tmp_path / "adapter"))
            await trainer.export_hf.route(str(tmp_path / "merged"), merged=True)
            end = await trainer.logprobs.route(fixed_batch())
            assert await trainer.load.route(str(tmp_path / "ckpt")) == 1
            resumed = await steps(trainer, 3)
            end_resumed = await trainer.logprobs.route(fixed_batch())
        finally:
            await sync.stop()
            await asyncio.gather(gen.shutdown(), trainer.shutdown())
            await weights.clear()
            await stop_store(store)
        return initial, first, went_on, groups, batch, trainer_lp, published, end, resumed, end_resumed

    initial, first, went_on, groups, batch, trainer_lp, published, end, resumed, end_resumed = asyncio.run(main())
    # The reference for free (the base model: adapters off, tested above): a KL that grows from 0 as the adapter moves.
    assert first[0][1]["kl"] == 0 and went_on[-1][1]["kl"] > 0
    # A version is the adapter, in PEFT's names: no base weight travels.
    assert published and all(".lora_A." in k or ".lora_B." in k for k in published)
    # The generator samples with it: its logprobs are the trainer's, and its completions say so.
    assert all(c.policy_version == c.max_policy_version == 4 for g in groups for c in g)
    m = batch.loss_mask.bool()
    assert (trainer_lp - batch.gen_logprobs)[m].abs().max().item() <= 1e-4
    # Exports: PEFT's adapter and the merged model give the trainer's logits.
    ids = fixed_batch().input_ids

    def hf_logprobs(model):
        with torch.no_grad():
            logits = model(ids).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]

    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    assert (hf_logprobs(peft) - end[:, 1:]).abs().max().item() <= 1e-4
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert (hf_logprobs(merged) - end[:, 1:]).abs().max().item() <= 1e-4
    assert not torch.equal(end, initial)
    # Resumed from step 1's checkpoint (adapter, its optimizer state, schedule, version): the same steps.
    assert resumed == went_on and torch.equal(end_resumed, end)


def peft_adapter(base_dir, out, seed: int, rank: int = 8):
    """A PEFT adapter on every linear of `base_dir`'s model, random (B != 0), saved to `out`; the model with it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(
        base, LoraConfig(r=rank, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    )
    model.save_pretrained(str(out))
    return model.eval()


@pytest.mark.slow  # 60 s: a `forge serve` process and its engine
def test_forge_serve_picks_the_adapter_by_model_name(tiny_model_dir, tmp_path):
    """`forge serve RUN --lora b=DIR` (RUN a LoRA run's directory: its adapter, served on its base
    model under the run's name): the OpenAI `model` field picks adapter run_a, b or the base
    model, and each answers with its own weights (prompt logprobs within 1e-4 of peft's)."""
    import signal

    import openai
    from transformers import AutoModelForCausalLM

    where = {"run_a": tmp_path / "run_a" / "model", "b": tmp_path / "b"}
    models = {name: peft_adapter(tiny_model_dir, where[name], seed) for name, seed in (("run_a", 1), ("b", 2))}
    models["test-tiny"] = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    proc, port, _ = forge_serve(str(tmp_path / "run_a"), "--prompt-logprobs", "--lora", f"b={where['b']}")
    prompt = [1, 40, 50, 60, 70, 80, 90, 30, 20]
    got = {}
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        assert {m.id for m in client.models.list().data} == set(models)
        for name in models:
            r = client.completions.create(model=name, prompt=prompt, max_tokens=1, echo=True, logprobs=0)
            got[name] = torch.tensor(r.choices[0].logprobs.token_logprobs[1 : len(prompt)])
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out[-2000:]
    ids = torch.tensor([prompt])
    for name, model in models.items():
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        assert (got[name] - lp).abs().max().item() <= 1e-4, name
    assert (got["run_a"] - got["b"]).abs().max() > 1e-2 and (got["run_a"] - got["test-tiny"]).abs().max() > 1e-2


def test_forge_serve_names_a_bad_adapter(tiny_model_dir, tmp_path, capsys):
    from apps import serve

    with pytest.raises(SystemExit):
        serve.main([str(tiny_model_dir), "--lora", f"a={tmp_path}"])
    assert f"--lora 'a={tmp_path}': {tmp_path} is not a PEFT adapter directory" in capsys.readouterr().err


def test_a_user_s_adapter_keeps_its_scaling_and_one_vllm_cannot_serve_is_named(tiny_model_dir, tmp_path):
    """read_adapter, then write_adapter (`forge eval` of an adapter and Tinker's sampler paths: the
    directory vLLM gets) give back the user's adapter: peft's model with either computes the same
    logits with use_rslora, alpha_pattern and rank_pattern. An option vLLM cannot serve is an error
    naming the file and key."""
    import json
    import re

    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from forge.lora import read_adapter, write_adapter

    ids = torch.tensor([[1, 40, 50, 60, 70, 80, 90]])

    def logits(adapter_dir):
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        with torch.no_grad():
            return PeftModel.from_pretrained(base, str(adapter_dir)).eval()(ids).logits

    scalings = {
        "use_rslora": dict(use_rslora=True),
        "alpha_pattern": dict(alpha_pattern={"q_proj": 64}),
        "rank_pattern": dict(rank_pattern={"layers.0.self_attn.q_proj": 4, "v_proj": 32}, alpha_pattern={"v_proj": 8}),
    }
    for name, options in scalings.items():
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        lora = LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False, **options)
        get_peft_model(base, lora).save_pretrained(str(tmp_path / name))
        cfg, tensors = read_adapter(tmp_path / name)
        write_adapter(tmp_path / f"{name}-served", tensors, cfg, str(tiny_model_dir))
        assert (logits(tmp_path / name) - logits(tmp_path / f"{name}-served")).abs().max().item() <= 1e-5, name

    config = tmp_path / "use_rslora" / "adapter_config.json"
    plain = json.loads(config.read_text())
    for key, value in {"use_dora": True, "init_lora_weights": "pissa", "modules_to_save": ["lm_head"]}.items():
        config.write_text(json.dumps({**plain, key: value}))
        with pytest.raises(ValueError, match=re.escape(f"{config}: key '{key}' is {value!r}: vLLM cannot serve")):
            read_adapter(config.parent)


def test_a_bad_adapter_config_is_named(tiny_model_dir, tmp_path):
    """`forge serve --lora` / generator.adapters: an adapter_config.json that is not JSON, or whose
    rank `r` is missing or not a positive int, is an error naming the file and key. vLLM's slots
    hold the largest rank, a rank_pattern's included."""
    import json

    from services.generator import engine_args

    config = tmp_path / "adapter_config.json"
    gen_cfg = GeneratorConfig(adapters={"a": str(tmp_path)})
    bad = {'{"r": 8,': "not JSON", '{"lora_alpha": 16}': "key 'r'", '{"r": "8"}': "key 'r'", '{"r": 0}': "key 'r'"}
    for text, message in bad.items():
        config.write_text(text)
        with pytest.raises(ValueError, match=f"{config}: {message}"):
            engine_args(gen_cfg, str(tiny_model_dir))
    config.write_text(json.dumps({"r": 8, "rank_pattern": {"q_proj": 32}}))
    assert engine_args(gen_cfg, str(tiny_model_dir)).max_lora_rank == 32
    for pattern in ({}, None):  # PEFT writes {} (a plain adapter)
        config.write_text(json.dumps({"r": 16, "rank_pattern": pattern}))
        assert engine_args(gen_cfg, str(tiny_model_dir)).max_lora_rank == 16


def test_runs_sharing_a_generator_sample_with_their_own_adapters(tiny_model_dir, tmp_path):
    """One generator serves two runs (tenants a and b), each publishing its adapter to its own
    store, each seen through its own RunGenerator and WeightSync. Requests of both, interleaved
    while a's next version lands, sample with their own run's adapter (logprobs within 1e-4 of
    peft's model with that adapter, far from the other's) and carry their own run's version.
    A's v2 is live before vLLM has loaded it (its shapes are v1's): requests sent at once use it.
    An adapter vLLM refuses (rank 16, the config says 8) fails its load, and b keeps its v1."""
    from peft import get_peft_model_state_dict

    models = {seed: peft_adapter(tiny_model_dir, tmp_path / str(seed), seed) for seed in (1, 2, 3)}
    too_big = get_peft_model_state_dict(peft_adapter(tiny_model_dir, tmp_path / "r16", 4, rank=16))
    lora = LoRAConfig(rank=8, alpha=16)
    prompts = ([1, 40, 50, 60, 70], [1, 80, 90, 30], [1, 20, 40, 60, 80, 90])

    async def main():
        store = await start_store()
        stores = {run: WeightStore(run) for run in ("a", "b")}
        gen = await Generator.options().as_service(
            str(tiny_model_dir), GeneratorConfig(max_model_len=128), tenants={r: (s, lora) for r, s in stores.items()}
        )
        views = {run: RunGenerator(gen, run) for run in stores}
        syncs = {run: WeightSync(None, view) for run, view in views.items()}
        try:
            for sync in syncs.values():
                await sync.start()

            async def publish(run, version, seed):
                await stores[run].publish(version, get_peft_model_state_dict(models[seed]))
                syncs[run].publish(version)
                await syncs[run].wait_held(version, timeout_s=60)

            await publish("a", 1, 1)
            await publish("b", 1, 2)

            async def sample(run):
                return run, await views[run].generate.route(prompts[len(run) % 3], n=4, sampling={"max_tokens": 12})

            requests = [sample(run) for _ in range(4) for run in ("a", "b")]
            first = await asyncio.gather(*requests[:4])
            later = await asyncio.gather(*requests[4:], publish("a", 2, 3))
            at_once = await sample("a")
            with pytest.raises(Exception, match="add_lora"):
                await views["b"].load_weights.route(too_big, version=2)
            held = {run: await view.policy_version.route() for run, view in views.items()}
            with pytest.raises(ValueError, match="no policy 'c'"):
                await gen.generate.route([1, 40], policy="c")
        finally:
            for sync in syncs.values():
                await sync.stop()
            await gen.shutdown()
            await stop_store(store)
        return [*first, *later[:-1], at_once], held

    samples, held = asyncio.run(main())
    assert held == {"a": 2, "b": 1}

    def hf_logprobs(model, c):
        ids = torch.tensor([c.prompt_ids + c.token_ids])
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        return lp[len(c.prompt_ids) - 1 :]

    checked = {"a": set(), "b": set()}
    for run, group in samples:
        for c in group:
            assert c.policy_version == c.max_policy_version  # each request keeps the adapter it was admitted under
            seed = {("a", 1): 1, ("a", 2): 3, ("b", 1): 2}[(run, c.policy_version)]
            got = torch.tensor(c.logprobs)
            assert (got - hf_logprobs(models[seed], c)).abs().max().item() <= 1e-4, (run, c.policy_version)
            others = [m for s, m in models.items() if s != seed]
            assert all((got - hf_logprobs(m, c)).abs().max().item() > 1e-2 for m in others)
            checked[run].add(c.policy_version)
    assert checked == {"a": {1, 2}, "b": {1}} and samples[-1][1][0].policy_version == 2


@pytest.mark.slow  # 70 s: three generators
def test_forge_eval_of_an_adapter_is_the_merged_model_s(tiny_model_dir, tmp_path):
    """`forge eval CONFIG --model ADAPTER_DIR` evaluates the adapter on the base model it names:
    the greedy eval's figures are those of the model with the adapter merged in, not the base's."""
    from apps.evaluate import evaluate_model
    from apps.grpo import Config
    from forge.config import load_config

    model = peft_adapter(tiny_model_dir, tmp_path / "adapter", seed=1)
    model.merge_and_unload().save_pretrained(tmp_path / "merged")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny_model_dir / f).exists():
            (tmp_path / "merged" / f).write_bytes((tiny_model_dir / f).read_bytes())
    over = ["eval.prompts=16", "rewards.weights.exact=0", "rewards.weights.task=1", "generator.max_model_len=128"]
    cfg = load_config("configs/grpo_tiny.yaml", over, Config)
    got = {m: asyncio.run(evaluate_model(cfg, str(tmp_path / m))) for m in ("adapter", "merged")}
    base = asyncio.run(evaluate_model(cfg, str(tiny_model_dir)))
    assert got["adapter"]["eval/reward_mean"] == got["merged"]["eval/reward_mean"]
    assert got["adapter"]["eval/reward_mean"] != base["eval/reward_mean"]


@pytest.mark.slow  # 52 s: a LoRA trainer service, three steps
def test_dpo_reference_with_lora_is_the_adapter_off_policy(tiny_model_dir):
    """DPO with LoRA and no reference in the batch: the trainer's reference is its own model with
    the adapters off. After two steps (the adapter moved the policy), a step's implicit rewards
    beta x (log pi - log pi_ref) equal those computed with the base checkpoint's logprobs as the
    reference (1e-5), and differ from 0 (the adapter-on policy as its own reference)."""
    from forge.losses import preference_metric_sums

    lora = LoRAConfig(rank=8, alpha=16)
    loss = LossConfig(name="dpo", beta=0.5)
    cfg = TrainerConfig(lr=1e-2, loss=loss, lora=lora)
    g = torch.Generator().manual_seed(0)

    def pairs() -> object:
        eps = [
            Episode(torch.randint(6, 100, (n,), generator=g).tolist(), [0] * 3 + [1] * (n - 3), [0.0] * n)
            for n in (9, 7, 10, 6)
        ]
        return collate(eps, pad_id=0, keep_together=2)

    async def main():
        store = await start_store()
        trainer = await Trainer.options(procs=1).as_service(str(tiny_model_dir), cfg, WeightStore("dpo_lora"))
        try:
            for _ in range(2):
                await trainer.train_step.route(pairs())
            batch = pairs()
            policy = await trainer.logprobs.route(batch)
            _, metrics = await trainer.train_step.route(batch)
        finally:
            await trainer.shutdown()
            await stop_store(store)
        return batch, policy, metrics

    batch, policy, metrics = asyncio.run(main())
    base = load_hf_model(tiny_model_dir)
    with torch.no_grad():
        batch.ref_logprobs = token_logprobs(base, batch.input_ids, positions=batch.positions)[0]
    expected = {k: v.item() / 2 for k, v in preference_metric_sums(policy, batch, loss).items()}  # two pairs
    assert abs(expected["rewards/margin"]) > 1e-3  # the adapter moved the policy from the base
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margin"):
        assert metrics[key] == pytest.approx(expected[key], abs=1e-5), key


def test_a_token_of_no_adapter_gets_nothing_when_every_slot_holds_one():
    """vLLM's CPU LoRA kernels index "no adapter" (-1) as the last slot, which holds an adapter when
    every slot is in use (`forge serve --lora` of one adapter has one slot): a base-model request
    batched with an adapter's ran under it. forge's kernels give such a token nothing."""
    from services.vllm_lora import bgmv_expand, bgmv_shrink

    torch.manual_seed(0)
    lora_a, lora_b = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 8, 4)  # one slot: [slots, 1, rank, in], [.., out, rank]
    x, indices = torch.randn(3, 8), torch.tensor([-1, 0, -1])
    shrunk, out = torch.zeros(3, 4), torch.zeros(3, 8)
    bgmv_shrink(x, lora_a, shrunk, indices)
    bgmv_expand(shrunk, lora_b, out, indices)
    assert out[0].abs().max() == 0 and out[2].abs().max() == 0
    assert torch.allclose(out[1], lora_b[0, 0] @ (lora_a[0, 0] @ x[1]), atol=1e-5)


def test_an_adapter_of_another_method_is_named_and_alpha_defaults_as_in_peft(tiny_model_dir, tmp_path):
    """An AdaLoRA adapter (its own tensors and maths), or one with tensors besides A and B, is an
    error naming the file, not read as plain LoRA. An adapter_config.json without lora_alpha has
    PEFT's (8): the adapter written back computes the same logits."""
    import json
    import re

    from peft import AdaLoraConfig, LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from forge.lora import ADAPTER_WEIGHTS, read_adapter, write_adapter

    def save(name, lora):
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        get_peft_model(base, lora).save_pretrained(str(tmp_path / name))
        return tmp_path / name

    adalora = save("adalora", AdaLoraConfig(r=4, init_r=4, target_modules=["q_proj"], total_step=10, lora_alpha=8))
    config = adalora / "adapter_config.json"
    with pytest.raises(ValueError, match=re.escape(f"{config}: key 'peft_type' is 'ADALORA': vLLM cannot serve")):
        read_adapter(adalora)

    plain = save("plain", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    weights = load_file(str(plain / ADAPTER_WEIGHTS))
    save_file({**weights, "base_model.model.lm_head.lora_E": torch.zeros(4, 1)}, str(plain / ADAPTER_WEIGHTS))
    with pytest.raises(ValueError, match=re.escape(f"{plain / ADAPTER_WEIGHTS}: ['base_model.model.lm_head.lora_E']")):
        read_adapter(plain)
    save_file(weights, str(plain / ADAPTER_WEIGHTS))

    config = plain / "adapter_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "lora_alpha"}))
    cfg, tensors = read_adapter(plain)
    assert cfg.alpha == 8
    write_adapter(tmp_path / "served", tensors, cfg, str(tiny_model_dir))
    ids = torch.tensor([[1, 40, 50, 60, 70, 80, 90]])
    logits = []
    for adapter in (plain, tmp_path / "served"):
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        with torch.no_grad():
            logits.append(PeftModel.from_pretrained(base, str(adapter)).eval()(ids).logits)
    assert (logits[0] - logits[1]).abs().max().item() <= 1e-5


def test_adapter_dropout_is_off_outside_a_training_step(tiny_llama_dir):
    """The trainer's model stays in training mode: `logprobs`, a critic's `values` and a reward
    model's `scores` run without gradients, and see the adapter whole (PEFT's eval), as the
    generator does; a training step's forward (gradients on) drops the adapter's inputs."""
    model = load_hf_model(tiny_llama_dir, lora=LoRAConfig(rank=8, dropout=0.5))
    plain = load_hf_model(tiny_llama_dir, lora=LoRAConfig(rank=8))
    with torch.no_grad():
        for m in (model, plain):
            for name, p in m.named_parameters():
                if ".lora_b." in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    ids = fixed_batch().input_ids
    assert model.training
    with torch.no_grad():
        assert torch.equal(token_logprobs(model, ids)[0], token_logprobs(plain, ids)[0])
    assert not torch.equal(token_logprobs(model, ids)[0].detach(), token_logprobs(plain, ids)[0].detach())


def test_a_checkpoint_of_another_lora_config_is_named_and_the_trainer_lives(tiny_llama_dir, tmp_path):
    """`forge run --resume DIR trainer.lora.rank=4` of a rank-8 run: the trainer's load is an error
    naming the checkpoint, the tensor and the config key, and the replica keeps its weights
    (DCP's CheckpointException, a BaseException, took it down as a crash)."""
    import torch.distributed.checkpoint as dcp

    from services.lora import AdapterState

    saved = tmp_path / "trainer"
    rank8 = load_hf_model(tiny_llama_dir, lora=LoRAConfig(rank=8))
    optimizers, schedulers = build_optimizers(rank8, TrainerConfig())
    state = {"optimizer": optimizers, "lr_scheduler": schedulers, "train_state": {"step": 1, "version": 1}}
    dcp.save({"model": AdapterState(rank8), **state}, checkpoint_id=saved)  # the trainer's save
    cfg = TrainerConfig(lr=1e-2, lora=LoRAConfig(rank=4))

    async def main():
        store = await start_store()
        trainer = await Trainer.options(procs=1).as_service(str(tiny_llama_dir), cfg, WeightStore("lora_resume"))
        try:
            with pytest.raises(ValueError) as e:
                await trainer.load.route(str(saved))
            return str(e.value), await trainer.logprobs.route(fixed_batch())
        finally:
            await trainer.shutdown()
            await stop_store(store)

    message, lp = asyncio.run(main())
    assert f"{saved}: cannot load it" in message and "trainer.lora" in message and "lora_a.weight" in message
    assert torch.equal(lp, token_logprobs(load_hf_model(tiny_llama_dir), fixed_batch().input_ids)[0])
