"""Memory and speed of long sequences: the learner's loss, chunked against full logits.

    python -m benchmarks.long_context --quick --out FILE   # loss at 2,048, 4,096 and 8,192 tokens; smaller mixes
    python -m benchmarks.long_context --out FILE           # and 32,768 (chunked only: full cannot fit)
    python -m benchmarks.long_context --sections varlen --out FILE   # one part only (loss varlen prefill
                                                                     # concurrency)

The loss of one sequence of N tokens on a model shaped like a real one where it matters here: a vocabulary of
151,936 (Qwen2.5's) and hidden size 512, random weights. Each measurement is a fresh process (so its high-water
RSS is of that measurement alone) that builds the final hidden states ``[N, H]`` and the lm-head ``[V, H]``,
then runs one forward + backward of the per-token log-probs (and entropy) at temperature 1:

- ``chunked``: :func:`learner.logprobs.token_logprobs` (the learner's path), ``loss_chunk_tokens`` at a time;
- ``full``: the reference, ``log_softmax(hidden @ W.T)`` gathered (``[N, V]`` logits, as the learner did).

Reported per length: peak RSS, the RSS the setup already held, their difference (what the loss added), and
tokens per second of the forward + backward (best of ``--repeats``). ``full`` is skipped where its logits
(about four ``[N, V]`` float32 copies live, as measured at 2,048 and 4,096 tokens) would not fit in the memory
available when the benchmark starts, and the result says so.

Three more comparisons, each against its baseline in the same run:

- ``ratio_varlen_vs_padded``: trained tokens/s of one learner step (``learner.step.train_step``, decoupled PPO)
  on a long-tailed length mix, varlen packed rows (the learner's way) against every sequence right-padded to the
  longest; the model is Qwen2 with the same vocabulary and hidden size 512 (MLP 2,048), random weights; output
  lengths are the long-output task's reference lengths (``long_multiplication``), so a few sequences are many
  times the median. Both ways must agree on the loss before they are timed. Measured at 8 layers (full mode: 2
  and 8): the lm-head runs on trained tokens only in both ways, so padding costs only in the decoder layers,
  and with 2 layers the lm-head is about 90% of the per-token compute (in Qwen2.5-0.5B the 24 layers are about
  70%, in 7B about 92%): a 2-layer model hides most of what padding costs a real one. At 8 layers the layers
  are about 28%, still less than in any real model.
- ``ratio_prefill_tokens_unshared_vs_shared``: prompt tokens the built-in engine computes for one group of 8
  samples of one 2,048-token prompt, submitted together as a rollout worker does, with the engine's sharing (a
  group's samples share the prompt's blocks; the prefix cache) against ``engine.disable_radix_cache``.
- ``ratio_concurrent_sequences_paged_vs_contiguous``: sequences decoded together by the built-in engine within
  the same KV memory (``engine.max_total_tokens``), on requests whose output lengths follow the same long-tailed
  mix, with paged blocks of 16 tokens against contiguous per-request rows (``kv_block_size`` = the context
  length: each request holds one row of its full context from admission, as engines without paging reserve it).
  Counted as the mean decode batch over the steps during which requests were waiting for memory, where the
  layout decides how many run; the mean over all steps is reported beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import add_mode_flags, mode_of, write_result

VOCAB = 151_936
HIDDEN = 512
CHUNK = 1024
SIZES = {"smoke": [128], "quick": [2048, 4096, 8192], "full": [2048, 4096, 8192, 32768]}
TARGETS = {
    "ratio_peak_memory_full_vs_chunked": (">=", 4.0),
    "ratio_tokens_per_s_chunked_vs_full": (">=", 0.9),
    "ratio_varlen_vs_padded": (">=", 1.5),
    "ratio_prefill_tokens_unshared_vs_shared": (">=", 6.0),
    "ratio_concurrent_sequences_paged_vs_contiguous": (">=", 1.5),
}
# varlen vs padded: sequences of the long task's lengths (digits up to max_digits), micro-batch token budget
VARLEN = {
    "smoke": {"sequences": 2, "max_digits": 2, "budget": 1024, "repeats": 1, "layers": [1]},
    "quick": {"sequences": 16, "max_digits": 12, "budget": 4096, "repeats": 1, "layers": [8]},
    "full": {"sequences": 24, "max_digits": 14, "budget": 8192, "repeats": 1, "layers": [2, 8]},
}
GROUP_SIZE = 8
SHARED_PROMPT = {"smoke": 64, "quick": 2048, "full": 2048}  # tokens of the group's one prompt
SECTIONS = ("loss", "varlen", "prefill", "concurrency")
# paged vs contiguous: requests, KV memory (tokens), context (the contiguous row), digits of the length mix
CONCURRENCY = {
    "smoke": {"requests": 6, "kv_tokens": 256, "context": 128, "max_digits": 2},
    "quick": {"requests": 128, "kv_tokens": 4096, "context": 1024, "max_digits": 8},
    "full": {"requests": 192, "kv_tokens": 8192, "context": 2048, "max_digits": 10},
}


def rss_mib() -> float:
    """This process's high-water RSS in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure_loss(tokens: int, mode: str, repeats: int) -> dict[str, Any]:
    """One fresh process's measurement (run through ``--measure``)."""
    import torch

    from learner.logprobs import token_logprobs

    torch.manual_seed(0)
    hidden = (torch.randn(tokens, HIDDEN) * 0.5).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN) * HIDDEN**-0.5).requires_grad_()
    targets = torch.randint(0, VOCAB, (tokens,))
    temperature = torch.ones(tokens)
    setup = current_rss_mib()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        if mode == "chunked":
            logp, _entropy = token_logprobs(hidden, weight, None, targets, temperature, CHUNK)
        else:
            logp, _entropy = full_logprobs(hidden, weight, targets, temperature)
        logp.sum().backward()
        best = min(best, time.perf_counter() - start)
        hidden.grad = weight.grad = None
        del logp
    peak = rss_mib()
    return {
        "tokens": tokens,
        "mode": mode,
        "peak_rss_mib": round(peak, 1),
        "setup_rss_mib": round(setup, 1),
        "loss_added_mib": round(peak - setup, 1),
        "seconds": round(best, 3),
        "tokens_per_s": round(tokens / best, 1),
    }


def full_logprobs(hidden: Any, weight: Any, targets: Any, temperature: Any) -> tuple[Any, Any]:
    """The learner's path before chunking (``gather_logprobs`` and ``token_entropy`` over ``[N, V]`` logits)."""
    import torch

    scaled = (hidden @ weight.t()).float() / temperature[:, None]
    logp = scaled.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(scaled, dim=-1)
    with torch.no_grad():
        all_logp = torch.log_softmax(scaled, dim=-1)
        entropy = -(all_logp.exp() * all_logp).sum(-1)
    return logp, entropy


def run_fresh(tokens: int, mode: str, repeats: int) -> dict[str, Any]:
    args = [sys.executable, "-m", "benchmarks.long_context", "--measure", mode, "--tokens", str(tokens),
            "--repeats", str(repeats)]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {"tokens": tokens, "mode": mode, "failed": proc.stderr[-2000:] or f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo (what a new process can take without swapping anything out)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def full_fits(tokens: int) -> bool:
    """Whether full logits fit: about four [N, V] float32 copies live at once (logits, log-softmax, softmax
    for the entropy, and the gradient: 4.0 copies measured at 4,096 tokens), with 1 GiB to spare."""
    return 4 * tokens * VOCAB * 4 + 2**30 < available_bytes()


def ratios(row: dict[str, Any], suffix: str) -> dict[str, float]:
    full, chunked = row["full"], row["chunked"]
    return {
        f"ratio_peak_memory_full_vs_chunked{suffix}": full["peak_rss_mib"] / chunked["peak_rss_mib"],
        f"ratio_loss_added_memory_full_vs_chunked{suffix}": full["loss_added_mib"]
        / chunked["loss_added_mib"],
        f"ratio_tokens_per_s_chunked_vs_full{suffix}": chunked["tokens_per_s"] / full["tokens_per_s"],
    }


# -- varlen packed rows against padding --------------------------------------------------------------------


def real_shaped_model(layers: int, max_positions: int) -> Any:
    """Qwen2 with Qwen2.5's vocabulary and hidden size 512 (8 heads of 64, 2 KV heads), random weights, using
    the learner's packed attention."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner.attention import register_packed_attention

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=max_positions,
        tie_word_embeddings=True, attn_implementation=register_packed_attention(),
    )  # fmt: skip
    return Qwen2ForCausalLM(config).float()


def long_task_lengths(n: int, max_digits: int) -> list[int]:
    """Output lengths (with EOS) of the first ``n`` train problems of the long-output task."""
    from rollout_fleet.tasks.long_multiplication import LongMultiplicationTask

    task = LongMultiplicationTask(max_digits=max_digits)
    return [len(task.reference_completion(task.make_prompt(i))) + 1 for i in range(n)]


def long_task_batch(n: int, max_digits: int, vocab: int) -> list[Any]:
    """Training sequences with the long task's output lengths: prompts of 10-30 random tokens, random output
    tokens, behaviour log-probs near a uniform policy's, advantages of both signs."""
    import torch

    from learner.packing import TrainSequence

    gen = torch.Generator().manual_seed(0)
    seqs = []
    for i, out in enumerate(long_task_lengths(n, max_digits)):
        prompt = int(torch.randint(10, 31, (1,), generator=gen))
        seqs.append(
            TrainSequence(
                prompt_ids=torch.randint(1, vocab, (prompt,), generator=gen),
                output_ids=torch.randint(1, vocab, (out,), generator=gen),
                logprobs=-11.9 + 0.3 * torch.randn(out, generator=gen),
                versions=torch.zeros(out, dtype=torch.long),
                loss_mask=torch.ones(out),
                advantages=float(torch.randn(1, generator=gen)),
                index=i,
            )
        )
    return seqs


def varlen_vs_padded(mode: str) -> dict[str, Any]:
    """Both ways on the same batch, once per model depth of the mode; the headline is the deepest model's."""
    from benchmarks.learner_throughput import compare, packed_micro_batches, padded_micro_batches

    p = VARLEN[mode]
    seqs = long_task_batch(p["sequences"], p["max_digits"], VOCAB)
    ways = {
        "varlen": packed_micro_batches(seqs, p["budget"]),
        "padded": padded_micro_batches(seqs, p["budget"]),
    }
    out: dict[str, Any] = {
        "params": {**p, "output_lengths": sorted(s.length - len(s.prompt_ids) for s in seqs)}
    }
    for layers in p["layers"]:
        model = real_shaped_model(layers, max(s.length for s in seqs))
        result = compare(model, seqs, ways, p["budget"], p["repeats"])
        result["ratio"] = result["tokens_per_s"]["varlen"] / result["tokens_per_s"]["padded"]
        out[f"{layers}_layers"] = result
        print(f"varlen vs padded, {layers} layers: {result['ratio']:.3f}", flush=True)
    out["ratio"] = out[f"{max(p['layers'])}_layers"]["ratio"]
    return out


# -- the engine: prompt sharing and paged KV ------------------------------------------------------------------


def run_engine(engine: Any, items: list[Any], timeout: float = 1800.0) -> list[Any]:
    """Submit ``items`` together (as one ``/generate`` of a rollout worker) and wait for every final snapshot."""
    import threading

    done: dict[str, Any] = {}
    finished = threading.Event()

    def sink(snapshot: Any) -> None:
        if snapshot.finished:
            done[snapshot.rid] = snapshot
            if len(done) == len(items):
                finished.set()

    engine.submit_batch([(item, sink) for item in items])
    if not finished.wait(timeout):
        raise SystemExit(f"the engine finished {len(done)} of {len(items)} requests in {timeout:.0f} s")
    return [done[item.rid] for item in items]


def gen_item(rid: str, prompt: list[int], max_new_tokens: int, seed: int) -> Any:
    from rollout_fleet.engine.protocol import GenItem, parse_sampling_params

    params = parse_sampling_params(
        {"max_new_tokens": max_new_tokens, "ignore_eos": True, "sampling_seed": seed}
    )
    return GenItem(rid=rid, input_ids=prompt, params=params, max_new_tokens=max_new_tokens)


def prefill_sharing(mode: str) -> dict[str, Any]:
    """Prompt tokens computed for one group of 8 samples of one 2,048-token prompt (smoke: 64), sharing on and
    off."""
    import torch

    from rollout_fleet.engine.core import Engine
    from rollout_fleet.model import init_tiny_model

    prompt_tokens = SHARED_PROMPT[mode]
    prompt = torch.randint(5, 90, (prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "group_size": GROUP_SIZE}
    for name, disable in (("shared", False), ("unshared", True)):
        engine = Engine(init_tiny_model(), max_running_requests=GROUP_SIZE, disable_radix_cache=disable,
                        max_total_tokens=GROUP_SIZE * (prompt_tokens + 32), seed=0).start()  # fmt: skip
        try:
            items = [gen_item(f"{name}-{k}", prompt, 16, k) for k in range(GROUP_SIZE)]
            snapshots = run_engine(engine, items)
            stats = engine.scheduler.stats
            out[name] = {
                "prefill_tokens_computed": stats.prefill_tokens_computed,
                "cached_tokens": [s.cached_tokens for s in snapshots],
                "output_tokens": sum(len(s.output_ids) for s in snapshots),
            }
        finally:
            engine.shutdown()
    out["ratio"] = out["unshared"]["prefill_tokens_computed"] / out["shared"]["prefill_tokens_computed"]
    return out


def decode_concurrency(mode: str) -> dict[str, Any]:
    """Mean decode batch of the built-in engine in the same KV memory, paged blocks against contiguous rows."""
    import torch

    from rollout_fleet.engine.core import Engine
    from rollout_fleet.model import LONG_CONTEXT_SPEC, init_tiny_model

    p = CONCURRENCY[mode]
    gen = torch.Generator().manual_seed(1)
    lengths = [min(n, p["context"] - 40) for n in long_task_lengths(p["requests"], p["max_digits"])]
    prompts = [torch.randint(5, 90, (int(torch.randint(10, 31, (1,), generator=gen)),), generator=gen).tolist()
               for _ in lengths]  # fmt: skip
    out: dict[str, Any] = {"params": {**p, "output_lengths": sorted(lengths), "block_size_paged": 16}}
    for name, block in (("paged", 16), ("contiguous", p["context"])):
        engine = Engine(init_tiny_model(spec=LONG_CONTEXT_SPEC), max_context_len=p["context"],
                        max_running_requests=p["requests"], max_total_tokens=p["kv_tokens"], kv_block_size=block,
                        seed=0).start()  # fmt: skip
        batches: list[tuple[int, int]] = []  # (decode batch, requests waiting) per decode step
        scheduler = engine.scheduler

        def record(step: Any, scheduler: Any = scheduler, batches: list = batches) -> None:
            if step.kind == "decode":
                batches.append((step.tokens, len(scheduler.waiting)))

        scheduler.add_step_listener(record)
        started = time.perf_counter()
        try:
            items = [
                gen_item(f"{name}-{i}", pr, n, i)
                for i, (pr, n) in enumerate(zip(prompts, lengths, strict=True))
            ]
            snapshots = run_engine(engine, items)
        finally:
            engine.shutdown()
        if [len(s.output_ids) for s in snapshots] != lengths:
            raise SystemExit(f"{name}: outputs are not of the requested lengths")
        bound = [b for b, waiting in batches if waiting]
        out[name] = {
            "kv_capacity_tokens": engine.max_total_tokens,
            "decode_steps": len(batches),
            "mean_batch_all_steps": statistics.fmean(b for b, _ in batches),
            "memory_bound_steps": len(bound),
            "mean_batch_memory_bound": statistics.fmean(bound) if bound else None,
            "peak_batch": max(b for b, _ in batches),
            "retractions": engine.scheduler.stats.retractions,
            "seconds": round(time.perf_counter() - started, 2),
        }
    paged, contiguous = out["paged"]["mean_batch_memory_bound"], out["contiguous"]["mean_batch_memory_bound"]
    out["ratio"] = paged / contiguous if paged and contiguous else None
    out["ratio_all_steps"] = out["paged"]["mean_batch_all_steps"] / out["contiguous"]["mean_batch_all_steps"]
    return out


def loss_memory(mode: str, repeats: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The loss, chunked against full logits, each length in fresh processes: (sizes, headline ratios)."""
    sizes: dict[str, dict[str, Any]] = {}
    for tokens in SIZES[mode]:
        row: dict[str, Any] = {"chunked": run_fresh(tokens, "chunked", repeats)}
        if full_fits(tokens):
            row["full"] = run_fresh(tokens, "full", repeats)
        else:
            row["full"] = {"skipped": f"[{tokens}, {VOCAB}] float32 logits ({tokens * VOCAB * 4 / 2**30:.1f} "
                           "GiB a copy, about four live) do not fit in the memory available "
                           f"({available_bytes() / 2**30:.1f} GiB)"}  # fmt: skip
        sizes[str(tokens)] = row
        print(json.dumps({str(tokens): row}), flush=True)
    headline: dict[str, Any] = {
        "ratio_peak_memory_full_vs_chunked": None,
        "ratio_tokens_per_s_chunked_vs_full": None,
    }
    both = [
        n for n, row in sizes.items() if "peak_rss_mib" in row["full"] and "peak_rss_mib" in row["chunked"]
    ]
    for n in both:  # the targets are at 8,192 tokens; every length where both ran is reported
        suffix = "" if n == "8192" else f"_at_{n}"
        headline.update(ratios(sizes[n], suffix))
    return sizes, headline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_mode_flags(parser, "loss up to 8,192 tokens; smaller mixes (minutes)")
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        default=list(SECTIONS),
        help="what to measure (default: all): the loss, varlen vs padded, prefill sharing, paged concurrency",
    )
    parser.add_argument("--out", type=Path, help="result JSON")
    parser.add_argument(
        "--repeats", type=int, help="forward + backward passes per measurement (default 2; smoke 1)"
    )
    parser.add_argument("--measure", choices=["chunked", "full"], help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure_loss(args.tokens, args.measure, args.repeats)))
        return 0
    if args.out is None:
        parser.error("--out is required")
    mode = mode_of(parser, args)
    args.repeats = args.repeats or (1 if mode == "smoke" else 2)
    results: dict[str, Any] = {}
    headline: dict[str, Any] = {}
    if "loss" in args.sections:
        results["sizes"], ratios_at = loss_memory(mode, args.repeats)
        headline.update(ratios_at)
    for name, section, measure in (
        ("varlen_vs_padded", "varlen", lambda: varlen_vs_padded(mode)),
        ("prefill_tokens_unshared_vs_shared", "prefill", lambda: prefill_sharing(mode)),
        ("concurrent_sequences_paged_vs_contiguous", "concurrency", lambda: decode_concurrency(mode)),
    ):
        if section not in args.sections:
            continue
        started = time.perf_counter()
        results[name] = measure()
        headline[f"ratio_{name}"] = results[name]["ratio"]
        print(f"ratio_{name} {results[name]['ratio']} ({time.perf_counter() - started:.0f} s)", flush=True)
    if "varlen" in args.sections:
        for layers in VARLEN[mode]["layers"]:
            headline[f"ratio_varlen_vs_padded_{layers}_layers"] = results["varlen_vs_padded"][
                f"{layers}_layers"
            ]["ratio"]
    targets = {name: t for name, t in TARGETS.items() if name in headline}  # those of the sections run
    params = {"vocab": VOCAB, "hidden": HIDDEN, "loss_chunk_tokens": CHUNK, "repeats": args.repeats,
              "varlen": VARLEN[mode], "concurrency": CONCURRENCY[mode], "shared_prompt": SHARED_PROMPT[mode]}  # fmt: skip
    params["sections"] = args.sections
    doc = write_result(args.out, "long_context", mode, params, results, targets, headline)
    print(json.dumps({k: doc[k] for k in ("targets", "passed")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
