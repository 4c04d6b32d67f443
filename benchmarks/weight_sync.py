"""Weight sync: time to send a model of a few hundred MB (fp32, CPU, gloo) from the learner to two engines.

One run, one update group, two engine processes (``benchmarks.mini_engine``: a Qwen2 of the same shape behind
the SGLang weight-update endpoints); four ways, interleaved and repeated:

* ``sync``: ``sync_weights`` as the learner runs it, default config: FSDP2 gather (``full_tensor``, one
  learner rank) pipelined with the broadcast, buckets of ``bucket_mb``, the whole HTTP protocol (pause, begin,
  one update call per bucket, end, continue); ``load_format`` auto = per-tensor on gloo, received in place
  into the engines' parameters.
* ``sync_flattened``: the same with ``flattened_bucket`` (packed on the learner, unpacked and copied into the
  model on the engines): the GPU default, reported for comparison.
* ``flat_broadcast``: one broadcast of a single uint8 buffer of the same bytes, into a buffer each engine
  keeps across calls, nothing else (no gather, no HTTP in the timed part, no loading): the transport's limit.
* ``chunked_broadcast``: the same bytes in bucket-size chunks, all broadcasts in flight at once, same buffers:
  gloo runs a group's operations on two worker threads, so this is the tighter bound on gloo.
* ``per_param``: PipelineRL's way: one update call naming every parameter, then for each parameter gather it
  and broadcast it, waiting for each broadcast before the next gather (no bucketing, no overlap).

Reported: median seconds of each, ``ratio_vs_flat_broadcast`` = sync / flat_broadcast (lower is better; target
<= 1.25), ``ratio_vs_per_param`` = per_param / sync (above 1: ours is faster), and the time generation is
paused per sync. After the last sync the engines' weights are checked bit-identical to the learner's.

    python -m benchmarks.weight_sync --quick --out runs/weight_sync.json
    python -m benchmarks.weight_sync --out benchmarks/results/weight_sync.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import add_mode_flags, format_table, mode_of, write_result
from weight_sync import protocol
from weight_sync.buckets import TensorMeta
from weight_sync.config import WeightSyncConfig
from weight_sync.receiver import weights_checksum
from weight_sync.sender import WeightSender, hf_name, iter_full_tensors, sync_weights

REPO = Path(__file__).resolve().parents[1]
TARGETS = {"ratio_vs_flat_broadcast": ("<=", 1.25)}
BASE_MODEL = {
    "vocab_size": 32000,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
}
MODES = {
    # ~4 MB of fp32 weights: that it runs (--smoke); benchmarks.colocated's --tiny
    "smoke": {
        "model": {"vocab_size": 1024, "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256},
        "repeats": 1,
    },
    # ~0.35 GB of fp32 weights.
    "quick": {"model": {"hidden_size": 768, "num_hidden_layers": 6, "intermediate_size": 2048}, "repeats": 5},
    # ~0.62 GB of fp32 weights.
    "full": {"model": {"hidden_size": 1024, "num_hidden_layers": 8, "intermediate_size": 2816}, "repeats": 9},
}
TIMEOUT_S = 300.0


def http_json(url: str, body: dict | None = None, timeout: float = 30.0) -> Any:
    """GET (no body) or POST a JSON body with the standard library; the parsed JSON reply (None when empty)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        text = resp.read()
    return json.loads(text) if text else None


def build_learner_model(config: dict) -> torch.nn.Module:
    """The learner's model, FSDP2-sharded over a one-rank gloo group so the sync gathers DTensors for real."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from broker.server import free_port
    from learner.distributed import init_distributed, shard_model

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    info = init_distributed(timeout_s=TIMEOUT_S, threads=1)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**config))
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=gen)
    return shard_model(model, info.device)


def start_engines(config: dict, count: int) -> tuple[list[subprocess.Popen], list[str]]:
    cmd = [sys.executable, "-m", "benchmarks.mini_engine", "--model-config", json.dumps(config)]
    cmd += ["--timeout-s", str(TIMEOUT_S)]
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True) for _ in range(count)]
    urls = []
    for proc in procs:
        line = proc.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"engine failed to start: {line!r}")
        urls.append(f"http://127.0.0.1:{int(line.split()[1])}")
    for url in urls:
        deadline = time.monotonic() + 120
        while True:
            try:
                if http_json(url + "/health", timeout=2) is None:
                    break
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    return procs, urls


def flat_broadcast(sender: WeightSender, buffer: torch.Tensor, chunk: int = 0) -> float:
    """One broadcast of ``buffer`` to every engine (or, with ``chunk``, one per chunk, all in flight at once),
    timed from the moment all of them are waiting for it."""
    body = {"nbytes": buffer.numel(), "chunk": chunk, "group_name": sender.config.group_name}
    futures = [sender.http.submit(e.url, "/bench_receive", body, TIMEOUT_S) for e in sender.members]
    # the start line: every engine has posted its receive (on the buffer's device: NCCL takes CUDA tensors only)
    sender.group.broadcast(torch.zeros(1, device=buffer.device))
    t0 = time.perf_counter()
    for work in [sender.group.broadcast(c, async_op=True) for c in buffer.split(chunk or buffer.numel())]:
        work.wait()
    seconds = time.perf_counter() - t0
    for fut in futures:
        reply = fut.result(timeout=TIMEOUT_S)
        if not reply.ok:
            raise RuntimeError(f"bench_receive failed: {reply.describe()}")
    return seconds


def timed_sync(model: torch.nn.Module, version: int, sender: WeightSender, cfg: WeightSyncConfig) -> dict:
    sender.config = cfg
    result = sync_weights(model, version, sender)
    if not result.ok:
        raise RuntimeError(f"sync failed: {result.engines_failed}")
    return {"seconds": result.seconds, "paused_seconds": result.paused_seconds, "buckets": result.buckets}


def per_param_sync(model: torch.nn.Module, version: int, sender: WeightSender) -> float:
    """PipelineRL's way over the same protocol: one update call announcing every parameter, then gather and
    broadcast them one at a time, each broadcast waited for before the next gather."""
    urls = [e.url for e in sender.members]
    t0 = time.perf_counter()
    for path, body in (
        (protocol.PAUSE, protocol.pause_body("abort")),
        (protocol.BEGIN, protocol.begin_body()),
    ):
        if not all(r.ok for r in sender.http.call_all(urls, path, body).values()):
            raise RuntimeError(f"{path} failed")
    metas = [TensorMeta(hf_name(n), p.dtype, tuple(p.shape)) for n, p in model.named_parameters()]
    body = protocol.update_distributed_body(metas, weight_version=str(version))
    futures = [sender.http.submit(url, protocol.UPDATE_DISTRIBUTED, body, TIMEOUT_S) for url in urls]
    for _, tensor in iter_full_tensors(model):
        sender.group.broadcast(tensor)
    if not all(f.result(timeout=TIMEOUT_S).ok for f in futures):
        raise RuntimeError("per-parameter update failed")
    for path, body in ((protocol.END, protocol.end_body()), (protocol.CONTINUE, protocol.continue_body())):
        if not all(r.ok for r in sender.http.call_all(urls, path, body).values()):
            raise RuntimeError(f"{path} failed")
    return time.perf_counter() - t0


def run(mode: str, bucket_mb: float) -> tuple[dict, dict, dict]:
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    spec = MODES[mode]
    model_config = {**BASE_MODEL, **spec["model"]}
    procs, urls = start_engines(model_config, 2)
    try:
        model = build_learner_model(model_config)
        total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        ours = WeightSyncConfig(bucket_mb=bucket_mb, timeout_s=TIMEOUT_S, master_address="127.0.0.1")
        flattened = ours.model_copy(update={"load_format": "flattened_bucket"})
        sender = WeightSender(urls, ours)
        sender.connect()
        buffer = torch.randint(0, 255, (total_bytes,), dtype=torch.uint8)
        version = 1
        for cfg in (ours, flattened):  # warm-up: first allocations, connections
            timed_sync(model, version, sender, cfg)
            version += 1
        names = ("sync", "sync_flattened", "flat_broadcast", "chunked_broadcast", "per_param", "paused")
        samples: dict[str, list] = {k: [] for k in names}
        buckets = {}
        for _ in range(spec["repeats"]):
            samples["flat_broadcast"].append(flat_broadcast(sender, buffer))
            samples["chunked_broadcast"].append(flat_broadcast(sender, buffer, int(bucket_mb * 2**20)))
            sync = timed_sync(model, version, sender, ours)
            samples["sync"].append(sync["seconds"])
            samples["paused"].append(sync["paused_seconds"])
            buckets["sync"] = sync["buckets"]
            sync = timed_sync(model, version + 1, sender, flattened)
            samples["sync_flattened"].append(sync["seconds"])
            buckets["sync_flattened"] = sync["buckets"]
            samples["per_param"].append(per_param_sync(model, version + 2, sender))
            version += 3
        timed_sync(model, version, sender, ours)
        learner_sum = weights_checksum([(n, p.full_tensor()) for n, p in model.named_parameters()])
        engine_sums = [
            http_json(url + "/weights_checker", {"action": "checksum"}, TIMEOUT_S)["checksum"] for url in urls
        ]
        resolved = ours.resolved_load_format(sender.backend)
        sender.close()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)
    med = {k: statistics.median(v) for k, v in samples.items()}
    headline = {
        "seconds": med["sync"],
        "ratio_vs_flat_broadcast": med["sync"] / med["flat_broadcast"],
        "ratio_vs_per_param": med["per_param"] / med["sync"],
        "paused_seconds": med["paused"],
    }
    methods = ("sync", "sync_flattened", "flat_broadcast", "chunked_broadcast", "per_param")
    results = {
        "median_seconds": med,
        "samples": samples,
        "model_bytes": total_bytes,
        "buckets_per_sync": buckets,
        "gb_per_s": {k: total_bytes / med[k] / 1e9 for k in methods},
        "flattened_ratio_vs_flat_broadcast": med["sync_flattened"] / med["flat_broadcast"],
        # gloo runs a process group's operations on two worker threads, so the same bytes in bucket-size chunks
        # in flight together move faster than one flat broadcast: the tighter bound for this transport.
        "ratio_vs_chunked_broadcast": med["sync"] / med["chunked_broadcast"],
        "weights_bit_identical": all(s == learner_sum for s in engine_sums),
        # Other processes on the machine (the 2-core dev box is shared): the noise floor of these numbers.
        "load_avg_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
    }
    params = {
        "mode": mode,
        "engines": 2,
        "learner_ranks": 1,
        "bucket_mb": bucket_mb,
        "load_format": resolved,
        "pipeline_depth": ours.pipeline_depth,
        "repeats": spec["repeats"],
        "model": model_config,
        "dtype": "float32",
        "backend": "gloo",
        "torch_threads": 1,
    }
    return params, results, headline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_mode_flags(parser, "smaller model, fewer repeats (a few minutes)")
    parser.add_argument("--bucket-mb", type=float, default=64.0, help="bucket size of the measured sync, MiB")
    parser.add_argument("--out", type=Path, default=Path("runs/weight_sync.json"), help="result JSON")
    args = parser.parse_args(argv)
    mode = mode_of(parser, args)
    params, results, headline = run(mode, args.bucket_mb)
    if not results["weights_bit_identical"]:
        raise SystemExit("engines' weights differ from the learner's after the sync")
    doc = write_result(args.out, "weight_sync", mode, params, results, TARGETS, headline)
    med = results["median_seconds"]
    names = ("sync", "sync_flattened", "flat_broadcast", "chunked_broadcast", "per_param")
    rows = [[name, med[name], results["model_bytes"] / med[name] / 1e9] for name in names]
    print(format_table(["method", "seconds", "GB/s"], rows))
    print(
        f"ratio_vs_flat_broadcast {doc['ratio_vs_flat_broadcast']:.3f} (target <= 1.25), "
        f"ratio_vs_per_param {doc['ratio_vs_per_param']:.2f}, paused {doc['paused_seconds']:.3f} s per sync, "
        f"passed={doc['passed']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
