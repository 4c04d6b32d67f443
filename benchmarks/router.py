"""The fleet's own router against the SGLang router (PyPI ``sglang-router``) in front of the same engines.

    python -m benchmarks.router --quick --out FILE     # 4 rounds of 12 groups x 8 samples per arm (~2 minutes)
    python -m benchmarks.router --out FILE             # 6 rounds of 24 groups x 8 samples per arm

Two built-in engine processes (the fleet's command, one torch thread each) serve the tiny model; one sglang-router
process (``cache_aware``, its default policy, health probes on /model_info) sits in front of them for the whole
run. A client sends the rollout worker's requests (GRPO groups: a prompt of 48 to 96 tokens, 8 samples at
temperature 1, up to 48 new tokens each, ``max_concurrent_groups`` groups in flight) through each arm in turn,
the arms alternating in order every round, so a drift of the machine favours none:

- ``fleet_batched``: the fleet's router as a worker uses it by default: least outstanding requests, one batched
  ``/generate`` per group (``rollout.batch_group_requests``);
- ``fleet_single``: the fleet's router, one request per sample (the routing alone, like for like with the router);
- ``sglang_router``: every sample's request to the sglang-router (it takes no batch of rids; HTTP 422).

Measured per arm: samples/s and output tokens/s over the arm's wall time, and each sample's latency from its
request to its answer (p50, p95). Headline: ``ratio_fleet_vs_sglang_router`` = fleet_batched samples/s over the
sglang-router's (above 1: the fleet's router, the default, is better), ``ratio_fleet_single_vs_sglang_router``
beside it, and the p50 / p95 latencies of each arm. Nothing is targeted: the benchmark decides which router is
the default, and says so in ``better``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.common import add_mode_flags, format_table, mode_of, write_result
from common.config import SharedConfig
from rollout_fleet.config import EngineConfig
from rollout_fleet.fleet import Fleet
from rollout_fleet.generate_client import (
    EngineClient,
    SamplingConfig,
    build_generate_request,
    build_group_request,
)
from rollout_fleet.model import init_tiny_model
from rollout_fleet.router import Router
from rollout_fleet.sglang_router import running_router

MODES = {
    "smoke": {"rounds": 1, "groups": 1},
    "quick": {"rounds": 4, "groups": 12},
    "full": {"rounds": 6, "groups": 24},
}
ARMS = ("fleet_batched", "fleet_single", "sglang_router")
GROUP_SIZE, MAX_NEW_TOKENS, CONCURRENT_GROUPS = 8, 48, 4
SAMPLING = SamplingConfig(temperature=1.0)


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 100) for _ in range(rng.randrange(48, 97))] for _ in range(count)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run_arm(arm: str, router: Router, proxy: EngineClient, groups: list[list[int]], tag: str) -> dict:
    """Every group of ``groups`` through ``arm``, ``CONCURRENT_GROUPS`` at a time; per-sample latencies."""
    latencies: list[float] = []
    tokens = 0
    gate = asyncio.Semaphore(CONCURRENT_GROUPS)

    async def timed(call: Callable[[], Awaitable[Any]], samples: int) -> Any:
        nonlocal tokens
        started = time.monotonic()
        answer = await call()
        latencies.extend([time.monotonic() - started] * samples)
        tokens += sum(len(r.output_ids) for r in (answer if isinstance(answer, list) else [answer]))
        return answer

    async def via_fleet(payload: dict, batch: bool) -> Any:
        handle = await router.acquire()
        try:
            call = handle.client.generate_batch if batch else handle.client.generate
            return await call(payload)
        finally:
            router.release(handle)

    async def group(g: int, ids: list[int]) -> None:
        async with gate:
            rids = [f"{tag}-{g}:s{i}:r0" for i in range(GROUP_SIZE)]
            if arm == "fleet_batched":
                payload = build_group_request(ids, SAMPLING, MAX_NEW_TOKENS, rids)
                await timed(lambda: via_fleet(payload, True), GROUP_SIZE)
                return
            singles = [build_generate_request(ids, SAMPLING, MAX_NEW_TOKENS, rid) for rid in rids]
            if arm == "fleet_single":
                await asyncio.gather(*(timed(lambda p=p: via_fleet(p, False), 1) for p in singles))
            else:
                await asyncio.gather(*(timed(lambda p=p: proxy.generate(p), 1) for p in singles))

    started = time.monotonic()
    await asyncio.gather(*(group(g, ids) for g, ids in enumerate(groups)))
    wall = time.monotonic() - started
    return {
        "arm": arm,
        "samples": len(latencies),
        "output_tokens": tokens,
        "wall_s": wall,
        "samples_per_s": len(latencies) / wall,
        "tokens_per_s": tokens / wall,
        "latency_p50_s": percentile(latencies, 0.50),
        "latency_p95_s": percentile(latencies, 0.95),
    }


async def measure(work: Path, rounds: int, groups: int, policy: str) -> tuple[list[dict], dict]:
    model = init_tiny_model(work / "tiny")
    shared = SharedConfig(run_id="router-bench", model_path=model, run_dir=work / "run", torch_threads=1)
    engine = EngineConfig(count=2, seed=0, max_context_len=320, max_running_requests=64, launch_timeout_s=300)
    fleet = Fleet(shared, engine, None)
    urls = await fleet.start()
    runs: list[dict] = []
    try:
        with running_router(urls, _free_port(), policy=policy, log_path=work / "router.log") as url:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                router = Router(session, None, request_timeout_s=300, control_timeout_s=10)
                for u in urls:
                    router.add(u, healthy=True)
                proxy = EngineClient(session, url, 300, 10)
                warm = prompts(2, seed=999)
                for arm in ARMS:  # first calls (connections, allocator) outside the clock
                    await run_arm(arm, router, proxy, warm, f"warm-{arm}")
                for r in range(rounds):
                    order = ARMS if r % 2 == 0 else ARMS[::-1]
                    batch = prompts(groups, seed=r)  # the same prompts for every arm of a round
                    for arm in order:
                        result = await run_arm(arm, router, proxy, batch, f"r{r}-{arm}")
                        result["round"] = r
                        runs.append(result)
                        print(
                            f"round {r} {arm:<14} {result['samples_per_s']:6.1f} samples/s "
                            f"{result['tokens_per_s']:7.0f} tok/s  p50 {result['latency_p50_s']:.3f} s "
                            f"p95 {result['latency_p95_s']:.3f} s",
                            flush=True,
                        )
    finally:
        await fleet.stop()
    return runs, {"engines": urls, "policy": policy}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def of(runs: list[dict], round_: int, arm: str) -> float:
    return next(r["samples_per_s"] for r in runs if r["round"] == round_ and r["arm"] == arm)


def summarize(runs: list[dict]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        out[arm] = {
            key: statistics.fmean(r[key] for r in mine)
            for key in ("samples_per_s", "tokens_per_s", "latency_p50_s", "latency_p95_s")
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_mode_flags(parser, "4 rounds of 12 groups per arm (about 2 minutes)")
    parser.add_argument("--out", type=Path, required=True, help="result JSON")
    parser.add_argument(
        "--policy", default="cache_aware", help="the sglang-router's policy (default cache_aware)"
    )
    parser.add_argument("--work", type=Path, help="model and logs (default: a temporary directory)")
    args = parser.parse_args(argv)
    mode = mode_of(parser, args)
    rounds, groups = MODES[mode]["rounds"], MODES[mode]["groups"]
    work = args.work or Path(tempfile.mkdtemp(prefix="router-bench-"))
    started = time.monotonic()
    runs, setup = asyncio.run(measure(work, rounds, groups, args.policy))
    arms = summarize(runs)
    fleet, single, sgl = arms["fleet_batched"], arms["fleet_single"], arms["sglang_router"]
    ratio = fleet["samples_per_s"] / sgl["samples_per_s"]
    headline = {
        "ratio_fleet_vs_sglang_router": ratio,
        "ratio_fleet_single_vs_sglang_router": single["samples_per_s"] / sgl["samples_per_s"],
        "ratio_p50_latency_sglang_router_vs_fleet": sgl["latency_p50_s"] / fleet["latency_p50_s"],
        "ratio_p95_latency_sglang_router_vs_fleet": sgl["latency_p95_s"] / fleet["latency_p95_s"],
        "ratio_per_round": [
            of(runs, r, "fleet_batched") / of(runs, r, "sglang_router") for r in range(rounds)
        ],
        "better": "fleet" if ratio >= 1.0 else "sglang_router",
        "arms": arms,
    }
    params = {
        "rounds": rounds,
        "groups_per_arm_round": groups,
        "group_size": GROUP_SIZE,
        "max_new_tokens": MAX_NEW_TOKENS,
        "temperature": SAMPLING.temperature,
        "concurrent_groups": CONCURRENT_GROUPS,
        "prompt_tokens": "48..96",
        "engines": "2 built-in engine processes, tiny model, 1 torch thread each",
        "sglang_router": f"sglang-router 0.3.2, policy {setup['policy']}",
        "wall_s": time.monotonic() - started,
    }
    doc = write_result(args.out, "router", mode, params, {"runs": runs}, {}, headline)
    rows = [[a, arms[a]["samples_per_s"], arms[a]["tokens_per_s"], arms[a]["latency_p50_s"],
             arms[a]["latency_p95_s"]] for a in ARMS]  # fmt: skip
    print(format_table(["arm", "samples/s", "tokens/s", "p50 s", "p95 s"], rows))
    print(f"ratio_fleet_vs_sglang_router {ratio:.3f} (per sample: {headline['ratio_fleet_single_vs_sglang_router']:.3f}); "
          f"better: {doc['better']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
