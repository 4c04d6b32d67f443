"""Continuous batching: one thread owns the model, the KV cache and every live request.

Each iteration of the loop runs the commands other threads posted (new requests, aborts, pause / continue,
weight loads), then, unless paused, runs one prefill pass and one batched decode step over everything running.
A request joins the running batch right after its prefill and leaves it the step it finishes, so one decode
step serves requests that started at different times; prefill runs once per request (again only after a
retraction, over prompt + output so far).

Memory (:mod:`rollout_fleet.engine.kv_cache`): a request's KV is a table of fixed-size blocks from one pool of
``max_total_tokens``. A prefill pass computes at most ``chunked_prefill_size`` tokens: a longer prompt is
prefilled in chunks, one per iteration, so the decode steps of running requests go on between them. Admission
takes the longest cached prefix of a sequence (whole blocks) and computes only the rest; requests with the same
sequence admitted together are one :class:`PrefillJob`: computed once, then its members share the full blocks
and copy the partial last one. A request waits while the pool cannot hold its sequence; when a running request
needs a block for its next token and none is left, the youngest admitted request is retracted (its KV freed, its
full blocks left in the prefix cache, its output kept) and re-queued, as SGLang does, never an out-of-memory
error. ``Request.cached_tokens`` counts the tokens of its prefills that were not computed for it.

Nothing here blocks on the event loop: results go out through each request's ``sink`` callback (called on this
thread; it must not block), and callers wait on ``concurrent.futures.Future`` objects with timeouts.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from common.versioning import INITIAL_LABEL
from rollout_fleet.engine import sampler
from rollout_fleet.engine.protocol import (
    ABORT_IN_WAITING_QUEUE,
    ABORTED,
    GenItem,
    RequestSnapshot,
    SpanRecorder,
    finish_abort,
    finish_length,
    finish_stop,
)
from rollout_fleet.engine.runner import ModelRunner, PrefillChunk

log = logging.getLogger("streamrl.engine.scheduler")

PAUSE_MODES = ("abort", "retract", "in_place")
Sink = Callable[[RequestSnapshot], None]


@dataclass(eq=False)
class Request:
    """A live request; mutated only on the scheduler thread."""

    item: GenItem
    sink: Sink
    created: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    spans: SpanRecorder = field(default_factory=SpanRecorder)
    num_retractions: int = 0
    prefill_count: int = 0
    kv_len: int = 0  # tokens whose K/V sit in the cache; the last output token is fed by the next step
    blocks: list[int] = field(default_factory=list)  # the block table while running
    kv_epoch: int = -1  # the prefix cache's epoch the KV was computed under (older KV is never cached)
    cached_tokens: int = 0  # tokens of its prefills whose KV was reused, not computed for it
    admitted: int = -1  # admission order while admitted (prefilling or running); -1 while waiting
    finish_reason: dict[str, Any] | None = None
    generator: torch.Generator | None = None

    @property
    def rid(self) -> str:
        return self.item.rid

    def sequence(self) -> list[int]:
        """What a prefill computes: prompt + output so far."""
        return self.item.input_ids + self.output_ids

    def snapshot(self, weight_version: str, *, queued_abort: bool = False) -> RequestSnapshot:
        finished = self.finish_reason is not None
        return RequestSnapshot(
            rid=self.rid,
            prompt_ids=self.item.input_ids,
            params=self.item.params,
            output_ids=list(self.output_ids),
            output_logprobs=list(self.output_logprobs) if self.item.return_logprob else None,
            input_logprobs=self.input_logprobs,
            logprob_start_len=self.item.logprob_start_len,
            finish_reason=self.finish_reason,
            weight_version=weight_version,
            weight_versions=self.spans.copy(),
            num_retractions=self.num_retractions,
            finished=finished,
            queued_abort=queued_abort,
            e2e_latency=time.monotonic() - self.created if finished else 0.0,
            cached_tokens=self.cached_tokens,
        )


@dataclass(eq=False)
class PrefillJob:
    """A sequence being prefilled, over one or more passes, for the requests admitted with that sequence.

    The blocks are the job's until it completes; then ``members[0]`` takes them, and every other member shares
    the full blocks and gets a copy of the partial last one in its ``spare`` block (allocated when it joined)."""

    tokens: list[int]
    key: tuple[int, ...]
    blocks: list[int]  # covers every token
    done: int  # tokens whose KV is in the blocks (the prefix-cache hit, then the chunks computed)
    cached: int  # tokens of the prefix-cache hit
    epoch: int  # the prefix cache's epoch at admission
    admitted: int
    members: list[Request] = field(default_factory=list)
    spare: dict[int, int] = field(default_factory=dict)  # id(member) -> its block for the partial copy
    positions: set[int] = field(default_factory=set)  # logit positions members want (all >= done when asked)
    logits: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)  # collected per pass

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.done


@dataclass(frozen=True)
class StepRecord:
    """One forward pass: which requests it served. Tests read these to see batches form and change."""

    step: int
    kind: str  # "prefill" or "decode"
    rids: tuple[str, ...]
    tokens: int  # tokens fed through the model (prefill: prompt tokens; decode: batch size)


@dataclass
class SchedulerStats:
    """Counters, updated on the scheduler thread and read anywhere (plain ints: safe under the GIL)."""

    steps: int = 0
    prefill_batches: int = 0
    prefill_tokens_computed: int = 0
    prefill_tokens_cached: int = 0  # tokens of admitted sequences whose KV was reused (prefix cache, sharing)
    prefill_tokens_total: int = 0  # tokens of admitted sequences, computed or reused
    decode_steps: int = 0
    decode_tokens: int = 0
    generated_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    retractions: int = 0
    errors: int = 0
    peak_running: int = 0  # the largest decode batch so far
    rejected_requests: int = 0  # requests that could never fit in the KV cache


class Scheduler:
    """The engine thread: admission, chunked prefill, batched decode, KV memory, finishing, aborts, pauses."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        eos_token_ids: Iterable[int],
        decode_text: Callable[[list[int]], str],
        max_running_requests: int,
        max_prefill_tokens: int,
        chunked_prefill_size: int = 2048,
        disable_radix_cache: bool = False,
        seed: int = 0,
        step_log_size: int = 4096,
        weight_version: str = INITIAL_LABEL,
    ) -> None:
        if chunked_prefill_size < 1:
            raise ValueError(f"engine.chunked_prefill_size must be at least 1, got {chunked_prefill_size}")
        self.runner = runner
        self.cache = runner.cache
        self.allocator = runner.cache.allocator
        self.block_size = runner.block_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.decode_text = decode_text
        self.max_running = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill_size = chunked_prefill_size
        # SGLang's --disable-radix-cache: every request computes its whole sequence (the sharing baseline)
        self.disable_radix_cache = disable_radix_cache
        self.device = runner.device
        self.vocab_size = int(runner.model.config.vocab_size)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.weight_version = weight_version
        self.stats = SchedulerStats()
        self.step_log: collections.deque[StepRecord] = collections.deque(maxlen=step_log_size)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # decoding, in the order they joined
        self.jobs: list[PrefillJob] = []  # prefilling (possibly chunk by chunk), in admission order
        self._admissions = 0  # admission counter: the youngest admitted request is retracted first
        # (id of the queue head, blocks available) when it last had to wait for memory
        self._blocked: tuple[int, int] | None = None
        self.paused_mode: str | None = None  # "retract" or "in_place" while the scheduler itself is paused
        # Memory tags released by /release_memory_occupation (rollout_fleet.engine.memory); requests are refused
        # while "kv_cache" or "weights" is among them.
        self.released: set[str] = set()
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future | None]] = queue.SimpleQueue()
        self._listeners: list[Callable[[StepRecord], None]] = []
        self._batch: sampler.SamplingBatch | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._throughput: collections.deque[tuple[float, int]] = collections.deque(maxlen=256)

    # -- API for other threads --------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def stop(self, timeout: float) -> None:
        """Abort everything (each request is answered), then end the thread; waits at most ``timeout``."""
        if self._thread.is_alive():
            self.post(lambda: self._abort("", abort_all=True))
            self._stop.set()
            self._commands.put((lambda: None, None))  # wake the loop
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("scheduler thread did not stop within %.1f s", timeout)

    def post(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn()`` on the scheduler thread between steps; the future holds its result or exception."""
        future: Future = Future()
        self._commands.put((fn, future))
        return future

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        """``post`` and wait; runs inline when already on the scheduler thread."""
        if threading.current_thread() is self._thread:
            return fn()
        if not self._thread.is_alive():
            raise RuntimeError("the engine scheduler is not running")
        return self.post(fn).result(timeout)

    def submit(self, item: GenItem, sink: Sink) -> None:
        """Queue a request; its sink gets stream snapshots and, always, exactly one final snapshot."""
        self.post(lambda: self._enqueue(Request(item, sink)))

    def submit_batch(self, items: Sequence[tuple[GenItem, Sink]]) -> None:
        """Queue the items of one call in one command, so they reach one prefill pass together (the samples
        of a group then share one prompt prefill instead of finding it in the prefix cache one by one)."""
        reqs = [Request(item, sink) for item, sink in items]
        self.post(lambda: [self._enqueue(r) for r in reqs])

    def abort(self, rid: str = "", abort_all: bool = False) -> Future:
        """Abort every live request whose rid starts with ``rid`` (or all); each is answered."""
        return self.post(lambda: self._abort(rid, abort_all))

    def pause(self, mode: str) -> Future:
        """Stop forward passes: ``retract`` frees running requests' KV and re-queues them; ``in_place`` keeps all."""
        if mode not in ("retract", "in_place"):
            raise ValueError(f"scheduler pause mode must be retract or in_place, got {mode!r}")
        return self.post(lambda: self._pause(mode))

    def resume(self) -> Future:
        return self.post(self._resume)

    def add_step_listener(self, fn: Callable[[StepRecord], None]) -> Callable[[], None]:
        """Call ``fn(record)`` on the scheduler thread after every forward pass; returns a remover."""
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn)

    def pending_commands(self) -> int:
        return self._commands.qsize()

    def loads(self) -> dict[str, Any]:
        """Approximate load figures for /v1/loads (read without stopping the loop): SGLang's keys, tokens
        counted in whole KV blocks in use, plus the pool's own figures."""
        alloc, bs = self.allocator, self.block_size
        used = alloc.used() * bs
        total = alloc.capacity_tokens
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._throughput) if now - t < 10.0]
        span = max(now - recent[0][0], 1e-3) if recent else 1.0
        prefilled = self.stats.prefill_tokens_total
        return {
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "num_prefilling_reqs": sum(len(j.members) for j in list(self.jobs)),
            "num_used_tokens": used,
            "num_total_tokens": total,
            "token_usage": used / total if total else 0.0,
            "gen_throughput": sum(n for _, n in recent) / span if recent else 0.0,
            "cache_hit_rate": self.stats.prefill_tokens_cached / prefilled if prefilled else 0.0,
            "kv_block_size": bs,
            "kv_blocks_total": alloc.capacity_blocks,
            "kv_blocks_used": alloc.used(),
            "kv_blocks_peak": alloc.peak_used,
            "kv_blocks_cached": alloc.cached(),
            "kv_blocks_evicted": alloc.evictions,
        }

    # -- the loop -----------------------------------------------------------------------------------------

    def _has_work(self) -> bool:
        return self.paused_mode is None and bool(self.running or self.jobs or self.waiting)

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                self._run_commands(block=not self._has_work())
                if self._stop.is_set():
                    break
                if not self._has_work():
                    continue
                try:
                    self._prefill_pass()
                    if self.running:
                        self._decode_step()
                except Exception as exc:  # a failed step must answer its requests, not hang them
                    log.exception("engine step failed")
                    self._fail_running(exc)
            self._run_commands(block=False)

    def _run_commands(self, block: bool) -> None:
        try:
            fn, future = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._execute(fn, future)
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return

    @staticmethod
    def _execute(fn: Callable[[], Any], future: Future | None) -> None:
        try:
            result = fn()
        except BaseException as exc:  # handed to the waiting caller
            if future is not None:
                future.set_exception(exc)
            else:
                log.exception("scheduler command failed")
            return
        if future is not None:
            future.set_result(result)

    def _record(self, kind: str, reqs: list[Request], tokens: int) -> None:
        self.stats.steps += 1
        record = StepRecord(self.stats.steps, kind, tuple(r.rid for r in reqs), tokens)
        self.step_log.append(record)
        for listener in list(self._listeners):
            listener(record)

    # -- admission and prefill ----------------------------------------------------------------------------

    def _enqueue(self, req: Request) -> None:
        missing = sorted(self.released & {"kv_cache", "weights"})
        if missing:
            # SGLang would run on freed memory; here the request is answered at once, with the reason.
            message = (
                f"the engine's memory is released ({', '.join(missing)}): call /resume_memory_occupation (and "
                "update the weights) before generating"
            )
            self._finish(req, finish_abort(message, 503, "ServiceUnavailableError"))
            return
        seed = req.item.params.sampling_seed
        if seed is not None:
            req.generator = sampler.make_generator(seed, self.device)
        prompt, budget = len(req.item.input_ids), req.item.max_new_tokens
        longest = max(prompt, prompt + budget - 1)  # the last output token's KV is never stored
        if self.allocator.blocks_for(longest) > self.allocator.capacity_blocks:
            # It could never fit, not even alone: waiting would hang it, so it is answered now.
            self.stats.rejected_requests += 1
            message = (
                f"prompt ({prompt} tokens) + max_new_tokens ({budget}) needs KV for {longest} tokens, more than "
                f"the KV cache holds: engine.max_total_tokens = {self.allocator.capacity_tokens}"
            )
            self._finish(req, finish_abort(message, 400, "BadRequestError"))
            return
        self.waiting.append(req)
        log.debug("request %s queued: %d prompt tokens", req.rid, prompt)

    def _admitted_count(self) -> int:
        return len(self.running) + sum(len(j.members) for j in self.jobs)

    def _prefill_pass(self) -> None:
        """Plan one prefill pass (chunks of jobs in progress first, then new admissions, within the token
        budgets), run it, and move completed jobs' members into the running batch."""
        plan: list[tuple[PrefillJob, int]] = []  # (job, end of this pass's chunk)
        budget = self.chunked_prefill_size
        for job in self.jobs:
            take = self._chunk_size(plan, job, budget)
            if take == 0:
                break
            plan.append((job, job.done + take))
            budget -= take
        while self.waiting and self._admitted_count() < self.max_running:
            req = self.waiting[0]
            if self._join_job(req):
                continue  # joining computes nothing: it needs no budget
            blocked = self._blocked
            if budget == 0 or (
                blocked and blocked[0] == id(req) and self.allocator.available() <= blocked[1]
            ):
                break  # no budget left, or nothing freed since it last had to wait (skip the prefix walk)
            job = self._new_job(req)
            if job is None:
                # First come, first served: the head of the queue waits for memory.
                self._blocked = (id(req), self.allocator.available())
                break
            take = self._chunk_size(plan, job, budget)
            if take == 0:  # over the padded budget: it runs first in the next pass
                break
            plan.append((job, job.done + take))
            budget -= take
        if plan:
            self._run_prefill(plan)

    def _chunk_size(self, plan: list[tuple[PrefillJob, int]], job: PrefillJob, budget: int) -> int:
        """Tokens of ``job`` the pass can take: within the token budget and, with the chunks already planned,
        the padded budget (``max_prefill_tokens`` = sequences x longest chunk); the first chunk always runs."""
        take = min(job.remaining, budget, self.max_prefill_tokens)
        if plan:
            longest = max(max(end - j.done for j, end in plan), take)
            if longest * (len(plan) + 1) > self.max_prefill_tokens:
                return 0
        return take

    def _reserve(self) -> int:
        """Blocks kept back from admission: one per admitted request that may still need a block for its
        output (without it a new request would be admitted only to be retracted at once). A request whose
        blocks already hold its prompt and every token it may generate needs none."""
        running = sum(self._may_grow(r, len(r.blocks)) for r in self.running)
        return running + sum(self._may_grow(r, len(j.blocks)) for j in self.jobs for r in j.members)

    def _may_grow(self, req: Request, blocks: int) -> bool:
        longest = len(req.item.input_ids) + req.item.max_new_tokens - 1  # the last token's KV is never stored
        return self.allocator.blocks_for(longest) > blocks

    def _join_job(self, req: Request) -> bool:
        """Admit ``req`` into a job with its exact sequence whose chunks have not yet passed the positions it
        wants logits for; it needs at most one block (its copy of the partial last block)."""
        n = len(req.item.input_ids) + len(req.output_ids)
        if self.disable_radix_cache or not any(len(j.tokens) == n for j in self.jobs):
            return False  # the common case, without building the key
        seq = req.sequence()
        key = tuple(seq)
        job = next((j for j in self.jobs if j.key == key), None)
        positions = self._logit_positions(req, n)
        if job is None or min(positions) < job.done:
            return False
        if len(seq) % self.block_size:
            if self.allocator.available() - self._reserve() < 1:
                return False
            job.spare[id(req)] = self._allocate(1)[0]
        self.waiting.popleft()
        job.members.append(req)
        job.positions.update(positions)
        req.admitted = self._next_admission()
        return True

    def _new_job(self, req: Request) -> PrefillJob | None:
        """A job for ``req`` reusing the longest cached prefix, if the pool can hold the whole sequence; else
        None (it keeps waiting)."""
        seq = req.sequence()
        limit = len(seq) - 1  # the last token is always computed: its logits sample the next one
        if self._wants_input_logprobs(req, len(seq)):
            limit = min(limit, req.item.logprob_start_len)  # logits wanted from there on are computed too
        hit = [] if self.disable_radix_cache else self.allocator.match(seq, limit)
        fresh = self.allocator.blocks_for(len(seq)) - len(hit)
        if fresh + self.allocator.evictable_among(hit) > self.allocator.available() - self._reserve():
            return None
        self.allocator.share(hit)
        blocks = hit + self._allocate(fresh)
        cached = len(hit) * self.block_size
        job = PrefillJob(
            seq, tuple(seq), blocks, cached, cached, self.allocator.epoch, self._next_admission()
        )
        self.waiting.popleft()
        job.members.append(req)
        job.positions.update(self._logit_positions(req, len(seq)))
        req.admitted = job.admitted
        self.jobs.append(job)
        return job

    def _allocate(self, n: int) -> list[int]:
        """``n`` blocks the caller has checked are available."""
        blocks = self.cache.allocate(n)
        if blocks is None:
            raise RuntimeError(f"KV cache: {n} blocks were counted available but could not be allocated")
        return blocks

    def _next_admission(self) -> int:
        self._admissions += 1
        return self._admissions

    def _run_prefill(self, plan: list[tuple[PrefillJob, int]]) -> None:
        chunks = [
            PrefillChunk(
                job.blocks, job.tokens, job.done, end, sorted(p for p in job.positions if job.done <= p < end)
            )
            for job, end in plan
        ]
        computed = self.runner.prefill_tokens_computed
        logits = self.runner.prefill(chunks)
        computed = self.runner.prefill_tokens_computed - computed
        members = [r for job, _ in plan for r in job.members]
        completed = []
        for (job, end), chunk, lg in zip(plan, chunks, logits, strict=True):
            job.done = end
            if chunk.logit_positions:
                job.logits.append((list(chunk.logit_positions), lg))
            self._cache_blocks(job.blocks, job.tokens, job.done, job.epoch)
            if job.remaining == 0:
                completed.append(job)
        self.stats.prefill_batches += 1
        self.stats.prefill_tokens_computed += computed
        self._record("prefill", members, computed)
        for job in completed:
            self._complete(job)

    def _cache_blocks(self, blocks: list[int], tokens: list[int], kv_len: int, epoch: int) -> None:
        """Enter the full blocks of a table into the prefix cache, unless its KV predates the weights."""
        if epoch == self.allocator.epoch and not self.disable_radix_cache:
            self.allocator.register(blocks, tokens, kv_len // self.block_size)

    def _complete(self, job: PrefillJob) -> None:
        """The job's KV is whole: hand its blocks to its members, who join the running batch and sample."""
        self.jobs.remove(job)
        n = len(job.tokens)
        full, partial = divmod(n, self.block_size)
        positions = [p for ps, _ in job.logits for p in ps]
        where = {p: i for i, p in enumerate(positions)}
        rows = torch.cat([lg for _, lg in job.logits])
        self.stats.prefill_tokens_total += n * len(job.members)
        last: dict[int, torch.Tensor] = {}  # id(member) -> logits of the last position
        for k, req in enumerate(job.members):
            spare = job.spare.pop(id(req), None)
            if k == 0:
                req.blocks, req.cached_tokens = job.blocks, req.cached_tokens + job.cached
                self.stats.prefill_tokens_cached += job.cached
                if spare is not None:
                    self.allocator.release([spare])
            else:  # computed once for all: nothing of it was computed for this member
                self.allocator.share(job.blocks[:full])
                req.blocks = job.blocks[:full]
                if partial:
                    self.cache.copy_block(job.blocks[full], spare, partial)
                    req.blocks = [*req.blocks, spare]
                req.cached_tokens += n
                self.stats.prefill_tokens_cached += n
            lg = rows[[where[p] for p in self._logit_positions(req, n)]]
            if self._wants_input_logprobs(req, n):
                req.input_logprobs = self._input_logprobs(req, job.tokens, lg[:-1])
            req.kv_len, req.kv_epoch = n, job.epoch
            req.prefill_count += 1
            last[id(req)] = lg[-1]
            self.running.append(req)
        self._batch = None
        # Requests that may not generate at all finish here; the rest sample their next token.
        sampling = [r for r in job.members if r.item.max_new_tokens > len(r.output_ids)]
        for req in job.members:
            if req not in sampling:
                self._finish(req, finish_length(req.item.max_new_tokens))
        if sampling:
            logits = torch.stack([last[id(r)] for r in sampling])
            self._sample_and_advance(sampling, logits, self._make_batch(sampling))

    @staticmethod
    def _wants_input_logprobs(req: Request, length: int) -> bool:
        """Input log-probs are computed on the first prefill only (SGLang computes them once)."""
        start = req.item.logprob_start_len
        return req.item.return_logprob and req.prefill_count == 0 and 0 <= start < length

    def _logit_positions(self, req: Request, length: int) -> list[int]:
        """Positions whose logits the prefill returns: from logprob_start_len on when input log-probs are
        wanted (the last one also samples the next token), else only the last."""
        if self._wants_input_logprobs(req, length):
            return list(range(req.item.logprob_start_len, length))
        return [length - 1]

    def _input_logprobs(self, req: Request, seq: list[int], logits: torch.Tensor) -> list[float | None]:
        """SGLang's input_token_logprobs: aligned with prompt[start:], the first entry null, entry j the
        log-prob of prompt[start + j] given the tokens before it (temperature-scaled like the outputs)."""
        start = req.item.logprob_start_len
        temperature = 1.0 if req.item.params.greedy else req.item.params.temperature
        lp = torch.log_softmax(logits / temperature, dim=-1)
        targets = torch.tensor(seq[start + 1 :], device=lp.device)
        values = lp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        return [None, *values]

    # -- decode -------------------------------------------------------------------------------------------

    def _make_batch(self, reqs: list[Request]) -> sampler.SamplingBatch:
        return sampler.SamplingBatch.build(
            [r.item.params for r in reqs], [r.generator for r in reqs], self.vocab_size, self.device
        )

    def _decode_step(self) -> None:
        self._make_room_for_decode()
        if not self.running:
            return
        reqs = list(self.running)
        tokens = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.long, device=self.device)
        positions = torch.tensor([r.kv_len for r in reqs], dtype=torch.long, device=self.device)
        logits = self.runner.decode(tokens, positions, [r.blocks for r in reqs])
        for r in reqs:
            r.kv_len += 1
        self.stats.peak_running = max(self.stats.peak_running, len(reqs))
        self.stats.decode_steps += 1
        self.stats.decode_tokens += len(reqs)
        self._record("decode", reqs, len(reqs))
        if self._batch is None:
            self._batch = self._make_batch(reqs)
        self._sample_and_advance(reqs, logits, self._batch)

    def _make_room_for_decode(self) -> None:
        """Give every running request whose last block is full a new one, retracting the youngest admitted
        requests (prefilling or running) while the pool cannot provide them."""
        bs = self.block_size
        while True:
            needy = [r for r in self.running if r.kv_len >= len(r.blocks) * bs]
            if len(needy) <= self.allocator.available():
                break
            if self._admitted_count() == 1:
                # Cannot happen (_enqueue refuses what could never fit); answered rather than looped on.
                req = self.running[0]
                self._finish(req, finish_abort("the KV cache is full", 500, "InternalServerError"))
                return
            self._retract_youngest()
        for req in needy:
            req.blocks.extend(self._allocate(1))

    def _retract_youngest(self) -> None:
        job = max(self.jobs, key=lambda j: j.admitted, default=None)
        req = max(self.running, key=lambda r: r.admitted, default=None)
        if job is not None and (req is None or job.admitted > req.admitted):
            log.debug("KV cache full: retracting prefill of %s", [r.rid for r in job.members])
            self._retract_job(job)
        elif req is not None:
            log.debug("KV cache full: retracting %s after %d tokens", req.rid, len(req.output_ids))
            self._retract_running(req)

    def _requeue(self, req: Request) -> None:
        """Back to the head of the queue, output kept: it resumes by re-prefilling prompt + output so far."""
        req.blocks, req.kv_len, req.admitted = [], 0, -1
        req.num_retractions += 1
        self.stats.retractions += 1
        self.waiting.appendleft(req)

    def _retract_running(self, req: Request) -> None:
        self._leave_running(req)
        self._requeue(req)

    def _retract_job(self, job: PrefillJob) -> None:
        self._drop_job(job)
        for req in reversed(job.members):
            self._requeue(req)

    def _banned(self, reqs: list[Request]) -> list[tuple[int, list[int]]]:
        """Stop tokens blocked while a request is below its min_new_tokens."""
        banned = []
        for i, r in enumerate(reqs):
            p = r.item.params
            if p.min_new_tokens > len(r.output_ids) and not p.ignore_eos:
                ids = sorted((self.eos_token_ids | set(p.stop_token_ids)) & set(range(self.vocab_size)))
                banned.append((i, ids))
        return banned

    def _sample_and_advance(
        self, reqs: list[Request], logits: torch.Tensor, batch: sampler.SamplingBatch
    ) -> None:
        tokens, logprobs = sampler.sample(logits, batch, self.generator, self._banned(reqs))
        finished = []
        for req, token, lp in zip(reqs, tokens.tolist(), logprobs.tolist(), strict=True):
            req.output_ids.append(token)
            req.output_logprobs.append(lp)
            req.spans.add(self.weight_version, len(req.output_ids) - 1)
            reason = self._finish_reason(req)
            if reason is not None:
                finished.append((req, reason))
            elif req.item.stream and len(req.output_ids) % req.item.params.stream_interval == 0:
                req.sink(req.snapshot(self.weight_version))
        self.stats.generated_tokens += len(reqs)
        self._throughput.append((time.monotonic(), len(reqs)))
        for req, reason in finished:
            self._finish(req, reason)

    def _finish_reason(self, req: Request) -> dict[str, Any] | None:
        """SGLang's order: length first, then stop tokens (unless ignore_eos), then stop strings."""
        p, out = req.item.params, req.output_ids
        if len(out) >= req.item.max_new_tokens:
            return finish_length(req.item.max_new_tokens)
        if len(out) < p.min_new_tokens:
            return None
        last = out[-1]
        if not p.ignore_eos and (last in self.eos_token_ids or last in p.stop_token_ids):
            return finish_stop(last)
        if p.stop:
            window = max(len(s.encode()) for s in p.stop) + 1
            tail = self.decode_text(out[-window:])
            for s in p.stop:
                if s in tail:
                    return finish_stop(s)
        return None

    # -- leaving the batch --------------------------------------------------------------------------------

    def _leave_running(self, req: Request) -> None:
        """Take ``req`` out of the running batch; its full blocks stay in the prefix cache, the rest is freed."""
        self.running.remove(req)
        self._cache_blocks(req.blocks, req.sequence(), req.kv_len, req.kv_epoch)
        self.allocator.release(req.blocks)
        req.blocks = []
        self._batch = None

    def _drop_job(self, job: PrefillJob) -> None:
        """Free a job's blocks (its chunks done so far stay in the prefix cache)."""
        self.jobs.remove(job)
        self._cache_blocks(job.blocks, job.tokens, job.done, job.epoch)
        self.allocator.release(job.blocks)
        self.allocator.release(list(job.spare.values()))
        job.spare.clear()

    def _leave_job(self, req: Request) -> None:
        job = next(j for j in self.jobs if req in j.members)
        job.members.remove(req)
        spare = job.spare.pop(id(req), None)
        if spare is not None:
            self.allocator.release([spare])
        if not job.members:
            self._drop_job(job)

    def _job_of(self, req: Request) -> PrefillJob | None:
        return next((j for j in self.jobs if req in j.members), None)

    def _finish(self, req: Request, reason: dict[str, Any], *, queued_abort: bool = False) -> None:
        if req in self.running:
            self._leave_running(req)
        elif self._job_of(req) is not None:
            self._leave_job(req)
        req.admitted = -1
        req.finish_reason = reason
        self.stats.finished_requests += 1
        if reason["type"] == "abort":
            self.stats.aborted_requests += 1
        log.debug("request %s finished: %s after %d tokens", req.rid, reason, len(req.output_ids))
        req.sink(req.snapshot(self.weight_version, queued_abort=queued_abort))

    def _abort(self, rid: str, abort_all: bool) -> int:
        if not abort_all and not rid:
            return 0
        match = (lambda r: True) if abort_all else (lambda r: r.rid.startswith(rid))
        admitted = [r for j in self.jobs for r in j.members] + self.running
        hits = [r for r in admitted if match(r)]
        for req in hits:
            self._finish(req, finish_abort(ABORTED))
        queued = [r for r in self.waiting if match(r)]
        for req in queued:
            self.waiting.remove(req)
            self._finish(req, finish_abort(ABORT_IN_WAITING_QUEUE), queued_abort=True)
        return len(hits) + len(queued)

    def _fail_running(self, exc: Exception) -> None:
        """After a failed step the KV cache state is unknown: answer every admitted request with an error."""
        self.stats.errors += 1
        admitted = [r for j in self.jobs for r in j.members] + self.running
        self.jobs.clear()
        self.running.clear()
        self.cache.reset()
        self._batch = None
        for req in admitted:
            req.blocks = []
            self._finish(req, finish_abort(f"engine error: {exc}", 500, "InternalServerError"))

    # -- pause modes ----------------------------------------------------------------------------------------

    def _pause(self, mode: str) -> None:
        self.paused_mode = mode
        if mode != "retract":
            return
        # Retract: free every admitted request's KV and put it back at the head of the queue, oldest first
        # (their full blocks stay in the prefix cache unless the weights change before they resume).
        while self.running or self.jobs:
            self._retract_youngest()

    def _resume(self) -> None:
        self.paused_mode = None

    # -- weights --------------------------------------------------------------------------------------------

    def set_weight_version(self, label: str) -> None:
        """Label later tokens with ``label`` (scheduler thread): live requests start a new span with their next
        token, so ``weight_versions`` shows the switch."""
        self.weight_version = str(label)

    def flush_cache(self) -> bool:
        """SGLang refuses a flush while requests run, or wait while not paused; a permitted flush empties the
        prefix cache."""
        if self.running or self.jobs or (self.waiting and self.paused_mode is None):
            return False
        self.allocator.clear_cache()
        return True

    def ongoing(self) -> str:
        """What keeps the engine from being idle (scheduler thread): '' when no request is admitted or queued."""
        admitted = self._admitted_count()
        if not admitted and not self.waiting:
            return ""
        return f"{admitted} requests running, {len(self.waiting)} waiting"

    def invalidate_prefix_cache(self) -> None:
        """The weights changed (scheduler thread): no KV computed before may be found by a later request.
        Requests that hold blocks keep them (an ``in_place`` pause decodes on), but never cache them."""
        self.allocator.clear_cache()
