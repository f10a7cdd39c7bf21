"""Build a tiny model (of a family of services/models/, Qwen3 by default) and its tokenizer
offline, in HF format.

No hub is reachable, so forge makes its own: a character-level tokenizer trained with
`tokenizers` on the toy tasks' text, and a few-million-parameter causal LM (the family's tiny builder) saved
with `save_pretrained` (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json). Optionally it is warm-started (by the caller's `warm_start`, a short run of the SFT app on a toy
task) so it is partially competent, which is what RL then improves. The output is
cached: a directory whose `forge_build.json` matches the request is reused as is.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import string
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from forge import data, tasks
from forge.config import ConfigError
from services import models
from services.models import tiny as tiny_keys
from services.schema import ModelConfig, TinyModelSpec

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>", "<|im_start|>", "<|im_end|>"]
PAD, BOS, EOS, UNK = SPECIAL_TOKENS[:4]
# One token each, as in Qwen3's tokenizer (added, not special: they stay in decoded text, where
# vLLM's tool and reasoning parsers look for them). Spelled out in characters, a tool result sat
# 31 tokens of tags away from the model's answer, 30% of a `calc` episode.
TAG_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
ALPHABET = list(string.printable[:95]) + ["\n"]  # printable ASCII and the chat template's newline
BUILD_FILE = "forge_build.json"
# A chat template in the shape of Qwen3's: tools listed in the system turn, tool calls as
# <tool_call>{"name": ..., "arguments": ...}</tool_call> (vLLM's `hermes` tool parser reads them),
# tool results as <tool_response> user turns, and the reasoning (<think>...</think>) of assistant
# turns before the last user turn left out when the history is rendered again; with
# `enable_thinking=False` (a chat template kwarg), an empty reasoning block after the generation prompt.
CHAT_TEMPLATE = """\
{%- if tools -%}
<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}
{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a tool as <tool_call>{"name": NAME, "arguments": ARGS}</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' -%}
<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor -%}
{%- for m in messages -%}
{%- if m['role'] == 'assistant' -%}
{%- set content = m['content'] or '' -%}
{%- if loop.index0 < ns.last_user and '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif -%}
<|im_start|>assistant
{{ content }}
{%- for call in m['tool_calls'] or [] -%}
<tool_call>{"name": "{{ call['function']['name'] }}", "arguments": {{ call['function']['arguments'] if call['function']['arguments'] is string else call['function']['arguments'] | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif m['role'] == 'tool' -%}
<|im_start|>user
<tool_response>{{ m['content'] }}</tool_response><|im_end|>
{% elif m['role'] != 'system' or not loop.first -%}
<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif -%}
"""


def spec_key(spec: TinyModelSpec) -> str:
    """The cache key of a build: the spec, and the source of everything that makes the model."""
    family = sys.modules[models.get(spec.family, "model.tiny.family").tiny.__module__]  # its builder
    # data: the warm start's samples; tiny_keys: what every family's builder shares
    src = b"".join(Path(m.__file__).read_bytes() for m in (sys.modules[__name__], tasks, data, family, tiny_keys))
    blob = json.dumps(asdict(spec), sort_keys=True).encode() + src
    return hashlib.sha256(blob).hexdigest()[:16]


def build_tokenizer(seed: int = 0):
    """Character-level BPE: every printable ASCII character and the newline is one token, so
    digits and letters stay separate (the toy tasks are about single characters); the tags of
    TAG_TOKENS are one token each."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    # Splitting into single characters first means BPE learns no merges across them.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    corpus = [s.prompt + s.answer for name in sorted(tasks.TASKS) for s in tasks.generate(name, 2000, seed)]
    trainer = trainers.BpeTrainer(
        vocab_size=len(SPECIAL_TOKENS) + len(ALPHABET),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=ALPHABET,
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=SPECIAL_TOKENS[4:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )


WarmStart = Callable[[Path, TinyModelSpec], float]  # trains a built model in place; returns its final loss


def _check_replaceable(out: Path, where: str) -> None:
    """A build replaces `out` whole: only a directory that is missing, empty, or forge's own
    build (its BUILD_FILE) may be replaced, never a model or files forge did not write."""
    if out.exists() and not (out / BUILD_FILE).is_file() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"{where}: {out} is not a tiny model forge built (no {BUILD_FILE}) and not empty; building one "
            "there would replace it (use an empty or new directory)"
        )


def make_tiny_model(
    out: str | Path,
    spec: TinyModelSpec | None = None,
    force: bool = False,
    warm_start: WarmStart | None = None,
    where: str = "tiny model directory",
) -> Path:
    """Build (or reuse) the tiny model in `out`; returns the directory. A spec with `sft_steps`
    needs `warm_start` (the SFT app's: apps/sft.py `warm_start`). `out` must be missing, empty or
    an earlier build (else a ConfigError naming `where`, what set it), `force` or not."""
    spec = spec or TinyModelSpec()
    out = Path(out)
    build_file = out / BUILD_FILE
    if not force and build_file.is_file() and json.loads(build_file.read_text()).get("key") == spec_key(spec):
        return out
    _check_replaceable(out, where)
    tasks.get_task(spec.task)  # a bad task name fails before any work
    if spec.sft_steps and warm_start is None:
        raise ConfigError("config key 'model.tiny.sft_steps': a warm start needs the SFT app (apps/sft.py)")
    start = time.perf_counter()
    tokenizer = build_tokenizer(spec.seed)
    torch.manual_seed(spec.seed)  # the model's initial weights
    model = models.get(spec.family, "model.tiny.family").tiny(spec, tokenizer)
    # A chat turn ends at its template's end-of-turn token as well as at EOS (Qwen3's and Llama 3's
    # generation configs do the same), so vLLM stops there.
    turn_end = tokenizer.convert_tokens_to_ids(tasks.end_of_turn(tokenizer))
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, turn_end]
    # Write next to the target and swap in whole, so an interrupted build never looks cached; in a
    # directory of this build's own, so another build of `out` under way (another process) keeps its.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700: readable as the directory save_pretrained would make
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        info = {
            "key": spec_key(spec),
            "spec": asdict(spec),
            "parameters": sum(p.numel() for p in model.parameters()),
            "sft_final_loss": warm_start(tmp, spec) if warm_start and spec.sft_steps else None,
            "build_seconds": round(time.perf_counter() - start, 2),
        }
        (tmp / BUILD_FILE).write_text(json.dumps(info, indent=2))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    except BaseException:  # a build stopped (Ctrl-C, an error) leaves no half-written copy
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def resolve_model(cfg: ModelConfig, warm_start: WarmStart | None = None) -> Path:
    """The `model` section's directory, built first when `tiny` asks for it (warm-started by `warm_start`)."""
    if cfg.tiny is not None:
        return make_tiny_model(
            cfg.path, cfg.tiny, warm_start=warm_start, where="config keys 'model.path' and 'model.tiny'"
        )
    cfg.validate()
    return Path(cfg.path)
