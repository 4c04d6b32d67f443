"""Engine throughput: generated tokens/s of the built-in engine against transformers' ``generate``.

Both sides generate the same tokens for the same prompts with the same model on one CPU thread each:

* ``engine``: ``python -m rollout_fleet.engine`` in its own process (continuous batching, at most ``batch``
  requests decoding together), driven over HTTP with every request in flight at once, as a rollout worker does.
  Time runs from the first request sent to the last answer received.
* ``hf_generate``: ``model.generate`` on static batches of ``batch`` prompts in arrival order (left-padded,
  sampling at temperature 1), each batch run to the longest ``max_new_tokens`` in it: that is what a static batch
  must do. Only the requested tokens count as output; the rest is reported as padding waste.

Output lengths are long-tailed (log-normal, clipped), like chain-of-thought rollouts, and ``ignore_eos`` makes
them exact. The two sides alternate, repeat by repeat, so both see the same load on a shared machine. Reported:
tokens/s of each (median over repeats) and ratio_vs_hf_generate = the median over repeats of engine / hf
(target >= 1.5).

    python -m benchmarks.engine_throughput --quick --out runs/engine_throughput.json
    python -m benchmarks.engine_throughput --out benchmarks/results/engine_throughput.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import torch
from transformers import AutoModelForCausalLM

from benchmarks.common import add_mode_flags, format_table, mode_of, write_result
from rollout_fleet.model import init_tiny_model, load_tokenizer

TARGETS = {"ratio_vs_hf_generate": (">=", 1.5)}
MODES = {
    "smoke": {"requests": 4, "batch": 2, "repeats": 1},
    "quick": {"requests": 64, "batch": 16, "repeats": 2},
    "full": {"requests": 256, "batch": 32, "repeats": 3},
}
LENGTH_MEDIAN, LENGTH_SIGMA, LENGTH_MIN, LENGTH_MAX = 32, 0.9, 4, 480
CONTEXT = 1024
SEED = 0


def workload(n: int, seed: int = SEED) -> tuple[list[str], list[int]]:
    """Arithmetic prompts and long-tailed output lengths (log-normal around LENGTH_MEDIAN, clipped)."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(n):
        a, b = (int(rng.integers(0, 10 ** int(rng.integers(1, 7)))) for _ in range(2))
        prompts.append(f"{a}+{b}=")
    lengths = np.exp(rng.normal(np.log(LENGTH_MEDIAN), LENGTH_SIGMA, n)).round().astype(int)
    return prompts, np.clip(lengths, LENGTH_MIN, LENGTH_MAX).tolist()


# ----- the engine, as a process behind HTTP -----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EngineProcess:
    """``streamrl engine`` on a free port; stopped with SIGTERM. Its run directory (where it writes its resolved
    config) is a temporary one of its own: the default, runs/default, is relative to the working directory."""

    def __init__(self, model: Path, batch: int, extra: tuple[str, ...] = ()) -> None:
        self.run_dir = tempfile.TemporaryDirectory(prefix="streamrl-engine-bench-run-")
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "streamrl", "engine",
            f"--shared.model_path={model}", "--shared.torch_threads=1", f"--engine.port={self.port}",
            f"--engine.max_running_requests={batch}", f"--engine.max_context_len={CONTEXT}", "--engine.device=cpu",
            f"--shared.run_dir={self.run_dir.name}", *extra,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True
        )

    async def wait_ready(self, session: aiohttp.ClientSession, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"engine exited ({self.proc.returncode}): {self.proc.stderr.read()[-2000:]}"
                )
            try:
                async with session.get(self.url + "/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
        raise TimeoutError("engine did not become healthy")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.run_dir.cleanup()


async def engine_pass(
    session: aiohttp.ClientSession, url: str, prompts: list[str], lengths: list[int]
) -> dict:
    """Every request in flight at once; returns tokens, wall time and the engine's batch statistics."""

    async def one(i: int) -> int:
        body = {
            "text": prompts[i],
            "sampling_params": {"max_new_tokens": lengths[i], "ignore_eos": True, "temperature": 1.0},
            "return_logprob": True,
        }
        async with session.post(url + "/generate", json=body) as resp:
            data = await resp.json()
        assert resp.status == 200, data
        assert data["meta_info"]["completion_tokens"] == lengths[i], data["meta_info"]
        return lengths[i]

    async with session.get(url + "/server_info") as resp:
        before = (await resp.json())["internal_states"][0]
    started = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(len(prompts)))))
    wall = time.perf_counter() - started
    async with session.get(url + "/server_info") as resp:
        after = (await resp.json())["internal_states"][0]
    steps = after["decode_steps"] - before["decode_steps"]
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "decode_steps": steps,
        "mean_decode_batch": (after["decode_tokens"] - before["decode_tokens"]) / max(steps, 1),
        "prefill_batches": after["prefill_batches"] - before["prefill_batches"],
    }


# ----- the baseline: static batches through HF generate -------------------------------------------------------


def hf_pass(
    model: Any, tokenizer: Any, prompts: list[str], lengths: list[int], batch: int, seed: int
) -> dict:
    torch.manual_seed(seed)
    useful = padded = 0
    started = time.perf_counter()
    for start in range(0, len(prompts), batch):
        chunk, want = prompts[start : start + batch], lengths[start : start + batch]
        enc = tokenizer(chunk, return_tensors="pt", padding=True)
        steps = max(want)
        with torch.inference_mode():
            out = model.generate(
                **enc,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=steps,
                min_new_tokens=steps,
                pad_token_id=tokenizer.pad_token_id,
            )
        assert out.shape[1] - enc["input_ids"].shape[1] == steps
        useful += sum(want)
        padded += steps * len(chunk)
    wall = time.perf_counter() - started
    return {
        "tokens": useful,
        "generated_incl_padding": padded,
        "padding_waste": 1 - useful / padded,
        "wall_s": wall,
        "tokens_per_s": useful / wall,
        "raw_tokens_per_s": padded / wall,
    }


def load_hf(path: Path) -> tuple[Any, Any]:
    tokenizer = load_tokenizer(path)  # the engine's own loading: a saved tokenizers object stays exactly that
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore_eos on this side too: every batch runs to its max
    return model, tokenizer


# ----- driver ---------------------------------------------------------------------------------------------------


async def run_passes(
    model_dir: Path, prompts: list[str], lengths: list[int], cfg: dict, engine_args: tuple[str, ...] = ()
) -> tuple[list, list]:
    """Alternate engine and HF passes so that both see the same machine load (CPUs here are shared); the
    engine process idles (blocked on its queue, no CPU) while the HF pass runs."""
    model, tokenizer = load_hf(model_dir)
    engine = EngineProcess(model_dir, cfg["batch"], engine_args)
    engine_runs, hf_runs = [], []
    try:
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=1800)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await engine.wait_ready(session)
            await engine_pass(session, engine.url, prompts[:4], [4] * 4)  # warm-up
            hf_pass(model, tokenizer, prompts[:4], [4] * 4, 4, SEED)
            for r in range(cfg["repeats"]):
                engine_runs.append(await engine_pass(session, engine.url, prompts, lengths))
                hf_runs.append(hf_pass(model, tokenizer, prompts, lengths, cfg["batch"], SEED + r))
                ratio = engine_runs[-1]["tokens_per_s"] / hf_runs[-1]["tokens_per_s"]
                print(
                    f"  repeat {r}: engine {engine_runs[-1]['tokens_per_s']:.0f} tokens/s, "
                    f"hf_generate {hf_runs[-1]['tokens_per_s']:.0f} tokens/s, ratio {ratio:.2f}",
                    flush=True,
                )
    finally:
        engine.stop()
    return engine_runs, hf_runs


def summarize(engine_runs: list[dict], hf_runs: list[dict]) -> dict[str, Any]:
    def median(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    engine_tps, hf_tps = median(engine_runs, "tokens_per_s"), median(hf_runs, "tokens_per_s")
    return {
        "engine": {
            "tokens_per_s": round(engine_tps, 1),
            "wall_s": round(median(engine_runs, "wall_s"), 2),
            "mean_decode_batch": round(median(engine_runs, "mean_decode_batch"), 2),
            "decode_steps": int(median(engine_runs, "decode_steps")),
            "prefill_batches": int(median(engine_runs, "prefill_batches")),
            "runs": engine_runs,
        },
        "hf_generate": {
            "tokens_per_s": round(hf_tps, 1),
            "raw_tokens_per_s": round(median(hf_runs, "raw_tokens_per_s"), 1),
            "padding_waste": round(hf_runs[0]["padding_waste"], 3),
            "wall_s": round(median(hf_runs, "wall_s"), 2),
            "runs": hf_runs,
        },
        "ratio_of_medians": round(engine_tps / hf_tps, 3),
        # Each repeat runs both sides back to back under the same load: the median of those ratios is the headline.
        "ratio_vs_hf_generate": round(
            statistics.median(
                e["tokens_per_s"] / h["tokens_per_s"] for e, h in zip(engine_runs, hf_runs, strict=True)
            ),
            3,
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_mode_flags(parser, "64 requests, two repeats (under a minute)")
    parser.add_argument("--out", type=Path, default=Path("runs/engine_throughput.json"), help="result JSON")
    args = parser.parse_args(argv)
    mode = mode_of(parser, args)
    cfg = MODES[mode]
    torch.set_num_threads(1)
    prompts, lengths = workload(cfg["requests"])
    print(
        f"engine_throughput ({mode}): {cfg['requests']} requests, batch {cfg['batch']}, "
        f"{sum(lengths)} output tokens (median {int(np.median(lengths))}, max {max(lengths)})",
        flush=True,
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="streamrl-engine-bench-") as tmp:
        model_dir = init_tiny_model(Path(tmp) / "tiny")
        engine_runs, hf_runs = asyncio.run(run_passes(model_dir, prompts, lengths, cfg))
    summary = summarize(engine_runs, hf_runs)
    params = {
        **cfg,
        "model": "tiny Qwen2 (rollout_fleet.model.init_tiny_model, ~0.87M parameters, fp32)",
        "torch_threads": 1,
        "context": CONTEXT,
        "lengths": {
            "distribution": f"lognormal(median {LENGTH_MEDIAN}, sigma {LENGTH_SIGMA}) clipped [{LENGTH_MIN}, {LENGTH_MAX}]",
            "total": sum(lengths),
            "mean": round(float(np.mean(lengths)), 1),
            "median": int(np.median(lengths)),
            "p95": int(np.percentile(lengths, 95)),
            "max": max(lengths),
        },
        "sampling": "temperature 1.0, top_k off, top_p 1.0, ignore_eos",
        "engine_transport": "HTTP /generate from one aiohttp client, all requests in flight",
        "statistic": "median over repeats; ratio: median of per-repeat ratios (engine and HF back to back)",
    }
    headline = {
        "tokens_per_s": summary["engine"]["tokens_per_s"],
        "ratio_vs_hf_generate": summary["ratio_vs_hf_generate"],
    }
    doc = write_result(
        args.out,
        "engine_throughput",
        mode,
        params,
        {**summary, "wall_s": round(time.perf_counter() - started, 1)},
        TARGETS,
        headline=headline,
    )
    rows = [
        [
            "engine",
            summary["engine"]["tokens_per_s"],
            summary["engine"]["wall_s"],
            summary["engine"]["mean_decode_batch"],
        ],
        [
            "hf_generate",
            summary["hf_generate"]["tokens_per_s"],
            summary["hf_generate"]["wall_s"],
            float(cfg["batch"]),
        ],
    ]
    print(format_table(["method", "tokens/s", "wall s", "mean batch"], rows))
    print(
        f"ratio_vs_hf_generate = {summary['ratio_vs_hf_generate']} (target >= 1.5); "
        f"static-batch padding waste {summary['hf_generate']['padding_waste']:.0%}; passed={doc['passed']}"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
