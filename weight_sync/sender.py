"""Learner side of the weight sync: gather full tensors from FSDP2 shards, bucket them, broadcast them from the
learner's rank 0 to every engine rank (or, colocated, pass them by handle) while driving SGLang's HTTP update
protocol, and survive engines dying.

Every learner rank calls ``sync_weights(model, version, sender)``; only rank 0 holds a ``WeightSender``.

Pipelining: the calling (main) thread of every rank walks the parameters and gathers each one
(``DTensor.full_tensor()``, an all-gather over the learner's own group); on rank 0 it also packs the gathered
tensors into buckets (and the ``flattened_bucket`` byte buffer) and hands each full bucket to a sender thread
through a queue of depth one. The sender thread does the HTTP calls and the broadcast of one bucket at a time.
So bucket k+1 is gathered and packed while bucket k is on the wire, and at most three buckets are alive at once
(one in flight, one queued, one filling). Buckets are serialized on the wire: the HTTP call for bucket k+1 is
sent only after every engine confirmed bucket k, because engines post their receives in the order their HTTP
requests arrive.

Faults: every HTTP call and every broadcast wait is bounded by ``timeout_s``. A failed attempt is attributed to
engines (transport failure or no answer to a probe = dead; otherwise the engines whose reply failed for a
reason other than a timeout), those are quarantined, the group is destroyed and rebuilt with the others, and
the whole model is sent again (every learner rank takes part in the new gather; rank 0 tells them by a
one-element broadcast over the learner's group). Survivors keep their weight-update session open across the
retry, so a partially updated engine never closes a session, never gets ``continue_generation``, and never
serves.

Colocated (``weight_sync.transport = "tensor"``: the learner and the engines share a device): the transport
changes, not the protocol. There is no process group; each packed bucket lives in a buffer that travels by
handle (a CUDA IPC handle on GPU, a /dev/shm file on CPU: ``weight_sync.tensor_transport``) through SGLang's
``/update_weights_from_tensor``, serialized once per engine rank. Versions, pause / begin / end / continue,
pipelining, quarantine, retries and rejoining are the code above, shared. A buffer stays alive and out of the
pool until every engine has replied (it is what they read), and after each attempt the sender unlinks its
buffers' names, so an engine killed while mapping one leaves nothing behind. Between syncs the engines sleep:
``WeightSender.sleep`` pauses them (abort) and releases their memory (``/release_memory_occupation``), and
``WeightSender.wake`` resumes it before the next ``sync_weights``, which updates and continues them.

Rejoining: before each sync the publisher calls ``WeightSender.rejoin``, which probes every engine's
``weight_version`` (``GET /model_info``). A quarantined engine that answers again, or a member whose label is not
the one this sender last completed on it (it restarted, and serves its initial weights), leaves quarantine and
the group is rebuilt with it, so the sync that follows brings it to the current policy. ``WeightSender.recover``
(a reload from a Hugging Face export) stays for callers that want an engine back without a sync.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from common.auth import auth_headers
from common.versioning import encode_label
from weight_sync import protocol, tensor_transport
from weight_sync.buckets import Bucket, BucketBuilder, flatten_into, unflatten
from weight_sync.config import WeightSyncConfig
from weight_sync.engine_http import EngineHttp, wait_reply
from weight_sync.group import UpdateGroup, default_backend, host_address, join_group, open_store
from weight_sync.lora import (
    LoraSpec,
    iter_adapter_tensors,
    iter_merged_tensors,
    lora_layers,
    lora_spec,
    write_peft_adapter,
)
from weight_sync.protocol import Reply

log = logging.getLogger(__name__)

# Wrapper prefixes that torch adds to parameter names; engines expect plain Hugging Face names.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


@dataclass(frozen=True)
class EngineSpec:
    """One engine server: its base URL and how many ranks (TP size) it puts in the group."""

    url: str
    ranks: int = 1

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"engine url = {self.url!r} must start with http:// or https://")
        if self.ranks < 1:
            raise ValueError(f"engine ranks = {self.ranks} for {self.url} must be >= 1")


def as_engine(engine: str | EngineSpec | tuple[str, int]) -> EngineSpec:
    if isinstance(engine, EngineSpec):
        return engine
    if isinstance(engine, str):
        return EngineSpec(engine.rstrip("/"))
    url, ranks = engine
    return EngineSpec(url.rstrip("/"), int(ranks))


def rank_layout(engines: Sequence[EngineSpec]) -> tuple[dict[str, int], int]:
    """``rank_offset`` per engine (1 + ranks of the engines before it) and ``world_size`` (1 + all ranks)."""
    offsets, next_rank = {}, 1
    for engine in engines:
        offsets[engine.url] = next_rank
        next_rank += engine.ranks
    return offsets, next_rank


@dataclass
class SyncResult:
    """What one ``sync_weights`` did. ``ok``: every engine that was in the pool got the whole model."""

    version: int
    engines_ok: list[str]
    engines_failed: dict[str, str]
    seconds: float
    paused_seconds: float
    bytes: int
    buckets: int = 0
    attempts: int = 1
    quarantined: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.engines_failed


def hf_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def iter_full_tensors(
    model: nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` for every parameter, gathered one at a time.

    Every learner rank must iterate this to the end: each ``full_tensor()`` is an all-gather over the FSDP
    mesh. Tied weights appear once (``named_parameters`` deduplicates), as in the HF checkpoint. A model with
    LoRA layers is sent merged (``W_base + scaling * B @ A`` under the base layer's HF name).
    """
    if lora_layers(model):
        yield from iter_merged_tensors(model, dtype)
        return
    for name, param in model.named_parameters():
        tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        yield hf_name(name), tensor.contiguous()


class BufferPool:
    """Pack buffers reused across buckets and syncs: on CPU a fresh multi-MB buffer page-faults on every 4 KiB
    each time (glibc maps and unmaps big buffers); on GPU the caching allocator does this anyway. ``count`` = 3:
    one in flight, one queued, one being packed."""

    def __init__(
        self,
        nbytes: int,
        device: torch.device,
        count: int = 3,
        alloc: Callable[[int, torch.device], torch.Tensor] | None = None,
    ) -> None:
        self.nbytes, self.device = nbytes, device
        # The colocated transport allocates buffers that can travel by handle (tensor_transport.SharedBuffers).
        self._alloc = alloc or (lambda n, dev: torch.empty(n, dtype=torch.uint8, device=dev))
        self._free: queue.Queue[torch.Tensor | None] = queue.Queue()
        for _ in range(count):
            self._free.put(None)  # a slot whose buffer is allocated on first use

    def acquire(self, nbytes: int, alive: Callable[[], bool]) -> torch.Tensor:
        if nbytes > self.nbytes:  # a lone tensor larger than a bucket: a one-off buffer
            return self._alloc(nbytes, self.device)
        while True:
            try:
                buf = self._free.get(timeout=0.5)
                break
            except queue.Empty:
                if not alive():
                    return self._alloc(self.nbytes, self.device)
        return buf if buf is not None else self._alloc(self.nbytes, self.device)

    def release(self, buf: torch.Tensor | None) -> None:
        if buf is not None and buf.numel() == self.nbytes and buf.device == self.device:
            self._free.put(buf)

    def forget(self) -> None:
        """A buffer was given up on (a broadcast may still read it): its slot gets a new one later."""
        self._free.put(None)


class _Attempt:
    """One pass over the model on rank 0: the main thread adds tensors, a sender thread ships buckets."""

    def __init__(self, sender: WeightSender, version: int, adapter: LoraSpec | None = None) -> None:
        self.sender = sender
        self.version = version
        self.adapter = adapter  # a LoRA adapter update: buckets go to /load_lora_adapter_from_distributed
        cfg = sender.config
        self.flattened = cfg.resolved_load_format(sender.backend) == "flattened_bucket"
        self.by_handle = cfg.transport == "tensor"  # colocated: /update_weights_from_tensor, no broadcast
        self.bucket_bytes = max(1, int(cfg.bucket_mb * 2**20))
        self.builder = BucketBuilder(self.bucket_bytes)
        self.queue: queue.Queue[Bucket | None] = queue.Queue(maxsize=1)
        self.members = list(sender.members)
        self.failures: dict[str, Reply] = {}
        self.error: str | None = None
        self.bytes = 0
        self.buckets = 0
        self.depth = cfg.pipeline_depth
        # Sent, not yet confirmed: the replies, the bytes, and (by handle) the buffer engines read until they reply.
        self.outstanding: deque[tuple[dict[str, Future[Reply]], int, torch.Tensor | None]] = deque()
        self.thread = threading.Thread(target=self._run, name="weight-sync-send", daemon=True)
        self.thread.start()

    @property
    def failed(self) -> bool:
        return bool(self.failures) or self.error is not None

    # ------------------------------------------------------------------------------------- main thread

    def add(self, name: str, tensor: torch.Tensor) -> None:
        done = self.builder.add(name, tensor)
        if done is not None:
            self._put(done)

    def finish(self) -> None:
        last = self.builder.flush()
        if last is not None:
            self._put(last)
        self._put(None)
        self.thread.join()

    def _put(self, bucket: Bucket | None) -> None:
        if bucket is not None and self.failed:
            return  # the attempt already failed: keep gathering (all ranks must) but ship nothing
        if bucket is not None and (self.flattened or self.by_handle):
            if len(bucket.tensors) == 1 and not self.by_handle:  # one contiguous tensor: its bytes, no copy
                bucket.flat = bucket.tensors[0].view(-1).view(torch.uint8)
            else:  # packed here, overlapping the previous bucket's broadcast, into a pooled buffer (by handle:
                # always, so that engines map the sender's buffer, never a model tensor)
                pool = self.sender.pool(self.bucket_bytes, bucket.tensors[0].device)
                bucket.storage = pool.acquire(bucket.nbytes, self.thread.is_alive)
                bucket.flat = flatten_into(bucket.tensors, bucket.storage)
            bucket.tensors = [] if self.flattened else [t for _, t in unflatten(bucket.flat, bucket.metas)]
        while self.thread.is_alive():
            try:
                self.queue.put(bucket, timeout=0.5)
                return
            except queue.Full:
                continue

    # ----------------------------------------------------------------------------------- sender thread

    def _run(self) -> None:
        try:
            if self.members:
                self._prepare()
        except Exception as exc:  # never leave the main thread blocked on the queue
            self.error = f"prepare failed: {exc!r}"
        try:
            while True:
                bucket = self.queue.get()
                if bucket is None:
                    return
                if self.failed or not self.members:
                    self.sender.release(bucket.storage)
                    continue
                try:
                    self._send(bucket)
                except Exception as exc:
                    self.error = f"bucket {self.buckets}: {exc!r}"
        finally:
            self._confirm(keep=0)

    def _prepare(self) -> None:
        """Pause every member not yet paused, then open a session where the server has sessions."""
        s = self.sender
        # No adapter endpoint takes handles: refuse before pausing anything.
        if self.adapter is not None and self.by_handle:
            self.error = "lora_sync = 'adapter' needs transport = 'distributed'; use 'merged' when colocated"
            return
        if self.adapter is not None:  # before pausing: an engine that cannot take the adapter keeps serving
            self._probe_adapter_endpoint()
            if self.failures:
                return
        if s.pause_started is None:
            s.pause_started = time.perf_counter()
        self.failures.update(s.pause([e.url for e in self.members], s.config.pause_mode))
        if self.failures:
            return
        to_begin = [
            e.url for e in self.members if s.has_session.get(e.url) is not False and e.url not in s.sessions
        ]
        for url, reply in s.http.call_all(to_begin, protocol.BEGIN, protocol.begin_body()).items():
            if reply.not_found:
                s.has_session[url] = False  # SGLang before 0.5.23: no session
            elif reply.ok or reply.message == protocol.MSG_BEGIN_TWICE:
                s.has_session[url] = True
                s.sessions.add(url)
            else:
                self.failures[url] = reply

    def _probe_adapter_endpoint(self) -> None:
        """Before any adapter broadcast: an engine without ``/load_lora_adapter_from_distributed`` (SGLang) would
        answer 404 and never post its receive, and the abandoned broadcast would hold the group until its timeout.
        An empty body finds out without touching the engine (400: the route exists; 404: it does not)."""
        s = self.sender
        unknown = [e.url for e in self.members if e.url not in s.takes_adapters]
        for url, reply in s.http.call_all(unknown, protocol.LOAD_LORA_DISTRIBUTED, {}).items():
            if reply.not_found:
                self.failures[url] = Reply(
                    404,
                    {"message": f"{protocol.LOAD_LORA_DISTRIBUTED} not found: this engine takes no adapter over the "
                     "update group (SGLang: set weight_sync.lora_sync to adapter_path or merged)"},
                )  # fmt: skip
            elif not reply.transport_failed:
                s.takes_adapters.add(url)

    def _send(self, bucket: Bucket) -> None:
        """One bucket: the update call to every engine and the broadcast. Returns once the broadcast completed
        (every engine has received it) with at most ``pipeline_depth - 1`` earlier buckets unconfirmed, so the
        engines load bucket k while bucket k+1 is on the wire."""
        s, cfg = self.sender, self.sender.config
        self._confirm(keep=self.depth - 1)
        if self.failed:
            self.sender.release(bucket.storage)
            return
        if self.by_handle:
            self._send_handles(bucket)
            return
        body = protocol.update_distributed_body(
            bucket.metas,
            group_name=cfg.group_name,
            flush_cache=cfg.flush(),
            weight_version=encode_label(self.version),
            load_format="flattened_bucket" if self.flattened else None,
        )
        path = protocol.UPDATE_DISTRIBUTED
        if self.adapter is not None:
            path = protocol.LOAD_LORA_DISTRIBUTED
            body = {
                **body,
                "lora_name": cfg.adapter_name(self.version),
                "config_dict": self.adapter.config_dict(),
            }
        futures = {e.url: s.http.submit(e.url, path, body) for e in self.members}
        payload = [bucket.flat] if self.flattened else bucket.tensors
        works = [s.group.broadcast(t, async_op=True) for t in payload]
        self.outstanding.append((futures, bucket.nbytes, None))
        if self._wait_broadcast(works, payload):
            self.sender.release(bucket.storage)
        else:
            self.sender.forget(bucket.storage)

    def _send_handles(self, bucket: Bucket) -> None:
        """Colocated: one ``update_weights_from_tensor`` per engine, whose payload names the packed buffer (a CUDA
        IPC handle, or a shared-memory file on CPU), serialized once per engine rank (rank r reads element r).
        Nothing is copied here; the buffer stays alive, and out of the pool, until every engine has replied."""
        s, cfg = self.sender, self.sender.config
        payload = tensor_transport.bucket_payload(bucket.flat, bucket.metas, self.flattened)
        futures = {}
        for engine in self.members:
            body = protocol.update_tensor_body(
                [tensor_transport.serialize(payload) for _ in range(engine.ranks)],
                flush_cache=cfg.flush(),
                weight_version=encode_label(self.version),
                load_format="flattened_bucket" if self.flattened else None,
            )
            futures[engine.url] = s.http.submit(engine.url, protocol.UPDATE_TENSOR, body)
        self.outstanding.append((futures, bucket.nbytes, bucket.storage))

    def _confirm(self, keep: int) -> None:
        """Collect replies, oldest bucket first, until at most ``keep`` buckets are unconfirmed."""
        while len(self.outstanding) > keep:
            futures, nbytes, storage = self.outstanding.popleft()
            confirmed = True
            for url, fut in futures.items():
                reply = wait_reply(fut, self.sender.config.timeout_s)
                if not reply.ok:
                    self.failures[url] = reply
                    confirmed = False
            if confirmed:
                self.bytes += nbytes
                self.buckets += 1
            if storage is not None:  # by handle: an engine that did not answer may still read it
                (self.sender.release if confirmed else self.sender.forget)(storage)

    def _engine_failed(self) -> bool:
        return any(
            f.done() and not f.result().ok for futures, _, _ in self.outstanding for f in futures.values()
        )

    def _wait_broadcast(self, works: list, payload: list) -> bool:
        """Wait for the broadcast, but stop waiting early when an engine already failed this bucket (its
        receive will never be posted, so the broadcast could only time out). False: given up on, the buffers
        may still be read by the backend."""
        timeout_s = self.sender.config.timeout_s
        deadline = time.monotonic() + timeout_s
        pending = list(works)
        while pending:
            pending = [w for w in pending if not w.is_completed()]
            if not pending:
                break
            if self._engine_failed():
                self.error = "broadcast abandoned: an engine failed the update"
                self.sender.abandon(works, payload)
                return False
            if time.monotonic() > deadline:
                self.error = f"broadcast not complete within {timeout_s:g} s"
                self.sender.abandon(works, payload)
                return False
            time.sleep(0.001)
        try:
            for work in works:
                work.wait(timedelta(seconds=timeout_s))
        except Exception as exc:  # a member died mid-broadcast (gloo: connection reset)
            self.error = f"broadcast failed: {exc}"
        return True


class WeightSender:
    """Learner rank 0's end of the weight sync, for a pool of engines (SGLang or the built-in engine)."""

    def __init__(
        self,
        engines: Iterable[str | EngineSpec | tuple[str, int]],
        config: WeightSyncConfig | None = None,
        api_key: str | None = None,
    ) -> None:
        self.config = config or WeightSyncConfig()
        self.engines: list[EngineSpec] = [as_engine(e) for e in engines]
        urls = [e.url for e in self.engines]
        if len(set(urls)) != len(urls):
            raise ValueError(f"engines: duplicate URLs in {urls}")
        self.backend = default_backend() if self.config.backend == "auto" else self.config.backend
        self.address = self.config.master_address or host_address()
        self.http = EngineHttp(self.config.timeout_s, auth_headers(api_key))  # the run secret, if any
        self.group: UpdateGroup | None = None
        self.members: list[EngineSpec] = []
        self.quarantined: dict[str, str] = {}
        self.has_session: dict[str, bool] = {}
        self.sessions: set[str] = set()  # engines with a session we opened and have not closed
        self.takes_adapters: set[str] = set()  # engines known to serve /load_lora_adapter_from_distributed
        self.paused: set[str] = set()
        self.pause_started: float | None = None
        self.pause_ended: float | None = None
        self.setup_error: str | None = None
        self.syncs = 0
        # The weight_version label this sender last completed on each engine (an update that ended and
        # continued). A member whose probe reports anything else restarted since, or was updated by someone else.
        self.given: dict[str, str] = {}
        # Broadcasts given up on, with their buffers: gloo may still read them until the peer goes away.
        self._abandoned: list[tuple[list, list]] = []
        self._pool: BufferPool | None = None
        # Transport "tensor": this attempt's buffers that travel by handle, and the tags the last sleep released.
        self._shared: tensor_transport.SharedBuffers | None = None
        self._asleep: list[str] | None = None

    def pool(self, bucket_bytes: int, device: torch.device) -> BufferPool:
        by_handle = self.config.transport == "tensor"
        stale = self._pool is None or (self._pool.nbytes, self._pool.device) != (bucket_bytes, device)
        if stale or by_handle != (self._shared is not None):  # plain buffers must never travel by handle
            alloc = None
            if by_handle:
                self._shared = self._shared or tensor_transport.SharedBuffers()
                alloc = self._shared.empty
            self._pool = BufferPool(bucket_bytes, device, alloc=alloc)
        return self._pool

    def _drop_shared(self) -> None:
        """After an attempt by handle (every engine answered or was given up on): unlink the buffers' names, so a
        receiver killed while holding one leaves nothing in /dev/shm, and start the next attempt with new ones."""
        if self._shared is not None:
            self._shared.close()
            self._shared, self._pool = None, None

    def release(self, buf: torch.Tensor | None) -> None:
        if self._pool is not None:
            self._pool.release(buf)

    def forget(self, buf: torch.Tensor | None) -> None:
        if self._pool is not None and buf is not None:
            self._pool.forget()

    def abandon(self, works: list, payload: list) -> None:
        self._abandoned = [(w, p) for w, p in self._abandoned if not all(x.is_completed() for x in w)]
        self._abandoned.append((works, payload))

    # ---------------------------------------------------------------------------------------- group

    @property
    def healthy(self) -> list[EngineSpec]:
        return [e for e in self.engines if e.url not in self.quarantined]

    @property
    def connected(self) -> bool:
        """A group is built (transport distributed), or the members are known (tensor: there is no group)."""
        return self.group is not None if self.config.transport != "tensor" else bool(self.members)

    def connect(self) -> dict[str, str]:
        """(Re)build the group with every engine not quarantined; returns the engines quarantined on the way.

        An engine whose init fails is quarantined and the group is built again without it.
        """
        newly: dict[str, str] = {}
        # Engines that do not answer a probe now would only make every other member's join time out.
        unreachable = {u: "no answer to a probe before the group was built"
                       for u, ok in self._alive([e.url for e in self.healthy]).items() if not ok}  # fmt: skip
        if unreachable:
            self._quarantine(unreachable)
            newly.update(unreachable)
        while True:
            try:
                failures = self._build_group(self.healthy)
            except Exception as exc:  # trouble on this side (store port, backend): no engine to blame
                self.setup_error = f"update group setup failed: {exc!r}"
                log.error("%s", self.setup_error)
                self.group, self.members = None, []
                return newly
            self.setup_error = None
            if not failures:
                return newly
            blamed = self._blame(failures)
            self._quarantine(blamed)
            newly.update(blamed)

    def set_engines(self, engines: Iterable[str | EngineSpec | tuple[str, int]]) -> dict[str, str]:
        """Membership changed (an engine joined or left): rebuild the group with the engines present.

        The caller must then run ``sync_weights`` with the current version so that newcomers get the weights.
        """
        new = [as_engine(e) for e in engines]
        self.engines = new
        keep = {e.url for e in new}
        self.quarantined = {u: r for u, r in self.quarantined.items() if u in keep}
        self.paused &= keep
        self.sessions &= keep
        return self.connect()

    def _build_group(self, members: list[EngineSpec]) -> dict[str, Reply]:
        self._teardown_group()
        if not members:
            return {}
        cfg = self.config
        if cfg.transport == "tensor":  # colocated: no process group; every bucket names its own memory
            self.members = list(members)
            log.info("colocated weight sync (by handle): %d engines", len(members))
            return {}
        # A group of this name that an engine still holds is the leftover of a learner that died (the engine
        # would refuse to join a second one): destroy it first. "Does not exist" is the usual answer.
        self.http.call_all(
            [e.url for e in members], protocol.DESTROY_GROUP, protocol.destroy_group_body(cfg.group_name)
        )
        offsets, world = rank_layout(members)
        store = open_store(self.address, cfg.master_port, 0, world, cfg.timeout_s)
        port = store.port
        futures = {
            e.url: self.http.submit(
                e.url,
                protocol.INIT_GROUP,
                protocol.init_group_body(
                    self.address, port, offsets[e.url], world, cfg.group_name, self.backend
                ),
            )
            for e in members
        }
        group, join_error = None, None
        try:
            group = join_group(
                self.address, port, 0, world, cfg.group_name, self.backend, cfg.timeout_s, store
            )
        except Exception as exc:  # some engine did not join in time; the replies say which
            join_error = exc
        replies = {url: wait_reply(fut, cfg.timeout_s) for url, fut in futures.items()}
        failures = {url: r for url, r in replies.items() if not r.ok}
        if join_error is not None or failures:
            if group is not None:
                group.destroy()
            joined = [url for url, r in replies.items() if r.ok]
            self.http.call_all(joined, protocol.DESTROY_GROUP, protocol.destroy_group_body(cfg.group_name))
            if not failures:
                failures = {e.url: Reply(0, None, f"group join failed: {join_error}") for e in members}
            return failures
        self.group, self.members = group, list(members)
        log.info(
            "weight-update group %s: %d engines, world size %d, port %d",
            cfg.group_name,
            len(members),
            world,
            port,
        )
        return {}

    def _teardown_group(self) -> None:
        if self.group is None:
            self.members = []  # already empty unless the members had no group (transport tensor)
            return
        urls = [e.url for e in self.members if e.url not in self.quarantined]
        self.http.call_all(urls, protocol.DESTROY_GROUP, protocol.destroy_group_body(self.config.group_name))
        self.group.destroy()
        self.group, self.members = None, []

    def _quarantine(self, blamed: dict[str, str]) -> None:
        for url, reason in blamed.items():
            log.warning("quarantining engine %s: %s", url, reason)
            self.quarantined[url] = reason
            self.sessions.discard(url)
            self.paused.discard(url)  # it stays paused on its side: a partially updated engine never serves
            self.has_session.pop(url, None)
            self.given.pop(url, None)

    def _alive(self, urls: Iterable[str]) -> dict[str, bool]:
        """A cheap probe that never generates (``/health`` would block while paused): any HTTP answer."""
        timeout = min(self.config.timeout_s, 5.0)
        futures = {u: self.http.submit(u, protocol.MODEL_INFO, None, timeout, method="GET") for u in urls}
        return {u: not wait_reply(f, timeout).transport_failed for u, f in futures.items()}

    def probe_versions(self, urls: Iterable[str]) -> dict[str, str | None]:
        """Each engine's ``weight_version`` label from ``GET /model_info`` (never generates); None when it does
        not answer. SGLang's initial label is ``"default"``."""
        timeout = min(self.config.timeout_s, 5.0)
        futures = {u: self.http.submit(u, protocol.MODEL_INFO, None, timeout, method="GET") for u in urls}
        out: dict[str, str | None] = {}
        for url, fut in futures.items():
            reply = wait_reply(fut, timeout)
            body = reply.body if isinstance(reply.body, dict) else {}
            out[url] = str(body.get("weight_version", "")) if reply.status == 200 else None
        return out

    def rejoin_plan(self) -> tuple[dict[str, str], dict[str, str]]:
        """(engines to bring back, members to quarantine), each {url: why}, from one probe of every engine:

        - a quarantined engine that answers (restarted, or healthy again) comes back;
        - a member whose label differs from the one this sender last completed on it restarted (or was changed
          behind our back): its place in the group is gone, so it joins again;
        - a member that does not answer is quarantined, before a sync waits on it."""
        labels = self.probe_versions([e.url for e in self.engines])
        back: dict[str, str] = {}
        for url, reason in self.quarantined.items():
            if labels.get(url) is not None:
                back[url] = f"answers again (weight_version {labels[url]!r}) after: {reason}"
        for engine in self.members:
            label, given = labels.get(engine.url), self.given.get(engine.url)
            if label is not None and given is not None and label != given:
                back[engine.url] = f"serves weight_version {label!r}, was given {given!r}: it restarted"
        silent = {
            e.url: "no answer to a probe before a sync" for e in self.members if labels.get(e.url) is None
        }
        return back, silent

    def rejoin(self) -> dict[str, str]:
        """Carry out :meth:`rejoin_plan` and rebuild the group when anything changed; returns the engines brought
        back. The caller's next ``sync_weights`` then gives every engine in the group the current weights."""
        back, silent = self.rejoin_plan()
        for url, why in back.items():
            log.info("engine %s rejoins: %s", url, why)
            self._forget(url)
        if silent:
            self._quarantine(silent)
        if back or silent or (not self.connected and self.healthy):
            self.connect()
        return back

    def _forget(self, url: str) -> None:
        """Drop everything this sender believed about an engine: it starts over as a new member."""
        self.quarantined.pop(url, None)
        self.paused.discard(url)
        self.sessions.discard(url)
        self.has_session.pop(url, None)
        self.given.pop(url, None)
        self.takes_adapters.discard(url)

    def _blame(self, failures: dict[str, Reply]) -> dict[str, str]:
        """Which engines caused a failed step: dead ones (transport failure or no answer to a probe); if none
        is dead, those whose failure was not a timeout (a timeout is usually collateral); else all of them."""
        alive = self._alive([e.url for e in self.members or self.healthy] + list(failures))
        # A reply that timed out is no proof of death: an engine stuck waiting for a dead peer times out too.
        dead = {
            u: r.describe() for u, r in failures.items() if r.transport_failed and not alive.get(u, False)
        }
        for url, ok in alive.items():
            if not ok and url not in dead:
                dead[url] = "no answer to a probe after a failed update"
        if dead:
            return dead
        explicit = {u: r.describe() for u, r in failures.items()}
        not_timeouts = {
            u: m for u, m in explicit.items() if "timed out" not in m.lower() and "timeout" not in m.lower()
        }
        return not_timeouts or explicit

    # ------------------------------------------------------------------------------------- per update

    def start_attempt(self, version: int, adapter: LoraSpec | None = None) -> _Attempt:
        if not self.connected and self.healthy:
            self.connect()
        return _Attempt(self, version, adapter)

    def finish_attempt(self, attempt: _Attempt, state: _SyncState) -> bool:
        """Close an attempt; returns True when the model must be sent again (after a rebuild)."""
        attempt.finish()
        self._drop_shared()
        state.attempts += 1
        state.bytes += attempt.bytes
        state.buckets += attempt.buckets
        if not attempt.members:  # no group (all quarantined, or it could not be set up): nothing was sent
            reason = self.setup_error or "not in the update group"
            state.failed.update({e.url: reason for e in self.healthy})
            return False
        if not attempt.failed:
            failures = self._complete(attempt.members, encode_label(attempt.version))
            if not failures:
                state.ok = [e.url for e in attempt.members]
                return False
            attempt.failures.update(failures)
        if not attempt.failures:  # a local broadcast error, nobody to blame: report all, rebuild, no retry
            reason = attempt.error or "update failed"
            state.failed.update({e.url: reason for e in attempt.members})
            self.connect()  # they stay paused with partial weights until a sync goes through
            return False
        blamed = self._blame(attempt.failures)
        self._quarantine(blamed)
        state.failed.update(blamed)
        self.connect()  # destroy the broken group, rebuild with the survivors (may quarantine more)
        survivors = [e.url for e in self.members]
        if survivors and state.attempts < self.config.max_attempts:
            log.warning("re-sending version %d to %d surviving engines", attempt.version, len(survivors))
            return True
        for url in survivors:
            state.failed[url] = f"not updated after {state.attempts} attempts: {attempt.error or 'failed'}"
        return False

    def _complete(self, members: list[EngineSpec], label: str) -> dict[str, Reply]:
        """End the sessions, then let generation continue, on engines that received the whole model (they now
        serve ``label``)."""
        urls = [e.url for e in members]
        ends = self.http.call_all([u for u in urls if u in self.sessions], protocol.END, protocol.end_body())
        failures = {u: r for u, r in ends.items() if not r.ok}
        self.sessions -= set(ends)
        resumable = [u for u in urls if u not in failures]
        conts = self.http.call_all(resumable, protocol.CONTINUE, protocol.continue_body())
        failures.update({u: r for u, r in conts.items() if not r.ok})
        self.paused -= {u for u, r in conts.items() if r.ok}
        for url, reply in conts.items():
            if reply.ok:
                self.given[url] = label
            else:
                self.given.pop(url, None)
        self.pause_ended = time.perf_counter()
        return failures

    # -------------------------------------------------------------------------------------- recovery

    def recover(self, url: str, model_path: str, weight_version: str, wait_s: float | None = None) -> bool:
        """Bring a quarantined engine back: wait for it to answer (the caller restarted it), reload it from the
        learner's latest Hugging Face export, let it generate, and rebuild the group with it.

        Its weights are then the export's (``weight_version``); the next ``sync_weights`` brings it to the
        current version. Returns False (and keeps it quarantined) when it does not come back in ``wait_s``.
        """
        url = url.rstrip("/")
        if url not in {e.url for e in self.engines}:
            raise ValueError(f"recover: {url} is not one of the sender's engines")
        deadline = time.monotonic() + (wait_s or self.config.timeout_s)
        while not self._alive([url])[url]:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        body = protocol.update_from_disk_body(model_path, weight_version, flush_cache=self.config.flush())
        reply = self.http.call(url, protocol.UPDATE_FROM_DISK, body)
        if not reply.ok:
            self.quarantined[url] = f"recovery failed: {reply.describe()}"
            return False
        self.http.call(url, protocol.END, protocol.end_body())  # closes a session left open, if any
        cont = self.http.call(url, protocol.CONTINUE, protocol.continue_body())
        if not cont.ok:
            self.quarantined[url] = f"recovery failed: {cont.describe()}"
            return False
        self.quarantined.pop(url, None)
        self.given[url] = weight_version
        self.connect()
        return url not in self.quarantined

    # ------------------------------------------------------------------------ sleep and wake (colocated)

    def sleep(self, tags: Sequence[str] | None = ("kv_cache",)) -> dict[str, str]:
        """Colocated mode, before the learner trains: pause every healthy engine and release the memory of ``tags``
        (``/release_memory_occupation``; None: all, weights included). The pause is always ``abort``: a release
        needs an idle engine (SGLang asserts it), and the rollout workers resubmit what was aborted.

        Engines stay paused until the ``sync_weights`` after :meth:`wake` continues them. One that fails is
        quarantined (it stays paused; ``rejoin`` brings it back once it answers). Returns those ``{url: why}``."""
        body = protocol.memory_body(list(tags) if tags is not None else None)
        failures = {
            u: f"{protocol.PAUSE}: {r.describe()}" for u, r in self.pause(self._urls(), "abort").items()
        }
        ok = [url for url in self._urls() if url not in failures]
        for url, reply in self.http.call_all(ok, protocol.RELEASE_MEMORY, body).items():
            if reply.status != 200:
                failures[url] = f"{protocol.RELEASE_MEMORY}: {reply.describe()}"
        self._asleep = list(tags) if tags is not None else list(protocol.MEMORY_TAGS)
        self._quarantine(failures)
        return failures

    def wake(self, tags: Sequence[str] | None = None) -> dict[str, str]:
        """After training, before ``sync_weights``: ``/resume_memory_occupation`` of ``tags`` (default: what
        :meth:`sleep` released) on every healthy engine. They stay paused; the sync brings the new weights (a
        released ``weights`` tag reads zeros until then) and continues them. Failures are quarantined."""
        tags = list(tags) if tags is not None else self._asleep
        body = protocol.memory_body(tags)
        failures = {
            url: f"{protocol.RESUME_MEMORY}: {reply.describe()}"
            for url, reply in self.http.call_all(self._urls(), protocol.RESUME_MEMORY, body).items()
            if reply.status != 200
        }
        self._asleep = None
        self._quarantine(failures)
        return failures

    def continue_generation(self) -> dict[str, str]:
        """After a step that publishes nothing (its weights unchanged): ``/continue_generation`` on every engine
        this sender paused. Failures are quarantined; returns them."""
        urls = [url for url in self._urls() if url in self.paused]
        replies = self.http.call_all(urls, protocol.CONTINUE, protocol.continue_body())
        self.paused -= {u for u, r in replies.items() if r.ok}
        failures = {u: f"{protocol.CONTINUE}: {r.describe()}" for u, r in replies.items() if not r.ok}
        self._quarantine(failures)
        return failures

    def _urls(self) -> list[str]:
        return [e.url for e in self.healthy]

    def pause(self, urls: Iterable[str], mode: str) -> dict[str, Reply]:
        """``/pause_generation`` on each of ``urls`` not yet paused by this sender; returns the failed replies."""
        todo = [url for url in urls if url not in self.paused]
        failures = {}
        for url, reply in self.http.call_all(todo, protocol.PAUSE, protocol.pause_body(mode)).items():
            if reply.ok:
                self.paused.add(url)
            else:
                failures[url] = reply
        return failures

    def close(self) -> None:
        """Destroy the group on the engines and here; close HTTP. Engines are left generating."""
        try:
            self._teardown_group()
            self._drop_shared()
        finally:
            self.http.close()


@dataclass
class _SyncState:
    ok: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    attempts: int = 0
    bytes: int = 0
    buckets: int = 0


def _agree(flag: bool, model: nn.Module, process_group: dist.ProcessGroup | None) -> bool:
    """Rank 0's decision, known to every learner rank (one int broadcast over the learner's group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(process_group) == 1:
        return flag
    device = next(iter(model.parameters())).device
    if dist.get_backend(process_group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    box = torch.tensor([int(flag)], dtype=torch.int32, device=device if device.type != "meta" else "cpu")
    dist.broadcast(box, group=process_group, group_src=0)
    return bool(box.item())


def sync_weights(
    model: nn.Module,
    version: int,
    sender: WeightSender | None,
    process_group: dist.ProcessGroup | None = None,
    lora_sync: str = "adapter",
) -> SyncResult | None:
    """Send ``model``'s current weights to every engine as ``weight_version = encode_label(version)``.

    Call on every learner rank (each takes part in the FSDP gathers); pass the ``WeightSender`` on rank 0 of
    ``process_group`` (default: the learner's default group) and None elsewhere. Returns the ``SyncResult`` on
    rank 0, None elsewhere. Never raises for an engine's failure: failed engines are in the result.

    A model with LoRA layers sends, by ``lora_sync`` (``weight_sync.lora_sync``, the same on every rank):
    ``adapter``, only the adapter tensors over the group (``/load_lora_adapter_from_distributed``); ``merged``,
    every weight with the adapter merged in (any engine, SGLang without ``--enable-lora`` included);
    ``adapter_path``, a PEFT adapter directory loaded by SGLang's ``/load_lora_adapter``
    (:func:`sync_adapter_by_path`).
    """
    spec = lora_spec(model)
    if spec is not None and lora_sync == "adapter_path":
        return sync_adapter_by_path(model, version, sender, spec)
    adapter = spec if lora_sync == "adapter" else None
    t0 = time.perf_counter()
    state = _SyncState()
    dtype = None
    if sender is not None:
        if dist.is_available() and dist.is_initialized() and dist.get_rank(process_group) != 0:
            raise ValueError("sync_weights: the WeightSender must live on rank 0 of the learner's group")
        sender.pause_started = sender.pause_ended = None
        send_dtype = sender.config.send_dtype
        dtype = None if send_dtype == "auto" else getattr(torch, send_dtype)
    while True:
        attempt = sender.start_attempt(version, adapter) if sender is not None else None
        tensors = (
            iter_adapter_tensors(model, dtype) if adapter is not None else iter_full_tensors(model, dtype)
        )
        try:
            for name, tensor in tensors:
                if attempt is not None:
                    attempt.add(name, tensor)
        finally:
            again = sender.finish_attempt(attempt, state) if sender is not None else False
        if not _agree(again, model, process_group):
            break
    if sender is None:
        return None
    sender.syncs += 1
    start, end = sender.pause_started, sender.pause_ended or time.perf_counter()
    paused = 0.0 if start is None else end - start
    return SyncResult(
        version=version,
        engines_ok=state.ok,
        engines_failed=state.failed,
        seconds=time.perf_counter() - t0,
        paused_seconds=paused,
        bytes=state.bytes,
        buckets=state.buckets,
        attempts=state.attempts,
        quarantined=dict(sender.quarantined),
    )


def sync_adapter_by_path(
    model: nn.Module, version: int, sender: WeightSender | None, spec: LoraSpec
) -> SyncResult | None:
    """SGLang's LoRA path: rank 0 writes the adapter as a PEFT directory under ``weight_sync.adapter_dir`` (a
    filesystem every engine reads), each engine loads it with ``/load_lora_adapter`` as ``<lora_name>-v<N>``,
    its ``weight_version`` label is set to ``N`` (a load does not change it), and adapters older than the
    ``keep_adapters`` newest are unloaded. Requests select the adapter with ``lora_path = <lora_name>-v<N>``.

    No pause: SGLang keeps each request on the adapter it started with, so nothing is half-updated. Every
    learner rank calls this (the adapter tensors are gathered from the FSDP2 shards); rank 0 returns the result.
    """
    t0 = time.perf_counter()
    named = list(iter_adapter_tensors(model))
    if sender is None:
        return None
    cfg = sender.config
    if not cfg.adapter_dir:
        raise ValueError(
            "weight_sync.lora_sync = 'adapter_path' needs weight_sync.adapter_dir (read by every engine)"
        )
    name = cfg.adapter_name(version)
    path = write_peft_adapter(Path(cfg.adapter_dir) / name, named, spec)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    urls = [e.url for e in sender.healthy]
    failed: dict[str, str] = {}
    loads = sender.http.call_all(urls, protocol.LOAD_LORA, protocol.load_lora_body(name, str(path)))
    failed.update({u: f"{protocol.LOAD_LORA}: {r.describe()}" for u, r in loads.items() if not r.ok})
    loaded = [u for u in urls if u not in failed]
    label = protocol.update_weight_version_body(encode_label(version), abort_all_requests=False)
    labels = sender.http.call_all(loaded, protocol.UPDATE_WEIGHT_VERSION, label)
    failed.update(
        {u: f"{protocol.UPDATE_WEIGHT_VERSION}: {r.describe()}" for u, r in labels.items() if not r.ok}
    )
    ok = [u for u in loaded if u not in failed]
    for url in ok:
        sender.given[url] = encode_label(version)
    stale = version - cfg.keep_adapters
    if stale >= 0:  # best effort: an older version may never have been loaded here (a restart, a skip)
        sender.http.call_all(ok, protocol.UNLOAD_LORA, protocol.unload_lora_body(cfg.adapter_name(stale)))
    if failed:
        sender._quarantine(failed)
    sender.syncs += 1
    return SyncResult(
        version=version,
        engines_ok=ok,
        engines_failed=failed,
        seconds=time.perf_counter() - t0,
        paused_seconds=0.0,
        bytes=nbytes,
        buckets=1 if ok else 0,
        attempts=1,
        quarantined=dict(sender.quarantined),
    )
