"""Generator service on vLLM: one engine shared by the module (engine start is the slow part)."""

import asyncio
import os
import shutil
import signal
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import tokenizers
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedTokenizerFast

from forge.types import RewardInput
from services.generator import Generator
from services.rewards import builtin, gym
from services.schema import GeneratorConfig
from services.tiny_model import build_tokenizer

PROMPTS = ["rev abc=", "12+7=", "sort dbca=", "rev jihgf=", "3+45=", "sort gfe="]


@pytest.fixture(scope="module")
def gen(loop, tiny_model_dir):
    svc = loop.run_until_complete(
        Generator.options().as_service(str(tiny_model_dir), GeneratorConfig(max_model_len=256))
    )
    yield svc
    loop.run_until_complete(svc.shutdown())


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def perturbed(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Sharper, different weights: noise on every matrix."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.dim() == 2 else v.clone() for k, v in sd.items()}


def perturbed_model(src: Path, dst: Path, seed: int) -> dict[str, torch.Tensor]:
    """A copy of the model at `src` with perturbed weights (HF names)."""
    shutil.copytree(src, dst)
    sd = perturbed(load_file(src / "model.safetensors"), seed)
    save_file(sd, dst / "model.safetensors")
    return sd


def max_logprob_error(model_dir: Path, completions: list, sd: dict | None = None, temperature: float = 1.0) -> float:
    """How far the completions' logprobs are from an fp32 transformers forward (with weights
    `sd` if given) at `temperature`: log_softmax(logits / T), what the trainer computes."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        if sd is not None:
            # A checkpoint of its own, loaded as one: transformers converts what it must (it fuses
            # a MoE's experts), where load_state_dict(strict=False) would skip those names.
            for f in Path(model_dir).iterdir():
                if f.suffix != ".safetensors":
                    shutil.copy(f, tmp)
            save_file({k: v.contiguous() for k, v in sd.items()}, f"{tmp}/model.safetensors", metadata={"format": "pt"})
        model = AutoModelForCausalLM.from_pretrained(tmp if sd is not None else model_dir, dtype=torch.float32).eval()
    worst = 0.0
    for c in completions:
        with torch.no_grad():
            logits = (
                model(torch.tensor([c.prompt_ids + c.token_ids])).logits[0, len(c.prompt_ids) - 1 : -1] / temperature
            )
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    return worst


def test_completion_fields_seed_and_stop(loop, gen, tokenizer):
    async def main():
        group = await gen.generate.route("rev abc=", n=4, sampling={"max_tokens": 12, "seed": 7})
        again = await gen.generate.route("rev abc=", n=4, sampling={"max_tokens": 12, "seed": 7})
        ref = (await gen.generate.route("12+7=", sampling={"seed": 3, "max_tokens": 16, "ignore_eos": True}))[0]
        return group, again, ref

    group, again, ref = loop.run_until_complete(main())
    assert len(group) == 4 and [c.token_ids for c in group] == [c.token_ids for c in again]
    for c in group:
        assert c.prompt_ids == tokenizer("rev abc=")["input_ids"] and c.prompt == "rev abc="
        assert 0 < len(c.token_ids) <= 12 and len(c.logprobs) == len(c.token_ids)
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert all(lp <= 0 for lp in c.logprobs) and c.finish_reason in ("stop", "length")
        assert c.policy_version == c.max_policy_version == 0
        assert c.sampling["n"] == 4 and c.sampling["seed"] == 7 and c.sampling["max_tokens"] == 12

    # A stop string ends the text at its first occurrence, and the tokens still decode to the text.
    # (Same seed, so the same sample up to the stop.)
    stop = ref.text[3]
    cut = loop.run_until_complete(
        gen.generate.route("12+7=", sampling={"seed": 3, "max_tokens": 16, "ignore_eos": True, "stop": [stop]})
    )[0]
    assert cut.text == ref.text[: ref.text.index(stop) + 1] and cut.finish_reason == "stop"
    assert cut.text == tokenizer.decode(cut.token_ids, skip_special_tokens=True)


def test_a_stop_string_ending_inside_a_token_keeps_the_whole_token_in_the_text(loop, gen, tokenizer):
    """A stop string that ends inside a token (`</to` of the tag token `</tool_call>`): vLLM cuts
    its text there but keeps the whole token, which the trainer trains; the text, which a reward
    grades, is then the tokens' decode too."""

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    async def find():  # a sample with a token of 2+ characters whose first ones do not occur before it
        for seed in range(32):
            sampling = {"seed": seed, "max_tokens": 16, "ignore_eos": True}
            ids = (await gen.generate.route("12+7=", sampling=sampling))[0].token_ids
            for i in range(len(ids)):
                before, upto = decode(ids[:i]), decode(ids[: i + 1])
                if len(upto) - len(before) >= 2 and upto.find(upto[len(before) : -1]) == len(before):
                    return sampling, ids[: i + 1], upto[len(before) : -1]
        raise AssertionError("no sample with a token of 2+ characters")

    sampling, ids, stop = loop.run_until_complete(find())
    cut = loop.run_until_complete(gen.generate.route("12+7=", sampling={**sampling, "stop": [stop]}))[0]
    assert cut.finish_reason == "stop" and cut.token_ids == ids and len(cut.logprobs) == len(ids)
    # The whole last token's text, past the stop string's end.
    assert cut.text == decode(ids) and len(cut.text) > cut.text.index(stop) + len(stop)


def test_a_stop_string_samples_text_is_vllms_up_to_the_stop_string():
    """Only what follows the stop string comes from the tokens' own decode: a SentencePiece-like
    tokenizer decoding the completion alone drops its first space, and its clean-up joins " ,"."""
    vocab = {"<unk>": 0, "\u2581Q:": 1, "\u2581The": 2, "\u2581is": 3, "\u25815": 4, "\u2581,": 5, "\u2581STOP": 6}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(prepend_scheme="first")
    model.decoder = tokenizers.decoders.Metaspace(prepend_scheme="first")
    tok = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", clean_up_tokenization_spaces=True)
    ids = tok(" The is 5 , STOP", add_special_tokens=False)["input_ids"]
    stream = tokenizers.decoders.DecodeStream(ids=tok("Q:")["input_ids"], skip_special_tokens=True)
    vllms = "".join(stream.step(model, i) or "" for i in ids)  # vLLM's detokenizer: the prompt before it
    gen = SimpleNamespace(engine=SimpleNamespace(get_tokenizer=lambda: tok))
    for stop in ("STOP", "ST"):  # at a token's end, inside one
        text = vllms[: vllms.index(stop) + len(stop)]
        got = Generator._text(
            gen, SimpleNamespace(text=text, token_ids=ids, stop_reason=stop), SimpleNamespace(skip_special_tokens=True)
        )
        assert got == vllms == " The is 5 , STOP"


def test_each_engine_draws_its_own_seed(tiny_model_dir):
    """vLLM's seed (the randomness of requests that bring none) differs between engines: two
    replicas, a respawned one or two runs do not draw the same samples; the config can pin it."""
    from services.generator import engine_args

    seeds = {engine_args(GeneratorConfig(), str(tiny_model_dir)).seed for _ in range(3)}
    assert len(seeds) == 3
    assert engine_args(GeneratorConfig(engine={"seed": 7}), str(tiny_model_dir)).seed == 7


class RecordingEngine:
    """vLLM's AsyncLLM as `Generator._sample` uses it: yields the adapter each request was given."""

    async def generate(self, prompt, params, request_id, lora_request=None):
        yield lora_request


def test_a_lora_sample_is_labelled_with_the_version_it_was_sampled_with(loop, tiny_model_dir):
    """A LoRA policy's next version lands while a prompt renders (a chat's rendering runs in a
    thread while other calls go on): the sample, taken with the new adapter, says the new version."""
    from forge.schema import LoRAConfig

    generator = Generator(str(tiny_model_dir), lora=LoRAConfig(rank=4))
    generator.engine = RecordingEngine()
    policy = generator.policies[""]
    policy.version, policy.adapter = 1, "adapter v1"

    async def rendering(prompt, tools):
        await asyncio.sleep(0.05)
        return prompt

    async def publish_v2():
        await asyncio.sleep(0.01)
        policy.version, policy.adapter = 2, "adapter v2"

    async def main():
        generator._engine_prompt = rendering
        (admitted, _, sampled_with), _ = await asyncio.gather(
            generator._sample("rev abc=", None, None, None, policy), publish_v2()
        )
        return admitted, sampled_with

    assert loop.run_until_complete(main()) == (2, "adapter v2")


def test_the_engine_runs_in_one_process_on_cpu(loop, gen):
    """generator.cpu_threads: the model runs in vLLM's engine-core process, with no worker process
    of its own beside it (whose engine core busy-waits on it for a second after each step)."""
    import psutil

    pids = loop.run_until_complete(gen.engine_pids.route())
    assert [psutil.Process(p).name() for p in pids] == ["VLLM::EngineCore"]
    with pytest.raises(ValueError, match="'generator.cpu_threads' must be >= 0"):
        GeneratorConfig(cpu_threads=-1).validate()


def test_logprobs_match_transformers_fp32(loop, gen, tiny_model_dir):
    """processed_logprobs = log_softmax(logits / T): what the trainer computes."""
    temperature = 0.7

    async def main():
        sampling = {"temperature": temperature, "max_tokens": 24}
        return await asyncio.gather(*(gen.generate.route(p, n=2, sampling=sampling) for p in PROMPTS))

    groups = loop.run_until_complete(main())
    worst = max_logprob_error(tiny_model_dir, [c for g in groups for c in g], temperature=temperature)
    assert worst <= 1e-4, worst


def test_the_trainers_logprobs_of_a_sample_at_a_temperature_are_the_generators(loop, gen, tiny_model_dir):
    """On-policy, completions sampled at temperature 0.7 (and greedily, whose logprobs are at 1)
    have the logprobs in the trainer that the generator recorded: their episodes carry the
    temperature into the batch, so the importance weight is 1, not that of the plain distribution."""
    from forge.types import Episode, collate
    from services import titan

    async def main():
        tempered = await gen.generate.route(PROMPTS[0], n=4, sampling={"temperature": 0.7, "max_tokens": 24})
        greedy = await gen.generate.route(PROMPTS[1], sampling={"temperature": 0, "max_tokens": 24})
        return tempered + greedy

    episodes = [Episode.from_completion(c) for c in loop.run_until_complete(main())]
    assert episodes[-1].temperatures is None and set(episodes[0].temperatures) == {1.0, 0.7}
    batch = collate(episodes, pad_id=0)
    with torch.no_grad():
        lp, _ = titan.token_logprobs(
            titan.load_hf_model(tiny_model_dir), batch.input_ids, temperatures=batch.temperatures
        )
    mask = batch.loss_mask.bool()
    assert (lp[mask] - batch.gen_logprobs[mask]).abs().max().item() <= 1e-4


def test_reload_equals_fresh_engine(loop, gen, tmp_path, tiny_model_dir):
    """A staged swap gives what an engine started on the new weights gives; weights staging
    cannot take (a tensor missing) are reloaded in place by vLLM, with the same result."""
    new_dir = tmp_path / "v1"
    sd = perturbed_model(tiny_model_dir, new_dir, seed=1)
    greedy = {"temperature": 0, "max_tokens": 24}

    async def main():
        before = await gen.generate.route(PROMPTS[0], sampling=greedy)
        await gen.generate.route(PROMPTS[0], sampling=greedy)  # now in the prefix cache
        paused_s = await gen.load_weights.route(sd, version=1)
        reloaded = [(await gen.generate.route(p, sampling=greedy))[0] for p in PROMPTS]
        fresh_svc = await Generator.options().as_service(str(new_dir), GeneratorConfig(max_model_len=256))
        try:
            fresh = [(await fresh_svc.generate.route(p, sampling=greedy))[0] for p in PROMPTS]
        finally:
            await fresh_svc.shutdown()
        await gen.load_weights.route(load_file(tiny_model_dir / "model.safetensors"), version=2)
        # perturbed() leaves 1-d weights as they were: without the final norm, the same model
        partial = {k: v for k, v in sd.items() if k != "model.norm.weight"}
        await gen.load_weights.route(partial, version=3)
        in_place = [(await gen.generate.route(p, sampling=greedy))[0] for p in PROMPTS]
        return before[0], paused_s, reloaded, fresh, in_place

    before, paused_s, reloaded, fresh, in_place = loop.run_until_complete(main())
    for r, i in zip(reloaded, in_place):
        assert i.policy_version == 3 and i.token_ids == r.token_ids
        assert max(abs(a - b) for a, b in zip(r.logprobs, i.logprobs)) <= 1e-5
    assert paused_s < 30
    assert reloaded[0].token_ids != before.token_ids  # the new weights are live
    for r, f in zip(reloaded, fresh):
        assert r.policy_version == r.max_policy_version == 1
        assert r.token_ids == f.token_ids
        assert max(abs(a - b) for a, b in zip(r.logprobs, f.logprobs)) <= 1e-5


def test_reload_while_64_streams_in_flight(loop, gen, tmp_path, tiny_model_dir):
    sd = perturbed_model(tiny_model_dir, tmp_path / "v2", seed=2)
    version = loop.run_until_complete(gen.policy_version.route())

    async def main():
        long = {"max_tokens": 96, "ignore_eos": True, "temperature": 1.0}
        streams = [asyncio.ensure_future(gen.generate.route(PROMPTS[i % 6], sampling=long)) for i in range(64)]
        await asyncio.sleep(0.5)
        await gen.load_weights.route(sd, version=version + 1)
        late = await gen.generate.route(PROMPTS[0], sampling={"max_tokens": 4})
        return [c for s in await asyncio.gather(*streams) for c in s], late[0]

    done, late = loop.run_until_complete(main())
    assert len(done) == 64 and all(len(c.token_ids) == 96 for c in done)
    assert all(c.policy_version == version and c.max_policy_version == version + 1 for c in done)
    assert late.policy_version == version + 1


def test_bad_requests_fail_alone(loop, gen):
    async def main():
        errors = {}
        for name, prompt, sampling in [
            ("empty", "", None),
            ("no ids", [], None),
            ("type", {"text": "x"}, None),
            ("too long", "1+2=" * 100, None),
            ("vocab", [1, 5, 10**6], None),
            ("sampling", "1+2=", {"temprature": 1.0}),
        ]:
            try:
                await gen.generate.route(prompt, sampling=sampling)
            except Exception as e:
                errors[name] = e
        try:
            await gen.generate.route("1+2=", sampling={"max_tokens": 200, "ignore_eos": True}, timeout_s=0.01)
        except Exception as e:
            errors["timeout"] = e
        ok = await gen.generate.route("1+2=", sampling={"max_tokens": 4})
        return errors, ok

    errors, ok = loop.run_until_complete(main())
    assert isinstance(errors["empty"], ValueError) and "prompt is empty" in str(errors["empty"])
    assert isinstance(errors["no ids"], ValueError)
    assert isinstance(errors["type"], TypeError) and "got dict" in str(errors["type"])
    assert isinstance(errors["too long"], ValueError) and "maximum context length" in str(errors["too long"])
    assert "'1+2=1+2=" in str(errors["too long"])  # names the prompt
    assert isinstance(errors["vocab"], ValueError) and "1000000" in str(errors["vocab"])
    assert isinstance(errors["sampling"], ValueError) and "temprature" in str(errors["sampling"])
    assert isinstance(errors["timeout"], TimeoutError) and "request_timeout_s" in str(errors["timeout"])
    assert len(ok[0].token_ids) > 0 and len(gen.healthy()) == 1


def test_bad_sampling_values_are_value_errors(loop, gen):
    async def main():
        errors = []
        for n, sampling in [(0, None), (1, {"temperature": -1})]:
            try:
                await gen.generate.route("1+2=", n=n, sampling=sampling)
            except Exception as e:
                errors.append(e)
        return errors

    errors = loop.run_until_complete(main())
    assert [type(e) for e in errors] == [ValueError, ValueError], errors
    assert "n must be at least 1" in str(errors[0]) and "temperature" in str(errors[1])


def test_weights_that_do_not_fit_the_model_fail_alone(loop, gen, tiny_model_dir):
    """A tensor of the wrong shape: the call raises, naming it; the replica keeps its weights
    and its version (an in-place reload of it would have left the engine dead)."""
    sd = load_file(tiny_model_dir / "model.safetensors")
    sd["model.norm.weight"] = sd["model.norm.weight"][:1]
    greedy = {"temperature": 0, "max_tokens": 16}

    async def main():
        version = await gen.policy_version.route()
        before = await gen.generate.route(PROMPTS[0], sampling=greedy)
        try:
            await gen.load_weights.route(sd, version=version + 1)
            error = None
        except Exception as e:
            error = e
        after = await gen.generate.route(PROMPTS[0], sampling=greedy)
        return error, version, before[0], after[0]

    error, version, before, after = loop.run_until_complete(main())
    assert isinstance(error, ValueError) and "torch.Size([1])" in str(error), error
    assert after.token_ids == before.token_ids and after.policy_version == version
    assert sum(r.respawns for r in gen.replicas) == 0


def test_dead_engine_respawns_replica(loop, gen):
    """Killing vLLM's EngineCore makes the replica unhealthy; the call is retried on the
    respawned replica, which loads the policy it had (`on_respawn`)."""

    async def main():
        engine = (await gen.engine_pids.route())[0]
        os.kill(engine, signal.SIGKILL)
        out = await gen.generate.route("1+2=", sampling={"max_tokens": 4})
        await gen.wait_healthy()
        return engine, out, await gen.engine_pids.route()

    engine, out, pids_after = loop.run_until_complete(main())
    assert len(out[0].token_ids) > 0 and engine not in pids_after
    assert sum(r.respawns for r in gen.replicas) == 1


def test_a_prompt_that_opens_the_reasoning_makes_the_text_start_inside_it(loop, gen):
    """A chat template that opens <think> for the model (DeepSeek-R1's, QwQ's; here a prompt ending
    with the tag): a sample cut at max_tokens while thinking has no tag of its own, and math and
    reasoning_gym scored a number or <answer> in its thoughts as its answer. Its text now starts
    with the block the prompt opened (`thinking`), so rewards read it as cut while thinking."""
    sampling = {"max_tokens": 6, "seed": 1, "ignore_eos": True, "bad_words": ["</think>"]}

    async def main():
        opened = await gen.generate.route("12+7=<think>\n", n=3, sampling=sampling)
        others = [(await gen.generate.route(p, sampling=sampling))[0] for p in ("12+7=", "12+7=<think>x</think>")]
        return opened, others

    opened, others = loop.run_until_complete(main())
    for c in opened:
        assert c.thinking and c.finish_reason == "length" and not c.text.startswith("<think>")
        planted = RewardInput({"answer": "#### 19"}, c.text + " so #### 19", "length", thinking=c.thinking)
        assert builtin.math(planted)["reward"] == 0.0 and gym.model_answer(c.text + "<answer>19</answer>", True) == ""
        closed = RewardInput({"answer": "#### 19"}, c.text + "</think> #### 19", "stop", thinking=c.thinking)
        assert builtin.math(closed)["reward"] == 1.0
    assert not any(c.thinking for c in others)


def test_a_prompts_opened_reasoning_counts_only_where_the_text_keeps_the_tags():
    """Where <think> and </think> are special tokens that the samples' text drops (vLLM's
    `skip_special_tokens`, on by default), the model's </think> cannot be read either: the
    sample is not taken to start inside a block (a correct answer after it scored 0)."""
    tok = build_tokenizer()
    tags = [tokenizers.AddedToken("<think>", special=True), tokenizers.AddedToken("</think>", special=True)]
    tok.add_special_tokens({"additional_special_tokens": tags})
    gen = SimpleNamespace(engine=SimpleNamespace(get_tokenizer=lambda: tok))
    prompt_ids = tok("12+7=<think>\n")["input_ids"]
    for skip, thinking in ((True, False), (False, True)):
        assert Generator._opens_thinking(gen, prompt_ids, SimpleNamespace(skip_special_tokens=skip)) == thinking
