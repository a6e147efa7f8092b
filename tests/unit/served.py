"""An aiohttp app served on a loop of its own thread, for synchronous Hypothesis tests
that send it many requests through aiohttp's test client (Hypothesis runs no async
test: each example is one blocking call here)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import strategies as st

REQUEST_TIMEOUT_S = 10.0


class Served:
    """``build`` (a coroutine function, run on the thread's loop: what it builds may be
    bound to that loop or thread) returns the app to serve; ``close`` ends it all."""

    def __init__(self, build: Callable[[], Awaitable[web.Application]]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.client: TestClient[Any, Any] = self._call(self._start(build))

    async def _start(self, build: Callable[[], Awaitable[web.Application]]) -> TestClient[Any, Any]:
        client: TestClient[Any, Any] = TestClient(TestServer(await build()))
        await client.start_server()
        return client

    def _call(self, coro: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()  # type: ignore[arg-type]

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        data: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, bytes]:
        async def send() -> tuple[int, bytes]:
            async with self.client.request(
                method,
                path,
                params=params,
                data=data,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
            ) as resp:
                return resp.status, await resp.read()

        return self._call(send())  # type: ignore[no-any-return]

    def run(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``fn()`` on the app's loop (to set up or inspect what it serves)."""
        return self._call(fn())

    def close(self) -> None:
        self._call(self.client.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**63 - 2, max_value=2**64)
    | st.floats()
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
path_parts = st.text(max_size=12) | st.sampled_from(
    ["", ".", "..", "%2e%2e", "%00", "a" * 300, "n01", "ghost", "job-1", "0", "-1", "9" * 30]
)
