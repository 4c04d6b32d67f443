"""LoRA sync: bytes and seconds of an adapter sync against a full sync of the same model, to a real built-in engine.

One run, one learner (a one-rank FSDP2 gloo group, so the sync gathers DTensors for real) holding a Qwen2 with
peft LoRA adapters (``learner.lora.apply_lora``, every attention and MLP projection, adapters randomised so they
are not zero), one ``python -m streamrl engine`` process serving the same base model. Two ways, interleaved and
repeated, each a whole ``sync_weights`` as the learner runs it (pause, begin, buckets, end, continue):

* ``adapter``: ``weight_sync.lora_sync = adapter``: only ``lora_A`` / ``lora_B`` of each projection go over the
  group; the engine serves ``W_base + scaling * B @ A``;
* ``full``: ``weight_sync.lora_sync = merged``: every weight of the model, adapters merged in (what a LoRA
  learner must send to an engine that takes no adapter).

Reported: median seconds and bytes of each, ``bytes_ratio_vs_full`` = full bytes / adapter bytes and
``seconds_ratio_vs_full`` = full seconds / adapter seconds (above 1: the adapter sync is cheaper). After an
adapter sync and after a full sync the engine's log-probs of a fixed sequence are checked against the learner's.

    python -m benchmarks.lora_sync --quick --out runs/lora_sync.json
    python -m benchmarks.lora_sync --out benchmarks/results/lora_sync.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
from pathlib import Path

import torch

from benchmarks.common import add_mode_flags, format_table, mode_of, write_result
from benchmarks.weight_sync import http_json

REPO = Path(__file__).resolve().parents[1]
TARGETS = {"seconds_ratio_vs_full": (">", 1.0), "bytes_ratio_vs_full": (">", 10.0)}
MODES = {
    # ~0.3M parameters: that it runs (--smoke)
    "smoke": {
        "model": {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "intermediate_size": 128},
        "rank": 4,
        "repeats": 1,
    },
    # ~25M parameters, ~0.1 GB of fp32 weights.
    "quick": {
        "model": {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
                  "num_key_value_heads": 2, "intermediate_size": 1536},
        "rank": 16,
        "repeats": 5,
    },
    # ~190M parameters, ~0.75 GB of fp32 weights.
    "full": {
        "model": {"hidden_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16,
                  "num_key_value_heads": 4, "intermediate_size": 2816},
        "rank": 16,
        "repeats": 7,
    },
}  # fmt: skip
TIMEOUT_S = 300.0
SEQUENCE = list(range(5, 69))


def make_model_dir(root: Path, shape: dict) -> Path:
    """A Qwen2 of ``shape`` with the project's tokenizer, saved as a Hugging Face directory both sides load."""
    from rollout_fleet.model import TinyModelSpec, init_tiny_model

    return init_tiny_model(root / "model", TinyModelSpec(max_position_embeddings=1024, **shape))


def start_engine(model_dir: Path, run_dir: Path, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """A ``streamrl engine`` serving ``model_dir``; ``run_dir`` gets its resolved config (the default,
    runs/default, is relative to the working directory: the checkout)."""
    from broker.server import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "streamrl", "engine", f"--shared.model_path={model_dir}", f"--engine.port={port}",
           f"--engine.control_timeout_s={TIMEOUT_S}", "--engine.max_total_tokens=4096",
           "--engine.max_running_requests=4", f"--shared.run_dir={run_dir}", *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with code {proc.returncode}")
        try:
            http_json(url + "/model_info", timeout=2)
            return proc, url
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.3)


def build_learner_model(model_dir: Path, rank: int) -> torch.nn.Module:
    """The learner's model: LoRA injected, FSDP2-sharded over a one-rank gloo group; adapters randomised (B
    starts at 0, which would make the adapter's effect invisible in the log-prob check)."""
    from transformers import AutoModelForCausalLM

    from broker.server import free_port
    from learner.config import LoraSection
    from learner.distributed import init_distributed, shard_model
    from learner.lora import apply_lora

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    info = init_distributed(timeout_s=TIMEOUT_S, threads=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = apply_lora(model, LoraSection(rank=rank, alpha=2 * rank))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    return shard_model(model, info.device)


def learner_logprobs(model: torch.nn.Module) -> list[float]:
    with torch.no_grad():
        ids = torch.tensor([SEQUENCE])
        logp = torch.log_softmax(model(input_ids=ids).logits.float()[0, :-1], dim=-1)
        return logp.gather(-1, ids[0, 1:, None])[:, 0].tolist()


def engine_logprobs(url: str) -> list[float]:
    body = {"input_ids": SEQUENCE, "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
            "return_logprob": True, "logprob_start_len": 0}  # fmt: skip
    meta = http_json(url + "/generate", body, TIMEOUT_S)["meta_info"]
    return [lp for lp, _, _ in meta["input_token_logprobs"][1:]]


def served_gap(model: torch.nn.Module, url: str) -> float:
    """Largest |engine - learner| log-prob over the fixed sequence."""
    ours = learner_logprobs(model)
    return max(abs(a - b) for a, b in zip(engine_logprobs(url), ours, strict=True))


def merge_seconds(model: torch.nn.Module, repeats: int = 3) -> float:
    """What the engine's part of an adapter sync costs at least: ``W = W_base + s * B @ A`` over every adapted
    layer on this thread (the engine does the same addmm on its scheduler thread), median of ``repeats``."""
    from weight_sync.lora import lora_layers

    layers = [(m.base_layer.weight.full_tensor(), m.lora_A["default"].weight.full_tensor(),
               m.lora_B["default"].weight.full_tensor(), float(m.scaling["default"]))
              for m in lora_layers(model).values()]  # fmt: skip
    out = {id(w): torch.empty_like(w) for w, _, _, _ in layers}
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            for w, a, b, s in layers:
                torch.addmm(w, b, a, alpha=s, out=out[id(w)])
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(
    mode: str,
    bucket_mb: float,
    model_dir: Path | None = None,
    repeats: int | None = None,
    dtype: str = "float32",
) -> tuple[dict, dict, dict]:
    """``model_dir``: sync that model (benchmarks.model_scale's shaped one) instead of ``mode``'s, to an engine
    serving it in ``dtype``; a ``dtype`` other than float32 is also what the learner sends
    (``weight_sync.send_dtype``), and the log-prob check then measures that rounding too."""
    from weight_sync.config import WeightSyncConfig
    from weight_sync.sender import WeightSender, sync_weights

    torch.set_num_threads(1)
    load_before = os.getloadavg()
    spec = {**MODES[mode], "repeats": repeats or MODES[mode]["repeats"]}
    root = Path(tempfile.mkdtemp(prefix="lora_sync_"))
    proc = None
    try:
        given = model_dir is not None
        model_dir = model_dir if given else make_model_dir(root, spec["model"])
        proc, url = start_engine(
            model_dir, root / "engine-run", (f"--engine.dtype={dtype}",) if given else ()
        )
        model = build_learner_model(model_dir, spec["rank"])
        base_params = sum(p.numel() for n, p in model.named_parameters() if ".lora_" not in n)
        adapter_params = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
        send_dtype = "auto" if dtype == "float32" else dtype
        cfg = WeightSyncConfig(
            bucket_mb=bucket_mb, timeout_s=TIMEOUT_S, master_address="127.0.0.1", send_dtype=send_dtype
        )
        sender = WeightSender([url], cfg)
        sender.connect()
        version = 1

        def sync(way: str) -> dict:
            nonlocal version
            result = sync_weights(
                model, version, sender, lora_sync="adapter" if way == "adapter" else "merged"
            )
            version += 1
            if not result.ok:
                raise RuntimeError(f"{way} sync failed: {result.engines_failed}")
            return {"seconds": result.seconds, "bytes": result.bytes, "paused": result.paused_seconds}

        # warm-up (first allocations, connections), and the correctness check of each way on its own: an adapter
        # goes on the engine's base; a full sync replaces the base, so it comes last
        sync("adapter")
        gaps = {"adapter": served_gap(model, url)}
        samples: dict[str, list[dict]] = {"adapter": [], "full": []}
        for _ in range(spec["repeats"]):
            for way in ("adapter", "full"):
                samples[way].append(sync(way))
        sync("full")
        gaps["full"] = served_gap(model, url)
        sender.close()
        merge = merge_seconds(model)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)
    med = {w: {k: statistics.median(s[k] for s in samples[w]) for k in ("seconds", "bytes", "paused")}
           for w in samples}  # fmt: skip
    headline = {
        "bytes_ratio_vs_full": med["full"]["bytes"] / med["adapter"]["bytes"],
        "seconds_ratio_vs_full": med["full"]["seconds"] / med["adapter"]["seconds"],
        "adapter_seconds": med["adapter"]["seconds"],
        "full_seconds": med["full"]["seconds"],
        "adapter_bytes": int(med["adapter"]["bytes"]),
        "full_bytes": int(med["full"]["bytes"]),
    }
    results = {
        "median": med,
        "samples": samples,
        "base_parameters": base_params,
        "adapter_parameters": adapter_params,
        "max_logprob_gap": gaps,
        # the adapter sync's floor on the engine: merging every adapted weight (one addmm each, one thread)
        "merge_seconds": merge,
        "engine_matches_learner": all(g < 1e-3 for g in gaps.values()),
        # Other processes on the machine (the 2-core dev box is shared): the noise floor of these numbers.
        "load_avg_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
    }
    params = {
        "mode": mode,
        "engines": 1,
        "engine": "builtin",
        "learner_ranks": 1,
        "lora_rank": spec["rank"],
        "lora_alpha": 2 * spec["rank"],
        "target_modules": "q,k,v,o,gate,up,down projections",
        "bucket_mb": bucket_mb,
        "load_format": cfg.resolved_load_format("gloo"),
        "repeats": spec["repeats"],
        "model": str(model_dir) if given else spec["model"],
        "dtype": dtype,
        "backend": "gloo",
        "torch_threads": 1,
    }
    return params, results, headline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_mode_flags(parser, "smaller model, fewer repeats (about a minute)")
    parser.add_argument("--bucket-mb", type=float, default=64.0, help="bucket size of the syncs, MiB")
    parser.add_argument("--out", type=Path, default=Path("runs/lora_sync.json"), help="result JSON")
    args = parser.parse_args(argv)
    mode = mode_of(parser, args)
    params, results, headline = run(mode, args.bucket_mb)
    if not results["engine_matches_learner"]:
        raise SystemExit(f"the engine does not serve the learner's model: {results['max_logprob_gap']}")
    doc = write_result(args.out, "lora_sync", mode, params, results, TARGETS, headline)
    med = results["median"]
    rows = [
        [way, med[way]["seconds"], med[way]["bytes"] / 2**20, med[way]["paused"]]
        for way in ("adapter", "full")
    ]
    print(format_table(["sync", "seconds", "MiB", "paused s"], rows))
    print(
        f"bytes_ratio_vs_full {doc['bytes_ratio_vs_full']:.1f}, seconds_ratio_vs_full "
        f"{doc['seconds_ratio_vs_full']:.1f} (merging the adapter into the weights alone: "
        f"{results['merge_seconds']:.3f} s), passed={doc['passed']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
