"""The learner at a real model's shape: memory at start, checkpoints, and per-step overhead.

    python -m benchmarks.model_scale --quick --out runs/model_scale.quick.json   # qwen2.5-small (~12 M)
    python -m benchmarks.model_scale --out benchmarks/results/model_scale.json   # qwen2.5-0.5b (494 M)
    python -m benchmarks.model_scale --smoke --out /tmp/model_scale.json          # that it runs (~0.1 M)

The model is ``streamrl model init --shape`` (random weights, bf16 on disk, nothing downloaded). Two learner ranks
(gloo, one thread each, the 2 cores of this machine), each part in fresh processes:

* ``load``: each rank's peak resident memory (VmHWM) after building its FSDP2 fp32 policy, the
  whole-model path (``from_pretrained`` on every rank, then ``fully_shard``: the learner before sharded loading)
  against sharded loading (``learner.loading``: meta device, shard, each rank reads its rows). Also each rank's
  memory after imports, before loading. Target: whole peak >= 1.8x sharded peak. Beside them, the other way to
  fill the shards: rank 0 reads the whole state dict and ``set_model_state_dict(broadcast_from_rank0=True)``
  sends each rank its part (peak memory and seconds of both, to choose between them).
* ``checkpoint``: the seconds a step waits for a checkpoint of the policy and its AdamW state: ``save`` (written,
  fsynced and committed before training goes on) against ``save_async`` (training waits for the copy to host
  memory only; the write and commit follow), and how long the background write took. Alternated, ``repeats``
  times each.
* ``engine``: generated tokens/s of the built-in engine (continuous batching, one process, one thread) against
  transformers' ``generate`` on static batches (one thread), fp32 both, the workload of benchmarks.engine_throughput
  (arithmetic prompts, long-tailed output lengths, exact with ignore_eos) with lengths clipped to
  ``max_new_tokens``. Target: engine >= 1.5x.
* ``sync``: seconds of one weight sync of the model to a built-in engine over gloo (benchmarks.lora_sync's run,
  one learner rank, 64 MiB buckets): the whole model (``merged``) against rank-16 LoRA adapters on the 7
  projections (``adapter``), alternated, the engine's log-probs checked against the learner's after each way.
  Target: the adapter sync faster (the tiny model's 1.26x was mostly fixed costs).
* ``sync_bf16``: the same with the engine serving bf16 and the learner sending bf16 (``weight_sync.send_dtype``):
  the 0.99 GB a bf16 deployment moves (no target; the log-prob gap then includes bf16 rounding).
* ``train``: tokens/s of the learner's ``train_step`` (decoupled PPO, chunked loss, FSDP2 over the 2 ranks) against
  a plain loop in one process with 2 threads: the same model in fp32, the same token ids, Hugging Face's own
  forward with ``labels`` (cross-entropy), backward, AdamW step. Sequences have equal lengths, so neither pays for
  padding. Target: learner >= 0.9x the plain loop (streamrl's per-step overhead at this size).

``--smoke --out FILE``: every part above, each in fresh processes as in the other modes, at :data:`SMOKE_SHAPE`
(2 layers of width 64, built in a temporary directory, removed at the end), one repeat of each; its numbers mean
nothing. Still about 1 to 2 minutes on 2 cores (process starts: 4 of the learner part, an engine per other part),
so it runs in tests/test_benchmark_smoke.py's slow variant only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import add_mode_flags, format_table, mode_of, write_result
from rollout_fleet.shapes import ModelShape

TARGETS = {
    "ratio_load_peak_whole_vs_sharded": (">=", 1.8),
    "ratio_train_learner_vs_plain": (">=", 0.9),
    "ratio_engine_vs_hf_generate": (">=", 1.5),
    "ratio_sync_full_vs_adapter": (">", 1.0),
}
MODES = {
    "smoke": {"shape": "smoke", "sequences": 4, "length": 32, "repeats": 1,
              "engine": {"requests": 4, "batch": 2, "repeats": 1, "max_new_tokens": 8}, "sync_repeats": 1},
    "quick": {"shape": "qwen2.5-small", "sequences": 8, "length": 256, "repeats": 3,
              "engine": {"requests": 32, "batch": 16, "repeats": 2, "max_new_tokens": 96}, "sync_repeats": 3},
    "full": {"shape": "qwen2.5-0.5b", "sequences": 4, "length": 256, "repeats": 3,
             "engine": {"requests": 32, "batch": 16, "repeats": 2, "max_new_tokens": 64}, "sync_repeats": 3},
}  # fmt: skip
PARTS = ("learner", "engine", "sync", "sync_bf16")
# --smoke's model: the Qwen2 layout at the smallest size that still has grouped KV heads, MLPs and a BPE tokenizer
SMOKE_SHAPE = ModelShape(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=1024,
    max_position_embeddings=1024,  # the engine part's context (benchmarks.engine_throughput.CONTEXT)
    tokenizer_vocab=512,
)
WORLD = 2


def _rss_mb() -> float:
    """Peak resident memory of this process so far, MB: VmHWM, the high-water mark of its own address space
    (``ru_maxrss`` would also count the parent's, which a spawned process inherits across fork and exec)."""
    for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _current_rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _sequences(count: int, length: int, vocab: int, seed: int = 0) -> list[Any]:
    from learner.packing import TrainSequence

    gen = torch.Generator().manual_seed(seed)
    prompt = length // 4
    out = length - prompt
    return [
        TrainSequence(
            prompt_ids=torch.randint(1, vocab, (prompt,), generator=gen),
            output_ids=torch.randint(1, vocab, (out,), generator=gen),
            logprobs=-8.0 + 0.3 * torch.randn(out, generator=gen),
            versions=torch.zeros(out, dtype=torch.long),
            loss_mask=torch.ones(out),
            advantages=float(torch.randn(1, generator=gen)),
            index=i,
        )
        for i in range(count)
    ]


def _rank_job(rank: int, way: str, port: int, model_dir: str, spec: dict[str, Any], out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from learner.attention import register_packed_attention
    from learner.distributed import init_distributed, shard_model
    from learner.loading import load_sharded

    info = init_distributed(timeout_s=600, threads=1)
    attention = register_packed_attention()
    from transformers import (
        AutoModelForCausalLM,
    )  # imported before the baseline reading, as the learner has it

    result: dict[str, Any] = {"rss_before_mb": _current_rss_mb()}
    started = time.perf_counter()
    if way == "whole":
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation=attention
        )
        model = shard_model(model, info.device)
    elif way == "broadcast":
        model = _broadcast_load(Path(model_dir), info, attention)
    else:
        model, report = load_sharded(Path(model_dir), info.device, attention=attention)
        result["bytes_read"] = report.bytes_read
        result["stored_bytes"] = report.stored_bytes
    dist.barrier()
    result["load_s"] = time.perf_counter() - started
    result["rss_peak_mb"] = _rss_mb()
    result["rss_after_mb"] = _current_rss_mb()
    if way == "sharded":
        result.update(_train_and_checkpoint(model, info, spec, Path(out) / "ckpt"))
    torch.save(result, Path(out) / f"{way}-rank{rank}.pt")
    dist.destroy_process_group()


def _broadcast_load(model_dir: Path, info: Any, attention: str) -> Any:
    """The other way the issue names: the sharded skeleton as ``load_sharded`` builds it, then rank 0 reads the
    whole state dict and torch's distributed state-dict API broadcasts it (``broadcast_from_rank0``), each rank
    keeping its shards; the buffers computed at construction are put back as ``load_sharded`` does."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    from learner.distributed import shard_model
    from learner.loading import parameters_on_meta

    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(model_dir), dtype=torch.float32, attn_implementation=attention
        )
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    model = shard_model(model, info.device)
    model.to_empty(device=info.device)
    state: dict[str, torch.Tensor] = {}
    if info.rank == 0:
        for path in sorted(model_dir.glob("*.safetensors")):
            state.update({k: v.float() for k, v in load_file(str(path)).items()})
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, state, options=options)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
    return model


def _train_and_checkpoint(model: Any, info: Any, spec: dict[str, Any], root: Path) -> dict[str, Any]:
    from learner.checkpoint import CheckpointManager, CheckpointMeta
    from learner.config import LearnerConfig
    from learner.packing import plan_rows, rank_micro_batches, step_loss_units
    from learner.step import train_step

    config = LearnerConfig(micro_batch_tokens=spec["length"] * 2)
    seqs = _sequences(spec["sequences"], spec["length"], spec["vocab"])
    rows, plan = plan_rows(seqs, info.world_size, config.micro_batch_tokens, False)
    mbs = rank_micro_batches(seqs, plan, info.rank, rows=rows)
    normaliser = float(step_loss_units(seqs, config.loss.aggregation))
    temps = [torch.ones(mb.input_ids.shape[0]) for mb in mbs]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    seconds = []
    for repeat in range(spec["repeats"] + 1):  # the first step allocates AdamW's state: not timed
        dist.barrier()
        started = time.perf_counter()
        train_step(model, optimizer, mbs, temps, config, normaliser, learner_version=0)
        dist.barrier()
        if repeat:
            seconds.append(time.perf_counter() - started)
    tokens = sum(s.length for s in seqs)
    result: dict[str, Any] = {"train_seconds": seconds, "train_tokens": tokens}

    manager = CheckpointManager(root, keep_last=1)
    group = dist.new_group(backend="gloo")
    waits: dict[str, list[float]] = {"sync": [], "async": []}
    written: list[float] = []
    for repeat in range(spec["repeats"]):
        for way in ("sync", "async") if repeat % 2 == 0 else ("async", "sync"):
            meta = CheckpointMeta(step=2 * repeat + (way == "async"), policy_version=0)
            dist.barrier()
            started = time.perf_counter()
            if way == "sync":
                manager.save(model, optimizer, meta)
                waits["sync"].append(time.perf_counter() - started)
            else:
                pending = manager.save_async(model, optimizer, meta, group)
                waits["async"].append(time.perf_counter() - started)
                manager.finish(pending)
                written.append(time.perf_counter() - started)
    result.update(checkpoint_wait_s=waits, checkpoint_async_total_s=written)
    return result


def _spawn(way: str, model_dir: Path, spec: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    from broker.server import free_port

    mp.spawn(_rank_job, args=(way, free_port(), str(model_dir), spec, str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"{way}-rank{r}.pt", weights_only=False) for r in range(WORLD)]


def plain_loop(model_dir: Path, spec: dict[str, Any], queue: Any) -> None:
    """One process, 2 threads: the same token ids through Hugging Face's forward with labels, backward, AdamW."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(WORLD)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    seqs = _sequences(spec["sequences"], spec["length"], spec["vocab"])
    ids = torch.stack([torch.cat([s.prompt_ids, s.output_ids]) for s in seqs])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    seconds = []
    for repeat in range(spec["repeats"] + 1):
        started = time.perf_counter()
        for row in range(0, ids.shape[0], 2):  # two sequences per micro-batch, as the learner's token budget
            batch = ids[row : row + 2]
            model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if repeat:
            seconds.append(time.perf_counter() - started)
    queue.put({"train_seconds": seconds, "train_tokens": int(ids.numel())})


def engine_part(model_dir: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """The built-in engine against HF generate at this shape (benchmarks.engine_throughput's passes)."""
    import asyncio

    from benchmarks import engine_throughput as bench

    torch.set_num_threads(1)
    prompts, lengths = bench.workload(spec["requests"])
    lengths = [min(n, spec["max_new_tokens"]) for n in lengths]
    engine_runs, hf_runs = asyncio.run(
        bench.run_passes(model_dir, prompts, lengths, spec, ("--engine.dtype=float32",))
    )
    return bench.summarize(engine_runs, hf_runs)


def shaped_model(mode: str, root: Path | None) -> tuple[ModelShape, Path]:
    """The mode's shape and its model directory: the cached ``streamrl model init --shape`` one, or in smoke mode
    :data:`SMOKE_SHAPE` built under ``root`` (a smoke run writes nothing outside its temporary directory)."""
    from rollout_fleet.model import save_model_dir
    from rollout_fleet.shapes import SHAPES, build_bpe_tokenizer, build_shaped_model, init_shaped_model

    if mode != "smoke":
        name = MODES[mode]["shape"]
        return SHAPES[name], init_shaped_model(name)
    assert root is not None, "smoke mode builds its model under a temporary directory"
    tokenizer = build_bpe_tokenizer(SMOKE_SHAPE.tokenizer_vocab, SMOKE_SHAPE.seed)
    model = build_shaped_model(SMOKE_SHAPE, tokenizer)
    return SMOKE_SHAPE, save_model_dir(model, tokenizer, root / "model")


def run(mode: str, parts: tuple[str, ...] = PARTS, root: Path | None = None) -> dict[str, Any]:
    """The ``parts`` at ``mode``'s shape; ``root``: where smoke mode builds its model."""
    spec = dict(MODES[mode])
    shape, model_dir = shaped_model(mode, root)
    spec["vocab"] = shape.tokenizer_vocab
    results: dict[str, Any] = {
        "model": {"shape": spec["shape"], "parameters": shape.parameters(), "dir": str(model_dir)}
    }
    headline: dict[str, Any] = {}
    if "learner" in parts:
        got = learner_part(model_dir, spec)
        results.update(got["results"])
        headline.update(got["headline"])
    if "engine" in parts:
        print("engine against HF generate ...", file=sys.stderr)
        engine = engine_part(model_dir, spec["engine"])
        results["engine"] = engine
        headline.update(
            engine_tokens_per_s=engine["engine"]["tokens_per_s"],
            hf_generate_tokens_per_s=engine["hf_generate"]["tokens_per_s"],
            ratio_engine_vs_hf_generate=engine["ratio_vs_hf_generate"],
        )
    for part, dtype, prefix in (("sync", "float32", "sync"), ("sync_bf16", "bfloat16", "sync_bf16")):
        if part not in parts:
            continue
        from benchmarks import lora_sync

        print(f"weight sync ({dtype}): whole model against LoRA adapters ...", file=sys.stderr)
        params, sync, sync_headline = lora_sync.run(
            "smoke" if mode == "smoke" else "quick",
            64.0,
            model_dir=model_dir,
            repeats=spec["sync_repeats"],
            dtype=dtype,
        )
        results[part] = {"params": params, **sync}
        headline.update(
            {
                f"{prefix}_full_seconds": sync_headline["full_seconds"],
                f"{prefix}_full_bytes": sync_headline["full_bytes"],
                f"{prefix}_adapter_seconds": sync_headline["adapter_seconds"],
                f"{prefix}_adapter_bytes": sync_headline["adapter_bytes"],
                f"ratio_{prefix}_full_vs_adapter": sync_headline["seconds_ratio_vs_full"],
                f"{prefix}_max_logprob_gap": max(sync["max_logprob_gap"].values()),
            }
        )
    return {
        "params": {**spec, "parts": list(parts)},
        "results": results,
        "headline": headline,
        "model_dir": model_dir,
    }


def learner_part(model_dir: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """Load (whole against sharded), train steps (learner against the plain loop), checkpoints."""
    with tempfile.TemporaryDirectory(prefix="model_scale-") as tmp:
        out = Path(tmp)
        print(f"load, whole model on each of {WORLD} ranks ...", file=sys.stderr)
        whole = _spawn("whole", model_dir, spec, out)
        print("load, rank 0 reads and broadcasts ...", file=sys.stderr)
        broadcast = _spawn("broadcast", model_dir, spec, out)
        print("load sharded, train steps, checkpoints ...", file=sys.stderr)
        sharded = _spawn("sharded", model_dir, spec, out)
    print("plain single-process loop ...", file=sys.stderr)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=plain_loop, args=(model_dir, spec, queue))
    proc.start()
    plain = queue.get(timeout=3600)
    proc.join()

    whole_peak = max(r["rss_peak_mb"] for r in whole)
    sharded_peak = max(r["rss_peak_mb"] for r in sharded)
    tokens = sharded[0]["train_tokens"]
    learner_tps = tokens / statistics.median(sharded[0]["train_seconds"])
    plain_tps = plain["train_tokens"] / statistics.median(plain["train_seconds"])
    waits = sharded[0]["checkpoint_wait_s"]
    load_keys = ("rss_before_mb", "rss_peak_mb", "rss_after_mb", "load_s")
    results = {
        "load": {
            "whole": [{k: r[k] for k in load_keys} for r in whole],
            "broadcast": [{k: r[k] for k in load_keys} for r in broadcast],
            "sharded": [{k: r[k] for k in (*load_keys, "bytes_read")} for r in sharded],
            "stored_bytes": sharded[0]["stored_bytes"],
        },
        "train": {
            "tokens_per_step": tokens,
            "learner_seconds": sharded[0]["train_seconds"],
            "plain_seconds": plain["train_seconds"],
        },
        "checkpoint": {
            "sync_wait_s": waits["sync"],
            "async_wait_s": waits["async"],
            "async_total_s": sharded[0]["checkpoint_async_total_s"],
        },
    }
    headline = {
        "load_peak_whole_mb": whole_peak,
        "load_peak_sharded_mb": sharded_peak,
        "ratio_load_peak_whole_vs_sharded": whole_peak / sharded_peak,
        "load_peak_broadcast_mb": max(r["rss_peak_mb"] for r in broadcast),
        "load_seconds_sharded": max(r["load_s"] for r in sharded),
        "load_seconds_broadcast": max(r["load_s"] for r in broadcast),
        # what loading added to a rank's memory (its peak less what it held after the imports)
        "load_added_whole_mb": max(r["rss_peak_mb"] - r["rss_before_mb"] for r in whole),
        "load_added_sharded_mb": max(r["rss_peak_mb"] - r["rss_before_mb"] for r in sharded),
        "learner_tokens_per_s": learner_tps,
        "plain_tokens_per_s": plain_tps,
        "ratio_train_learner_vs_plain": learner_tps / plain_tps,
        "checkpoint_sync_wait_s": statistics.median(waits["sync"]),
        "checkpoint_async_wait_s": statistics.median(waits["async"]),
        "ratio_checkpoint_wait_sync_vs_async": statistics.median(waits["sync"])
        / statistics.median(waits["async"]),
    }
    return {"results": results, "headline": headline}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.model_scale", description=__doc__.split("\n")[0]
    )
    add_mode_flags(parser, "the small shape (qwen2.5-small), minutes")
    parser.add_argument("--out", type=Path, required=True, help="results JSON")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated parts to run (default {','.join(PARTS)})"
    )
    args = parser.parse_args(argv)
    mode = mode_of(parser, args)
    parts = tuple(p for p in args.parts.split(",") if p)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts = {args.parts!r}: {unknown} are not parts; the parts are {list(PARTS)}")
    # smoke: the model is built in a temporary directory, hashed into the result, then removed
    scratch = tempfile.TemporaryDirectory(prefix="model_scale-smoke-") if mode == "smoke" else nullcontext()
    with scratch as root:
        got = run(mode, parts, None if root is None else Path(root))
        targets = {k: v for k, v in TARGETS.items() if k in got["headline"]}
        doc = write_result(
            args.out,
            "model_scale",
            mode,
            got["params"],
            got["results"],
            targets,
            got["headline"],
            got["model_dir"],
        )
    rows = [[k, f"{v:.3g}" if isinstance(v, float) else v] for k, v in got["headline"].items()]
    print(format_table(["measure", "value"], rows))
    print(f"targets passed: {doc['passed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
