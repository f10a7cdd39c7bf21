"""The Tinker API's wire format, through the `tinker` SDK's own modules: its pydantic request types
(which refuse unknown fields) for the JSON bodies, its protobuf module for `forward_backward`
requests and the `forward_backward` and `sample` results. Everything a client sends is checked
here, and whatever is wrong is a `UserError` naming the field.

    req = parse(types.OptimStepRequest, body)              # JSON -> the SDK's request type
    fb = decode_forward_backward(body, vocab, limits)      # protobuf -> Datums + the loss
    encode_forward_backward(logprobs, loss)                # -> protobuf bytes
    encode_sample(completions, req)                        # -> protobuf bytes
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pydantic
import torch
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from forge.losses.tinker import LOSS_INPUTS, Datums, loss_config
from forge.types import Completion

T = TypeVar("T", bound=pydantic.BaseModel)
DTYPES = {pb.DTYPE_FLOAT32: np.dtype("<f4"), pb.DTYPE_INT64: np.dtype("<i8")}
NO_LOGPROB = -99999.0  # a top-k cell the SDK reads as empty
MAX_TOPK = 20  # vLLM's max_logprobs


class UserError(ValueError):
    """What a client sent is wrong: its request fails with category `user`, naming what."""


@dataclass
class Limits:
    max_datums: int  # per forward_backward request
    max_tokens: int  # summed over a request's datums
    max_seq_len: int  # one datum (or a prompt and its samples)


@dataclass
class ForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float]
    forward_only: bool
    # the datums by length class (1, 2, 3-4, 5-8, ... tokens), each class padded to its own longest:
    # at most twice the request's tokens in cells, whatever its lengths; (their indices, tensors)
    batches: list[tuple[list[int], Datums]]

    @property
    def count(self) -> int:
        return sum(len(rows) for rows, _ in self.batches)


def parse(cls: type[T], body: bytes | dict[str, Any]) -> T:
    """`body` (JSON) as the SDK's request type `cls`: a missing, unknown or mistyped field is a
    UserError naming it."""
    try:
        if isinstance(body, (bytes, str)):
            return cls.model_validate_json(body)
        return cls.model_validate(body)
    except pydantic.ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors()[:5])
        raise UserError(f"bad {cls.__name__}: {problems}") from None


def _unknown(msg: Any, where: str) -> None:
    found = UnknownFieldSet(msg)
    if len(found):
        raise UserError(f"{where} has unknown protobuf field(s) {sorted({f.field_number for f in found})}")


def _tensor(t: pb.Tensor, where: str, longest: int) -> np.ndarray:
    _unknown(t, where)
    if t.dtype not in DTYPES:
        raise UserError(f"{where}: dtype {pb.DType.Name(t.dtype)} (want DTYPE_FLOAT32 or DTYPE_INT64)")
    if t.WhichOneof("encoding") != "dense":
        raise UserError(
            f"{where}: only dense tensors of one value per token are served (got {t.WhichOneof('encoding')})"
        )
    shape = list(t.shape)
    if len(shape) != 1 or not 0 <= shape[0] <= longest:
        raise UserError(f"{where}: shape {shape}; forge takes one value per token, [T] with T <= {longest}")
    dtype = DTYPES[t.dtype]
    if len(t.dense) != shape[0] * dtype.itemsize:
        raise UserError(f"{where}: {len(t.dense)} bytes for shape {shape} of {dtype.name}")
    return np.frombuffer(t.dense, dtype=dtype)


def _tokens(datum: pb.Datum, where: str) -> np.ndarray:
    parts = []
    for chunk in datum.model_input:
        _unknown(chunk, f"{where}.model_input")
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise UserError(f"{where}.model_input: {kind} chunks are not supported (text tokens only)")
        if len(chunk.encoded_text.tokens) % 4:
            raise UserError(f"{where}.model_input: encoded_text.tokens is not int32 bytes")
        parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4"))
    return np.concatenate(parts) if parts else np.zeros(0, dtype="<i4")


def _datum(datum: pb.Datum, i: int, loss_fn: str, vocab: int, longest: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    where = f"data[{i}]"
    _unknown(datum, where)
    if len(datum.model_input_spans) or len(datum.loss_fn_input_spans):
        raise UserError(f"{where}: provenance spans are not supported")
    tokens = _tokens(datum, where)
    if not 0 < len(tokens) <= longest:
        raise UserError(f"{where}: {len(tokens)} tokens; a datum has 1 to {longest} (tinker.max_seq_len)")
    wanted = ("target_tokens", *LOSS_INPUTS[loss_fn][0])
    given = set(datum.loss_fn_inputs)
    if given != set(wanted):
        raise UserError(
            f"{where}.loss_fn_inputs: {loss_fn} takes {', '.join(wanted)}; got {', '.join(sorted(given)) or 'none'}"
        )
    inputs = {}
    for name in wanted:
        arr = _tensor(datum.loss_fn_inputs[name], f"{where}.loss_fn_inputs.{name}", longest)
        if arr.shape[0] != len(tokens):
            raise UserError(f"{where}.loss_fn_inputs.{name}: {arr.shape[0]} values for {len(tokens)} input tokens")
        if (name == "target_tokens") != (arr.dtype.kind == "i"):
            raise UserError(f"{where}.loss_fn_inputs.{name}: dtype {arr.dtype.name}")
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise UserError(f"{where}.loss_fn_inputs.{name}: holds a NaN or an infinity")
        inputs[name] = arr
    for name, ids in (("model_input", tokens), ("loss_fn_inputs.target_tokens", inputs["target_tokens"])):
        if len(ids) and not (0 <= ids.min() and ids.max() < vocab):
            raise UserError(f"{where}.{name}: token ids outside the vocabulary [0, {vocab})")
    return tokens, inputs


def decode_forward_backward(body: bytes, vocab: int, limits: Limits) -> ForwardBackward:
    """A `forward_backward` request (protobuf) as padded tensors (`ForwardBackward.batches`),
    every field checked."""
    try:
        msg = pb.ForwardBackwardRequest.FromString(body)
    except DecodeError as e:
        raise UserError(f"forward_backward: the body is not a ForwardBackwardRequest protobuf ({e})") from None
    _unknown(msg, "ForwardBackwardRequest")
    if not msg.model_id or msg.seq_id < 0:
        raise UserError("ForwardBackwardRequest: model_id and seq_id (>= 0) are required")
    if not 0 < len(msg.data) <= limits.max_datums:
        raise UserError(f"ForwardBackwardRequest.data: {len(msg.data)} datums; send 1 to {limits.max_datums}")
    given: dict[str, Any] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():  # the SDK writes numbers to both maps
        given[key] = value.number if value.WhichOneof("value") == "number" else value.text
    config = loss_config(msg.loss_fn, given)  # a ValueError names an unknown loss or key
    for key, value in config.items():  # a NaN or infinite threshold makes the loss, and the adapter, NaN
        if not math.isfinite(value):
            raise UserError(f"ForwardBackwardRequest.loss_fn_config.{key}: {value}; a finite number")
    # Each chunk is walked in Python: millions of empty ones would hold the server's event loop for
    # seconds. A chunk carries a token or more, so the request's token limit bounds them too.
    chunks = sum(len(d.model_input) for d in msg.data)
    if chunks > limits.max_tokens:
        raise UserError(
            f"ForwardBackwardRequest.data: {chunks} model_input chunks; at most {limits.max_tokens} (tinker.max_tokens)"
        )
    rows = [_datum(d, i, msg.loss_fn, vocab, limits.max_seq_len) for i, d in enumerate(msg.data)]
    total = sum(len(tokens) for tokens, _ in rows)
    if total > limits.max_tokens:
        raise UserError(
            f"forward_backward: {total} tokens in one request; at most {limits.max_tokens} (tinker.max_tokens)"
        )
    classes: dict[int, list[int]] = {}
    for i, (tokens, _) in enumerate(rows):
        classes.setdefault((len(tokens) - 1).bit_length(), []).append(i)
    batches = [(found, _pad([rows[i] for i in found])) for _, found in sorted(classes.items())]
    return ForwardBackward(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, batches)


def _pad(rows: list[tuple[np.ndarray, dict[str, np.ndarray]]]) -> Datums:
    width = max(len(tokens) for tokens, _ in rows)
    shape = (len(rows), width)
    ids, targets, mask = torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.long), torch.zeros(shape)
    others = {name: torch.zeros(shape) for name in rows[0][1] if name != "target_tokens"}
    for r, (tokens, inputs) in enumerate(rows):
        n = len(tokens)
        ids[r, :n] = torch.from_numpy(tokens.astype(np.int64))
        targets[r, :n] = torch.from_numpy(inputs["target_tokens"].copy())
        mask[r, :n] = 1
        for name, t in others.items():
            t[r, :n] = torch.from_numpy(inputs[name].astype(np.float32))
    return Datums(ids, targets, mask, others)


def _batched(rows: list[np.ndarray]) -> pb.BatchedTensor:
    offsets = np.cumsum([0] + [r.nbytes for r in rows], dtype=np.int64)
    return pb.BatchedTensor(
        data=b"".join(r.tobytes() for r in rows), offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32, trailing_shape=[]
    )


def encode_forward_backward(logprobs: list[list[float]], loss: float) -> bytes:
    """The result of `forward_backward`: each datum's target logprobs, and the loss as `loss:sum`."""
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(logprobs))
    record.fields["logprobs"].CopyFrom(_batched([np.asarray(row, dtype="<f4") for row in logprobs]))
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    out.loss_fn_outputs.append(record)
    out.metrics["loss:sum"] = loss
    return out.SerializeToString()


def sampling_args(req: types.SampleRequest, max_len: int, default_max_tokens: int, vocab: int) -> dict[str, Any]:
    """A sample request's options as the generator's `sampling` dict (vLLM's SamplingParams); an
    option forge does not serve is a UserError naming it."""
    unsupported = {
        "topk_sample_logprobs": req.topk_sample_logprobs,
        "target_prompt_logprobs": req.target_prompt_logprobs,
        "prompt_alt_tokens_k": req.prompt_alt_tokens_k,
        "record_stability_info": req.record_stability_info,
    }
    for name, value in unsupported.items():
        if value:
            raise UserError(f"sample: option {name} is not supported by forge")
    p = req.sampling_params
    out: dict[str, Any] = {
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": max(p.top_k, 0),
        "max_tokens": p.max_tokens if p.max_tokens is not None else default_max_tokens,
        "seed": p.seed,
        "stop": [],
    }
    if p.stop == []:  # Tinker: no stop at all, not even the end of sequence
        out["ignore_eos"] = True
    elif isinstance(p.stop, str):
        out["stop"] = [p.stop]
    elif p.stop and all(isinstance(s, int) for s in p.stop):
        if not all(0 <= s < vocab for s in p.stop):
            raise UserError(f"sampling_params.stop: token ids outside the vocabulary [0, {vocab})")
        out["stop_token_ids"] = list(p.stop)
    elif p.stop:
        out["stop"] = list(p.stop)
    if not 0 <= req.topk_prompt_logprobs <= MAX_TOPK:
        raise UserError(f"sample: topk_prompt_logprobs {req.topk_prompt_logprobs}; 0 to {MAX_TOPK}")
    if req.prompt_logprobs or req.topk_prompt_logprobs:
        out["prompt_logprobs"] = req.topk_prompt_logprobs
    if p.seed is not None and not -(2**63) <= p.seed < 2**63:
        raise UserError(f"sampling_params.seed: {p.seed}; a 64-bit integer")
    if not 0 < out["max_tokens"] <= max_len:
        raise UserError(f"sampling_params.max_tokens: {out['max_tokens']}; 1 to {max_len}")
    return out


def prompt_tokens(req: types.SampleRequest, vocab: int, max_len: int) -> list[int]:
    """The prompt's token ids (text chunks only), checked against the vocabulary and `max_len`."""
    tokens = []
    for chunk in req.prompt.chunks:
        if not isinstance(chunk, types.EncodedTextChunk):
            raise UserError(f"sample: prompt chunks of type {chunk.type} are not supported (text tokens only)")
        tokens += chunk.tokens
    if not 0 < len(tokens) <= max_len:
        raise UserError(f"sample: a prompt of {len(tokens)} tokens; 1 to {max_len}")
    if not all(0 <= t < vocab for t in tokens):
        raise UserError(f"sample: prompt token ids outside the vocabulary [0, {vocab})")
    last_n = req.prompt_logprobs_last_n
    if last_n is not None and not 1 <= last_n < len(tokens):
        raise UserError(f"sample: prompt_logprobs_last_n {last_n}; 1 to {len(tokens) - 1} (the prompt's tokens - 1)")
    return tokens


def encode_sample(completions: list[Completion], req: types.SampleRequest) -> bytes:
    """The result of `sample`: each sequence's tokens, logprobs and stop reason, and the prompt's
    logprobs (NaN where none was asked for, and at position 0) and top-k when asked."""
    out = pb.SampleResponse()
    for c in completions:
        out.sequences.append(
            pb.SampledSequence(
                stop_reason=pb.STOP_REASON_LENGTH if c.finish_reason == "length" else pb.STOP_REASON_STOP,
                tokens=np.asarray(c.token_ids, dtype="<i4").tobytes(),
                logprobs=np.asarray(c.logprobs, dtype="<f4").tobytes(),
            )
        )
    found = completions[0].prompt_logprobs if completions else None
    topk = req.topk_prompt_logprobs
    if found is not None and req.prompt_logprobs_last_n is not None:  # the top-k too: the last N only
        blank = len(found) - max(0, min(req.prompt_logprobs_last_n, len(found)))
        found = [None] * blank + found[blank:]
    if found is not None and req.prompt_logprobs:
        ids = completions[0].prompt_ids
        row = np.asarray([math.nan if p is None else p.get(t, math.nan) for p, t in zip(found, ids)], dtype="<f4")
        out.prompt_logprobs = row.tobytes()
    if found is not None and topk > 0:
        ids, lps = np.zeros((len(found), topk), dtype="<i4"), np.full((len(found), topk), NO_LOGPROB, dtype="<f4")
        for i, p in enumerate(found):
            best = sorted((p or {}).items(), key=lambda kv: -kv[1])[:topk]
            for j, (token, lp) in enumerate(best):
                ids[i, j], lps[i, j] = token, lp
        out.topk_prompt_logprobs.CopyFrom(
            pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=topk, length=len(found))
        )
    return out.SerializeToString()
