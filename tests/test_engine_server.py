"""The built-in engine over real HTTP (aiohttp server on 127.0.0.1, free port) against the SGLang reference.

The server runs in-process (its own thread and event loop; the scheduler in another thread), so tests can read
the scheduler's counters and batch log, and hold the scheduler between two steps with a ``StepGate`` to make
"while it is running" deterministic. Log-probs are checked against a teacher-forced forward pass of the same HF
model loaded separately.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout_fleet.engine.core import Engine
from rollout_fleet.engine.scheduler import StepRecord
from rollout_fleet.engine.server import ServerSettings, ServerThread
from rollout_fleet.model import TinyModelSpec, init_tiny_model

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(120)

CTX = 512
LONG = {"max_new_tokens": 400, "ignore_eos": True}
SETTINGS = ServerSettings(
    request_timeout_s=120, control_timeout_s=30, health_check_timeout_s=10, shutdown_timeout_s=5
)


# -- fixtures and helpers -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("engine") / "tiny")


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture, different weights: what a 'weight update' loads."""
    return init_tiny_model(tmp_path_factory.mktemp("engine") / "tiny-seed1", TinyModelSpec(seed=1))


def load_hf(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()


@contextlib.contextmanager
def serving(model_dir: Path, **engine_kwargs: Any) -> Iterator[ServerThread]:
    kwargs = {"max_running_requests": 8, "max_context_len": CTX, **engine_kwargs}
    engine = Engine(model_dir, **kwargs).start()
    server = ServerThread(engine, settings=SETTINGS).start()
    try:
        yield server
    finally:
        server.stop()
        engine.shutdown()


@pytest.fixture(scope="module")
def srv(model_dir: Path) -> Iterator[ServerThread]:
    with serving(model_dir) as server:
        yield server


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> torch.nn.Module:
    return load_hf(model_dir)


@pytest.fixture
async def http() -> aiohttp.ClientSession:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


async def call(
    http: aiohttp.ClientSession, method: str, url: str, body: Any = None, **kw: Any
) -> tuple[int, Any]:
    async with http.request(method, url, json=body, **kw) as resp:
        text = await resp.text()
        try:
            return resp.status, json.loads(text)
        except json.JSONDecodeError:
            return resp.status, text


async def generate(http: aiohttp.ClientSession, srv: ServerThread, body: dict) -> Any:
    status, data = await call(http, "POST", srv.url + "/generate", body)
    assert status == 200, data
    return data


async def wait_until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def live(srv: ServerThread, rid: str) -> Any:
    sched = srv.engine.scheduler
    return next((r for r in list(sched.running) + list(sched.waiting) if r.rid == rid), None)


def tokens_of(srv: ServerThread, rid: str) -> int:
    req = live(srv, rid)
    return len(req.output_ids) if req is not None else 0


class StepGate:
    """Holds the scheduler thread after the first forward pass where ``when(record)`` is true, until release."""

    def __init__(self, srv: ServerThread, when: Callable[[StepRecord], bool]) -> None:
        self.when = when
        self.hit = threading.Event()
        self._go = threading.Event()
        self._remove = srv.engine.scheduler.add_step_listener(self._on_step)
        self._srv = srv

    def _on_step(self, record: StepRecord) -> None:
        if not self.hit.is_set() and self.when(record):
            self.hit.set()
            self._go.wait(30)

    async def reached(self) -> None:
        assert await asyncio.to_thread(self.hit.wait, 30), "the gated step never happened"

    async def release_after_commands(self, n: int = 1) -> None:
        """Release once ``n`` commands are queued, so they run right after the held step."""
        await wait_until(lambda: self._srv.engine.scheduler.pending_commands() >= n)
        self.release()

    def release(self) -> None:
        self._go.set()
        self._remove()


def decoding(srv: ServerThread, rid: str, tokens: int) -> Callable[[StepRecord], bool]:
    return lambda rec: rec.kind == "decode" and rid in rec.rids and tokens_of(srv, rid) >= tokens


def reference_logprobs(
    model: torch.nn.Module, prompt: list[int], output: list[int], temperature: float
) -> torch.Tensor:
    """Teacher-forced log softmax(logits / T) of each output token (T = 1 when greedy)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1 :]
    t = 1.0 if temperature < 1e-6 else temperature
    return torch.log_softmax(logits / t, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


def logprobs_of(resp: dict) -> torch.Tensor:
    triples = resp["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in triples] == resp["output_ids"]
    return torch.tensor([t[0] for t in triples])


def prompt_ids(n: int, seed: int) -> list[int]:
    return torch.randint(5, 100, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- generation, shapes, log-probs --------------------------------------------------------------------------


async def test_concurrent_logprobs_equal_a_forward_pass(srv: ServerThread, hf, http) -> None:
    prompts = [prompt_ids(n, seed) for seed, n in enumerate((5, 17, 11))]
    temps = [0.7, 1.0, 0.0]
    bodies = [
        {
            "input_ids": p,
            "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, "temperature": t, "top_p": 0.95},
            "return_logprob": True,
            "logprob_start_len": 0 if i == 0 else -1,
            "rid": f"lp-{i}",
        }
        for i, (p, t) in enumerate(zip(prompts, temps, strict=True))
    ]
    results = await asyncio.gather(*(generate(http, srv, b) for b in bodies))
    decodes = [r for r in srv.engine.scheduler.step_log if r.kind == "decode"]
    assert any({"lp-0", "lp-1", "lp-2"} <= set(r.rids) for r in decodes), "the requests never shared a step"
    for prompt, t, res in zip(prompts, temps, results, strict=True):
        meta = res["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 24}
        assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == 24
        assert meta["output_token_logprobs_length"] == 24 and meta["weight_version"] == "0"
        assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 24}]
        assert meta["num_retractions"] == 0 and meta["cached_tokens"] == 0 and meta["e2e_latency"] > 0
        ref = reference_logprobs(hf, prompt, res["output_ids"], t)
        assert torch.allclose(logprobs_of(res), ref, atol=1e-4), (logprobs_of(res) - ref).abs().max()
    with torch.no_grad():  # greedy tokens are the argmax of the teacher-forced logits
        greedy = results[2]["output_ids"]
        logits = hf(torch.tensor([prompts[2] + greedy[:-1]])).logits[0, len(prompts[2]) - 1 :]
    assert logits.argmax(-1).tolist() == greedy
    inputs = results[0]["meta_info"]["input_token_logprobs"]
    assert [t[1] for t in inputs] == prompts[0] and inputs[0][0] is None
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([prompts[0]])).logits[0, :-1] / 0.7, -1)
    expected = lp.gather(1, torch.tensor(prompts[0][1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor([t[0] for t in inputs[1:]]), expected, atol=1e-4)
    assert results[1]["meta_info"]["input_token_logprobs"] == []


async def test_batch_order_text_input_and_greedy_determinism(srv: ServerThread, http) -> None:
    texts = ["12+34=", "7+8=", "123+456+789="]
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    batch = await generate(http, srv, {"text": texts, "sampling_params": params, "rid": "bo"})
    assert isinstance(batch, list) and len(batch) == 3
    assert [r["meta_info"]["id"] for r in batch] == ["bo_0", "bo_1", "bo_2"]
    singles = [await generate(http, srv, {"text": t, "sampling_params": params}) for t in texts]
    assert [r["output_ids"] for r in batch] == [r["output_ids"] for r in singles]
    assert [r["meta_info"]["prompt_tokens"] for r in batch] == [len(t) for t in texts]
    again = await generate(http, srv, {"text": texts[2], "sampling_params": params})
    assert again["output_ids"] == singles[2]["output_ids"] and again["text"] == singles[2]["text"]


async def test_finish_reasons_stop_token_stop_string_and_length(srv: ServerThread, http) -> None:
    # A seeded sampled run is the reference: a stopped run with the same seed is a prefix of it.
    base = {"input_ids": prompt_ids(8, 40)}
    seeded = {"max_new_tokens": 40, "sampling_seed": 5, "skip_special_tokens": False}
    free = {**seeded, "ignore_eos": True}
    ref = await generate(http, srv, {**base, "sampling_params": free})
    ids, text = ref["output_ids"], ref["text"]
    assert ref["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
    eos = srv.engine.eos_token_ids
    # Stop token: the run stops at the first occurrence of the chosen token (or of EOS, if earlier).
    stop_tok = next(t for t in ids[4:] if t not in eos)
    cut = next(i for i, t in enumerate(ids) if t == stop_tok or t in eos)
    res = await generate(http, srv, {**base, "sampling_params": {**seeded, "stop_token_ids": [stop_tok]}})
    assert res["output_ids"] == ids[: cut + 1]  # the stop token stays in output_ids
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[cut]}
    assert res["text"] == srv.engine.decode(ids[:cut], False)  # and leaves the text
    kept = {**seeded, "stop_token_ids": [stop_tok], "no_stop_trim": True}
    res = await generate(http, srv, {**base, "sampling_params": kept})
    assert res["text"] == srv.engine.decode(ids[: cut + 1], False)
    # Stop string: two one-character tokens whose text first appears at token k.
    pieces = [srv.engine.decode([t], False) for t in ids]
    offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(ids))]
    k = next(
        i
        for i in range(3, len(ids) - 2)
        if len(pieces[i]) == len(pieces[i + 1]) == 1 and text.find(pieces[i] + pieces[i + 1]) == offsets[i]
    )
    stop = pieces[k] + pieces[k + 1]
    res = await generate(http, srv, {**base, "sampling_params": {**free, "stop": [stop, "never-seen"]}})
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert res["text"] == text[: offsets[k]] and res["output_ids"] == ids[: k + 2]
    res = await generate(http, srv, {**base, "sampling_params": {**free, "stop": stop, "no_stop_trim": True}})
    assert res["text"] == text[: offsets[k] + 2]


async def test_n_fan_out_is_prompt_major_with_fresh_rids(srv: ServerThread, http) -> None:
    body = {
        "input_ids": [prompt_ids(3, 1), prompt_ids(7, 2)],
        "sampling_params": {"n": 3, "max_new_tokens": 4},
        "rid": "mine",
    }
    res = await generate(http, srv, body)
    assert [r["meta_info"]["prompt_tokens"] for r in res] == [3, 3, 3, 7, 7, 7]
    rids = [r["meta_info"]["id"] for r in res]
    assert len(set(rids)) == 6 and all(re.fullmatch(r"[0-9a-f]{32}", r) for r in rids)
    assert all(len(r["output_ids"]) == r["meta_info"]["completion_tokens"] for r in res)


async def test_protocol_errors_over_http(srv: ServerThread, http) -> None:
    url = srv.url + "/generate"
    status, data = await call(http, "POST", url, {"input_ids": [5], "sampling_params": {"foo": 1}})
    assert status == 400 and data["error"].startswith("unknown field `foo`, expected one of `max_new_tokens`")
    status, data = await call(http, "POST", url, {"input_ids": [5], "sampling_params": {"top_k": "3"}})
    assert (status, data) == (400, {"error": 'invalid type: string "3", expected i64'})
    status, data = await call(http, "POST", url, {"input_ids": [[5], [6]], "rid": ["d", "d"]})
    assert status == 400 and "Duplicate request ID" in data["error"]["message"]
    status, data = await call(
        http, "POST", url, {"input_ids": [5], "sampling_params": {"max_new_tokens": CTX}}
    )
    assert status == 400 and "maximum context length" in data["error"]["message"]
    status, data = await call(http, "POST", url, {"sampling_params": {}})
    assert (
        status == 400
        and data["error"]["message"] == "Either text, input_ids or input_embeds should be provided."
    )
    async with http.post(
        url, json={"input_ids": [5], "stream": True, "sampling_params": {"top_p": 2}}
    ) as resp:
        events = [line async for line in resp.content if line.strip()]
    assert resp.status == 200 and events[-1].strip() == b"data: [DONE]"
    assert "top_p must be in (0, 1]" in json.loads(events[0][len(b"data: ") :])["error"]["message"]
    for path in ("/pause_generation", "/abort_request", "/continue_generation"):
        status, data = await call(http, "POST", srv.url + path, data=b"")
        assert status == 400 and data["object"] == "error" and data["code"] == 400, path
    status, data = await call(http, "POST", srv.url + "/pause_generation", {"mode": "sideways"})
    assert status == 400 and data["type"] == "Bad Request"
    assert not srv.server.is_paused


async def test_streaming_sends_cumulative_chunks_then_done(srv: ServerThread, http) -> None:
    body = {
        "input_ids": prompt_ids(6, 3),
        "sampling_params": {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
    }
    final = await generate(http, srv, body)
    async with http.post(srv.url + "/generate", json={**body, "stream": True}) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = [line.strip() for line in [line async for line in resp.content] if line.strip()]
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, 11))
    for prev, nxt in zip(chunks, chunks[1:], strict=False):
        assert nxt["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert nxt["text"].startswith(prev["text"])
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    assert chunks[-1]["output_ids"] == final["output_ids"]
    assert len(chunks[-1]["meta_info"]["output_token_logprobs"]) == 10
    batch = {"input_ids": [prompt_ids(4, 5), prompt_ids(9, 6)], "sampling_params": {"max_new_tokens": 3}}
    async with http.post(srv.url + "/generate", json={**batch, "stream": True}) as resp:
        lines = [line.strip() for line in [line async for line in resp.content] if line.strip()]
    indexed = [json.loads(e[len(b"data: ") :]) for e in lines[:-1]]
    assert sorted({c["index"] for c in indexed}) == [0, 1] and lines[-1] == b"data: [DONE]"


async def test_sampling_seed_reproduces_in_any_batch(srv: ServerThread, http) -> None:
    body = {
        "input_ids": prompt_ids(7, 8),
        "sampling_params": {
            "max_new_tokens": 30,
            "ignore_eos": True,
            "temperature": 1.0,
            "sampling_seed": 42,
        },
    }
    alone = await generate(http, srv, {**body, "rid": "seed-a"})
    noise = {
        "input_ids": [prompt_ids(n, n) for n in (3, 12, 20)],
        "sampling_params": {**LONG, "max_new_tokens": 60},
        "rid": "noise",
    }
    crowded, _ = await asyncio.gather(
        generate(http, srv, {**body, "rid": "seed-b"}), generate(http, srv, noise)
    )
    assert any({"seed-b", "noise_0"} <= set(r.rids) for r in srv.engine.scheduler.step_log)
    assert crowded["output_ids"] == alone["output_ids"]
    other = await generate(
        http, srv, {**body, "sampling_params": {**body["sampling_params"], "sampling_seed": 7}}
    )
    assert other["output_ids"] != alone["output_ids"]


async def test_info_endpoints(srv: ServerThread, http) -> None:
    for path in ("/health", "/health_generate", "/ready"):
        status, _ = await call(http, "GET", srv.url + path)
        assert status == 200, path
    status, info = await call(http, "GET", srv.url + "/model_info")
    assert status == 200 and info["weight_version"] == "0" and info["is_generation"] is True
    assert info["architectures"] == ["Qwen2ForCausalLM"] and info["model_type"] == "qwen2"
    assert (await call(http, "GET", srv.url + "/get_model_info"))[1] == info
    status, server_info = await call(http, "GET", srv.url + "/server_info")
    assert server_info["max_running_requests"] == 8 and server_info["context_length"] == CTX
    assert server_info["internal_states"][0]["prefill_batches"] > 0 and server_info["version"] == "0.5.23"
    status, loads = await call(http, "GET", srv.url + "/v1/loads")
    load = loads["loads"][0]
    assert {"num_running_reqs", "num_waiting_reqs", "num_used_tokens", "token_usage"} <= set(load)
    async with http.get(srv.url + "/flush_cache") as resp:
        assert resp.status == 200 and (await resp.text()).startswith("Cache flushed.")


# -- continuous batching --------------------------------------------------------------------------------------


async def test_requests_join_a_running_batch_without_prefill_recompute(srv: ServerThread, hf, http) -> None:
    sched = srv.engine.scheduler
    a = {"input_ids": prompt_ids(9, 11), "rid": "cb-a", "return_logprob": True,
         "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}  # fmt: skip
    b = {"input_ids": prompt_ids(14, 12), "rid": "cb-b", "return_logprob": True,
         "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0.5}}  # fmt: skip
    first_step = sched.stats.steps
    prefill_before = sched.stats.prefill_tokens_computed
    gate = StepGate(srv, decoding(srv, "cb-a", 5))
    task_a = asyncio.create_task(generate(http, srv, a))
    await gate.reached()
    task_b = asyncio.create_task(generate(http, srv, b))  # arrives while A is mid-decode
    await gate.release_after_commands(1)
    res_a, res_b = await asyncio.gather(task_a, task_b)
    log = [r for r in sched.step_log if r.step > first_step]
    prefills = {
        rid: [r.step for r in log if r.kind == "prefill" and rid in r.rids] for rid in ("cb-a", "cb-b")
    }
    assert len(prefills["cb-a"]) == 1 and len(prefills["cb-b"]) == 1  # one prefill each, never recomputed
    shared = [r for r in log if r.kind == "decode" and {"cb-a", "cb-b"} <= set(r.rids)]
    assert shared, "B never joined A's decode batch"
    a_alone = [r for r in log if r.kind == "decode" and r.rids == ("cb-a",) and r.step < prefills["cb-b"][0]]
    assert len(a_alone) >= 4  # A was decoding before B arrived: they started at different times
    assert sched.stats.prefill_tokens_computed - prefill_before == 9 + 14
    assert torch.allclose(
        logprobs_of(res_a), reference_logprobs(hf, a["input_ids"], res_a["output_ids"], 1.0), atol=1e-4
    )
    assert torch.allclose(
        logprobs_of(res_b), reference_logprobs(hf, b["input_ids"], res_b["output_ids"], 0.5), atol=1e-4
    )


async def test_identical_prompts_admitted_together_are_prefilled_once(srv: ServerThread, hf, http) -> None:
    """A group's samples arrive with one prompt: one prefill of it, its KV copied, every sample still exact."""
    sched = srv.engine.scheduler
    p, q = prompt_ids(12, 21), prompt_ids(7, 22)
    hold = {"input_ids": prompt_ids(5, 23), "rid": "dup-hold",
            "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}}  # fmt: skip
    gate = StepGate(srv, decoding(srv, "dup-hold", 3))
    held = asyncio.create_task(generate(http, srv, hold))
    await gate.reached()
    before = sched.stats.prefill_tokens_computed
    params = {"max_new_tokens": 10, "ignore_eos": True, "temperature": 1.0}
    group = {"input_ids": [p, p, q, p], "rid": ["dup-0", "dup-1", "dup-2", "dup-3"], "return_logprob": True,
             "sampling_params": params}  # fmt: skip
    with_inputs = {"input_ids": p, "rid": "dup-in", "return_logprob": True, "logprob_start_len": 0,
                   "sampling_params": params}  # fmt: skip
    tasks = [asyncio.create_task(generate(http, srv, b)) for b in (group, with_inputs)]
    await gate.release_after_commands(2)
    batch, single = await asyncio.gather(*tasks)
    await held
    rids = ("dup-0", "dup-1", "dup-2", "dup-3", "dup-in")
    prefills = [r for r in sched.step_log if r.kind == "prefill" and set(rids) & set(r.rids)]
    assert len(prefills) == 1 and set(prefills[0].rids) == set(rids)  # admitted together
    assert sched.stats.prefill_tokens_computed - before == len(p) + len(q)  # p once for 4 requests
    for res, prompt in zip([*batch, single], [p, p, q, p, p], strict=True):
        ref = reference_logprobs(hf, prompt, res["output_ids"], 1.0)
        assert torch.allclose(logprobs_of(res), ref, atol=1e-4), (logprobs_of(res) - ref).abs().max()
    assert len({tuple(r["output_ids"]) for r in (batch[0], batch[1], batch[3], single)}) > 1  # own samples
    inputs = single["meta_info"]["input_token_logprobs"]  # this copy wanted every position's logits
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([p])).logits[0, :-1], -1)
    expected = lp.gather(1, torch.tensor(p[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor([t[0] for t in inputs[1:]]), expected, atol=1e-4)


# -- aborts ----------------------------------------------------------------------------------------------------


async def test_abort_running_request_returns_partial_output(srv: ServerThread, http) -> None:
    body = {"input_ids": prompt_ids(5, 21), "rid": "ab-1", "return_logprob": True, "sampling_params": LONG}
    gate = StepGate(srv, decoding(srv, "ab-1", 3))
    task = asyncio.create_task(generate(http, srv, body))
    await gate.reached()
    status, data = await call(http, "POST", srv.url + "/generate", {**body, "rid": "ab-1"})
    assert status == 400 and "Duplicate request ID" in data["error"]["message"]
    async with http.post(srv.url + "/abort_request", json={"rid": "no-such-rid"}) as resp:
        assert resp.status == 200
    async with http.post(srv.url + "/abort_request", json={"rid": "ab-1"}) as resp:
        assert resp.status == 200 and await resp.read() == b""
    await gate.release_after_commands(1)
    res = await task
    meta = res["meta_info"]
    assert meta["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }
    assert 3 <= meta["completion_tokens"] <= 5 and len(res["output_ids"]) == meta["completion_tokens"]
    assert meta["output_token_logprobs_length"] == meta["completion_tokens"] and meta["prompt_tokens"] == 5


async def test_abort_matches_rid_prefixes_of_live_requests(srv: ServerThread, http) -> None:
    body = {"input_ids": [prompt_ids(4, 1), prompt_ids(4, 2)], "rid": "grp", "sampling_params": LONG}
    gate = StepGate(srv, lambda rec: rec.kind == "decode" and {"grp_0", "grp_1"} <= set(rec.rids))
    task = asyncio.create_task(generate(http, srv, body))
    await gate.reached()
    await call(http, "POST", srv.url + "/abort_request", {"rid": "grp"})  # not a live rid: a no-op
    await call(http, "POST", srv.url + "/abort_request", {"rid": "grp_1"})
    await gate.release_after_commands(1)
    await wait_until(lambda: live(srv, "grp_1") is None)
    assert live(srv, "grp_0") is not None  # "grp" matched nothing, "grp_1" only itself
    await call(http, "POST", srv.url + "/abort_request", {"abort_all": True})
    res = await task
    assert [r["meta_info"]["finish_reason"]["type"] for r in res] == ["abort", "abort"]
    assert len(res[0]["output_ids"]) > len(res[1]["output_ids"]) > 0


async def test_abort_of_a_queued_request(model_dir: Path, http) -> None:
    with serving(model_dir, max_running_requests=1) as srv:
        running = asyncio.create_task(
            generate(http, srv, {"input_ids": prompt_ids(5, 3), "sampling_params": LONG})
        )
        queued = asyncio.create_task(generate(http, srv, {"input_ids": [7, 8, 9], "rid": "q-1"}))
        sched = srv.engine.scheduler
        # the single row is taken (once the first request's prefill is done, it is running): q-1 waits
        await wait_until(lambda: any(r.rid == "q-1" for r in list(sched.waiting)) and len(sched.running) == 1)
        await call(http, "POST", srv.url + "/abort_request", {"rid": "q-1"})
        res = await queued
        meta = res["meta_info"]
        assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
        assert "prompt_tokens" not in meta and "cached_tokens" not in meta
        assert res["output_ids"] == [] and meta["completion_tokens"] == 0 and meta["weight_version"] == "0"
        assert not running.done()
        await call(http, "POST", srv.url + "/abort_request", {"abort_all": True})
        assert (await running)["meta_info"]["finish_reason"]["message"] == "Aborted"


# -- pause modes ---------------------------------------------------------------------------------------------


async def test_pause_abort_answers_in_flight_then_blocks_new_requests(srv: ServerThread, http) -> None:
    bodies = [{"input_ids": prompt_ids(6, s), "rid": f"pa-{s}", "sampling_params": LONG} for s in (1, 2)]
    gate = StepGate(srv, lambda rec: rec.kind == "decode" and {"pa-1", "pa-2"} <= set(rec.rids))
    tasks = [asyncio.create_task(generate(http, srv, b)) for b in bodies]
    await gate.reached()
    pause = asyncio.create_task(call(http, "POST", srv.url + "/pause_generation", {}))
    await gate.release_after_commands(1)
    assert await pause == (200, {"message": "Generation paused successfully.", "status": "ok"})
    assert srv.server.update_lock.readers == 0  # every in-flight /generate had written its answer
    for res in await asyncio.gather(*tasks):
        assert (
            res["meta_info"]["finish_reason"]["type"] == "abort" and res["meta_info"]["completion_tokens"] > 0
        )
    steps = srv.engine.scheduler.stats.steps
    blocked = asyncio.create_task(
        generate(http, srv, {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}})
    )
    await asyncio.sleep(0.3)
    assert not blocked.done() and srv.engine.scheduler.stats.steps == steps  # held at the pause gate
    assert await call(http, "POST", srv.url + "/continue_generation", {}) == (
        200,
        {"message": "Generation continued successfully.", "status": "ok"},
    )
    assert (await blocked)["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


async def _pause_mid_request(srv: ServerThread, http, body: dict, mode: str) -> asyncio.Task:
    """Start ``body``, pause in ``mode`` once it has generated some tokens; the request stays open."""
    gate = StepGate(srv, decoding(srv, body["rid"], 5))
    task = asyncio.create_task(generate(http, srv, body))
    await gate.reached()
    pause = asyncio.create_task(call(http, "POST", srv.url + "/pause_generation", {"mode": mode}))
    await gate.release_after_commands(1)
    assert (await pause)[0] == 200
    assert not task.done()
    return task


async def test_pause_retract_reprefills_under_the_new_weights(
    model_dir: Path, other_model_dir: Path, http
) -> None:
    old, new = load_hf(model_dir), load_hf(other_model_dir)
    body = {"input_ids": prompt_ids(9, 31), "rid": "rt", "return_logprob": True,
            "sampling_params": {"max_new_tokens": 40, "ignore_eos": True, "temperature": 0.8}}  # fmt: skip
    with serving(model_dir) as srv:
        sched = srv.engine.scheduler
        task = await _pause_mid_request(srv, http, body, "retract")
        req = live(srv, "rt")
        assert not sched.running and list(sched.waiting) == [req]  # KV freed, back in the queue
        assert req.kv_len == 0 and req.num_retractions == 1
        k = len(req.output_ids)
        async with http.get(srv.url + "/flush_cache") as resp:
            assert resp.status == 200  # waiting requests do not block a flush while paused
        prefill_before = sched.stats.prefill_tokens_computed
        await asyncio.to_thread(srv.engine.load_weights, list(new.state_dict().items()), "1", 30.0)
        assert (await call(http, "GET", srv.url + "/model_info"))[1]["weight_version"] == "1"
        assert (await call(http, "POST", srv.url + "/continue_generation", {}))[0] == 200
        res = await task
    meta = res["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 40} and meta["num_retractions"] == 1
    assert meta["weight_versions"] == [
        {"version": "0", "start": 0, "end": k},
        {"version": "1", "start": k, "end": 40},
    ]
    assert meta["weight_version"] == "1"
    assert sched.stats.prefill_tokens_computed - prefill_before == 9 + k  # prompt + output so far, once
    lps, ids = logprobs_of(res), res["output_ids"]
    assert torch.allclose(lps[:k], reference_logprobs(old, body["input_ids"], ids, 0.8)[:k], atol=1e-4)
    assert torch.allclose(lps[k:], reference_logprobs(new, body["input_ids"], ids, 0.8)[k:], atol=1e-4)


async def test_pause_in_place_keeps_state_and_kv(model_dir: Path, other_model_dir: Path, http) -> None:
    old, new = load_hf(model_dir), load_hf(other_model_dir)
    prompt = prompt_ids(9, 32)
    body = {"input_ids": prompt, "rid": "ip", "return_logprob": True,
            "sampling_params": {"max_new_tokens": 30, "ignore_eos": True, "temperature": 0.0}}  # fmt: skip
    with serving(model_dir) as srv:
        sched = srv.engine.scheduler
        task = await _pause_mid_request(srv, http, body, "in_place")
        req = live(srv, "ip")
        assert sched.running == [req] and req.kv_len > 0 and req.prefill_count == 1
        k = len(req.output_ids)
        async with http.get(srv.url + "/flush_cache") as resp:
            assert resp.status == 400  # a request is running: SGLang refuses the flush
        steps, prefill_before = sched.stats.steps, sched.stats.prefill_tokens_computed
        await asyncio.sleep(0.2)
        assert sched.stats.steps == steps and len(req.output_ids) == k  # no forward pass while paused
        await asyncio.to_thread(srv.engine.load_weights, list(new.state_dict().items()), "1", 30.0)
        await call(http, "POST", srv.url + "/continue_generation", {})
        res = await task
    meta = res["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 30} and meta["num_retractions"] == 0
    assert meta["weight_versions"] == [
        {"version": "0", "start": 0, "end": k},
        {"version": "1", "start": k, "end": 30},
    ]
    assert (
        sched.stats.prefill_tokens_computed == prefill_before and req.prefill_count == 1
    )  # nothing recomputed
    ids, lps = res["output_ids"], logprobs_of(res)
    assert torch.allclose(lps[:k], reference_logprobs(old, prompt, ids, 0.0)[:k], atol=1e-4)
    # After the switch the engine decodes with the new weights on top of the old weights' KV: reproduce that.
    seq = prompt + ids
    with torch.no_grad():
        cache = old(torch.tensor([seq[: len(prompt) + k - 1]]), use_cache=True).cache
        expected = []
        for j in range(k, len(ids)):
            out = new(torch.tensor([[seq[len(prompt) + j - 1]]]), cache=cache, use_cache=True)
            cache = out.cache
            expected.append(torch.log_softmax(out.logits[0, -1], -1)[ids[j]])
    assert torch.allclose(lps[k:], torch.stack(expected), atol=1e-4)
    fresh = reference_logprobs(new, prompt, ids, 0.0)[k:]
    assert (lps[k:] - fresh).abs().max() > 1e-3  # a re-prefill would have matched this instead


async def test_update_weight_version_labels_later_tokens(model_dir: Path, http) -> None:
    with serving(model_dir) as srv:
        body = {"new_version": "7", "abort_all_requests": False}
        status, data = await call(http, "POST", srv.url + "/update_weight_version", body)
        assert status == 200 and data["new_version"] == "7"
        res = await generate(
            http, srv, {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
        )
        assert res["meta_info"]["weight_version"] == "7"
        assert res["meta_info"]["weight_versions"] == [{"version": "7", "start": 0, "end": 2}]


async def test_retracted_request_aborted_while_paused_keeps_its_partial_output(
    srv: ServerThread, http
) -> None:
    body = {"input_ids": prompt_ids(6, 33), "rid": "ra", "return_logprob": True, "sampling_params": LONG}
    task = await _pause_mid_request(srv, http, body, "retract")
    k = tokens_of(srv, "ra")
    await call(http, "POST", srv.url + "/abort_request", {"abort_all": True})
    res = await task
    assert await call(http, "POST", srv.url + "/continue_generation", {}) == (
        200,
        {"message": "Generation continued successfully.", "status": "ok"},
    )
    meta = res["meta_info"]
    assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert (
        len(res["output_ids"]) == meta["completion_tokens"] == k > 0
    )  # resumable: the tokens so far come back
    assert meta["output_token_logprobs_length"] == k and "prompt_tokens" not in meta


async def test_zero_new_tokens_and_prompt_logprobs_only(srv: ServerThread, hf, http) -> None:
    prompt = prompt_ids(7, 34)
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 2,
    }
    res = await generate(http, srv, body)
    assert res["output_ids"] == [] and res["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    inputs = res["meta_info"]["input_token_logprobs"]
    assert [t[1] for t in inputs] == prompt[2:] and inputs[0][0] is None
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1)
    expected = [lp[i - 1, prompt[i]].item() for i in range(3, len(prompt))]
    assert torch.allclose(torch.tensor([t[0] for t in inputs[1:]]), torch.tensor(expected), atol=1e-4)
    last = await generate(http, srv, {**body, "logprob_start_len": len(prompt) - 1})
    assert last["meta_info"]["input_token_logprobs"] == [[None, prompt[-1], None]]
    end = await generate(http, srv, {**body, "logprob_start_len": len(prompt)})
    assert end["meta_info"]["input_token_logprobs"] == []


@pytest.mark.gpu
async def test_cuda_engine_matches_the_cpu_forward(model_dir: Path, hf, http) -> None:
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")
    prompt = prompt_ids(11, 35)
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 32, "ignore_eos": True},
    }
    with serving(model_dir, device="cuda", dtype="float32") as srv:
        assert srv.engine.device.type == "cuda"
        res = await generate(http, srv, body)
    assert torch.allclose(logprobs_of(res), reference_logprobs(hf, prompt, res["output_ids"], 1.0), atol=1e-3)
    with serving(model_dir, device="cuda", dtype="bfloat16") as srv:
        res = await generate(http, srv, {**body, "input_ids": [prompt, prompt[:5]]})
    assert [r["meta_info"]["completion_tokens"] for r in res] == [32, 32]
