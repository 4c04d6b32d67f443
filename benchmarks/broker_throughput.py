"""Broker throughput: produce -> consume -> acknowledge of trajectory groups through a real Redis stream.

For each output length (1024, 8192, 32768 tokens; 8 samples per group, with log-probs and versions) three
pipelines move the same groups, interleaved and repeated in one run on one embedded Redis started here:

* ``streamrl``: Producer.send (validate, msgpack with packed arrays, the idempotent back-pressured Lua XADD),
  Consumer.read (XREADGROUP, decode, validate, duplicate check), Consumer.ack (Lua XACK), periodic trim.
* ``json``: the same groups encoded as JSON with lists of numbers, through the same Producer / Consumer path
  (only the codec differs).
* ``raw_blob``: XADD / XREADGROUP / XACK of an opaque blob of the msgpack payload's size, with the same
  in-flight bound and no codec, Lua or validation: the transport's limit.

Reported per size: tokens/s and entries/s (median over repeats) and the ratios streamrl / json and
streamrl / raw_blob. Targets at 8192 tokens: ratio_vs_json >= 5, ratio_vs_raw_blob >= 0.7.

    python -m benchmarks.broker_throughput --quick --out runs/broker_throughput.json
    python -m benchmarks.broker_throughput --out benchmarks/results/broker_throughput.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import redis

from benchmarks.common import add_mode_flags, format_table, mode_of, write_result
from broker.client import connect
from broker.codec import decode as codec_decode
from broker.codec import encode
from broker.config import BrokerConfig, RedisServerConfig
from broker.consumer import Consumer
from broker.producer import Producer
from broker.record import Sample, TrajectoryGroup, synthetic_group
from broker.server import EmbeddedRedis
from common.config import SharedConfig

SIZES = (1024, 8192, 32768)
NUM_SAMPLES = 8
METHODS = ("streamrl", "json", "raw_blob")
TARGETS = {"ratio_vs_json": (">=", 5.0), "ratio_vs_raw_blob": (">=", 0.7)}
# Entries per timed pass, per size. JSON is 20-50x slower, so its passes move fewer of the same groups (rates
# are compared, not totals); each method runs `repeats` times, interleaved, and the median is reported.
MODES = {
    "smoke": {  # every size and method once, a handful of entries: that it runs, not how fast
        "entries": {1024: 4, 8192: 2, 32768: 1},
        "json_entries": {1024: 1, 8192: 1, 32768: 1},
        "repeats": 1,
    },
    "quick": {
        "entries": {1024: 100, 8192: 30, 32768: 8},
        "json_entries": {1024: 20, 8192: 4, 32768: 2},
        "repeats": 5,
    },
    "full": {
        "entries": {1024: 300, 8192: 80, 32768: 20},
        "json_entries": {1024: 60, 8192: 12, 32768: 4},
        "repeats": 9,
    },
}
TRIM_EVERY = 8  # consumer batches between trims
SENDERS = 4  # concurrent sends in the producer process: a rollout worker has many groups in flight


# ----- the JSON baseline codec: the same record, arrays as lists of numbers ---------------------------------


def _lists(record: object) -> dict:
    """A record's fields with every array (whichever the schema has) as a list of numbers."""
    values = {name: getattr(record, name) for name in record.__dataclass_fields__}
    return {name: v.tolist() if isinstance(v, np.ndarray) else v for name, v in values.items()}


def json_encode(group: TrajectoryGroup) -> bytes:
    group.validate()
    d = _lists(group)
    d["samples"] = [_lists(s) for s in group.samples]
    return json.dumps(d).encode()


def json_decode(data: bytes) -> TrajectoryGroup:
    """The record's own constructors turn the lists back into arrays of the schema's dtypes."""
    d = json.loads(data)
    samples = [Sample(**s) for s in d.pop("samples")]
    group = TrajectoryGroup(**d, samples=samples)
    group.validate()
    return group


# ----- workload ---------------------------------------------------------------------------------------------


def make_groups(num_tokens: int, n: int, offset: int) -> list[TrajectoryGroup]:
    """``n`` groups with distinct ids; their arrays come from a small pool so memory stays small."""
    rng = np.random.default_rng(num_tokens)
    pool = [synthetic_group(rng, num_samples=NUM_SAMPLES, num_tokens=num_tokens, version=3) for _ in range(4)]
    out = []
    for i in range(n):
        base = pool[i % len(pool)]
        g = TrajectoryGroup(
            run_id="bench",
            epoch=0,
            prompt_index=offset + i,
            attempt=0,
            prompt_id=f"p{offset + i}",
            task=base.task,
            prompt_ids=base.prompt_ids,
            samples=base.samples,
            worker_id=base.worker_id,
            created_at=base.created_at,
            extra=base.extra,
        )
        out.append(g)
    return out


@dataclass
class Pass:
    method: str
    num_tokens: int
    entries: int
    seconds: float
    payload_bytes: int
    rep: int
    cpu_s: dict[str, float]

    @property
    def entries_per_s(self) -> float:
        return self.entries / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.entries * NUM_SAMPLES * self.num_tokens / self.seconds


@dataclass(frozen=True)
class PassSpec:
    method: str
    num_tokens: int
    entries: int
    rep: int

    @property
    def run_id(self) -> str:
        return f"bench-{self.method}-{self.num_tokens}-{self.rep}"


# max_backlog above any pass's entry count: the bound is tested (tests/), never reached here, so no method
# waits on it; read_count 8 and a trim every TRIM_EVERY batches.
BENCH_CFG = BrokerConfig(max_backlog=100_000, block_ms=100, read_count=8)


# ----- the two roles, each in its own process (a rollout worker and a learner in the real system) ----------


async def _produce(url: str, spec: PassSpec, conn: Connection) -> None:
    client = connect(url, BENCH_CFG)
    shared = SharedConfig(run_id=spec.run_id)
    if spec.method == "raw_blob":
        blob = np.random.default_rng(0).bytes(len(encode(make_groups(spec.num_tokens, 1, 0)[0])))
        stream = shared.key("raw")

        async def send(i: int) -> None:
            await client.xadd(stream, {"d": blob})

    else:
        groups = make_groups(spec.num_tokens, spec.entries, spec.rep * 10**5)
        producer = Producer(client, shared, BENCH_CFG, "bench")

        async def send(i: int) -> None:
            g = groups[i]
            if spec.method == "streamrl":
                await producer.send(g)
            else:
                await producer.send_payload(g.group_id, json_encode(g), g.schema_version)

    await client.ping()
    next_index = iter(range(spec.entries))

    async def sender() -> None:
        for i in next_index:
            await send(i)

    conn.send("ready")
    conn.recv()  # go
    cpu = time.process_time()
    await asyncio.gather(*(sender() for _ in range(SENDERS)))
    conn.send(("done", time.process_time() - cpu))
    await client.aclose()


async def _consume(url: str, spec: PassSpec, conn: Connection) -> None:
    """Reads one batch ahead: the next read is in flight while the last batch is acknowledged (and trimmed),
    as a learner's reader task keeps groups queued for its ranks."""
    client = connect(url, BENCH_CFG)
    shared = SharedConfig(run_id=spec.run_id)
    if spec.method == "raw_blob":
        stream = shared.key("raw")
        await client.xgroup_create(stream, "g", id="0", mkstream=True)

        async def read() -> list:
            res = await client.xreadgroup("g", "c", {stream: ">"}, count=BENCH_CFG.read_count, block=100)
            return [i for i, _ in res[0][1]] if res else []

        async def ack(ids: list, trim: bool) -> None:
            if ids:
                await client.xack(stream, "g", *ids)
                if trim:
                    await client.xtrim(stream, minid=ids[-1])

    else:
        decoder = json_decode if spec.method == "json" else codec_decode
        consumer = Consumer(client, shared, BENCH_CFG, "bench", decoder=decoder)
        await consumer.ensure_group()
        await consumer.read(block_ms=0)  # first-read recovery check done before the clock starts

        async def read() -> list:
            return await consumer.read()

        async def ack(got: list, trim: bool) -> None:
            await consumer.ack(got)
            if trim:
                await consumer.trim()

    conn.send("ready")
    conn.recv()  # go
    cpu = time.process_time()
    done = batches = 0
    pending = asyncio.ensure_future(read())
    while done < spec.entries:
        got = await pending
        done += len(got)
        if done < spec.entries:
            pending = asyncio.ensure_future(read())
        batches += 1
        await ack(got, trim=batches % TRIM_EVERY == 0)
    conn.send(("done", time.process_time() - cpu))
    await client.aclose()


def _role_main(role: str, url: str, conn: Connection) -> None:
    """A long-lived role process: runs one pass per PassSpec received, until None."""
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        loop_factory = None
    run = _produce if role == "producer" else _consume
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        while (spec := conn.recv()) is not None:
            runner.run(run(url, spec, conn))


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of another process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Roles:
    """The producer and consumer processes and the clock around each pass."""

    def __init__(self, url: str, server_pid: int) -> None:
        ctx = mp.get_context("spawn")
        self.url = url
        self.server_pid = server_pid
        self.pipes = {}
        self.procs = []
        for role in ("consumer", "producer"):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_role_main, args=(role, url, theirs), daemon=True)
            proc.start()
            self.pipes[role] = ours
            self.procs.append(proc)
        self.admin = redis.Redis.from_url(url)

    def _recv(self, role: str, timeout_s: float = 600.0) -> str:
        deadline = time.monotonic() + timeout_s
        while not self.pipes[role].poll(0.05):
            if not all(p.is_alive() for p in self.procs):
                raise RuntimeError(f"a role process died (exit codes {[p.exitcode for p in self.procs]})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{role} process gave no answer in {timeout_s}s")
        return self.pipes[role].recv()

    def run(self, spec: PassSpec) -> tuple[float, dict[str, float]]:
        """Seconds from 'go' to the consumer's last acknowledgement, and the CPU seconds each process spent."""
        for role in ("consumer", "producer"):
            self.pipes[role].send(spec)
        for role in ("consumer", "producer"):
            assert self._recv(role) == "ready"
        server_cpu = _process_cpu_s(self.server_pid)
        t0 = time.perf_counter()
        self.pipes["consumer"].send("go")
        self.pipes["producer"].send("go")
        status, consumer_cpu = self._recv("consumer")
        seconds = time.perf_counter() - t0
        server_cpu = _process_cpu_s(self.server_pid) - server_cpu
        status, producer_cpu = self._recv("producer")
        self.admin.flushall()
        return seconds, {"producer": producer_cpu, "consumer": consumer_cpu, "redis": server_cpu}

    def close(self) -> None:
        for pipe in self.pipes.values():
            with contextlib.suppress(OSError):
                pipe.send(None)
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        self.admin.close()


def bench(url: str, server_pid: int, mode: str) -> list[Pass]:
    spec = MODES[mode]
    roles = Roles(url, server_pid)
    passes: list[Pass] = []
    try:
        for num_tokens in SIZES:
            payload = len(encode(make_groups(num_tokens, 1, 0)[0]))
            roles.run(PassSpec("streamrl", num_tokens, 4, 99))  # warm-up: connections, scripts, allocator
            for rep in range(spec["repeats"]):
                # streamrl and raw_blob run back to back, in alternating order, so each repeat is a paired
                # comparison under the same background load; JSON (slow) runs after them.
                order = ["streamrl", "raw_blob"] if rep % 2 == 0 else ["raw_blob", "streamrl"]
                for method in [*order, "json"]:
                    n = spec["json_entries" if method == "json" else "entries"][num_tokens]
                    seconds, cpu = roles.run(PassSpec(method, num_tokens, n, rep))
                    p = Pass(method, num_tokens, n, seconds, payload, rep, cpu)
                    passes.append(p)
                    print(
                        f"  {num_tokens:>6} tokens  {method:<9} rep {rep}: {n} entries in {seconds:6.2f}s  "
                        f"{p.tokens_per_s:>12,.0f} tokens/s  {p.entries_per_s:8.1f} entries/s  cpu ms/entry "
                        + " ".join(f"{k} {v / n * 1e3:.2f}" for k, v in cpu.items()),
                        flush=True,
                    )
    finally:
        roles.close()
    return passes


def _cpu_total(method: dict) -> float:
    return sum(method["cpu_ms_per_entry"].values())


def summarize(passes: list[Pass]) -> dict[str, dict]:
    """Per size: median rates per method; ratio_vs_raw_blob is the median of the paired per-repeat ratios,
    ratio_vs_json the ratio of medians."""
    sizes: dict[str, dict] = {}
    for num_tokens in SIZES:
        med = {}
        for method in METHODS:
            runs = [p for p in passes if p.method == method and p.num_tokens == num_tokens]
            med[method] = {
                "tokens_per_s": statistics.median(p.tokens_per_s for p in runs),
                "entries_per_s": statistics.median(p.entries_per_s for p in runs),
                "runs_s": [round(p.seconds, 4) for p in runs],
                "cpu_ms_per_entry": {
                    k: round(statistics.median(p.cpu_s[k] / p.entries * 1e3 for p in runs), 3)
                    for k in ("producer", "consumer", "redis")
                },
            }
        by_rep = {(p.method, p.rep): p for p in passes if p.num_tokens == num_tokens}
        paired = [
            by_rep["streamrl", r].tokens_per_s / by_rep["raw_blob", r].tokens_per_s
            for m, r in by_rep
            if m == "streamrl"
        ]
        payload = next(p.payload_bytes for p in passes if p.num_tokens == num_tokens)
        ours = med["streamrl"]
        sizes[str(num_tokens)] = {
            "tokens_per_s": ours["tokens_per_s"],
            "entries_per_s": ours["entries_per_s"],
            "ratio_vs_json": ours["tokens_per_s"] / med["json"]["tokens_per_s"],
            "ratio_vs_raw_blob": statistics.median(paired),
            "paired_ratios_vs_raw_blob": [round(x, 3) for x in paired],
            # CPU of producer + consumer + Redis per entry: insensitive to other load on the machine. With the
            # three processes on enough cores, throughput follows it rather than the wall-clock of one pass.
            "cpu_ratio_vs_raw_blob": _cpu_total(med["raw_blob"]) / _cpu_total(ours),
            "payload_bytes": payload,
            "methods": med,
        }
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_mode_flags(parser, "fewer entries and repeats (under a minute)")
    parser.add_argument("--out", type=Path, default=Path("runs/broker_throughput.json"), help="result JSON")
    args = parser.parse_args(argv)
    mode = mode_of(parser, args)
    print(f"broker_throughput ({mode}): {NUM_SAMPLES} samples per group, sizes {SIZES}", flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="streamrl-bench-") as tmp:
        server_cfg = RedisServerConfig()
        with EmbeddedRedis(Path(tmp), server_cfg) as server:
            passes = bench(server.url, server.process.pid, mode)
    sizes = summarize(passes)
    headline = {k: sizes["8192"][k] for k in ("tokens_per_s", "ratio_vs_json", "ratio_vs_raw_blob")}
    params = {
        "num_samples": NUM_SAMPLES,
        "sizes": list(SIZES),
        "entries": {str(k): v for k, v in MODES[mode]["entries"].items()},
        "json_entries": {str(k): v for k, v in MODES[mode]["json_entries"].items()},
        "repeats": MODES[mode]["repeats"],
        "processes": "producer and consumer in separate processes (a worker and a learner), one Redis",
        "max_backlog": BENCH_CFG.max_backlog,
        "read_count": BENCH_CFG.read_count,
        "trim_every_batches": TRIM_EVERY,
        "concurrent_sends": SENDERS,
        "redis": {"appendonly": True, "appendfsync": server_cfg.appendfsync},
        "event_loop": "uvloop",
        "statistic": "median over repeats; ratio_vs_raw_blob: median of per-repeat paired ratios",
    }
    doc = write_result(
        args.out,
        "broker_throughput",
        mode,
        params,
        {"sizes": sizes, "wall_s": round(time.perf_counter() - started, 1)},
        TARGETS,
        headline={**headline, "sizes": sizes},
    )
    rows = []
    for size, r in sizes.items():
        m = r["methods"]
        rows.append(
            [
                size,
                r["payload_bytes"],
                m["streamrl"]["tokens_per_s"],
                m["json"]["tokens_per_s"],
                m["raw_blob"]["tokens_per_s"],
                r["entries_per_s"],
                r["ratio_vs_json"],
                r["ratio_vs_raw_blob"],
                f"{min(r['paired_ratios_vs_raw_blob']):.2f}-{max(r['paired_ratios_vs_raw_blob']):.2f}",
                r["cpu_ratio_vs_raw_blob"],
            ]
        )
    headers = [
        "tokens",
        "bytes",
        "streamrl tok/s",
        "json tok/s",
        "raw tok/s",
        "entries/s",
        "vs json",
        "vs raw",
        "paired range",
        "cpu vs raw",
    ]
    print()
    print(format_table(headers, rows))
    for name, t in doc["targets"].items():
        verdict = "PASS" if t["passed"] else "MISS"
        print(f"target {name} {t['op']} {t['value']} at 8192 tokens: {t['actual']:.2f}  {verdict}")
    print(f"wrote {args.out} in {time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
