"""SGLang's OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions`` over the ``/generate`` path.

A request is translated into a ``/generate`` body (reference section 6's mapping) and parsed by
:func:`protocol.parse_generate`, so it runs as the same scheduler items with the same validation; the finished
snapshots are rendered as OpenAI objects. Beyond OpenAI's fields each choice carries SGLang's ``token_ids``
(the completion's ids, the final stop token included) and ``prompt_token_ids`` (the ids the engine was
prompted with), and ``meta_info`` (the ``/generate`` meta_info: ``output_token_logprobs`` triples,
``weight_versions`` spans) when ``return_meta_info`` is set, so a trainer driving the engine through an OpenAI
client stays token-exact. The built-in engine returns the ids always (SGLang: only with ``return_token_ids`` /
``return_prompt_token_ids``); ``false`` for either omits them.

Chat: ``messages`` are rendered with the tokenizer's own chat template (``add_generation_prompt``, ``tools``
and ``chat_template_kwargs`` passed through) and tokenised without special tokens added; SGLang's ``input_ids``
extension bypasses the template. The chat template's end-of-turn token (the special token that follows an
assistant message, ``<|im_end|>`` for ChatML) stops a chat completion, as a chat model's EOS does in SGLang.

Pure functions and plain data: the HTTP handlers live in :mod:`server`.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rollout_fleet.engine import protocol
from rollout_fleet.engine.protocol import ContractError, GenerateCall, RequestError, RequestSnapshot

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and SGLang's default for /v1/completions
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
_SENTINEL = "\u241eassistant\u241e"

# OpenAI / SGLang request fields the built-in engine accepts only at their default (or null).
_UNSUPPORTED: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": None,
    "best_of": None,
    "suffix": None,
    "response_format": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "stop_regex": None,
    "echo": False,
    "stream": False,
    "return_hidden_states": False,
    "lora_path": None,
}
_SUPPORTED_HINT = {
    "stream": "call /generate with stream for streaming",
    "echo": "prompt_token_ids carries the prompt",
}


class OpenAIRequestError(RequestError):
    """A bad OpenAI request: HTTP 400 in OpenAI's error shape, ``param`` naming the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def error_body(message: str, param: str | None = None, status: int = 400) -> dict[str, Any]:
    """SGLang's ``ErrorResponse`` for the OpenAI endpoints (the openai client reads ``message``)."""
    kind = "BadRequestError" if status == 400 else "InternalServerError" if status >= 500 else "Error"
    return {"object": "error", "message": message, "type": kind, "param": param, "code": status}


@dataclass
class OpenAICall:
    """A parsed OpenAI request: the scheduler items, and how to render their answer."""

    kind: str  # "completion" | "chat"
    call: GenerateCall
    model: str
    n: int
    logprobs: bool  # return OpenAI logprobs
    return_token_ids: bool
    return_prompt_token_ids: bool
    return_meta_info: bool


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(float(v))


def _field(body: dict[str, Any], name: str, check: Callable[[Any], bool], expected: str) -> Any:
    value = body.get(name)
    if value is not None and not check(value):
        raise OpenAIRequestError(f"{name} = {value!r}: expected {expected}", name)
    return value


def _bool_flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = _field(body, name, lambda v: isinstance(v, bool), "a boolean")
    return default if value is None else value


def _check_unsupported(body: dict[str, Any]) -> None:
    for name, default in _UNSUPPORTED.items():
        value = body.get(name, default)
        if value is None or value == default or value in ({}, []):
            continue
        hint = _SUPPORTED_HINT.get(name)
        raise OpenAIRequestError(
            f"{name} = {value!r} is not supported by the built-in engine"
            + (f" ({hint})" if hint else f" (only its default {default!r} is accepted)"),
            name,
        )


def _sampling(body: dict[str, Any], max_tokens: int | None, extra_stop_ids: Sequence[int]) -> dict[str, Any]:
    """The ``sampling_params`` of the ``/generate`` body, each field checked with a message naming it."""
    params: dict[str, Any] = {"max_new_tokens": max_tokens}
    temperature = _field(body, "temperature", _is_number, "a number")
    if temperature is not None:
        if temperature < 0 or temperature > 2:
            raise OpenAIRequestError(f"temperature = {temperature!r}: must be in [0, 2]", "temperature")
        params["temperature"] = float(temperature)
    top_p = _field(body, "top_p", _is_number, "a number")
    if top_p is not None:
        if not 0 < top_p <= 1:
            raise OpenAIRequestError(f"top_p = {top_p!r}: must be in (0, 1]", "top_p")
        params["top_p"] = float(top_p)
    top_k = _field(body, "top_k", _is_int, "an integer")
    if top_k is not None:
        if top_k < 1 and top_k != -1:
            raise OpenAIRequestError(f"top_k = {top_k!r}: must be -1 (all tokens) or at least 1", "top_k")
        params["top_k"] = top_k
    min_p = _field(body, "min_p", _is_number, "a number")
    if min_p is not None:
        if not 0 <= min_p <= 1:
            raise OpenAIRequestError(f"min_p = {min_p!r}: must be in [0, 1]", "min_p")
        params["min_p"] = float(min_p)
    stop = _field(
        body,
        "stop",
        lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)),
        "a string or a list of strings",
    )
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else list(stop)
        if any(s == "" for s in stops):
            raise OpenAIRequestError(f"stop = {stop!r}: contains an empty string", "stop")
        if len(stops) > 32:
            raise OpenAIRequestError(f"stop has {len(stops)} strings; at most 32 allowed", "stop")
        if stops:
            params["stop"] = stops
    stop_ids = _field(
        body,
        "stop_token_ids",
        lambda v: isinstance(v, list) and all(_is_int(i) for i in v),
        "a list of integers",
    )
    ids = sorted(set(stop_ids or ()) | set(extra_stop_ids))
    if ids:
        params["stop_token_ids"] = ids
    n = _field(body, "n", _is_int, "an integer")
    if n is not None:
        if n < 1 or n > 128:
            raise OpenAIRequestError(f"n = {n!r}: must be in [1, 128]", "n")
        params["n"] = n
    seed = _field(body, "seed", _is_int, "an integer")
    if seed is not None:
        params["sampling_seed"] = seed
    min_tokens = _field(body, "min_tokens", _is_int, "an integer")
    if min_tokens:
        params["min_new_tokens"] = min_tokens
    for flag in ("ignore_eos", "no_stop_trim", "skip_special_tokens"):
        value = _field(body, flag, lambda v: isinstance(v, bool), "a boolean")
        if value is not None:
            params[flag] = value
    return params


def _max_tokens(body: dict[str, Any], names: Sequence[str], default: int | None) -> int | None:
    for name in names:
        value = _field(body, name, _is_int, "an integer")
        if value is not None:
            if value <= 0:
                raise OpenAIRequestError(f"{name} = {value!r}: must be positive", name)
            return value
    return default


def _to_call(
    kind: str,
    body: dict[str, Any],
    gen_body: dict[str, Any],
    *,
    encode: Callable[[str], list[int]],
    vocab_size: int,
    context_len: int,
    model: str,
    logprobs: bool,
) -> OpenAICall:
    try:
        protocol.check_contract(gen_body)
        call = protocol.parse_generate(
            gen_body, encode=encode, vocab_size=vocab_size, context_len=context_len
        )
    except (ContractError, RequestError) as exc:
        if isinstance(exc, OpenAIRequestError):
            raise
        raise OpenAIRequestError(str(exc)) from None
    requested_model = body.get("model")
    return OpenAICall(
        kind=kind,
        call=call,
        model=requested_model if isinstance(requested_model, str) and requested_model else model,
        n=gen_body["sampling_params"].get("n", 1),
        logprobs=logprobs,
        return_token_ids=_bool_flag(body, "return_token_ids", True),
        return_prompt_token_ids=_bool_flag(body, "return_prompt_token_ids", True),
        return_meta_info=_bool_flag(body, "return_meta_info", False),
    )


def _rid(body: dict[str, Any]) -> str:
    rid = _field(body, "rid", lambda v: isinstance(v, str) and v != "", "a non-empty string")
    return rid or uuid.uuid4().hex


def parse_completion(
    body: Any,
    *,
    encode: Callable[[str], list[int]],
    vocab_size: int,
    context_len: int,
    model: str,
) -> OpenAICall:
    """A ``/v1/completions`` body: ``prompt`` as text or token ids (one prompt; a batch is refused)."""
    if not isinstance(body, dict):
        raise OpenAIRequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    _check_unsupported(body)
    prompt = body.get("prompt")
    gen: dict[str, Any] = {"rid": _rid(body)}
    if isinstance(prompt, str):
        if not prompt:
            raise OpenAIRequestError("prompt = '': the prompt is empty", "prompt")
        gen["text"] = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        gen["input_ids"] = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise OpenAIRequestError(
            f"prompt is a batch of {len(prompt)} prompts; the built-in engine serves one prompt per request "
            "(send several requests, or /generate with a batch)",
            "prompt",
        )
    else:
        shown = repr(prompt) if not isinstance(prompt, list) or len(prompt) < 8 else f"[{prompt[0]!r}, ...]"
        raise OpenAIRequestError(
            f"prompt = {shown}: expected a non-empty string or a non-empty list of token ids", "prompt"
        )
    lp = _field(body, "logprobs", _is_int, "an integer or null")
    if lp is not None and lp != 0:
        raise OpenAIRequestError(
            f"logprobs = {lp!r}: top log-probs are not supported by the built-in engine; send logprobs = 0 "
            "for the sampled tokens' log-probs",
            "logprobs",
        )
    max_tokens = _max_tokens(body, ("max_tokens",), COMPLETION_DEFAULT_MAX_TOKENS)
    gen["sampling_params"] = _sampling(body, max_tokens, ())
    gen["return_logprob"] = (
        True  # always: token_ids and meta_info carry them; OpenAI logprobs only on request
    )
    return _to_call(
        "completion",
        body,
        gen,
        encode=encode,
        vocab_size=vocab_size,
        context_len=context_len,
        model=model,
        logprobs=lp is not None,
    )


def _message_text(index: int, message: Any) -> dict[str, Any]:
    """One message as the chat template takes it: role and text content (text parts joined)."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise OpenAIRequestError(f"{where} = {message!r}: expected an object with role and content", where)
    role = message.get("role")
    if not isinstance(role, str) or role.lower() not in CHAT_ROLES:
        raise OpenAIRequestError(
            f"{where}.role = {role!r}: expected one of {', '.join(CHAT_ROLES)}", f"{where}.role"
        )
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise OpenAIRequestError(
                    f"{where}.content[{j}] = {part!r}: only text parts are supported by the built-in engine",
                    f"{where}.content",
                )
            parts.append(part["text"])
        content = "".join(parts)
    if content is None and message.get("tool_calls"):
        content = ""
    if not isinstance(content, str):
        raise OpenAIRequestError(
            f"{where}.content = {content!r}: expected a string or a list of text parts", f"{where}.content"
        )
    out = {k: v for k, v in message.items() if k not in ("role", "content")}
    out.update(role=role.lower(), content=content)
    return out


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """The special token(s) the chat template puts right after an assistant message (``<|im_end|>``): a chat
    completion ends there. Empty when the template has none or the tokenizer has no template."""
    if getattr(tokenizer, "chat_template", None) is None:
        return []
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}], tokenize=False
        )
    except Exception:  # noqa: BLE001 - a template that cannot render this: no extra stop
        return []
    tail = text[text.rindex(_SENTINEL) + len(_SENTINEL) :] if _SENTINEL in text else ""
    specials = sorted(getattr(tokenizer, "all_special_tokens", []) or [], key=len, reverse=True)
    stripped = tail.lstrip()
    for token in specials:
        if token and stripped.startswith(token):
            return [int(tokenizer.convert_tokens_to_ids(token))]
    return []


def render_chat(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    """The prompt ids of a chat request: the messages through the tokenizer's chat template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIRequestError(
            f"messages = {messages!r}: expected a non-empty list of messages", "messages"
        )
    rendered = [_message_text(i, m) for i, m in enumerate(messages)]
    if getattr(tokenizer, "chat_template", None) is None:
        raise OpenAIRequestError(
            "the model's tokenizer has no chat template: use /v1/completions", "messages"
        )
    kwargs = _field(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object") or {}
    tools = _field(body, "tools", lambda v: isinstance(v, list), "a list of tools")
    continue_final = _bool_flag(body, "continue_final_message", False)
    if continue_final and rendered[-1]["role"] != "assistant":
        raise OpenAIRequestError(
            "continue_final_message = true needs an assistant message last", "continue_final_message"
        )
    options: dict[str, Any] = {
        "add_generation_prompt": _bool_flag(body, "add_generation_prompt", not continue_final),
        "continue_final_message": continue_final,
        **kwargs,
    }
    if tools:  # OpenAI's {"type": "function", "function": {...}} entries, as HF chat templates take them
        options["tools"] = tools
    try:
        text = tokenizer.apply_chat_template(rendered, tokenize=False, **options)
    except Exception as exc:  # noqa: BLE001 - a template error is the request's (a role it cannot place)
        raise OpenAIRequestError(
            f"the chat template cannot render these messages: {type(exc).__name__}: {exc}", "messages"
        ) from None
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def parse_chat(
    body: Any,
    *,
    tokenizer: Any,
    encode: Callable[[str], list[int]],
    vocab_size: int,
    context_len: int,
    model: str,
    stop_ids: Sequence[int] = (),
) -> OpenAICall:
    """A ``/v1/chat/completions`` body; ``stop_ids`` are the template's end-of-turn ids (:func:`end_of_turn_ids`)."""
    if not isinstance(body, dict):
        raise OpenAIRequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    _check_unsupported(body)
    input_ids = body.get("input_ids")
    if input_ids is not None:  # SGLang: precomputed prompt ids bypass the template (messages still required)
        if not isinstance(input_ids, list) or not input_ids or not all(_is_int(t) for t in input_ids):
            raise OpenAIRequestError(
                f"input_ids = {input_ids!r}: expected a non-empty list of token ids", "input_ids"
            )
        if not isinstance(body.get("messages"), list):
            raise OpenAIRequestError("messages is required (a list of messages)", "messages")
        ids = list(input_ids)
    else:
        ids = render_chat(tokenizer, body)
    logprobs = _bool_flag(body, "logprobs", False)
    top = _field(body, "top_logprobs", _is_int, "an integer or null")
    if top:
        raise OpenAIRequestError(
            f"top_logprobs = {top!r}: top log-probs are not supported by the built-in engine (0 or null)",
            "top_logprobs",
        )
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise OpenAIRequestError(
            f"tool_choice = {body['tool_choice']!r}: the built-in engine does not constrain tool calls "
            "(auto or none)",
            "tool_choice",
        )
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), None)
    gen = {
        "rid": _rid(body),
        "input_ids": ids,
        "sampling_params": _sampling(body, max_tokens, stop_ids),
        "return_logprob": True,
    }
    return _to_call(
        "chat",
        body,
        gen,
        encode=encode,
        vocab_size=vocab_size,
        context_len=context_len,
        model=model,
        logprobs=logprobs,
    )


# -- responses -------------------------------------------------------------------------------------------------


def _finish(snap: RequestSnapshot) -> tuple[str | None, int | str | None]:
    reason = snap.finish_reason or {}
    kind = reason.get("type")
    if kind == "stop":
        return "stop", reason.get("matched")
    if kind == "length":
        return "length", None
    if kind == "abort":
        return "abort", None
    return None, None


def _token_text(decode: Callable[[list[int], bool], str], token: int) -> str:
    return decode([token], False)


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _choice_extras(
    oc: OpenAICall, snap: RequestSnapshot, decode: Callable[[list[int], bool], str]
) -> dict[str, Any]:
    extras: dict[str, Any] = {}
    if oc.return_token_ids:
        extras["token_ids"] = list(snap.output_ids)
    if oc.return_prompt_token_ids:
        extras["prompt_token_ids"] = list(snap.prompt_ids)
    if oc.return_meta_info:
        extras["meta_info"] = protocol.build_response(snap, decode=decode)["meta_info"]
    return extras


def _usage(snaps: Sequence[RequestSnapshot]) -> dict[str, Any]:
    prompt = len(snaps[0].prompt_ids) if snaps else 0
    completion = sum(len(s.output_ids) for s in snaps)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in snaps)},
        "reasoning_tokens": 0,
    }


def _metadata(snaps: Sequence[RequestSnapshot]) -> dict[str, Any]:
    first = snaps[0]
    spans = first.weight_versions
    return {
        "weight_version": (spans[-1]["version"] if spans else None) or first.weight_version,
        "weight_versions": [dict(s) for s in spans],
    }


def build_response(
    oc: OpenAICall, snaps: Sequence[RequestSnapshot], decode: Callable[[list[int], bool], str]
) -> dict[str, Any]:
    """The OpenAI response object of the finished snapshots (in choice order)."""
    choices = []
    for index, snap in enumerate(snaps):
        text = protocol.output_text(snap, decode)
        finish, matched = _finish(snap)
        values = snap.output_logprobs or []
        logprobs: dict[str, Any] | None = None
        if oc.logprobs:
            tokens = [_token_text(decode, t) for t in snap.output_ids]
            if oc.kind == "chat":
                logprobs = {
                    "content": [
                        {
                            "token": tok,
                            "bytes": list(tok.encode("utf-8")),
                            "logprob": _finite(v),
                            "top_logprobs": [],
                        }
                        for tok, v in zip(tokens, values, strict=True)
                    ]
                }
            else:
                logprobs = {
                    "tokens": tokens,
                    "token_logprobs": [_finite(v) for v in values],
                    "top_logprobs": [{} for _ in tokens],
                    "text_offset": [-1] * len(tokens),
                }
        choice: dict[str, Any] = {"index": index}
        if oc.kind == "chat":
            choice["message"] = {
                "role": "assistant",
                "content": text,
                "reasoning_content": None,
                "tool_calls": None,
            }
        else:
            choice["text"] = text
        choice.update(logprobs=logprobs, finish_reason=finish, matched_stop=matched)
        choice.update(_choice_extras(oc, snap, decode))
        choices.append(choice)
    return {
        "id": snaps[0].rid if snaps else uuid.uuid4().hex,
        "object": "chat.completion" if oc.kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": oc.model,
        "choices": choices,
        "usage": _usage(snaps),
        "metadata": _metadata(snaps),
    }
