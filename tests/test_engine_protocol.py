"""The /generate protocol without a server: the 0.5.23 contract gate, normalisation, validation, responses."""

from __future__ import annotations

import re

import pytest

from rollout_fleet.engine import protocol
from rollout_fleet.engine.protocol import (
    ContractError,
    RequestError,
    RequestSnapshot,
    SamplingParams,
    SpanRecorder,
    build_response,
    check_contract,
    parse_generate,
    parse_sampling_params,
)

VOCAB = 50


def encode(text: str) -> list[int]:
    return [ord(c) % VOCAB for c in text]


def decode(ids: list[int], skip_special: bool) -> str:
    return "".join(
        "<eos>" if (i == 1 and not skip_special) else "" if i == 1 else chr(ord("a") + i % 26) for i in ids
    )


def parse(body: dict, context_len: int = 256) -> protocol.GenerateCall:
    check_contract(body)
    return parse_generate(body, encode=encode, vocab_size=VOCAB, context_len=context_len)


# -- the contract gate -------------------------------------------------------------------------------------


def test_unknown_sampling_key_gets_the_gate_string_error() -> None:
    with pytest.raises(ContractError) as err:
        check_contract({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3, "foo": 1}})
    message = str(err.value)
    assert message.startswith("unknown field `foo`, expected one of `max_new_tokens`, `min_new_tokens`, ")
    for key in ("temperature", "top_p", "top_k", "stop_token_ids", "no_stop_trim", "sampling_seed"):
        assert f"`{key}`" in message


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"max_new_tokens": "x"}, 'invalid type: string "x", expected i64'),
        ({"max_new_tokens": 1.5}, "invalid type: floating point `1.5`, expected i64"),
        ({"top_k": True}, "invalid type: boolean `true`, expected i64"),
        ({"temperature": "hot"}, 'invalid type: string "hot", expected f64'),
        ({"temperature": None}, "invalid type: null, expected f64"),
        ({"ignore_eos": 1}, "invalid type: integer `1`, expected a boolean"),
        ({"stop": 5}, "invalid type: integer `5`, expected a string or a sequence of strings"),
        ({"stop_token_ids": [1, "2"]}, "invalid type: sequence, expected a sequence of i64"),
    ],
)
def test_wrong_json_types_are_gate_errors(params: dict, message: str) -> None:
    with pytest.raises(ContractError, match=re.escape(message)):
        check_contract({"input_ids": [1], "sampling_params": params})


def test_gate_accepts_nulls_where_sglang_has_optionals_and_ignores_unknown_top_level_keys() -> None:
    body = {
        "input_ids": [1],
        "sampling_params": {"max_new_tokens": None, "stop": None, "sampling_seed": None},
    }
    check_contract({**body, "some_future_field": {"x": 1}})
    with pytest.raises(ContractError, match="expected a sequence of i64 or a sequence of sequences"):
        check_contract({"input_ids": "12"})
    with pytest.raises(ContractError):
        check_contract({"input_ids": [1], "sampling_params": [{"max_new_tokens": 1}, {"bogus": 1}]})


# -- normalisation ---------------------------------------------------------------------------------------


def test_single_and_batch_inputs() -> None:
    single = parse({"input_ids": [3, 4, 5], "rid": "r"})
    assert not single.is_batch and [i.rid for i in single.items] == ["r"]
    assert single.items[0].max_new_tokens == protocol.DEFAULT_MAX_NEW_TOKENS
    batch = parse({"text": ["ab", "cde"], "rid": "b", "sampling_params": {"max_new_tokens": 4}})
    assert batch.is_batch
    assert [i.rid for i in batch.items] == ["b_0", "b_1"]
    assert [i.input_ids for i in batch.items] == [encode("ab"), encode("cde")]
    listed = parse({"input_ids": [[3], [4]], "rid": ["x", "y"], "return_logprob": [True, False]})
    assert [(i.rid, i.return_logprob) for i in listed.items] == [("x", True), ("y", False)]


def test_n_fans_out_prompt_major_with_fresh_rids() -> None:
    call = parse(
        {"input_ids": [[3, 4], [5, 6, 7]], "rid": "mine", "sampling_params": {"n": 3, "max_new_tokens": 2}}
    )
    assert call.is_batch
    assert [len(i.input_ids) for i in call.items] == [2, 2, 2, 3, 3, 3]
    assert [i.index for i in call.items] == list(range(6))
    rids = [i.rid for i in call.items]
    assert len(set(rids)) == 6 and all(re.fullmatch(r"[0-9a-f]{32}", r) for r in rids)
    single = parse({"input_ids": [3], "sampling_params": {"n": 2, "max_new_tokens": 1}})
    assert single.is_batch and len(single.items) == 2  # a single prompt with n > 1 answers an array


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "Either text, input_ids or input_embeds should be provided."),
        ({"input_ids": []}, "input_ids cannot be empty."),
        ({"input_ids": [1], "text": "a"}, "not both"),
        ({"input_embeds": [[0.1]]}, "input_embeds is not supported"),
        ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, "Duplicate request ID found in the batch: 'a'"),
        ({"input_ids": [[1], [2]], "rid": ["a"]}, "rids length mismatch"),
        ({"input_ids": [1, 99]}, "token id 99, outside the vocabulary [0, 50)"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature must be non-negative"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1], got 0.0."),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k must be -1 (disable), or at least 1"),
        ({"input_ids": [1], "sampling_params": {"min_p": 2}}, "min_p must be in [0, 1]"),
        (
            {"input_ids": [1], "sampling_params": {"max_new_tokens": 300}},
            "maximum context length of 256 tokens",
        ),
        ({"input_ids": [1] * 256}, "longer than the model's context length (256 tokens)"),
        ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 3}, "logprob_start_len (3)"),
        ({"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty = 0.5 is not"),
        ({"input_ids": [1], "sampling_params": {"regex": "a+"}}, "regex = 'a+' is not supported"),
        ({"input_ids": [[1], [2]], "sampling_params": [{"n": 2}, {"n": 1}]}, "parallel_sample_num"),
        (
            {"input_ids": [[1], [2]], "sampling_params": {"n": 2}, "return_logprob": [True, True]},
            "Cannot use list return_logprob with parallel_sample_num > 1",
        ),
        ({"input_ids": [1], "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}}, "min_new_tokens"),
    ],
)
def test_validation_errors_name_the_problem(body: dict, message: str) -> None:
    body.setdefault("sampling_params", {"max_new_tokens": 4})
    with pytest.raises(RequestError) as err:
        parse(body)
    assert message in str(err.value)


def test_sampling_defaults_and_budget() -> None:
    p = parse_sampling_params({"top_k": 1 << 30, "temperature": 0, "stop": "##", "frequency_penalty": 0.0})
    assert p.top_k == -1 and p.greedy and p.stop == ("##",) and p.max_new_tokens == 128
    assert not SamplingParams(temperature=1e-6).greedy
    call = parse({"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": None}}, context_len=64)
    assert call.items[0].max_new_tokens == 54  # null: everything the context leaves
    exact = parse({"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 54}}, context_len=64)
    assert exact.items[0].max_new_tokens == 54


# -- responses ----------------------------------------------------------------------------------------------


def snapshot(**overrides) -> RequestSnapshot:
    base = dict(
        rid="r",
        prompt_ids=[3, 4, 5],
        params=SamplingParams(),
        output_ids=[6, 7, 1],
        output_logprobs=[-0.5, -1.0, -0.25],
        input_logprobs=[None, -2.0, float("-inf")],
        logprob_start_len=0,
        finish_reason=protocol.finish_stop(1),
        weight_version="3",
        weight_versions=[{"version": "2", "start": 0, "end": 2}, {"version": "3", "start": 2, "end": 3}],
        num_retractions=1,
        finished=True,
        e2e_latency=0.5,
    )
    base.update(overrides)
    return RequestSnapshot(**base)


def test_finished_response_shape() -> None:
    out = build_response(snapshot(), decode=decode)
    assert out["output_ids"] == [6, 7, 1]  # the stop token stays in output_ids ...
    assert out["text"] == decode([6, 7], True)  # ... and leaves the text
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": 1}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 3 and meta["cached_tokens"] == 0
    assert meta["num_retractions"] == 1 and meta["reasoning_tokens"] == 0
    assert meta["output_token_logprobs"] == [[-0.5, 6, None], [-1.0, 7, None], [-0.25, 1, None]]
    assert meta["output_token_logprobs_length"] == 3
    assert meta["input_token_logprobs"] == [[None, 3, None], [-2.0, 4, None], [None, 5, None]]  # -inf -> null
    assert meta["weight_version"] == "3" and len(meta["weight_versions"]) == 2
    assert meta["e2e_latency"] == 0.5
    texts = build_response(
        snapshot(), decode=decode, return_text_in_logprobs=True, return_prompt_token_ids=True
    )
    assert texts["meta_info"]["output_token_logprobs"][0] == [-0.5, 6, decode([6], False)]
    assert texts["prompt_token_ids"] == [3, 4, 5]


def test_stop_trimming_rules() -> None:
    no_trim = SamplingParams(no_stop_trim=True, skip_special_tokens=False)
    assert build_response(snapshot(params=no_trim), decode=decode)["text"] == decode([6, 7, 1], False)
    stop_str = snapshot(
        output_ids=[2, 3, 4, 5], finish_reason=protocol.finish_stop("de"), output_logprobs=None
    )
    assert decode([2, 3, 4, 5], True) == "cdef"
    assert build_response(stop_str, decode=decode)["text"] == "c"
    kept = snapshot(
        output_ids=[2, 3, 4, 5],
        finish_reason=protocol.finish_stop("de"),
        params=no_trim,
        output_logprobs=None,
    )
    assert build_response(kept, decode=decode)["text"] == "cdef"
    length = snapshot(finish_reason=protocol.finish_length(3))
    assert build_response(length, decode=decode)["text"] == decode([6, 7, 1], True)


def test_queued_abort_and_stream_chunk_keys() -> None:
    queued = snapshot(
        output_ids=[],
        output_logprobs=None,
        finish_reason=protocol.finish_abort(protocol.ABORT_IN_WAITING_QUEUE),
        queued_abort=True,
        weight_versions=[],
    )
    meta = build_response(queued, decode=decode)["meta_info"]
    assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert "prompt_tokens" not in meta and "cached_tokens" not in meta
    assert {"id", "finish_reason", "weight_version", "e2e_latency", "completion_tokens"} <= set(meta)
    assert meta["weight_version"] == "3"
    running_abort = protocol.finish_abort()
    assert running_abort == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    chunk = build_response(snapshot(finished=False, finish_reason=None), decode=decode)["meta_info"]
    assert chunk["finish_reason"] is None and "e2e_latency" not in chunk and "weight_versions" not in chunk


def test_span_recorder_and_error_status() -> None:
    spans = SpanRecorder()
    for i, v in enumerate(["0", "0", "1", "1", "1", "2"]):
        spans.add(v, i)
    assert spans.copy() == [
        {"version": "0", "start": 0, "end": 2},
        {"version": "1", "start": 2, "end": 5},
        {"version": "2", "start": 5, "end": 6},
    ]
    failed = snapshot(finish_reason=protocol.finish_abort("boom", 500, "InternalServerError"))
    assert protocol.error_status(failed) == 500
    assert protocol.error_status(snapshot(finish_reason=protocol.finish_abort())) is None
