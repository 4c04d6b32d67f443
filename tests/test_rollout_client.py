"""Request building and response parsing of /generate, against the JSON shapes of sglang-api.md (pure)."""

from __future__ import annotations

import copy

import pytest

from rollout_fleet.generate_client import (
    InvalidResponse,
    RequestRejected,
    SamplingConfig,
    build_generate_request,
    build_group_request,
    error_message,
    parse_generate_response,
)

# Section 2.8's example response, with the engine labelled by our policy versions.
EXAMPLE = {
    "text": "4<|im_end|>",
    "output_ids": [19, 151645],
    "meta_info": {
        "id": "req-42",
        "finish_reason": {"type": "stop", "matched": 151645},
        "prompt_tokens": 10,
        "weight_version": "3",
        "num_retractions": 0,
        "input_token_logprobs": [],
        "output_token_logprobs": [[-0.012, 19, None], [-0.003, 151645, None]],
        "output_token_logprobs_length": 2,
        "reasoning_tokens": 0,
        "completion_tokens": 2,
        "cached_tokens": 0,
        "weight_versions": [{"version": "3", "start": 0, "end": 2}],
        "e2e_latency": 0.05,
        "response_sent_to_client_ts": 1.7e9,
    },
}


def example(**meta: object) -> dict:
    body = copy.deepcopy(EXAMPLE)
    body["meta_info"].update(meta)
    return body


def test_the_request_is_one_input_ids_prompt_with_output_logprobs_and_known_sampling_keys() -> None:
    sampling = SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=(1, 151645))
    body = build_generate_request([3, 4, 5], sampling, 128, "g:s0:r0")
    assert body == {
        "input_ids": [3, 4, 5],
        "sampling_params": {
            "max_new_tokens": 128,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "stop_token_ids": [1, 151645],
            "no_stop_trim": True,
            "skip_special_tokens": False,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
        "rid": "g:s0:r0",
    }
    assert "n" not in body["sampling_params"]  # one request per sample, never n > 1
    with pytest.raises(ValueError, match="input_ids is empty"):
        build_generate_request([], sampling, 1, "r")
    with pytest.raises(ValueError, match="max_new_tokens = 0"):
        build_generate_request([1], sampling, 0, "r")
    with pytest.raises(ValueError, match="rid"):
        build_generate_request([1], sampling, 1, "")


def test_a_group_request_is_a_batch_of_the_prompt_with_one_rid_per_sample() -> None:
    sampling = SamplingConfig(temperature=0.7)
    body = build_group_request([3, 4], sampling, 16, ["g:s0:r0", "g:s1:r0", "g:s2:r0"])
    single = build_generate_request([3, 4], sampling, 16, "g:s0:r0")
    # sglang-api.md 2.6: a list of lists of input_ids answers with an array in the same order, a rid each
    assert body == {**single, "input_ids": [[3, 4]] * 3, "rid": ["g:s0:r0", "g:s1:r0", "g:s2:r0"]}
    assert "n" not in body["sampling_params"]
    with pytest.raises(ValueError, match="distinct"):
        build_group_request([3], sampling, 16, ["a", "a"])
    with pytest.raises(ValueError, match="non-empty"):
        build_group_request([3], sampling, 16, [])


def test_a_finished_answer_gives_ids_logprobs_and_per_token_versions() -> None:
    r = parse_generate_response(EXAMPLE, expected_rid="req-42")
    assert (r.output_ids, r.logprobs, r.versions) == ([19, 151645], [-0.012, -0.003], [3, 3])
    assert (r.finish_reason, r.matched, r.prompt_tokens, r.weight_version, r.aborted) == (
        "stop",
        151645,
        10,
        3,
        False,
    )


def test_version_spans_give_each_token_the_version_that_generated_it() -> None:
    body = example(
        output_token_logprobs=[[-0.1, 7, None], [-0.2, 8, None], [-0.3, 9, None]],
        weight_versions=[{"version": "0", "start": 0, "end": 1}, {"version": "1", "start": 1, "end": 3}],
    )
    body["output_ids"] = [7, 8, 9]
    assert parse_generate_response(body).versions == [0, 1, 1]
    gap = example(
        weight_versions=[{"version": "0", "start": 0, "end": 1}, {"version": "1", "start": 2, "end": 2}]
    )
    with pytest.raises(InvalidResponse, match=r"weight_versions\[1\].*tile"):
        parse_generate_response(gap)
    short = example(weight_versions=[{"version": "0", "start": 0, "end": 1}])
    with pytest.raises(InvalidResponse, match="cover 1 tokens, the output has 2"):
        parse_generate_response(short)


def test_sglang_0_5_10_without_spans_uses_the_weight_version_and_default_is_version_0() -> None:
    body = example(weight_version="default")
    del body["meta_info"]["weight_versions"]
    assert parse_generate_response(body).versions == [0, 0]
    # a label that names no policy version is an invalid answer, naming where it was and what it was
    with pytest.raises(InvalidResponse, match=r"meta_info\.weight_version = 'v2'"):
        parse_generate_response(example(weight_version="v2"))


def test_an_abort_keeps_the_partial_output_and_a_queue_abort_has_none() -> None:
    partial = example(
        finish_reason={"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    )
    r = parse_generate_response(partial)
    assert r.aborted and r.output_ids == [19, 151645] and r.finish_message == "Aborted"
    queued = {
        "text": "",
        "output_ids": [],
        "meta_info": {
            "id": "x",
            "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
            "weight_version": "0",
            "e2e_latency": 0.01,
            "completion_tokens": 0,
        },
    }
    r = parse_generate_response(queued)
    assert r.aborted and (r.output_ids, r.logprobs, r.versions, r.prompt_tokens) == ([], [], [], None)


def test_answers_that_would_corrupt_training_are_refused_with_the_reason() -> None:
    nan = example(output_token_logprobs=[[None, 19, None], [-0.003, 151645, None]])
    with pytest.raises(InvalidResponse, match=r"output_token_logprobs\[0\] log-prob = None"):
        parse_generate_response(nan)
    with pytest.raises(InvalidResponse, match="disagree"):
        parse_generate_response({**EXAMPLE, "output_ids": [19, 20]})
    with pytest.raises(InvalidResponse, match="output_token_logprobs is missing"):
        parse_generate_response(example(output_token_logprobs=None))
    with pytest.raises(InvalidResponse, match="expected 'mine'"):
        parse_generate_response(EXAMPLE, expected_rid="mine")
    with pytest.raises(InvalidResponse, match="one JSON object"):
        parse_generate_response([EXAMPLE])
    with pytest.raises(InvalidResponse, match="finish_reason"):
        parse_generate_response(example(finish_reason=None))


def test_a_validation_abort_is_a_rejected_request() -> None:
    body = example(
        finish_reason={
            "type": "abort",
            "message": "too long",
            "status_code": 400,
            "err_type": "BadRequestError",
        }
    )
    with pytest.raises(RequestRejected) as info:
        parse_generate_response(body)
    assert (info.value.status, info.value.message) == (400, "too long")


def test_error_bodies_of_every_sglang_shape_give_their_message() -> None:
    assert error_message(400, '{"error": "unknown field `foo`, expected one of ..."}').startswith(
        "unknown field"
    )
    assert error_message(400, '{"error": {"message": "Requested token count exceeds"}}') == (
        "Requested token count exceeds"
    )
    assert error_message(400, '{"object":"error","message":"bad body","code":400}') == "bad body"
    assert error_message(502, "Bad Gateway") == "Bad Gateway"
