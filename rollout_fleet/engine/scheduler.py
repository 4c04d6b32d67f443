"""Continuous batching: one thread owns the model, the KV cache and every live request.

Each iteration of the loop runs the commands other threads posted (new requests, aborts, pause / continue,
weight loads), then, unless paused, admits waiting requests with one batched prefill and runs one batched decode
step over everything running. A request joins the running batch right after its prefill and leaves it the step
it finishes, so one decode step serves requests that started at different times; prefill runs once per request
(again only after a retraction, over prompt + output so far).

Nothing here blocks on the event loop: results go out through each request's ``sink`` callback (called on this
thread; it must not block), and callers wait on ``concurrent.futures.Future`` objects with timeouts.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

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
from rollout_fleet.engine.runner import ModelRunner

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
    row: int = -1
    finish_reason: dict[str, Any] | None = None
    generator: torch.Generator | None = None

    @property
    def rid(self) -> str:
        return self.item.rid

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
        )


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
    decode_steps: int = 0
    decode_tokens: int = 0
    generated_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    retractions: int = 0
    errors: int = 0


class Scheduler:
    """The engine thread: admission, batched prefill and decode, finishing, aborts, pause modes."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        eos_token_ids: Iterable[int],
        decode_text: Callable[[list[int]], str],
        max_running_requests: int,
        max_prefill_tokens: int,
        seed: int = 0,
        step_log_size: int = 4096,
        weight_version: str = "0",
    ) -> None:
        self.runner = runner
        self.eos_token_ids = frozenset(eos_token_ids)
        self.decode_text = decode_text
        self.max_running = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.device = runner.device
        self.vocab_size = int(runner.model.config.vocab_size)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.weight_version = weight_version
        self.stats = SchedulerStats()
        self.step_log: collections.deque[StepRecord] = collections.deque(maxlen=step_log_size)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.paused_mode: str | None = None  # "retract" or "in_place" while the scheduler itself is paused
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
        """Approximate load figures for /v1/loads (read without stopping the loop)."""
        running = list(self.running)
        used = sum(r.kv_len for r in running)
        total = self.max_running * self.runner.max_context_len
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._throughput) if now - t < 10.0]
        span = max(now - recent[0][0], 1e-3) if recent else 1.0
        return {
            "num_running_reqs": len(running),
            "num_waiting_reqs": len(self.waiting),
            "num_used_tokens": used,
            "num_total_tokens": total,
            "token_usage": used / total if total else 0.0,
            "gen_throughput": sum(n for _, n in recent) / span if recent else 0.0,
            "cache_hit_rate": 0.0,
        }

    # -- the loop -----------------------------------------------------------------------------------------

    def _has_work(self) -> bool:
        return self.paused_mode is None and bool(self.running or self.waiting)

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                self._run_commands(block=not self._has_work())
                if self._stop.is_set():
                    break
                if not self._has_work():
                    continue
                try:
                    self._admit()
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
        seed = req.item.params.sampling_seed
        if seed is not None:
            req.generator = sampler.make_generator(seed, self.device)
        self.waiting.append(req)
        log.debug("request %s queued: %d prompt tokens", req.rid, len(req.item.input_ids))

    def _admit(self) -> None:
        """Move waiting requests into the running batch, within the row limit and the prefill token budget."""
        batch: list[Request] = []
        longest = 0
        while self.waiting and len(self.running) + len(batch) < self.max_running:
            n = len(self.waiting[0].item.input_ids) + len(self.waiting[0].output_ids)
            if batch and max(longest, n) * (len(batch) + 1) > self.max_prefill_tokens:
                break
            longest = max(longest, n)
            batch.append(self.waiting.popleft())
        if not batch:
            return
        try:
            self._prefill(batch)
        except Exception as exc:
            # Requests that never reached the running batch are answered here; _fail_running takes the rest.
            for req in batch:
                if req.row < 0 and req.finish_reason is None:
                    self._finish(req, finish_abort(f"engine error: {exc}", 500, "InternalServerError"))
            raise

    def _prefill(self, batch: list[Request]) -> None:
        seqs = [r.item.input_ids + r.output_ids for r in batch]
        positions = [self._logit_positions(r, len(s)) for r, s in zip(batch, seqs, strict=True)]
        rows = list(range(len(self.running), len(self.running) + len(batch)))
        computed = self.runner.prefill_tokens_computed
        logits = self.runner.prefill(rows, seqs, positions)
        computed = self.runner.prefill_tokens_computed - computed
        for req, row, seq, lg in zip(batch, rows, seqs, logits, strict=True):
            if self._wants_input_logprobs(req, len(seq)):
                req.input_logprobs = self._input_logprobs(req, seq, lg[:-1])
            req.row, req.kv_len = row, len(seq)
            req.prefill_count += 1
            self.running.append(req)
        self._batch = None
        self.stats.prefill_batches += 1
        self.stats.prefill_tokens_computed += computed
        self._record("prefill", batch, sum(len(s) for s in seqs))
        # Requests that may not generate at all finish here; the rest sample their next token.
        sampling = [r for r in batch if r.item.max_new_tokens > len(r.output_ids)]
        for req in batch:
            if req not in sampling:
                self._finish(req, finish_length(req.item.max_new_tokens))
        if sampling:
            index = {id(r): i for i, r in enumerate(batch)}
            last = torch.stack([logits[index[id(r)]][-1] for r in sampling])
            self._sample_and_advance(sampling, last, self._make_batch(sampling))

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
        reqs = list(self.running)
        tokens = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.long, device=self.device)
        positions = torch.tensor([r.kv_len for r in reqs], dtype=torch.long, device=self.device)
        logits = self.runner.decode(tokens, positions)
        for r in reqs:
            r.kv_len += 1
        self.stats.decode_steps += 1
        self.stats.decode_tokens += len(reqs)
        self._record("decode", reqs, len(reqs))
        if self._batch is None:
            self._batch = self._make_batch(reqs)
        self._sample_and_advance(reqs, logits, self._batch)

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

    def _release_row(self, req: Request) -> None:
        """Take ``req`` out of the running batch, moving the last row into its slot to keep rows compact."""
        last = len(self.running) - 1
        row = req.row
        if row != last:
            moved = self.running[last]
            self.runner.cache.move_row(last, row, moved.kv_len)
            self.running[row] = moved
            moved.row = row
        self.running.pop()
        req.row = -1
        self._batch = None

    def _finish(self, req: Request, reason: dict[str, Any], *, queued_abort: bool = False) -> None:
        if req.row >= 0:
            self._release_row(req)
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
        hits = [r for r in self.running if match(r)]
        for req in hits:
            self._finish(req, finish_abort(ABORTED))
        queued = [r for r in self.waiting if match(r)]
        for req in queued:
            self.waiting.remove(req)
            self._finish(req, finish_abort(ABORT_IN_WAITING_QUEUE), queued_abort=True)
        return len(hits) + len(queued)

    def _fail_running(self, exc: Exception) -> None:
        """After a failed step the KV cache state is unknown: answer the running requests with an error."""
        self.stats.errors += 1
        for req in list(self.running):
            self._finish(req, finish_abort(f"engine error: {exc}", 500, "InternalServerError"))
        self.runner.cache.reset()

    # -- pause modes ----------------------------------------------------------------------------------------

    def _pause(self, mode: str) -> None:
        self.paused_mode = mode
        if mode != "retract":
            return
        # Retract: free every running request's KV and put it back at the head of the queue, in order.
        for req in reversed(self.running):
            req.row, req.kv_len = -1, 0
            req.num_retractions += 1
            self.waiting.appendleft(req)
        self.stats.retractions += len(self.running)
        self.running.clear()
        self._batch = None

    def _resume(self) -> None:
        self.paused_mode = None

    # -- weights --------------------------------------------------------------------------------------------

    def set_weight_version(self, label: str) -> None:
        """Label later tokens with ``label`` (scheduler thread): live requests start a new span with their next
        token, so ``weight_versions`` shows the switch."""
        self.weight_version = str(label)

    def flush_cache(self) -> bool:
        """SGLang refuses a flush while requests run, or wait while not paused; there is no prefix cache
        here, so a permitted flush only shrinks the KV buffers."""
        if self.running or (self.waiting and self.paused_mode is None):
            return False
        self.runner.cache.reset()
        return True
