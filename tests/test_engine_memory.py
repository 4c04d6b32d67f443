"""The built-in engine's KV memory over real HTTP: a group's samples share their prompt's blocks, a prefix cache
across requests reported in ``cached_tokens`` and cleared by weight updates, chunked prefill between decode
steps, and a memory bound that makes requests wait and retracts the youngest, never failing. Every output is
checked against a teacher-forced forward of the HF model (log-probs within 1e-4)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from rollout_fleet.engine.protocol import GenItem, RequestSnapshot, parse_sampling_params
from rollout_fleet.engine.scheduler import StepRecord
from rollout_fleet.model import TinyModelSpec, init_tiny_model
from tests.test_engine_server import (
    StepGate,
    call,
    decoding,
    generate,
    live,
    load_hf,
    logprobs_of,
    prompt_ids,
    reference_logprobs,
    serving,
)

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(180)
BS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("engine-mem") / "tiny")


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("engine-mem") / "tiny-seed1", TinyModelSpec(seed=1))


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> torch.nn.Module:
    return load_hf(model_dir)


@pytest.fixture
async def http() -> aiohttp.ClientSession:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


def assert_matches_teacher_forcing(model: torch.nn.Module, prompt: list[int], res: dict, temp: float) -> None:
    ref = reference_logprobs(model, prompt, res["output_ids"], temp)
    got = logprobs_of(res)
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


def input_logprobs_match(model: torch.nn.Module, prompt: list[int], res: dict, start: int) -> None:
    inputs = res["meta_info"]["input_token_logprobs"]
    assert [t[1] for t in inputs] == prompt[start:] and inputs[0][0] is None
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1)
    want = torch.tensor([lp[i - 1, prompt[i]].item() for i in range(start + 1, len(prompt))])
    assert torch.allclose(torch.tensor([t[0] for t in inputs[1:]]), want, atol=1e-4)


def sampled(max_new: int, **extra: Any) -> dict[str, Any]:
    return {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 1.0, **extra}


# -- shared prompt blocks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [2048, 64], ids=["one-pass", "chunked"])
async def test_a_groups_samples_share_the_prompt_blocks(model_dir: Path, hf, http, chunk: int) -> None:
    """Also when the first sample's prefill takes the whole token budget of a pass (chunked): the others join
    it, since joining computes nothing."""
    prompt = prompt_ids(100, 51)  # 6 full blocks + 4 tokens
    body = {"input_ids": prompt, "return_logprob": True, "sampling_params": {**sampled(20), "n": 8}}
    with serving(model_dir, kv_block_size=BS, chunked_prefill_size=chunk) as srv:
        sched, alloc = srv.engine.scheduler, srv.engine.scheduler.allocator
        seen: dict[str, Any] = {}

        def on_step(rec: StepRecord) -> None:  # on the scheduler thread, at the third decode step
            third = all(len(r.output_ids) == 3 for r in sched.running)
            if rec.kind == "decode" and len(rec.rids) == 8 and "used" not in seen and third:
                seen["used"] = alloc.used()
                seen["tables"] = [list(r.blocks) for r in sched.running]

        sched.add_step_listener(on_step)
        before = sched.stats.prefill_tokens_computed
        results = await generate(http, srv, body)
        computed = sched.stats.prefill_tokens_computed - before
        prefills = [r for r in sched.step_log if r.kind == "prefill"]
    assert computed == len(prompt)  # one prompt's prefill for 8 samples
    assert [len(r.rids) for r in prefills] == [8] * (1 if chunk > 100 else 2)
    # 102 tokens of KV each: the 6 full prompt blocks once, plus each sample's own last block (the leader's
    # original, 7 copies), against 8 x 7 = 56 unshared
    assert seen["used"] == 6 + 8
    tables = seen["tables"]
    assert all(t[:6] == tables[0][:6] for t in tables) and len({t[6] for t in tables}) == 8
    assert sorted(r["meta_info"]["cached_tokens"] for r in results) == [0] + [100] * 7
    assert len({tuple(r["output_ids"]) for r in results}) > 1  # their own samples
    for res in results:
        assert_matches_teacher_forcing(hf, prompt, res, 1.0)


async def test_disable_radix_cache_computes_every_samples_prompt(model_dir: Path, hf, http) -> None:
    """SGLang's --disable-radix-cache (the sharing baseline of benchmarks/long_context.py): no shared job, no
    prefix hit, not even for the same prompt again; outputs are still exact."""
    prompt = prompt_ids(100, 51)
    body = {"input_ids": prompt, "return_logprob": True, "sampling_params": {**sampled(8), "n": 4}}
    with serving(model_dir, kv_block_size=BS, disable_radix_cache=True) as srv:
        stats = srv.engine.scheduler.stats
        results = await generate(http, srv, body)
        results += await generate(http, srv, body)
        status, info = await call(http, "GET", srv.url + "/server_info")
    assert status == 200 and info["disable_radix_cache"] is True
    assert stats.prefill_tokens_computed == 8 * len(prompt) and stats.prefill_tokens_cached == 0
    assert [r["meta_info"]["cached_tokens"] for r in results] == [0] * 8
    for res in results:
        assert_matches_teacher_forcing(hf, prompt, res, 1.0)


# -- the prefix cache ----------------------------------------------------------------------------------------


async def test_prefix_cache_hits_are_reused_and_reported(model_dir: Path, hf, http) -> None:
    p = prompt_ids(70, 52)  # 4 full blocks + 6
    extended = p + prompt_ids(30, 53)
    greedy = {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0.0}
    with serving(model_dir, kv_block_size=BS) as srv:
        stats = srv.engine.scheduler.stats

        async def run(prompt: list[int], **extra: Any) -> tuple[dict, int]:
            before = stats.prefill_tokens_computed
            res = await generate(
                http, srv, {"input_ids": prompt, "return_logprob": True, "sampling_params": greedy, **extra}
            )
            assert res["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
            assert_matches_teacher_forcing(hf, prompt, res, 0.0)
            return res, stats.prefill_tokens_computed - before

        first, computed = await run(p)
        assert first["meta_info"]["cached_tokens"] == 0 and computed == 70
        longer, computed = await run(extended)  # p's 4 full blocks are found; block 5 differs
        assert longer["meta_info"]["cached_tokens"] == 64 and computed == 100 - 64
        again, computed = await run(extended)  # all of it but the last token, in whole blocks
        assert again["meta_info"]["cached_tokens"] == 96 and computed == 4
        assert again["output_ids"] == longer["output_ids"]
        # Input log-probs from position 80 on need those logits: the cache is used only up to there.
        lp80, computed = await run(extended, logprob_start_len=80)
        assert lp80["meta_info"]["cached_tokens"] == 80 and computed == 20
        input_logprobs_match(hf, extended, lp80, 80)
        status, loads = await call(http, "GET", srv.url + "/v1/loads")
        load = loads["loads"][0]
        assert load["cache_hit_rate"] == pytest.approx((64 + 96 + 80) / (70 + 3 * 100))
        assert load["kv_blocks_cached"] >= 6 and load["num_total_tokens"] == srv.engine.max_total_tokens
        async with http.get(srv.url + "/flush_cache") as resp:
            assert resp.status == 200
        flushed, computed = await run(extended)
        assert flushed["meta_info"]["cached_tokens"] == 0 and computed == 100


async def test_a_weight_update_invalidates_the_prefix_cache(
    model_dir: Path, other_model_dir: Path, http
) -> None:
    old, new = load_hf(model_dir), load_hf(other_model_dir)
    prompt = prompt_ids(40, 54)  # 2 full blocks + 8
    body = {"input_ids": prompt, "return_logprob": True, "sampling_params": sampled(12)}
    with serving(model_dir, kv_block_size=BS) as srv:
        stats = srv.engine.scheduler.stats
        res = await generate(http, srv, body)
        assert_matches_teacher_forcing(old, prompt, res, 1.0)
        warm = await generate(http, srv, body)
        assert warm["meta_info"]["cached_tokens"] == 32  # the cache is live before the update
        await asyncio.to_thread(srv.engine.load_weights, list(new.state_dict().items()), "1", 30.0)
        before = stats.prefill_tokens_computed
        res = await generate(http, srv, body)
        assert res["meta_info"]["cached_tokens"] == 0 and stats.prefill_tokens_computed - before == 40
        assert res["meta_info"]["weight_versions"] == [{"version": "1", "start": 0, "end": 12}]
        assert_matches_teacher_forcing(new, prompt, res, 1.0)


async def test_kv_from_before_an_in_place_update_is_never_cached(
    model_dir: Path, other_model_dir: Path, http
) -> None:
    """An in_place pause keeps decoding on KV computed under the old weights; that KV (prompt blocks included)
    must not be offered to a request that arrives after the update."""
    new = load_hf(other_model_dir)
    prompt = prompt_ids(40, 55)
    body = {"input_ids": prompt, "rid": "ipc", "sampling_params": sampled(30)}
    with serving(model_dir, kv_block_size=BS) as srv:
        gate = StepGate(srv, decoding(srv, "ipc", 5))
        task = asyncio.create_task(generate(http, srv, body))
        await gate.reached()
        pause = asyncio.create_task(call(http, "POST", srv.url + "/pause_generation", {"mode": "in_place"}))
        await gate.release_after_commands(1)
        assert (await pause)[0] == 200
        await asyncio.to_thread(srv.engine.load_weights, list(new.state_dict().items()), "1", 30.0)
        await call(http, "POST", srv.url + "/continue_generation", {})
        mixed = await task
        assert mixed["meta_info"]["weight_versions"][-1]["version"] == "1"
        res = await generate(
            http, srv, {"input_ids": prompt, "return_logprob": True, "sampling_params": sampled(4)}
        )
    assert res["meta_info"]["cached_tokens"] == 0
    assert_matches_teacher_forcing(new, prompt, res, 1.0)


# -- chunked prefill -----------------------------------------------------------------------------------------


async def test_chunked_prefill_runs_between_decode_steps(model_dir: Path, hf, http) -> None:
    long_prompt = prompt_ids(150, 56)
    a = {
        "input_ids": prompt_ids(9, 57),
        "rid": "chunk-a",
        "return_logprob": True,
        "sampling_params": sampled(60),
    }
    b = {"input_ids": long_prompt, "rid": "chunk-b", "return_logprob": True, "logprob_start_len": 0,
         "sampling_params": sampled(10)}  # fmt: skip
    with serving(model_dir, kv_block_size=BS, chunked_prefill_size=32) as srv:
        sched = srv.engine.scheduler
        gate = StepGate(srv, decoding(srv, "chunk-a", 3))
        task_a = asyncio.create_task(generate(http, srv, a))
        await gate.reached()
        task_b = asyncio.create_task(generate(http, srv, b))
        await gate.release_after_commands(1)
        res_a, res_b = await asyncio.gather(task_a, task_b)
        log = list(sched.step_log)
    chunks = [r for r in log if r.kind == "prefill" and "chunk-b" in r.rids]
    assert [r.tokens for r in chunks] == [32, 32, 32, 32, 22]  # 150 tokens in chunks of 32
    first, last = chunks[0].step, chunks[-1].step
    between = [r for r in log if first < r.step < last and r.kind == "decode"]
    assert len(between) == len(chunks) - 1 and all("chunk-a" in r.rids for r in between)  # decode went on
    assert res_b["meta_info"]["cached_tokens"] == 0
    assert_matches_teacher_forcing(hf, a["input_ids"], res_a, 1.0)
    assert_matches_teacher_forcing(hf, long_prompt, res_b, 1.0)
    input_logprobs_match(hf, long_prompt, res_b, 0)


# -- the memory bound ----------------------------------------------------------------------------------------


async def test_a_full_cache_makes_requests_wait_and_retracts_the_youngest(model_dir: Path, hf, http) -> None:
    """8 blocks of 16 tokens for 4 requests that need 5 blocks each: they cannot all run. Whatever the engine
    retracts resumes from its output so far: seeded samples equal those of a roomy engine, token for token."""
    bodies = [
        {"input_ids": prompt_ids(20, 60 + i), "rid": f"mem-{i}", "return_logprob": True,
         "sampling_params": sampled(60, sampling_seed=100 + i)}
        for i in range(4)
    ]  # fmt: skip
    with serving(model_dir, kv_block_size=BS) as roomy:
        expected = [await generate(http, roomy, b) for b in bodies]
    with serving(model_dir, kv_block_size=BS, max_total_tokens=128) as srv:
        sched, alloc = srv.engine.scheduler, srv.engine.scheduler.allocator
        lock = threading.Lock()
        seen = {"max_used": 0, "waited_while_running": False}

        def on_step(rec: StepRecord) -> None:
            with lock:
                seen["max_used"] = max(seen["max_used"], alloc.used())
                if sched.running and sched.waiting:
                    seen["waited_while_running"] = True

        sched.add_step_listener(on_step)
        results = await asyncio.gather(*(generate(http, srv, b) for b in bodies))
        assert alloc.used() == 0  # everything given back
    assert seen["max_used"] <= 8 and seen["waited_while_running"]
    assert sum(r["meta_info"]["num_retractions"] for r in results) == sched.stats.retractions > 0
    for body, res, want in zip(bodies, results, expected, strict=True):
        meta = res["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 60}
        assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 60}]
        assert res["output_ids"] == want["output_ids"]
        assert_matches_teacher_forcing(hf, body["input_ids"], res, 1.0)


async def test_a_request_whose_blocks_hold_all_it_may_generate_reserves_nothing(
    model_dir: Path, http
) -> None:
    """Blocks of 128 tokens (one contiguous row per request, the baseline layout of benchmarks/long_context.py)
    and a pool of 4: each request of 20 + 60 tokens needs one block and never another, so 4 run together.
    Keeping a block back for each admitted one would let only 2 run."""
    bodies = [{"input_ids": prompt_ids(20, 70 + i), "sampling_params": sampled(60)} for i in range(4)]
    with serving(model_dir, kv_block_size=128, max_total_tokens=4 * 128) as srv:
        sched = srv.engine.scheduler
        results = await asyncio.gather(*(generate(http, srv, b) for b in bodies))
    assert all(r["meta_info"]["finish_reason"]["length"] == 60 for r in results)
    assert sched.stats.peak_running == 4 and sched.stats.retractions == 0


async def test_a_request_that_can_never_fit_is_answered_with_an_error(model_dir: Path, http) -> None:
    with serving(model_dir, kv_block_size=BS, max_total_tokens=64) as srv:
        engine = srv.engine
        assert engine.context_len == 64  # requests are limited to what the cache holds, as in SGLang
        status, info = await call(http, "GET", srv.url + "/server_info")
        assert info["max_total_num_tokens"] == 64 and info["context_length"] == 64
        status, data = await call(http, "POST", srv.url + "/generate", {"input_ids": prompt_ids(70, 1)})
        assert status == 400 and "context length (64 tokens)" in data["error"]["message"]
        # Past the HTTP checks (a direct submit), the scheduler answers instead of letting it wait forever.
        done: asyncio.Future[RequestSnapshot] = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()
        item = GenItem("too-long", prompt_ids(50, 2), parse_sampling_params({}), 30)
        engine.submit(item, lambda snap: loop.call_soon_threadsafe(done.set_result, snap))
        snap = await asyncio.wait_for(done, 30)
        assert snap.finished and snap.finish_reason["status_code"] == 400
        assert "engine.max_total_tokens = 64" in snap.finish_reason["message"]
        res = await generate(
            http,
            srv,
            {"input_ids": prompt_ids(20, 3), "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}},
        )
        assert res["meta_info"]["finish_reason"] == {"type": "length", "length": 40}  # what fits still runs


async def test_pause_retract_resumes_from_the_prefix_cache(model_dir: Path, hf, http) -> None:
    prompt = prompt_ids(40, 58)
    body = {"input_ids": prompt, "rid": "rtc", "return_logprob": True, "sampling_params": sampled(30)}
    with serving(model_dir, kv_block_size=BS) as srv:
        sched = srv.engine.scheduler
        gate = StepGate(srv, decoding(srv, "rtc", 5))
        task = asyncio.create_task(generate(http, srv, body))
        await gate.reached()
        pause = asyncio.create_task(call(http, "POST", srv.url + "/pause_generation", {"mode": "retract"}))
        await gate.release_after_commands(1)
        assert (await pause)[0] == 200
        req = live(srv, "rtc")
        assert list(sched.waiting) == [req] and req.blocks == [] and sched.allocator.used() == 0
        k = len(req.output_ids)
        before = sched.stats.prefill_tokens_computed
        await call(http, "POST", srv.url + "/continue_generation", {})
        res = await task
    # KV of prompt + k - 1 tokens was left in the cache: its whole blocks are not recomputed
    cached = (len(prompt) + k - 1) // BS * BS
    assert res["meta_info"]["num_retractions"] == 1 and res["meta_info"]["cached_tokens"] == cached
    assert sched.stats.prefill_tokens_computed - before == len(prompt) + k - cached
    assert_matches_teacher_forcing(hf, prompt, res, 1.0)


def nth_prefill_of(rid: str, n: int) -> Callable[[StepRecord], bool]:
    """A StepGate condition: the n-th prefill pass that serves ``rid``."""
    seen: list[StepRecord] = []

    def when(rec: StepRecord) -> bool:
        if rec.kind == "prefill" and rid in rec.rids:
            seen.append(rec)
        return len(seen) == n

    return when


async def test_a_prefill_interrupted_between_chunks(model_dir: Path, hf, http) -> None:
    """Aborted between two chunks, a prompt's blocks are freed; retracted (pause), it resumes from the chunks it
    had done, which the prefix cache kept."""
    prompt = prompt_ids(150, 59)
    with serving(model_dir, kv_block_size=BS, chunked_prefill_size=32) as srv:
        sched = srv.engine.scheduler
        body = {"input_ids": prompt, "rid": "cut", "sampling_params": sampled(5)}
        gate = StepGate(srv, nth_prefill_of("cut", 2))
        task = asyncio.create_task(generate(http, srv, body))
        await gate.reached()
        await call(http, "POST", srv.url + "/abort_request", {"rid": "cut"})
        await gate.release_after_commands(1)
        res = await task
        assert res["meta_info"]["finish_reason"]["message"] == "Aborted" and res["output_ids"] == []
        assert not sched.jobs and sched.allocator.used() == 0
        async with http.get(srv.url + "/flush_cache") as resp:
            assert resp.status == 200
        before = sched.stats.prefill_tokens_computed
        body = {"input_ids": prompt, "rid": "paused", "return_logprob": True, "sampling_params": sampled(5)}
        gate = StepGate(srv, nth_prefill_of("paused", 2))
        task = asyncio.create_task(generate(http, srv, body))
        await gate.reached()
        pause = asyncio.create_task(call(http, "POST", srv.url + "/pause_generation", {"mode": "retract"}))
        await gate.release_after_commands(1)
        assert (await pause)[0] == 200
        assert not sched.jobs and [r.rid for r in sched.waiting] == ["paused"]
        await call(http, "POST", srv.url + "/continue_generation", {})
        res = await task
    assert res["meta_info"]["num_retractions"] == 1 and res["meta_info"]["cached_tokens"] == 64
    assert sched.stats.prefill_tokens_computed - before == 150  # 2 chunks, then 86 tokens after the cached 64
    assert_matches_teacher_forcing(hf, prompt, res, 1.0)
