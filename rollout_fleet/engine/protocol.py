"""SGLang 0.5.23's ``/generate`` protocol: request parsing, validation and response building.

Pure functions and plain data, no HTTP and no torch, so every rule of the reference
(``docs/sglang_api.md`` section 2) can be tested without a server. Two error kinds exist
because SGLang answers with two shapes: the 0.5.23 *contract gate* (unknown ``sampling_params`` keys and wrong
JSON types) answers ``400 {"error": "<str>"}``; every later validation error answers
``400 {"error": {"message": "<str>"}}``.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

GREEDY_TEMPERATURE = 1e-6  # SGLang: any 0 <= T < 1e-6 samples greedily
DEFAULT_MAX_NEW_TOKENS = 128
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK_"

ABORTED = "Aborted"
ABORT_IN_WAITING_QUEUE = "Abort in waiting queue"


class ContractError(ValueError):
    """The 0.5.23 contract gate refused the raw JSON: HTTP 400 with a string-valued ``error``."""


class RequestError(ValueError):
    """A request that passed the gate but is invalid: HTTP 400 ``{"error": {"message": ...}}``."""


# ---------------------------------------------------------------------------------------------------------
# The contract gate: serde-style type checks (the gate is generated Rust-style code, so are its messages).
# ---------------------------------------------------------------------------------------------------------

# name -> (kind, nullable). The order is the order the gate lists them in "expected one of".
SAMPLING_FIELDS: dict[str, tuple[str, bool]] = {
    "max_new_tokens": ("i64", True),
    "min_new_tokens": ("i64", False),
    "temperature": ("f64", False),
    "top_p": ("f64", False),
    "top_k": ("i64", False),
    "min_p": ("f64", False),
    "frequency_penalty": ("f64", False),
    "presence_penalty": ("f64", False),
    "repetition_penalty": ("f64", False),
    "stop": ("str_or_strs", True),
    "stop_token_ids": ("i64s", True),
    "stop_regex": ("str_or_strs", True),
    "ignore_eos": ("bool", False),
    "skip_special_tokens": ("bool", False),
    "spaces_between_special_tokens": ("bool", False),
    "no_stop_trim": ("bool", False),
    "n": ("i64", False),
    "json_schema": ("str", True),
    "regex": ("str", True),
    "ebnf": ("str", True),
    "structural_tag": ("str", True),
    "stream_interval": ("i64", True),
    "logit_bias": ("map", True),
    "sampling_seed": ("i64", True),
    "custom_params": ("map", True),
    "beam_width": ("i64", True),
    "watermark": ("any", True),
    "choice": ("any", True),
}

# Top-level fields the gate types; unknown top-level keys are ignored (as in SGLang).
TOP_LEVEL_FIELDS: dict[str, str] = {
    "text": "str_or_strs",
    "input_ids": "ids_or_batch",
    "rid": "str_or_strs",
    "return_logprob": "bool_or_bools",
    "logprob_start_len": "i64_or_i64s",
    "top_logprobs_num": "i64_or_i64s",
    "return_text_in_logprobs": "bool",
    "stream": "bool",
    "return_prompt_token_ids": "bool",
    "return_hidden_states": "bool_or_bools",
}

_EXPECTED = {
    "i64": "i64",
    "f64": "f64",
    "bool": "a boolean",
    "str": "a string",
    "map": "a map",
    "str_or_strs": "a string or a sequence of strings",
    "i64s": "a sequence of i64",
    "ids_or_batch": "a sequence of i64 or a sequence of sequences of i64",
    "bool_or_bools": "a boolean or a sequence of booleans",
    "i64_or_i64s": "i64 or a sequence of i64",
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _describe(v: Any) -> str:
    """serde's rendering of an unexpected JSON value."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{str(v).lower()}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    if isinstance(v, list):
        return "sequence"
    return "map"


def _matches(kind: str, v: Any) -> bool:
    checks: dict[str, Callable[[Any], bool]] = {
        "any": lambda x: True,
        "i64": _is_int,
        "f64": lambda x: _is_int(x) or isinstance(x, float),
        "bool": lambda x: isinstance(x, bool),
        "str": lambda x: isinstance(x, str),
        "map": lambda x: isinstance(x, dict),
        "str_or_strs": lambda x: (
            isinstance(x, str) or (isinstance(x, list) and all(isinstance(s, str) for s in x))
        ),
        "i64s": lambda x: isinstance(x, list) and all(_is_int(i) for i in x),
        "ids_or_batch": lambda x: (
            isinstance(x, list)
            and (
                all(_is_int(i) for i in x)
                or all(isinstance(r, list) and all(_is_int(i) for i in r) for r in x)
            )
        ),
        "bool_or_bools": lambda x: (
            isinstance(x, bool) or (isinstance(x, list) and all(isinstance(b, bool) for b in x))
        ),
        "i64_or_i64s": lambda x: _is_int(x) or (isinstance(x, list) and all(_is_int(i) for i in x)),
    }
    return checks[kind](v)


def _type_error(kind: str, v: Any) -> ContractError:
    return ContractError(f"invalid type: {_describe(v)}, expected {_EXPECTED[kind]}")


def check_sampling_contract(params: Any) -> None:
    """Reject what SGLang 0.5.23's gate rejects in one ``sampling_params`` object: unknown keys, wrong types."""
    if not isinstance(params, dict):
        raise ContractError(f"invalid type: {_describe(params)}, expected struct SamplingParams")
    for key, value in params.items():
        spec = SAMPLING_FIELDS.get(key)
        if spec is None:
            known = ", ".join(f"`{name}`" for name in SAMPLING_FIELDS)
            raise ContractError(f"unknown field `{key}`, expected one of {known}")
        kind, nullable = spec
        if value is None:
            if nullable:
                continue
            raise _type_error(kind, value)
        if not _matches(kind, value):
            raise _type_error(kind, value)


def check_contract(body: Any) -> None:
    """The whole gate: the body is an object, known top-level fields are well typed, sampling keys are known."""
    if not isinstance(body, dict):
        raise ContractError(f"invalid type: {_describe(body)}, expected struct GenerateRequest")
    for key, kind in TOP_LEVEL_FIELDS.items():
        value = body.get(key)
        if value is not None and not _matches(kind, value):
            raise _type_error(kind, value)
    params = body.get("sampling_params")
    if params is None:
        return
    if isinstance(params, list):
        for item in params:
            check_sampling_contract(item)
    else:
        check_sampling_contract(params)


# ---------------------------------------------------------------------------------------------------------
# Sampling parameters and request items.
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingParams:
    """The sampling parameters the built-in engine implements, validated (SGLang's defaults and ranges)."""

    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: all tokens (SGLang's default 1 << 30 is normalised to -1)
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    stream_interval: int = 1
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


# Known keys the engine accepts only at their default (or null): anything else is a clear 400.
_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "stop_regex": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "beam_width": None,
    "watermark": None,
    "choice": None,
}


def _check_unsupported(raw: dict[str, Any]) -> None:
    for key, default in _UNSUPPORTED_DEFAULTS.items():
        value = raw.get(key, default)
        if value in (default, None, {}, []) or (key == "beam_width" and value == 1):
            continue
        raise RequestError(
            f"sampling_params.{key} = {value!r} is not supported by the built-in engine "
            f"(only its default {default!r} is accepted)"
        )


def parse_sampling_params(raw: dict[str, Any] | None) -> SamplingParams:
    """Validate one (gate-checked) ``sampling_params`` dict with SGLang's range rules and messages."""
    raw = dict(raw or {})
    _check_unsupported(raw)
    values = {k: v for k, v in raw.items() if v is not None and k in SamplingParams.__dataclass_fields__}
    if "stop" in values:
        stop = values["stop"]
        values["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
        if len(values["stop"]) > 32:
            raise RequestError(f"sampling_params.stop has {len(values['stop'])} strings; at most 32 allowed")
        if any(s == "" for s in values["stop"]):
            raise RequestError("sampling_params.stop contains an empty string")
    if "stop_token_ids" in values:
        values["stop_token_ids"] = tuple(values["stop_token_ids"])
    if "max_new_tokens" in raw and raw["max_new_tokens"] is None:
        values["max_new_tokens"] = None
    for key in ("temperature", "top_p", "min_p"):
        if key in values:
            values[key] = float(values[key])
    params = SamplingParams(**values)
    _verify(params)
    if params.top_k == 1 << 30:
        params = replace(params, top_k=-1)
    return params


def _verify(p: SamplingParams) -> None:
    """SGLang's ``SamplingParams.verify`` rules; messages name the field and the value."""
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise RequestError(f"temperature must be non-negative, got {p.temperature}.")
    if not 0.0 < p.top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {p.top_p}.")
    if not 0.0 <= p.min_p <= 1.0:
        raise RequestError(f"min_p must be in [0, 1], got {p.min_p}.")
    if p.top_k < 1 and p.top_k != -1:
        raise RequestError(f"top_k must be -1 (disable), or at least 1, got {p.top_k}.")
    if p.max_new_tokens is not None and p.max_new_tokens < 0:
        raise RequestError(f"max_new_tokens must be at least 0, got {p.max_new_tokens}.")
    if p.min_new_tokens < 0:
        raise RequestError(f"min_new_tokens must be in [0, max_new_tokens], got {p.min_new_tokens}.")
    if p.max_new_tokens is not None and p.min_new_tokens > p.max_new_tokens:
        raise RequestError(
            f"min_new_tokens must be in [0, max_new_tokens({p.max_new_tokens})], got {p.min_new_tokens}."
        )
    if p.n < 1:
        raise RequestError(f"n must be at least 1, got {p.n}.")
    if p.stream_interval < 1:
        raise RequestError(f"stream_interval must be at least 1, got {p.stream_interval}.")


@dataclass
class GenItem:
    """One generation the scheduler runs: a prompt, its parameters and its place in the response."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # resolved against the context length
    return_logprob: bool = False
    logprob_start_len: int = -1
    index: int = 0
    stream: bool = False  # the scheduler sends a snapshot every stream_interval tokens


@dataclass
class GenerateCall:
    """A parsed ``/generate`` body: the items in response order and how to shape the answer."""

    items: list[GenItem]
    is_batch: bool  # answer with a JSON array (batch input or n > 1)
    stream: bool = False
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False


def _per_item(name: str, value: Any, batch_size: int, default: Any) -> list[Any]:
    """Broadcast a scalar to every item, or check a list's length against the batch."""
    if value is None:
        return [default] * batch_size
    if isinstance(value, list):
        if len(value) != batch_size:
            raise RequestError(f"{name} has {len(value)} entries but the batch has {batch_size} prompts")
        return [default if v is None else v for v in value]
    return [value] * batch_size


def _prompts(body: dict[str, Any], encode: Callable[[str], list[int]]) -> tuple[list[list[int]], bool]:
    """The prompts as token ids, and whether the input was a batch."""
    text, input_ids = body.get("text"), body.get("input_ids")
    given = [k for k in ("text", "input_ids", "input_embeds") if body.get(k) is not None]
    if not given or len(given) == 3:
        raise RequestError("Either text, input_ids or input_embeds should be provided.")
    if "input_embeds" in given:
        raise RequestError("input_embeds is not supported by the built-in engine; send input_ids or text")
    if len(given) > 1:
        raise RequestError("Provide one of text or input_ids, not both.")
    if input_ids is not None:
        if len(input_ids) == 0:
            raise RequestError("input_ids cannot be empty.")
        if _is_int(input_ids[0]):
            return [list(input_ids)], False
        return [list(row) for row in input_ids], True
    if isinstance(text, str):
        return [encode(text)], False
    if len(text) == 0:
        raise RequestError("text cannot be an empty list.")
    return [encode(t) for t in text], True


def _resolve_budget(prompt_len: int, params: SamplingParams, context_len: int) -> int:
    """max_new_tokens against the context length, with SGLang's messages."""
    if prompt_len >= context_len:
        raise RequestError(
            f"The input ({prompt_len} tokens) is longer than the model's context length ({context_len} tokens)."
        )
    if params.max_new_tokens is None:
        return context_len - prompt_len
    total = prompt_len + params.max_new_tokens
    if total > context_len:
        raise RequestError(
            f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
            f"You requested a total of {total} tokens: {prompt_len} tokens from the input messages and "
            f"{params.max_new_tokens} tokens for the completion. Please reduce the number of tokens in the "
            "input messages or the completion to fit within the limit."
        )
    return params.max_new_tokens


def _check_ids(ids: list[int], vocab_size: int, where: str) -> None:
    if not ids:
        raise RequestError(f"{where} is empty: input_ids cannot be empty.")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"{where} contains token id {bad}, outside the vocabulary [0, {vocab_size})")


def _rids(rid: Any, batch_size: int, is_batch: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(batch_size)]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(batch_size)] if is_batch else [rid]
    if len(rid) != batch_size:
        raise RequestError("The specified rids length mismatch with the batch_size for batch processing.")
    return list(rid)


def parse_generate(
    body: dict[str, Any], *, encode: Callable[[str], list[int]], vocab_size: int, context_len: int
) -> GenerateCall:
    """Normalise a gate-checked ``/generate`` body into items (SGLang 2.3): batch, n fan-out, rids, logprobs."""
    prompts, is_batch = _prompts(body, encode)
    batch = len(prompts)
    raw_params = body.get("sampling_params")
    if isinstance(raw_params, list):
        if not is_batch and len(raw_params) == 1:
            raw_params = raw_params[0]
        elif len(raw_params) != batch:
            raise RequestError(
                f"sampling_params has {len(raw_params)} entries but the batch has {batch} prompts"
            )
    params = [parse_sampling_params(p) for p in _per_item("sampling_params", raw_params, batch, {})]
    n = params[0].n
    if any(p.n != n for p in params):
        raise RequestError("The parallel_sample_num should be the same for all samples in sample params.")
    if n > 1:
        for name in ("return_logprob", "logprob_start_len", "top_logprobs_num"):
            if isinstance(body.get(name), list):
                raise RequestError(f"Cannot use list {name} with parallel_sample_num > 1")
    if any(v for v in _per_item("top_logprobs_num", body.get("top_logprobs_num"), batch, 0)):
        raise RequestError("top_logprobs_num > 0 is not supported by the built-in engine")
    if body.get("token_ids_logprob") is not None:
        raise RequestError("token_ids_logprob is not supported by the built-in engine")
    if any(_per_item("return_hidden_states", body.get("return_hidden_states"), batch, False)):
        raise RequestError("return_hidden_states is not supported by the built-in engine")
    rids = _rids(body.get("rid"), batch, is_batch)
    if len(set(rids)) != len(rids):
        dup = next(r for r in rids if rids.count(r) > 1)
        raise RequestError(f"Duplicate request ID found in the batch: {dup!r}")
    stream = bool(body.get("stream") or False)
    want_lp = _per_item("return_logprob", body.get("return_logprob"), batch, False)
    starts = _per_item("logprob_start_len", body.get("logprob_start_len"), batch, -1)
    items: list[GenItem] = []
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        where = f"input_ids[{i}]" if is_batch else "input_ids"
        _check_ids(ids, vocab_size, where)
        budget = _resolve_budget(len(ids), p, context_len)
        start = starts[i] if want_lp[i] else -1
        if start < -1:
            raise RequestError(f"logprob_start_len must be -1 or at least 0, got {start}")
        if start > len(ids):
            raise RequestError(f"logprob_start_len ({start}) is larger than the input length ({len(ids)})")
        for j in range(n):
            rid = uuid.uuid4().hex if n > 1 else rids[i]
            items.append(GenItem(rid, ids, p, budget, bool(want_lp[i]), start, i * n + j, stream))
    return GenerateCall(
        items=items,
        is_batch=is_batch or n > 1,
        stream=stream,
        return_text_in_logprobs=bool(body.get("return_text_in_logprobs") or False),
        return_prompt_token_ids=bool(body.get("return_prompt_token_ids") or False),
    )


# ---------------------------------------------------------------------------------------------------------
# Responses.
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSnapshot:
    """What the scheduler reports about one request: cumulative output so far, final when ``finished``."""

    rid: str
    prompt_ids: Sequence[int]
    params: SamplingParams
    output_ids: list[int]
    output_logprobs: list[float] | None
    input_logprobs: list[float | None] | None
    logprob_start_len: int
    finish_reason: dict[str, Any] | None
    weight_version: str
    weight_versions: list[dict[str, Any]]
    num_retractions: int
    finished: bool
    queued_abort: bool = False  # aborted before it ever ran: SGLang omits prompt_tokens / cached_tokens
    e2e_latency: float = 0.0
    cached_tokens: int = 0


def finish_length(length: int) -> dict[str, Any]:
    return {"type": "length", "length": length}


def finish_stop(matched: int | str) -> dict[str, Any]:
    return {"type": "stop", "matched": matched}


def finish_abort(message: str = ABORTED, status_code: int | None = None, err_type: str | None = None):
    """The abort object; a request aborted in the waiting queue carries only type and message."""
    if message == ABORT_IN_WAITING_QUEUE:
        return {"type": "abort", "message": message}
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


def output_text(snap: RequestSnapshot, decode: Callable[[list[int], bool], str]) -> str:
    """Decoded output with SGLang's stop trimming: the matched stop token or stop string leaves ``text``
    (unless ``no_stop_trim``); ``output_ids`` always keeps it."""
    ids = snap.output_ids
    reason = snap.finish_reason or {}
    matched = reason.get("matched") if reason.get("type") == "stop" else None
    skip = snap.params.skip_special_tokens
    if matched is None or snap.params.no_stop_trim:
        return decode(ids, skip)
    if isinstance(matched, int):
        return decode(ids[:-1], skip)
    text = decode(ids, skip)
    pos = text.find(matched)
    return text[:pos] if pos != -1 else text


def _finite(x: float | None) -> float | None:
    # NaN and +-inf become null, as orjson writes them in SGLang's responses.
    return x if x is not None and math.isfinite(x) else None


def _logprob_triples(
    values: Sequence[float | None], ids: Sequence[int], texts: Callable[[int], str | None]
) -> list[list[Any]]:
    return [[_finite(v), t, texts(t)] for v, t in zip(values, ids, strict=True)]


def build_response(
    snap: RequestSnapshot,
    *,
    decode: Callable[[list[int], bool], str],
    return_text_in_logprobs: bool = False,
    return_prompt_token_ids: bool = False,
) -> dict[str, Any]:
    """One response object (section 2.4), or one cumulative stream chunk when the snapshot is unfinished."""
    meta: dict[str, Any] = {"id": snap.rid, "finish_reason": snap.finish_reason}
    if not snap.queued_abort:
        meta["prompt_tokens"] = len(snap.prompt_ids)
    last_span = snap.weight_versions[-1]["version"] if snap.weight_versions else None
    meta["weight_version"] = (last_span if snap.finished and last_span else None) or snap.weight_version
    meta["completion_tokens"] = len(snap.output_ids)
    if not snap.queued_abort:
        meta["cached_tokens"] = snap.cached_tokens
        meta["reasoning_tokens"] = 0
        meta["num_retractions"] = snap.num_retractions
    if snap.output_logprobs is not None:
        texts = (lambda t: decode([t], False)) if return_text_in_logprobs else (lambda t: None)
        start = snap.logprob_start_len
        in_ids = list(snap.prompt_ids[start:]) if start >= 0 else []
        in_vals = snap.input_logprobs if snap.input_logprobs is not None else []
        meta["input_token_logprobs"] = _logprob_triples(in_vals[: len(in_ids)], in_ids[: len(in_vals)], texts)
        meta["output_token_logprobs"] = _logprob_triples(snap.output_logprobs, snap.output_ids, texts)
        meta["output_token_logprobs_length"] = len(snap.output_logprobs)
    if snap.finished:
        meta["weight_versions"] = snap.weight_versions
        meta["e2e_latency"] = snap.e2e_latency
    meta["response_sent_to_client_ts"] = time.time()
    out: dict[str, Any] = {"text": output_text(snap, decode), "output_ids": list(snap.output_ids)}
    out["meta_info"] = meta
    if return_prompt_token_ids:
        out["prompt_token_ids"] = list(snap.prompt_ids)
    return out


def error_status(snap: RequestSnapshot) -> int | None:
    """The HTTP status a finished non-stream request maps to when its abort carries an error code."""
    reason = snap.finish_reason or {}
    code = reason.get("status_code")
    return code if reason.get("type") == "abort" and isinstance(code, int) and code >= 400 else None


@dataclass
class SpanRecorder:
    """Per-token weight versions as SGLang's ``weight_versions`` spans ``[{version, start, end})``."""

    spans: list[dict[str, Any]] = field(default_factory=list)

    def add(self, version: str, index: int) -> None:
        if self.spans and self.spans[-1]["version"] == version and self.spans[-1]["end"] == index:
            self.spans[-1]["end"] = index + 1
        else:
            self.spans.append({"version": version, "start": index, "end": index + 1})

    def copy(self) -> list[dict[str, Any]]:
        return [dict(s) for s in self.spans]
