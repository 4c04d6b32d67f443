"""Memory and speed of long sequences: the learner's loss, chunked against full logits.

    python -m benchmarks.long_context --quick --out FILE   # 2,048, 4,096 and 8,192 tokens
    python -m benchmarks.long_context --out FILE           # and 32,768 (chunked only: full cannot fit)

The loss of one sequence of N tokens on a model shaped like a real one where it matters here: a vocabulary of
151,936 (Qwen2.5's) and hidden size 512, random weights. Each measurement is a fresh process (so its high-water
RSS is of that measurement alone) that builds the final hidden states ``[N, H]`` and the lm-head ``[V, H]``,
then runs one forward + backward of the per-token log-probs (and entropy) at temperature 1:

- ``chunked``: :func:`learner.logprobs.token_logprobs` (the learner's path), ``loss_chunk_tokens`` at a time;
- ``full``: the reference, ``log_softmax(hidden @ W.T)`` gathered (``[N, V]`` logits, as the learner did).

Reported per length: peak RSS, the RSS the setup already held, their difference (what the loss added), and
tokens per second of the forward + backward (best of ``--repeats``). ``full`` is skipped where its logits alone
would not fit in the machine's memory, and the result says so.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import write_result

VOCAB = 151_936
HIDDEN = 512
CHUNK = 1024
QUICK_SIZES = [2048, 4096, 8192]
FULL_SIZES = [2048, 4096, 8192, 32768]
TARGETS = {
    "ratio_peak_memory_full_vs_chunked": (">=", 4.0),
    "ratio_tokens_per_s_chunked_vs_full": (">=", 0.9),
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


def full_fits(tokens: int) -> bool:
    """Whether full logits fit: about four [N, V] float32 copies live at once (logits, log-softmax, softmax
    for the entropy, and the gradient), with a quarter of the memory left for everything else."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 4 * tokens * VOCAB * 4 < 0.75 * total


def ratios(row: dict[str, Any], suffix: str) -> dict[str, float]:
    full, chunked = row["full"], row["chunked"]
    return {
        f"ratio_peak_memory_full_vs_chunked{suffix}": full["peak_rss_mib"] / chunked["peak_rss_mib"],
        f"ratio_loss_added_memory_full_vs_chunked{suffix}": full["loss_added_mib"]
        / chunked["loss_added_mib"],
        f"ratio_tokens_per_s_chunked_vs_full{suffix}": chunked["tokens_per_s"] / full["tokens_per_s"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2,048, 4,096 and 8,192 tokens only")
    parser.add_argument("--out", type=Path, help="result JSON")
    parser.add_argument("--repeats", type=int, default=2, help="forward + backward passes per measurement")
    parser.add_argument("--measure", choices=["chunked", "full"], help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure_loss(args.tokens, args.measure, args.repeats)))
        return 0
    if args.out is None:
        parser.error("--out is required")
    sizes: dict[str, dict[str, Any]] = {}
    for tokens in QUICK_SIZES if args.quick else FULL_SIZES:
        row: dict[str, Any] = {"chunked": run_fresh(tokens, "chunked", args.repeats)}
        if full_fits(tokens):
            row["full"] = run_fresh(tokens, "full", args.repeats)
        else:
            row["full"] = {"skipped": f"[{tokens}, {VOCAB}] float32 logits ({tokens * VOCAB * 4 / 2**30:.1f} "
                           "GiB a copy, about four live) do not fit in this machine's memory"}  # fmt: skip
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
    params = {"vocab": VOCAB, "hidden": HIDDEN, "loss_chunk_tokens": CHUNK, "repeats": args.repeats}
    doc = write_result(args.out, "long_context", "quick" if args.quick else "full", params, {"sizes": sizes},
                       TARGETS, headline)  # fmt: skip
    print(json.dumps({k: doc[k] for k in ("targets", "passed")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
