"""``make gpu-check``: the GPU path in one short script on one GPU, one JSON with each part's status.

    python -m benchmarks.gpu_check --out benchmarks/results/gpu_check.json

Parts, in order, each ``{status: passed | failed | skipped, seconds, reason, ...numbers}``:

1. ``pytest_gpu``: ``pytest -m gpu`` (the tests CI deselects: SGLang servers, the CUDA engine, flash-attention),
   in a subprocess under ``--pytest-timeout``; its counts from the JUnit XML.
2. ``learner_step_bf16``: one learner step (``learner.step.train_step``, the trainer's own inputs from
   ``learner.trainer.plan_step_inputs``) of a model shaped like Qwen2.5-0.5B (random weights, the config built
   by hand: hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocabulary 151936, tied
   embeddings), FSDP2 on one rank (``learner.distributed.shard_model``) with ``mixed_precision = bf16``: the
   loss, the gradient norm, seconds, tokens/s and peak memory.
3. ``nccl_sync``: the same model's weights sent with ``weight_sync.sender.sync_weights`` (the learner's sync:
   FSDP2 gather, buckets, the SGLang update protocol, ``send_dtype = bfloat16``) over NCCL to one receiving
   engine (``weight_sync.mini_engine`` on CUDA, bf16), against one flat ``torch.distributed`` broadcast of the
   same bytes (``benchmarks.weight_sync.flat_broadcast``): GB/s of each, ``ratio_vs_flat_broadcast`` (ours /
   flat, lower is better), and the engine's weights checked bit-identical to the learner's bf16 cast. The engine
   runs on the second GPU when there is one; on one GPU it shares the learner's, which NCCL may refuse (a
   communicator's ranks must be on distinct devices: "Duplicate GPU detected"): then the part fails with
   that error recorded, which is the finding.
4. ``sglang_fleet``: when ``import sglang`` works: a real SGLang server launched by ``rollout_fleet.fleet.Fleet``
   with the tiny model, a greedy generation, a weight update by ``/update_weights_from_disk`` of perturbed
   weights (the protocol's recovery path; an NCCL group between this process and the server would put two ranks
   on one GPU, see part 3; no ``gpu`` test sends full weights to SGLang over NCCL either, which needs two
   GPUs), then the new ``weight_version`` and changed log-probs checked. Skipped, with the import error as its reason, otherwise.

Without a CUDA device it writes the JSON with ``status = "no_cuda"`` and every part skipped for that reason,
prints "gpu-check: no CUDA device", and exits 2 (nothing was checked). ``--allow-cpu`` runs parts 2 and 3 on the
CPU with gloo and a small model instead (how the script itself is tested here); its JSON says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "gpu_check.json"
# Qwen2.5-0.5B's shape (its config.json), random weights: about 494M parameters, 0.99 GB in bf16.
QWEN25_05B = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
# --allow-cpu: the same parts on gloo with a model small enough for a CPU test.
SMALL = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "tie_word_embeddings": True,
}
PARTS = ("pytest_gpu", "learner_step_bf16", "nccl_sync", "sglang_fleet")
TIMEOUT_S = 120.0  # every collective and HTTP call of the check: a hang fails its part within two minutes


def timed_part(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one part; any exception is the part's failure, recorded with the end of its traceback."""
    started = time.monotonic()
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - a part's failure is a result, never the script's crash
        out = {
            "status": "failed",
            "reason": f"{type(exc).__name__}: {exc}"[:2000],
            "traceback": traceback.format_exc()[-4000:],
        }
    out["seconds"] = time.monotonic() - started
    return out


# -- 1. pytest -m gpu -------------------------------------------------------------------------------------------


def pytest_gpu(timeout_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "gpu.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
        ]
        try:
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            tail = (
                (exc.stdout or b"")[-3000:] if isinstance(exc.stdout, bytes) else (exc.stdout or "")[-3000:]
            )
            return {
                "status": "failed",
                "reason": f"pytest -m gpu ran past {timeout_s} s",
                "output_tail": str(tail),
            }
        counts: dict[str, int] = {}
        if junit.is_file():
            suite = ET.parse(junit).getroot()
            suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
            if suite is not None:
                counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    ok = proc.returncode == 0 and counts.get("tests", 0) > 0
    return {
        "status": "passed" if ok else "failed",
        "reason": "" if ok else f"pytest exited {proc.returncode}",
        "returncode": proc.returncode,
        **counts,
        "output_tail": proc.stdout[-3000:],
    }


# -- 2. a bf16 learner step, FSDP2 on one rank ------------------------------------------------------------------


def init_one_rank() -> Any:
    """The learner's default process group with one rank (NCCL on CUDA, gloo on CPU), as torchrun would set it."""
    from broker.server import free_port
    from learner.distributed import init_distributed

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    return init_distributed(timeout_s=TIMEOUT_S, threads=1)


def random_model(shape: dict[str, Any], device: Any, attn_implementation: str = "sdpa") -> Any:
    """A Qwen2 of ``shape`` with random weights (seeded) on ``device``, its buffers (the rotary frequencies)
    computed as from_pretrained would."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # built on the device, not on "meta" then to_empty: to_empty leaves the rotary embedding's inv_freq buffer
    # uninitialised memory, which made the step's loss NaN now and then
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**shape, attn_implementation=attn_implementation))
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=gen)
    model.tie_weights()
    return model


def build_model(shape: dict[str, Any], device: Any, mixed_precision: str) -> Any:
    """:func:`random_model` with fp32 master weights on ``device``, sharded by FSDP2."""
    from learner.attention import register_packed_attention, resolve_attention_kernel
    from learner.distributed import compute_dtype, shard_model

    # the packed attention the trainer picks on this device (flash-attention's varlen kernel where it serves)
    kernel = resolve_attention_kernel("auto", device, compute_dtype(mixed_precision, device))  # type: ignore[arg-type]
    model = random_model(shape, device, register_packed_attention(kernel))
    return shard_model(model, device, mixed_precision=mixed_precision)  # type: ignore[arg-type]


def step_sequences(vocab: int, count: int, seed: int = 0) -> tuple[list[Any], list[float]]:
    """GRPO-like sequences (4 groups' prompts shared, outputs of 64 to 512 tokens, advantages of both signs)."""
    import math

    import torch

    from learner.packing import TrainSequence

    gen = torch.Generator().manual_seed(seed)
    seqs, temps = [], []
    prompt = torch.zeros(0, dtype=torch.long)
    for i in range(count):
        if i % 4 == 0:
            prompt = torch.randint(
                1, vocab, (int(torch.randint(32, 129, (1,), generator=gen)),), generator=gen
            )
        n = int(torch.randint(64, 513, (1,), generator=gen))
        seqs.append(
            TrainSequence(
                prompt_ids=prompt,
                output_ids=torch.randint(1, vocab, (n,), generator=gen),
                # near a random model's own (-log V), so the importance ratios stay inside the clip range
                logprobs=-math.log(vocab) + 0.05 * torch.randn(n, generator=gen),
                versions=torch.zeros(n, dtype=torch.long),
                loss_mask=torch.ones(n),
                advantages=float(torch.randn(1, generator=gen)),
                index=i,
            )
        )
        temps.append(1.0)
    return seqs, temps


def learner_step(model: Any, device: Any, vocab: int, mixed_precision: str) -> dict[str, Any]:
    import math

    import torch

    from learner.config import LearnerConfig
    from learner.distributed import compute_dtype
    from learner.step import train_step
    from learner.trainer import plan_step_inputs

    config = LearnerConfig(micro_batch_tokens=4096, mixed_precision=mixed_precision)  # type: ignore[arg-type]
    seqs, temps = step_sequences(vocab, 16)
    inputs = plan_step_inputs(seqs, temps, config, 1)
    mbs = [mb.to(device) for mb in inputs.micro_batches[0]]
    temperatures = [t.to(device) for t in inputs.temperatures[0]]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    result = train_step(model, optimizer, mbs, temperatures, config, inputs.normaliser, learner_version=0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    tokens = sum(s.length for s in seqs)
    loss = float(result.metrics["loss"])
    grad_norm = float(result.grad_norm) if result.grad_norm is not None else float("nan")
    ok = bool(result.applied) and math.isfinite(loss) and math.isfinite(grad_norm) and grad_norm > 0
    dtype = compute_dtype(mixed_precision, device)  # type: ignore[arg-type]
    return {
        "status": "passed" if ok else "failed",
        "reason": ""
        if ok
        else f"step not applied, non-finite or no gradient (loss {loss}, grad norm {grad_norm})",
        "compute_dtype": str(dtype or "float32"),
        "attention": str(model.config._attn_implementation),
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokens": tokens,
        "micro_batches": len(mbs),
        "loss": loss,
        "grad_norm": grad_norm,
        "step_seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
    }


# -- 3. NCCL weight sync against one flat broadcast -------------------------------------------------------------


def start_mini_engine(shape: dict[str, Any], device: str, dtype: str, env: dict[str, str]) -> tuple[Any, str]:
    """One ``weight_sync.mini_engine`` process (the receiving engine), its URL once it answers /health."""
    from benchmarks.weight_sync import http_json

    cmd = [sys.executable, "-m", "weight_sync.mini_engine", "--model-config", json.dumps(shape)]
    cmd += ["--timeout-s", str(TIMEOUT_S), "--device", device, "--dtype", dtype]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("PORT "):
        proc.kill()
        raise RuntimeError(f"the receiving engine did not start: {line!r}")
    url = f"http://127.0.0.1:{int(line.split()[1])}"
    deadline = time.monotonic() + 300
    while True:
        try:
            http_json(url + "/health", timeout=2)
            return proc, url
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise
            time.sleep(0.5)


def nccl_sync(model: Any, shape: dict[str, Any], device: Any, repeats: int) -> dict[str, Any]:
    import statistics

    import torch

    from benchmarks.weight_sync import flat_broadcast, http_json
    from weight_sync.config import WeightSyncConfig
    from weight_sync.receiver import weights_checksum
    from weight_sync.sender import WeightSender, sync_weights

    on_cuda = device.type == "cuda"
    gpus = torch.cuda.device_count() if on_cuda else 0
    # the engine on the second GPU when there is one (NCCL wants its ranks on distinct devices)
    engine_env = {"CUDA_VISIBLE_DEVICES": "1"} if gpus >= 2 else {}
    engine_device = "cuda:0" if on_cuda else "cpu"
    dtype = "bfloat16"
    proc, url = start_mini_engine(shape, engine_device, dtype, engine_env)
    sender = None
    try:
        cfg = WeightSyncConfig(
            bucket_mb=512, timeout_s=TIMEOUT_S, master_address="127.0.0.1", send_dtype=dtype
        )
        sender = WeightSender([url], cfg)
        sender.connect()
        if sender.setup_error or sender.quarantined:
            raise RuntimeError(f"update group setup failed: {sender.setup_error or sender.quarantined}")
        nbytes = sum(p.numel() * 2 for p in model.parameters())  # bf16 on the wire
        buffer = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
        version, syncs, flats = 1, [], []
        for i in range(repeats + 1):  # the first of each is a warm-up (allocations, NCCL channels)
            result = sync_weights(model, version, sender)
            version += 1
            if result is None or not result.ok:
                raise RuntimeError(f"sync failed: {None if result is None else result.engines_failed}")
            flat = flat_broadcast(sender, buffer)
            if i:
                syncs.append(result.seconds)
                flats.append(flat)
        learner_sum = weights_checksum(
            [(n, p.full_tensor().to(torch.bfloat16)) for n, p in model.named_parameters()]
        )
        engine_sum = http_json(url + "/weights_checker", {"action": "checksum"}, TIMEOUT_S)["checksum"]
        sync_s, flat_s = statistics.median(syncs), statistics.median(flats)
        identical = learner_sum == engine_sum
        return {
            "status": "passed" if identical else "failed",
            "reason": "" if identical else "the engine's weights differ from the learner's bf16 weights",
            "backend": sender.backend,
            "gpus": gpus,
            "engine_device": f"cuda:{1 if gpus >= 2 else 0}" if on_cuda else "cpu",
            "bytes": nbytes,
            "sync_seconds": sync_s,
            "flat_broadcast_seconds": flat_s,
            "sync_gb_per_s": nbytes / sync_s / 1e9,
            "flat_broadcast_gb_per_s": nbytes / flat_s / 1e9,
            "ratio_vs_flat_broadcast": sync_s / flat_s,
            "samples": {"sync": syncs, "flat_broadcast": flats},
            "weights_bit_identical": identical,
        }
    finally:
        if sender is not None:
            sender.close()
        proc.kill()
        proc.wait(30)


# -- 4. a real SGLang fleet with a weight update ----------------------------------------------------------------


def sglang_fleet(work: Path) -> dict[str, Any]:
    try:
        import sglang  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason to skip
        return {"status": "skipped", "reason": f"import sglang failed: {type(exc).__name__}: {exc}"}
    return asyncio.run(_sglang_fleet(work))


async def _sglang_fleet(work: Path) -> dict[str, Any]:
    import socket

    import aiohttp
    import torch
    from transformers import AutoModelForCausalLM

    from broker.config import SharedConfig
    from rollout_fleet.client import EngineClient, SamplingConfig, build_generate_request
    from rollout_fleet.config import EngineConfig
    from rollout_fleet.fleet import Fleet
    from rollout_fleet.model import init_tiny_model
    from weight_sync import protocol
    from weight_sync.config import WeightSyncConfig
    from weight_sync.sender import WeightSender

    model_dir = init_tiny_model(work / "tiny")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    shared = SharedConfig(run_id="gpucheck", model_path=model_dir, run_dir=work / "run", http_timeout_s=60.0)
    engine = EngineConfig(
        kind="sglang", count=1, mem_fraction_static=0.2, max_context_len=512, launch_timeout_s=600.0,
        extra_args=["--disable-cuda-graph"],
    )  # fmt: skip
    fleet = Fleet(shared, engine, None, ports=[port])
    out: dict[str, Any] = {}
    (url,) = await fleet.start()
    try:
        async with aiohttp.ClientSession() as session:
            client = EngineClient(session, url, 120, 60)
            payload = build_generate_request([5, 6, 7, 8], SamplingConfig(temperature=0.0), 16, "gpucheck-0")
            before = await client.generate(payload)
            # new weights: the tiny model perturbed, written as a Hugging Face directory
            new_dir = work / "tiny-v1"
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            model.save_pretrained(new_dir)
            sender = WeightSender([url], WeightSyncConfig(timeout_s=120, master_address="127.0.0.1"))
            reply = sender.http.call(
                url, protocol.UPDATE_FROM_DISK, protocol.update_from_disk_body(str(new_dir), "1")
            )
            sender.http.close()
            out["update"] = {"method": "update_weights_from_disk", "ok": reply.ok, "reply": reply.describe()}
            info = await client.model_info()
            after = await client.generate({**payload, "rid": "gpucheck-1"})
    finally:
        await fleet.stop()
    changed = before.logprobs != after.logprobs
    ok = out["update"]["ok"] and info.get("weight_version") == "1" and changed
    return {
        "status": "passed" if ok else "failed",
        "reason": ""
        if ok
        else f"update {out['update']}, weight_version {info.get('weight_version')!r}, "
        f"log-probs changed: {changed}",
        **out,
        "weight_version_after": info.get("weight_version"),
        "tokens_before": before.output_ids,
        "tokens_after": after.output_ids,
        "logprobs_changed": changed,
        "note": "the update goes by disk: on one GPU an NCCL group between this process and the server would "
        "put two ranks on one device",
    }


# -- the script -------------------------------------------------------------------------------------------------


def write(out: Path, doc: dict[str, Any]) -> None:
    from benchmarks.common import git_sha, machine_info

    doc = {"benchmark": "gpu_check", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_sha": git_sha(),
           "machine": machine_info(), **doc}  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    tmp.replace(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="result JSON")
    parser.add_argument("--pytest-timeout", type=float, default=420.0, help="seconds for pytest -m gpu")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed syncs and flat broadcasts (after a warm-up)"
    )
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: " + ", ".join(PARTS))
    parser.add_argument(
        "--allow-cpu", action="store_true", help="testing: parts 2 and 3 on CPU, gloo, small model"
    )
    args = parser.parse_args(argv)
    import torch

    skip = {s for s in args.skip.split(",") if s}
    if unknown := skip - set(PARTS):
        parser.error(f"--skip: unknown parts {sorted(unknown)}")
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        reason = "no CUDA device"
        write(args.out, {"status": "no_cuda", "reason": reason,
                         "parts": {p: {"status": "skipped", "reason": reason} for p in PARTS}})  # fmt: skip
        print(f"gpu-check: no CUDA device (torch {torch.__version__}); nothing checked, {args.out} records it",
              file=sys.stderr)  # fmt: skip
        return 2
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    shape = QWEN25_05B if cuda else SMALL
    mixed = "bf16"
    parts: dict[str, dict[str, Any]] = {}
    started = time.monotonic()

    def run(name: str, fn: Callable[[], dict[str, Any]], cpu_ok: bool = True) -> None:
        if name in skip:
            parts[name] = {"status": "skipped", "reason": "--skip"}
        elif not cuda and not cpu_ok:
            parts[name] = {"status": "skipped", "reason": "--allow-cpu: needs a CUDA device"}
        else:
            parts[name] = timed_part(fn)
        print(f"gpu-check: {name}: {parts[name]['status']} {parts[name].get('reason', '')}", flush=True)

    run("pytest_gpu", lambda: pytest_gpu(args.pytest_timeout), cpu_ok=False)
    model_box: dict[str, Any] = {}

    def step() -> dict[str, Any]:
        init_one_rank()
        model_box["model"] = build_model(shape, device, mixed)
        return learner_step(model_box["model"], device, shape["vocab_size"], mixed)

    run("learner_step_bf16", step)

    def sync() -> dict[str, Any]:
        if "model" not in model_box:
            init_one_rank()
            model_box["model"] = build_model(shape, device, mixed)
        return nccl_sync(model_box["model"], shape, device, args.repeats)

    run("nccl_sync", sync)
    with tempfile.TemporaryDirectory() as tmp:
        run("sglang_fleet", lambda: sglang_fleet(Path(tmp)), cpu_ok=False)
    failed = [p for p, r in parts.items() if r["status"] == "failed"]
    doc = {
        "status": "failed" if failed else "passed",
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (--allow-cpu)",
        "gpus": torch.cuda.device_count() if cuda else 0,
        "torch": torch.__version__,
        "model_shape": "Qwen2.5-0.5B" if cuda else "small (--allow-cpu)",
        "model_config": shape,
        "wall_s": time.monotonic() - started,
        "failed": failed,
        "parts": parts,
    }
    write(args.out, doc)
    sync_part = parts.get("nccl_sync", {})
    if "sync_gb_per_s" in sync_part:
        print(f"gpu-check: sync {sync_part['sync_gb_per_s']:.2f} GB/s, flat broadcast "
              f"{sync_part['flat_broadcast_gb_per_s']:.2f} GB/s, ratio {sync_part['ratio_vs_flat_broadcast']:.2f}")  # fmt: skip
    print(f"gpu-check: {doc['status']} ({', '.join(failed) or 'no part failed'}); {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
