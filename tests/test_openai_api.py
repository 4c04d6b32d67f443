"""The built-in engine's OpenAI-compatible /v1/completions and /v1/chat/completions, over real HTTP against a
real engine: the same ids and log-probs as /generate, the chat template applied, 400s that name the field, the
pause gate, and the `openai` client talking to it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from rollout_fleet.engine.server import ServerThread
from rollout_fleet.model import build_tokenizer
from tests.test_rollout_worker import StepGate, model_dir, serving

pytestmark = pytest.mark.timeout(120)
__all__ = ["model_dir"]  # the module fixture, shared

PROMPT = "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def srv(model_dir: Path) -> Iterator[ServerThread]:
    with serving(model_dir) as server:
        yield server


async def _post(url: str, body: object) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def _generate(srv: ServerThread, ids: list[int], max_new: int, **params: object) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, **params},
        "return_logprob": True,
    }
    status, out = await _post(srv.url + "/generate", body)
    assert status == 200, out
    return out


async def test_completions_return_the_ids_and_logprobs_of_generate(srv: ServerThread) -> None:
    tok = build_tokenizer()
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    ref = await _generate(srv, ids, 12)
    ref_lps = [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]]
    for prompt in (PROMPT, ids):  # text and token ids
        status, out = await _post(
            srv.url + "/v1/completions",
            {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0},
        )
        assert status == 200, out
        assert out["object"] == "text_completion" and out["model"] == "tiny"
        (choice,) = out["choices"]
        assert choice["prompt_token_ids"] == ids
        assert choice["token_ids"] == ref["output_ids"]
        assert choice["text"] == ref["text"]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(ref_lps, abs=1e-6)
        assert choice["logprobs"]["tokens"] == [tok.decode([t]) for t in ref["output_ids"]]
        assert choice["finish_reason"] == ("length" if len(ref["output_ids"]) == 12 else "stop")
        assert out["usage"]["prompt_tokens"] == len(ids)
        assert out["usage"]["completion_tokens"] == len(ref["output_ids"])
        assert out["metadata"]["weight_version"] == "0"


async def test_chat_applies_the_template_and_stops_at_the_end_of_turn(srv: ServerThread) -> None:
    tok = build_tokenizer()
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "12+34="}]
    templated = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(templated, add_special_tokens=False)["input_ids"]
    assert templated.endswith("<|im_start|>assistant\n")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ref = await _generate(srv, ids, 24, stop_token_ids=[im_end])
    body = {
        "messages": messages,
        "max_tokens": 24,
        "temperature": 0,
        "logprobs": True,
        "return_meta_info": True,
    }
    status, out = await _post(srv.url + "/v1/chat/completions", body)
    assert status == 200, out
    (choice,) = out["choices"]
    assert out["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert choice["prompt_token_ids"] == ids  # rendered by the tokenizer's chat template
    assert choice["token_ids"] == ref["output_ids"]
    assert choice["message"]["content"] == ref["text"]
    lps = [c["logprob"] for c in choice["logprobs"]["content"]]
    assert lps == pytest.approx([lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]], abs=1e-6)
    assert choice["meta_info"]["weight_versions"][0]["version"] == "0"
    if choice["finish_reason"] == "stop":  # the end-of-turn token stopped it: kept in the ids, not the text
        assert choice["token_ids"][-1] == im_end and choice["matched_stop"] == im_end
        assert "<|im_end|>" not in choice["message"]["content"]
    # SGLang's input_ids bypass the template: the same ids give the same answer
    status, again = await _post(srv.url + "/v1/chat/completions", {**body, "input_ids": ids})
    assert status == 200 and again["choices"][0]["token_ids"] == choice["token_ids"]
    # n samples with a seed: n choices, each with its own ids; the same seed reproduces them
    sampled = {"messages": messages, "max_tokens": 8, "temperature": 1.0, "n": 3, "seed": 7}
    status, first = await _post(srv.url + "/v1/chat/completions", sampled)
    status2, second = await _post(srv.url + "/v1/chat/completions", sampled)
    assert status == status2 == 200 and len(first["choices"]) == 3
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in first["choices"]] == [c["token_ids"] for c in second["choices"]]


@pytest.mark.parametrize(
    ("path", "body", "param", "needle"),
    [
        ("/v1/completions", {"prompt": 5}, "prompt", "prompt = 5"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt", "batch of 2 prompts"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens = 0"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature", "temperature = 'hot'"),
        ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p", "top_p = 1.5"),
        ("/v1/completions", {"prompt": "x", "logprobs": 3}, "logprobs", "logprobs = 3"),
        ("/v1/completions", {"prompt": "x", "stream": True}, "stream", "stream = True"),
        ("/v1/completions", {"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty", "0.5"),
        ("/v1/completions", {"prompt": [1, 999999]}, None, "token id 999999"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, None, "maximum context length"),
        ("/v1/chat/completions", {"messages": []}, "messages", "messages = []"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "robot"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "= 3"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n", "n = 0"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
         "top_logprobs", "top_logprobs = 2"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": ["a", ""]}, "stop",
         "empty string"),
    ],
)  # fmt: skip
async def test_bad_requests_are_400s_naming_the_field_and_value(
    srv: ServerThread, path: str, body: dict, param: str | None, needle: str
) -> None:
    status, out = await _post(srv.url + path, body)
    assert status == 400, out
    assert out["object"] == "error" and out["code"] == 400 and out["param"] == param
    assert needle in out["message"], out["message"]


async def test_not_json_is_a_400(srv: ServerThread) -> None:
    async with aiohttp.ClientSession() as http, http.post(srv.url + "/v1/completions", data=b"{nope") as resp:
        assert resp.status == 400 and "not valid JSON" in (await resp.json())["message"]


async def test_a_paused_engine_holds_openai_requests_until_continue(srv: ServerThread) -> None:
    """The same gate as /generate: after /pause_generation a new chat request waits, then runs on continue."""
    async with aiohttp.ClientSession() as http:
        async with http.post(srv.url + "/pause_generation", json={"mode": "in_place"}) as resp:
            assert resp.status == 200
        try:
            before = srv.engine.stats()["finished_requests"]
            body = {"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 4, "temperature": 0}
            pending = asyncio.ensure_future(_post(srv.url + "/v1/chat/completions", body))
            await asyncio.sleep(0.5)
            assert not pending.done() and srv.engine.stats()["finished_requests"] == before
        finally:
            async with http.post(srv.url + "/continue_generation", json={}) as resp:
                assert resp.status == 200
        status, out = await asyncio.wait_for(pending, 30)
        assert status == 200 and out["choices"][0]["token_ids"]


async def test_an_abort_mode_pause_answers_an_openai_request_as_aborted_with_its_partial_ids(
    srv: ServerThread,
) -> None:
    """As /generate: /pause_generation (abort) aborts the in-flight chat request, which answers 200 with
    finish_reason abort and the tokens generated so far, and returns only once that answer is out."""
    gate = StepGate(srv, lambda r: r.kind == "decode" and "abort-me" in r.rids)
    body = {
        "messages": [{"role": "user", "content": "1+1="}],
        "max_tokens": 200,
        "ignore_eos": True,
        "temperature": 1.0,
        "rid": "abort-me",
    }
    pending = asyncio.ensure_future(_post(srv.url + "/v1/chat/completions", body))
    try:
        await gate.reached()
        pause = asyncio.ensure_future(_post(srv.url + "/pause_generation", {"mode": "abort"}))
        await asyncio.sleep(0.2)
    finally:
        gate.release()
    try:
        assert (await asyncio.wait_for(pause, 30))[0] == 200
        assert pending.done()  # answered before the pause returned
        status, out = pending.result()
        (choice,) = out["choices"]
        assert status == 200 and choice["finish_reason"] == "abort"
        assert 0 < len(choice["token_ids"]) < 200
    finally:
        await _post(srv.url + "/continue_generation", {})


async def test_the_openai_client_talks_to_the_engine(srv: ServerThread) -> None:
    import openai

    tok = build_tokenizer()
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    try:
        models = await client.models.list()
        assert [m.id for m in models.data] == [srv.engine.served_model_name]
        chat = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "12+34="}],
            max_tokens=10,
            temperature=0,
            logprobs=True,
        )
        choice = chat.choices[0]
        extra = choice.model_extra or {}
        templated = tok.apply_chat_template(
            [{"role": "user", "content": "12+34="}], tokenize=False, add_generation_prompt=True
        )
        assert extra["prompt_token_ids"] == tok(templated, add_special_tokens=False)["input_ids"]
        assert len(extra["token_ids"]) == len(choice.logprobs.content) == chat.usage.completion_tokens
        assert choice.message.content == tok.decode(
            [t for t in extra["token_ids"] if t != tok.convert_tokens_to_ids("<|im_end|>")]
        )
        done = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0)
        assert done.choices[0].text and len((done.choices[0].model_extra or {})["token_ids"]) <= 5
        with pytest.raises(openai.BadRequestError, match="top_p = 2"):
            await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, top_p=2)
    finally:
        await client.close()
