"""HTTP to the engines from the learner's rank 0: concurrent, every call bounded by a timeout.

Why a private event loop in a thread: an ``update_weights_from_distributed`` reply arrives only after the
broadcast it describes has completed, so the calls must be in flight while the sending thread broadcasts.
Calls return ``concurrent.futures.Future[Reply]``s; a transport failure (refused, reset, timed out) is a
``Reply`` with status 0, never an exception, so one dead engine cannot break the loop over the others.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from typing import Any

import aiohttp

from weight_sync.protocol import Reply


def wait_reply(future: Future[Reply], timeout_s: float) -> Reply:
    """The reply, or a transport failure if even the client's own timeout did not fire (a stuck loop)."""
    try:
        return future.result(timeout=timeout_s + 5.0)
    except TimeoutError:
        return Reply(0, None, f"no reply within {timeout_s:g} s")


class EngineHttp:
    """A pool of HTTP connections to engines, driven by one background asyncio loop."""

    def __init__(self, timeout_s: float, headers: Mapping[str, str] | None = None) -> None:
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})  # sent with every call (the run secret's, common.auth)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="weight-sync-http", daemon=True)
        self._thread.start()
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    async def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No pooling limit: one update call per engine is in flight at a time, plus control calls. Idle
            # connections are dropped after 3 s, before a server's own keep-alive timeout (uvicorn, which serves
            # SGLang, closes them after 5 s): reusing one the server has closed fails the request, and a failed
            # pause at the start of a sync would quarantine a healthy engine.
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0)
            self._session = aiohttp.ClientSession(connector=connector, headers=self.headers)
        return self._session

    async def _request(self, method: str, url: str, body: Any, timeout_s: float) -> Reply:
        try:
            session = await self._get_session()
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with session.request(method, url, json=body, timeout=timeout) as resp:
                text = await resp.text()
                try:
                    parsed = json.loads(text) if text else None
                except ValueError:
                    parsed = text
                return Reply(resp.status, parsed)
        except TimeoutError:
            return Reply(0, None, f"no reply within {timeout_s:g} s")
        except (aiohttp.ClientError, OSError) as exc:
            return Reply(0, None, f"{type(exc).__name__}: {exc}")

    def submit(
        self, base_url: str, path: str, body: Any = None, timeout_s: float | None = None, method: str = "POST"
    ) -> Future[Reply]:
        """Start one call; the future resolves to a ``Reply`` within ``timeout_s`` (default: the pool's)."""
        if self._closed:
            raise RuntimeError("EngineHttp is closed")
        url = base_url.rstrip("/") + path
        coro = self._request(method, url, {} if body is None else body, timeout_s or self.timeout_s)
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(
        self, base_url: str, path: str, body: Any = None, timeout_s: float | None = None, method: str = "POST"
    ) -> Reply:
        """One blocking call."""
        return wait_reply(self.submit(base_url, path, body, timeout_s, method), timeout_s or self.timeout_s)

    def call_all(
        self, urls: Iterable[str], path: str, body: Any = None, timeout_s: float | None = None
    ) -> dict[str, Reply]:
        """The same call to every engine, concurrently; returns when all have answered or timed out."""
        futures = {url: self.submit(url, path, body, timeout_s) for url in urls}
        return {url: wait_reply(fut, timeout_s or self.timeout_s) for url, fut in futures.items()}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def _shutdown() -> None:
            if self._session is not None:
                await self._session.close()

        asyncio.run_coroutine_threadsafe(_shutdown(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()
