"""``make gpu-check``: the GPU path in one short script on one GPU (within 8 minutes), one JSON with each part's
status.

    python -m benchmarks.gpu_check --out benchmarks/results/gpu_check.json

Parts, each ``{status: passed | failed | skipped, seconds, reason, ...numbers}`` (in this order in the JSON):

1. ``pytest_gpu``: the ``gpu``-marked tests that this machine can run. The test files with a ``gpu`` mark are
   found by an ast scan of tests/*.py (an attribute ``mark.gpu``: a decorator or a ``pytestmark``; a mark inside
   a string does not count, :func:`select_gpu_test_files`). A file *needs* a package of
   :data:`OPTIONAL_TEST_PACKAGES` when it imports it (``import P``, ``from P import``,
   ``pytest.importorskip("P")``), and needs ``sglang`` also when it starts an SGLang engine (a ``kind="sglang"``
   keyword or an ``engine.kind=sglang`` flag); a file that needs a package this Python cannot import
   (``importlib.util.find_spec``) is left out, and the JSON names each one with its reason. ``pytest -m gpu
   FILES`` then runs in a subprocess under ``--pytest-timeout`` (only those files are collected, so a test file
   that imports a package this machine lacks is never imported); its counts come from the JUnit XML.
2. ``learner_step_bf16``: learner steps (``learner.step.train_step``, the trainer's own inputs from
   ``learner.trainer.plan_step_inputs``) of a model shaped like Qwen2.5-0.5B (random weights, the config built
   by hand: hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocabulary 151936, tied
   embeddings), FSDP2 on one rank (``learner.distributed.shard_model``) with ``mixed_precision = bf16``: one
   warm-up step, then one timed step: its loss, gradient norm, seconds, tokens/s, peak memory
   (``torch.cuda.max_memory_allocated``) and MFU (:func:`model_flops`, :func:`mfu`).
3. ``engine_generation``: the built-in engine (``python -m streamrl engine``, ``--engine.device=cuda``) serving
   the tiny model (``rollout_fleet.model.init_tiny_model``), ``--engine-requests`` (64) concurrent requests on
   the SGLang-shaped ``/generate`` (``--engine-new-tokens`` each, ``ignore_eos``) after one warm-up request:
   tokens/s = generated tokens / wall seconds of the batch, and every answer checked to be a non-empty list of
   token ids in the vocabulary with ``completion_tokens`` equal to its length.
4. ``colocated_up``: ``streamrl up --shared.placement=colocated --shared.eta=0`` on the built-in arithmetic task
   with the warm-started tiny model (``streamrl.warm_start.init_warm_model``: cached under $STREAMRL_CACHE,
   else built on the CPU, in the background while part 1 runs), one learner rank and one engine sharing the GPU,
   ``--colocated-steps`` (30) steps. Then from the run directory: the weight transport every role read
   (config.toml's ``weight_sync.transport``: ``tensor``, i.e. CUDA IPC handles on a GPU, shared memory on the
   CPU) and the device plan (devices.json); from the learner's metrics stream (the run's Redis, started again on
   its data): seconds per weight update (``sync_seconds``, and the engine's sleep and wake); from summary.json
   the held-out greedy accuracy before and after (``heldout_gain``) and seconds per step; and the project's
   audit (``streamrl.audit``: nothing lost, nothing trained twice). Passes when the run exits 0 with every step
   done, every applied step's weights delivered to the engine by a ``tensor`` transport (on a GPU: a CUDA
   device plan), and the audit clean; the held-out gain is a number, not a condition (30 steps are noisy).
5. ``nccl_sync``: only with two GPUs or more (it runs right after part 2, whose model it sends): the model's
   weights sent with ``weight_sync.sender.sync_weights`` (the learner's sync: FSDP2 gather, buckets, the SGLang
   update protocol, ``send_dtype = bfloat16``) over NCCL to one receiving engine (``benchmarks.mini_engine`` on
   the second GPU, bf16), against one flat ``torch.distributed`` broadcast of the same bytes
   (``benchmarks.weight_sync.flat_broadcast``): GB/s of each, ``ratio_vs_flat_broadcast`` (ours / flat, lower is
   better), and the engine's weights checked bit-identical to the learner's bf16 cast. With one GPU it is
   skipped: NCCL refuses two ranks of one communicator on one device ("Duplicate GPU detected"), and part 4
   covers the one-GPU path (weights by CUDA IPC handle).
6. ``sglang_fleet``: when ``import sglang`` works: a real SGLang server launched by ``rollout_fleet.fleet.Fleet``
   with the tiny model, a greedy generation, a weight update by ``/update_weights_from_disk`` of perturbed
   weights (the protocol's recovery path; an NCCL group between this process and the server would put two ranks
   on one GPU, see part 5), then the new ``weight_version`` and changed log-probs checked. Skipped, with the
   import error as its reason, otherwise.

Without a CUDA device it writes the JSON with ``status = "no_cuda"`` and every part skipped for that reason,
prints "gpu-check: no CUDA device", and exits 2 (nothing was checked). ``--allow-cpu`` runs parts 2 to 5 on the
CPU instead (how the script itself is tested here; its JSON says so): a small model on gloo for parts 2 and 5,
the engine on the CPU with ``--engine-new-tokens`` 32, and ``up`` with ``--colocated-steps`` 3 and 20 held-out
prompts. Exit 0 when no part failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
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
PARTS = ("pytest_gpu", "learner_step_bf16", "engine_generation", "colocated_up", "nccl_sync", "sglang_fleet")
TIMEOUT_S = 120.0  # every collective and HTTP call of the check: a hang fails its part within two minutes
# Packages some gpu tests need that a GPU machine may lack (the lent one has neither): a test file that needs one
# this Python cannot import is left out of pytest_gpu (see select_gpu_test_files).
OPTIONAL_TEST_PACKAGES = ("sglang", "flash_attn")
# bf16 dense (no sparsity) tensor-core peak, FLOP/s, by a substring of torch.cuda.get_device_name(); the first
# match wins. The H100 SXM reports itself as "NVIDIA H100 80GB HBM3"; an H100 PCIe or NVL matches nothing (its
# peak is lower) and gets no MFU.
BF16_PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 SXM", 989e12),
    ("H100 80GB HBM3", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
)


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


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a process the check starts: this one's without torch.distributed's rendezvous
    variables (init_one_rank set them for this process's own group: a learner started by `up` would take
    itself for its rank and bind its MASTER_PORT, already taken), plus ``extra``."""
    from streamrl.supervisor import child_environment

    return child_environment(extra)


def importable(module: str) -> bool:
    """Whether this Python can import ``module`` (found, not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


# -- 1. pytest -m gpu on the files this machine can run ---------------------------------------------------------


def scan_test_file(text: str) -> tuple[bool, set[str]]:
    """(whether the file has a ``gpu`` mark, the :data:`OPTIONAL_TEST_PACKAGES` it needs), from its ast: a mark
    is an attribute ``mark.gpu`` (``@pytest.mark.gpu``, ``pytestmark = pytest.mark.gpu`` or in a list), never
    text inside a string; a package is needed when imported anywhere in the file (``import P``, ``from P import``,
    ``importorskip("P")``), and ``sglang`` also when the file starts an SGLang engine (a ``kind="sglang"``
    keyword, or a string holding ``engine.kind=sglang``)."""
    gpu, needs = False, set()
    optional = set(OPTIONAL_TEST_PACKAGES)
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute):
            if node.attr == "gpu" and isinstance(node.value, ast.Attribute) and node.value.attr == "mark":
                gpu = True
        elif isinstance(node, ast.Import):
            needs |= {alias.name.split(".")[0] for alias in node.names} & optional
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                needs |= {node.module.split(".")[0]} & optional
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0] if node.args else None
            if name == "importorskip" and isinstance(first, ast.Constant) and isinstance(first.value, str):
                needs |= {first.value.split(".")[0]} & optional
        elif isinstance(node, ast.keyword):
            if node.arg == "kind" and isinstance(node.value, ast.Constant) and node.value.value == "sglang":
                needs.add("sglang")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and "engine.kind=sglang" in node.value
        ):
            needs.add("sglang")
    return gpu, needs


def select_gpu_test_files(
    tests: Path = TESTS, can_import: Callable[[str], bool] = importable
) -> tuple[list[str], dict[str, str]]:
    """The test files (paths relative to the repository root, or to ``tests``' parent) with a ``gpu`` mark whose
    needed packages ``can_import``; and those left out, each with why (:func:`scan_test_file` has the rule)."""
    selected, left_out = [], {}
    for path in sorted(tests.glob("test_*.py")):
        gpu, needs = scan_test_file(path.read_text())
        if not gpu:
            continue
        shown = path.relative_to(tests.parent).as_posix()
        missing = sorted(p for p in needs if not can_import(p))
        if missing:
            how = " and ".join(missing)
            left_out[shown] = f"its gpu tests need {how}, which this Python cannot import"
        else:
            selected.append(shown)
    return selected, left_out


def pytest_gpu(timeout_s: float, tests: Path = TESTS) -> dict[str, Any]:
    files, left_out = select_gpu_test_files(tests)
    chosen = {"files": files, "left_out": left_out}
    if not files:
        return {"status": "failed", "reason": "no gpu test file this machine can run", **chosen}
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "gpu.xml"
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
               f"--junitxml={junit}", *files]  # fmt: skip
        try:
            proc = subprocess.run(
                cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
            return {"status": "failed", "reason": f"pytest -m gpu ran past {timeout_s:.0f} s", **chosen,
                    "output_tail": out[-3000:]}  # fmt: skip
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
        **chosen,
        "returncode": proc.returncode,
        **counts,
        "output_tail": proc.stdout[-3000:],
    }


# -- 2. bf16 learner steps, FSDP2 on one rank, and their MFU ----------------------------------------------------


def model_flops(
    parameters: int, forward_tokens: int, sample_lengths: Sequence[int], layers: int, attention_width: int
) -> float:
    """Model FLOPs of one training step (forward and backward):

        6 x parameters x forward_tokens  +  6 x layers x attention_width x sum(L_i ** 2)

    The first term is every weight's multiply-add per token in the forward (2 FLOPs) and twice that in the
    backward (input and weight gradients): ``parameters`` counts a tied embedding once, which is the LM head's
    matmul (the input lookup costs no FLOPs). ``forward_tokens`` are the tokens the forward runs on (a prompt that
    several samples of a group share runs once, ``MicroBatch.num_tokens``). The second term is causal attention
    per sample of length ``L_i`` (prompt + output), per layer: QK^T and attention x V are each L^2 x width
    multiply-adds, halved by the causal mask: 2 L^2 width FLOPs forward, times 3 with the backward;
    ``attention_width`` = heads x head dimension. Recomputation, the optimizer and the loss are not counted."""
    dense = 6.0 * parameters * forward_tokens
    attention = 6.0 * layers * attention_width * sum(length * length for length in sample_lengths)
    return dense + attention


def bf16_peak_flops(device_name: str) -> float | None:
    """The GPU's bf16 dense peak in FLOP/s from :data:`BF16_PEAK_FLOPS`, None when unknown."""
    for key, peak in BF16_PEAK_FLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


def mfu(flops: float, seconds: float, device_name: str) -> tuple[float | None, float | None, str]:
    """(model FLOPs utilisation = flops / seconds / peak, the peak, why there is none): flops per second over the
    device's bf16 dense peak; None with the reason for a device without a known peak."""
    peak = bf16_peak_flops(device_name)
    if peak is None:
        known = ", ".join(key for key, _ in BF16_PEAK_FLOPS)
        return None, None, f"no bf16 peak known for {device_name!r} (known: {known})"
    if seconds <= 0:
        return None, peak, f"step seconds {seconds}: no rate"
    return flops / seconds / peak, peak, ""


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


def learner_step(
    model: Any, device: Any, shape: dict[str, Any], mixed_precision: str, sequences: int
) -> dict[str, Any]:
    """One warm-up step (kernels, allocator, cuBLAS handles), then one timed step of the same inputs."""
    import math

    import torch

    from learner.config import LearnerConfig
    from learner.distributed import compute_dtype
    from learner.step import train_step
    from learner.trainer import plan_step_inputs

    config = LearnerConfig(micro_batch_tokens=8192, mixed_precision=mixed_precision)  # type: ignore[arg-type]
    seqs, temps = step_sequences(shape["vocab_size"], sequences)
    inputs = plan_step_inputs(seqs, temps, config, 1)
    mbs = [mb.to(device) for mb in inputs.micro_batches[0]]
    temperatures = [t.to(device) for t in inputs.temperatures[0]]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    on_cuda = device.type == "cuda"

    def timed_step(version: int) -> tuple[Any, float]:
        if on_cuda:
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        result = train_step(
            model, optimizer, mbs, temperatures, config, inputs.normaliser, learner_version=version
        )
        if on_cuda:
            torch.cuda.synchronize(device)
        return result, time.perf_counter() - started

    _, warmup_seconds = timed_step(0)
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    result, seconds = timed_step(1)
    tokens = sum(s.length for s in seqs)
    forward_tokens = sum(mb.num_tokens for mb in mbs if not mb.is_empty)
    parameters = sum(p.numel() for p in model.parameters())
    heads = shape["num_attention_heads"]
    width = heads * shape.get("head_dim", shape["hidden_size"] // heads)
    flops = model_flops(
        parameters, forward_tokens, [s.length for s in seqs], shape["num_hidden_layers"], width
    )
    device_name = torch.cuda.get_device_name(device) if on_cuda else "cpu"
    utilisation, peak, mfu_reason = mfu(flops, seconds, device_name)
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
        "parameters": parameters,
        "sequences": len(seqs),
        "tokens": tokens,
        "forward_tokens": forward_tokens,
        "micro_batches": len(mbs),
        "loss": loss,
        "grad_norm": grad_norm,
        "warmup_step_seconds": warmup_seconds,
        "step_seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "model_flops": flops,
        "tflops_per_s": flops / seconds / 1e12,
        "bf16_peak_tflops": peak / 1e12 if peak else None,
        "mfu": utilisation,
        "mfu_reason": mfu_reason,
        "mfu_formula": "(6 x parameters x forward_tokens + 6 x layers x heads x head_dim x sum(sample_len^2)) "
        "/ step_seconds / bf16 dense peak",
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if on_cuda else None,
    }


# -- 3. the built-in engine on the device: concurrent generation ------------------------------------------------


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log: Path | None = None) -> None:
    from benchmarks.weight_sync import http_json

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            http_json(url + "/health", timeout=2)
            return
        except OSError as exc:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-2000:] if log is not None and log.is_file() else ""
                state = (
                    f"exited {proc.returncode}"
                    if proc.poll() is not None
                    else f"not healthy in {timeout_s:.0f} s"
                )
                raise RuntimeError(f"the engine {state} ({exc}); its log ends:\n{tail}") from exc
            time.sleep(0.3)


async def _generate_all(url: str, bodies: list[dict[str, Any]], timeout_s: float) -> tuple[list[Any], float]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(body: dict[str, Any]) -> Any:
            async with session.post(url + "/generate", json=body) as resp:
                resp.raise_for_status()
                return await resp.json()

        await one({**bodies[0], "sampling_params": {**bodies[0]["sampling_params"], "max_new_tokens": 8}})
        started = time.perf_counter()
        answers = await asyncio.gather(*(one(b) for b in bodies))
        return list(answers), time.perf_counter() - started


def engine_generation(
    device: str, requests: int, new_tokens: int, work: Path, timeout_s: float
) -> dict[str, Any]:
    import random

    from broker.server import free_port
    from rollout_fleet.model import init_tiny_model

    model_dir = init_tiny_model()
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    port = free_port()
    log = work / "engine.log"
    cmd = [sys.executable, "-m", "streamrl", "engine", f"--shared.model_path={model_dir}", f"--engine.port={port}",
           f"--engine.device={device}", f"--engine.max_running_requests={requests}",
           f"--engine.max_context_len={64 + new_tokens + 16}", f"--engine.request_timeout_s={timeout_s}",
           f"--shared.run_dir={work / 'engine-run'}"]  # fmt: skip
    started = time.monotonic()
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout_s, log)
        startup = time.monotonic() - started
        rng = random.Random(0)
        bodies = [
            {
                "input_ids": [rng.randrange(5, vocab) for _ in range(rng.randint(8, 64))],
                "sampling_params": {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True},
            }
            for _ in range(requests)
        ]
        answers, wall = asyncio.run(_generate_all(url, bodies, timeout_s))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    bad = []
    generated = 0
    for i, answer in enumerate(answers):
        ids = answer.get("output_ids") if isinstance(answer, dict) else None
        meta = answer.get("meta_info", {}) if isinstance(answer, dict) else {}
        ok = (
            isinstance(ids, list)
            and len(ids) > 0
            and all(isinstance(t, int) and 0 <= t < vocab for t in ids)
            and meta.get("completion_tokens") == len(ids)
        )
        if not ok:
            bad.append(i)
        generated += len(ids) if isinstance(ids, list) else 0
    ok = not bad and len(answers) == requests
    return {
        "status": "passed" if ok else "failed",
        "reason": "" if ok else f"requests {bad[:10]} answered no token ids (or not their completion_tokens)",
        "device": device,
        "model": "tiny (rollout_fleet.model.init_tiny_model)",
        "requests": requests,
        "answered": len(answers) - len(bad),
        "max_new_tokens": new_tokens,
        "generated_tokens": generated,
        "wall_seconds": wall,
        "tokens_per_s": generated / wall if wall > 0 else None,
        "startup_seconds": startup,
    }


# -- 4. streamrl up, colocated, eta 0 ---------------------------------------------------------------------------


def run_metrics_and_audit(run_dir: Path) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """The learner's metrics points and the project's audit of a finished run (its Redis started on its data)."""
    import redis

    from broker.metrics import metrics_key, parse_number
    from streamrl.audit import audit_url, load_run_config, runs_redis

    config = load_run_config(run_dir)
    with runs_redis(config) as url:
        client = redis.Redis.from_url(url, socket_timeout=10, decode_responses=True)
        try:
            rows = client.xrange(metrics_key(config.shared, "learner"))
        finally:
            client.close()
        report = asyncio.run(audit_url(url, config)).as_dict()
    points = []
    for _, fields in rows:
        values = {k: parse_number(v) for k, v in fields.items()}
        points.append({k: float(v) for k, v in values.items() if isinstance(v, int | float)})
    return points, report


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _log_tails(run_dir: Path, names: Sequence[str] = ("learner", "engine-0", "rollout-0")) -> dict[str, str]:
    logs = run_dir / "logs"
    return {
        n: (logs / f"{n}.log").read_text(errors="replace")[-1500:]
        for n in names
        if (logs / f"{n}.log").is_file()
    }


def colocated_up(
    steps: int, on_cuda: bool, heldout: int, work: Path, timeout_s: float, warm_model: Future
) -> dict[str, Any]:
    model_started = time.monotonic()
    model = warm_model.result()
    model_wait = time.monotonic() - model_started
    run_dir = work / "colocated-run"
    args = [
        sys.executable, "-m", "streamrl", "up", f"--shared.run_dir={run_dir}", f"--shared.model_path={model}",
        "--shared.placement=colocated", "--shared.eta=0", f"--learner.max_steps={steps}",
        "--learner.world_size=1", "--engine.count=1", "--learner.wandb_mode=disabled", "--dashboard.port=0",
        "--dashboard.metrics_base_port=0", "--eval.every_versions=0", f"--eval.heldout_prompts={heldout}",
        "--archive.enabled=false",
    ]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.Popen(args, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # up stops every role it started
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate(timeout=30)
        return {"status": "failed", "reason": f"streamrl up ran past {timeout_s:.0f} s", "output_tail": out[-3000:],
                "logs": _log_tails(run_dir)}  # fmt: skip
    wall = time.monotonic() - started
    if proc.returncode != 0 or not (run_dir / "summary.json").is_file():
        return {"status": "failed", "reason": f"streamrl up exited {proc.returncode}", "output_tail": out[-3000:],
                "logs": _log_tails(run_dir)}  # fmt: skip
    summary = json.loads((run_dir / "summary.json").read_text())
    sync = tomllib.loads((run_dir / "config.toml").read_text())["weight_sync"]  # what every role read
    plan = json.loads((run_dir / "devices.json").read_text())
    points, report = run_metrics_and_audit(run_dir)
    applied = [p for p in points if p.get("step_applied") == 1.0]
    updates = [p for p in points if p.get("sync_engines_ok", 0) >= 1]
    engines = len(plan["engines"])
    undelivered = [
        int(p.get("step", -1))
        for p in applied
        if p.get("sync_engines_ok") != engines or p.get("sync_engines_failed", 0) != 0
    ]
    before, after = summary.get("eval_greedy_accuracy_before"), summary.get("eval_greedy_accuracy_after")
    done = summary.get("steps")
    problems = []
    if done != steps:
        problems.append(f"{done} of {steps} steps")
    if not applied or undelivered:
        problems.append(f"applied steps {undelivered or 'none'} not delivered to every engine")
    if not (report["ok"] and report["lost"] == 0 and report["trained_twice"] == 0):
        problems.append(f"audit: {report['lost']} lost, {report['trained_twice']} trained twice")
    if sync["transport"] != "tensor":
        problems.append(f"weight_sync.transport = {sync['transport']!r}, not tensor")
    if on_cuda and plan.get("device") != "cuda":
        problems.append(f"the device plan ran on {plan.get('device')!r}, not cuda")
    return {
        "status": "failed" if problems else "passed",
        "reason": "; ".join(problems),
        "steps_asked": steps,
        "steps": done,
        "steps_applied": len(applied),
        "updates": len(updates),
        "sync_engines_failed": sum(p.get("sync_engines_failed", 0) for p in points),
        "seconds_per_update": _median([p["sync_seconds"] for p in updates if "sync_seconds" in p]),
        "update_seconds_mean": statistics.fmean(p["sync_seconds"] for p in updates) if updates else None,
        "sleep_seconds_median": _median(
            [p["colocated_sleep_seconds"] for p in points if "colocated_sleep_seconds" in p]
        ),
        "wake_seconds_median": _median(
            [p["colocated_wake_seconds"] for p in points if "colocated_wake_seconds" in p]
        ),
        "update_bytes": updates[-1].get("sync_bytes") if updates else None,
        "seconds_per_step": summary["training_wall_seconds"] / done if done else None,
        "heldout_greedy_before": before,
        "heldout_greedy_after": after,
        "heldout_gain": after - before if before is not None and after is not None else None,
        "heldout_prompts": heldout,
        "eval_after_is_final_policy": summary.get("eval_after_is_final_policy"),
        "audit": {
            k: report[k]
            for k in (
                "ok",
                "generated",
                "trained",
                "dropped",
                "dead_lettered",
                "pending",
                "trained_twice",
                "lost",
            )
        },  # fmt: skip
        "transport": sync["transport"],
        "release_memory": sync.get("release_memory", []),
        "device_plan": plan,
        "model": str(model),
        "model_wait_seconds": model_wait,
        "up_wall_seconds": wall,
    }


# -- 5. NCCL weight sync against one flat broadcast (two GPUs or more) --------------------------------------------


def start_mini_engine(shape: dict[str, Any], device: str, dtype: str, env: dict[str, str]) -> tuple[Any, str]:
    """One ``benchmarks.mini_engine`` process (the receiving engine), its URL once it answers /health."""
    from benchmarks.weight_sync import http_json

    cmd = [sys.executable, "-m", "benchmarks.mini_engine", "--model-config", json.dumps(shape)]
    cmd += ["--timeout-s", str(TIMEOUT_S), "--device", device, "--dtype", dtype]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, env=child_env(**env))
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


def second_gpu() -> str:
    """The second visible GPU as CUDA_VISIBLE_DEVICES names it (the receiving engine's, for NCCL's distinct
    devices): the second entry of this process's CUDA_VISIBLE_DEVICES when set, else "1"."""
    visible = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return visible[1] if len(visible) >= 2 else "1"


def nccl_sync(model: Any, shape: dict[str, Any], device: Any, repeats: int) -> dict[str, Any]:
    """With two GPUs or more (the caller skips it on one): the engine on the second GPU; under --allow-cpu on
    gloo, the engine on the CPU."""
    import torch

    from benchmarks.weight_sync import flat_broadcast, http_json
    from weight_sync.config import WeightSyncConfig
    from weight_sync.receiver import weights_checksum
    from weight_sync.sender import WeightSender, sync_weights

    on_cuda = device.type == "cuda"
    gpus = torch.cuda.device_count() if on_cuda else 0
    if on_cuda and gpus < 2:
        raise RuntimeError("nccl_sync needs two GPUs (NCCL refuses two ranks of one communicator on one GPU)")
    # the engine on the second GPU (its device 0 there)
    engine_env = {"CUDA_VISIBLE_DEVICES": second_gpu()} if on_cuda else {}
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
            "engine_device": f"GPU {engine_env['CUDA_VISIBLE_DEVICES']}" if on_cuda else "cpu",
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


# -- 6. a real SGLang fleet with a weight update ----------------------------------------------------------------


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

    from common.config import SharedConfig
    from rollout_fleet.config import EngineConfig
    from rollout_fleet.fleet import Fleet
    from rollout_fleet.generate_client import EngineClient, SamplingConfig, build_generate_request
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


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="result JSON")
    parser.add_argument("--pytest-timeout", type=float, default=150.0, help="seconds for pytest -m gpu FILES")
    parser.add_argument(
        "--step-sequences", type=int, default=None, help="sequences of the learner step (default 64; CPU 16)"
    )
    parser.add_argument(
        "--engine-requests", type=int, default=64, help="concurrent /generate requests to the engine"
    )
    parser.add_argument(
        "--engine-new-tokens",
        type=int,
        default=None,
        help="tokens each request generates (default 256; CPU 32)",
    )
    parser.add_argument(
        "--colocated-steps", type=int, default=None, help="steps of the colocated up run (default 30; CPU 3)"
    )
    parser.add_argument(
        "--colocated-timeout", type=float, default=240.0, help="seconds for the colocated up run"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="nccl_sync: timed syncs and flat broadcasts (after a warm-up)"
    )
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: " + ", ".join(PARTS))
    parser.add_argument(
        "--allow-cpu",
        action="store_true",
        help="testing: parts 2 to 5 on the CPU (gloo, small model, fewer steps)",
    )
    args = parser.parse_args(argv)
    args.skip = {s for s in args.skip.split(",") if s}
    if unknown := args.skip - set(PARTS):
        parser.error(f"--skip: unknown parts {sorted(unknown)}")
    for name in ("step_sequences", "engine_requests", "engine_new_tokens", "colocated_steps", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} = {value}: must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        reason = "no CUDA device"
        write(args.out, {"status": "no_cuda", "reason": reason,
                         "parts": {p: {"status": "skipped", "reason": reason} for p in PARTS}})  # fmt: skip
        print(f"gpu-check: no CUDA device (torch {torch.__version__}); nothing checked, {args.out} records it",
              file=sys.stderr)  # fmt: skip
        return 2
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    gpus = torch.cuda.device_count() if cuda else 0
    shape = QWEN25_05B if cuda else SMALL
    sequences = args.step_sequences or (64 if cuda else 16)
    new_tokens = args.engine_new_tokens or (256 if cuda else 32)
    colocated_steps = args.colocated_steps or (30 if cuda else 3)
    heldout = 200 if cuda else 20
    mixed = "bf16"
    parts: dict[str, dict[str, Any]] = {}
    started = time.monotonic()

    def run(name: str, fn: Callable[[], dict[str, Any]], cpu_ok: bool = True, skip_reason: str = "") -> None:
        if name in args.skip:
            parts[name] = {"status": "skipped", "reason": "--skip"}
        elif not cuda and not cpu_ok:
            parts[name] = {"status": "skipped", "reason": "--allow-cpu: needs a CUDA device"}
        elif skip_reason:
            parts[name] = {"status": "skipped", "reason": skip_reason}
        else:
            parts[name] = timed_part(fn)
        print(f"gpu-check: {name}: {parts[name]['status']} {parts[name].get('reason', '')}", flush=True)

    pool = ThreadPoolExecutor(1)
    warm_model: Future = Future()
    if "colocated_up" not in args.skip:
        from streamrl.warm_start import init_warm_model

        # the colocated run's model, cached or built on the CPU (one thread) while the GPU parts run
        warm_model = pool.submit(init_warm_model, progress=None)
    nccl_skip = ""
    if cuda and gpus < 2:
        nccl_skip = (
            f'{gpus} GPU visible: NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"); '
            "colocated_up covers one GPU (weights by CUDA IPC handle)"
        )
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        run("pytest_gpu", lambda: pytest_gpu(args.pytest_timeout), cpu_ok=False)
        model_box: dict[str, Any] = {}

        def model() -> Any:
            if "model" not in model_box:
                init_one_rank()
                model_box["model"] = build_model(shape, device, mixed)
            return model_box["model"]

        run("learner_step_bf16", lambda: learner_step(model(), device, shape, mixed, sequences))
        run("nccl_sync", lambda: nccl_sync(model(), shape, device, args.repeats), skip_reason=nccl_skip)
        # the learner's model, its memory and its process group, before the engines take the device
        model_box.clear()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if cuda:
            import gc

            gc.collect()
            torch.cuda.empty_cache()
        engine_device = "cuda" if cuda else "cpu"
        run("engine_generation",
            lambda: engine_generation(engine_device, args.engine_requests, new_tokens, work, TIMEOUT_S))  # fmt: skip
        run("colocated_up",
            lambda: colocated_up(colocated_steps, cuda, heldout, work, args.colocated_timeout, warm_model))  # fmt: skip
        run("sglang_fleet", lambda: sglang_fleet(work), cpu_ok=False)
    pool.shutdown(wait=True)
    parts = {p: parts[p] for p in PARTS}
    failed = [p for p, r in parts.items() if r["status"] == "failed"]
    doc = {
        "status": "failed" if failed else "passed",
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (--allow-cpu)",
        "gpus": gpus,
        "torch": torch.__version__,
        "model_shape": "Qwen2.5-0.5B" if cuda else "small (--allow-cpu)",
        "model_config": shape,
        "wall_s": time.monotonic() - started,
        "failed": failed,
        "parts": parts,
    }
    write(args.out, doc)
    step = parts["learner_step_bf16"]
    if "tokens_per_s" in step:
        mfu_text = (
            f"MFU {step['mfu']:.3f}" if step.get("mfu") is not None else f"no MFU ({step['mfu_reason']})"
        )
        print(f"gpu-check: learner step {step['tokens_per_s']:.0f} tokens/s, {mfu_text}")
    engine = parts["engine_generation"]
    if engine.get("tokens_per_s"):
        print(f"gpu-check: engine {engine['tokens_per_s']:.0f} tokens/s over {engine['requests']} requests")
    up = parts["colocated_up"]
    if up.get("seconds_per_update") is not None:
        print(f"gpu-check: colocated {up['steps']} steps, {up['seconds_per_update']:.3f} s per update "
              f"({up['transport']}), held-out gain {up['heldout_gain']}")  # fmt: skip
    sync_part = parts["nccl_sync"]
    if "sync_gb_per_s" in sync_part:
        print(f"gpu-check: sync {sync_part['sync_gb_per_s']:.2f} GB/s, flat broadcast "
              f"{sync_part['flat_broadcast_gb_per_s']:.2f} GB/s, ratio {sync_part['ratio_vs_flat_broadcast']:.2f}")  # fmt: skip
    print(f"gpu-check: {doc['status']} ({', '.join(failed) or 'no part failed'}); {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
