"""A lean HTTP/1.1 client for the request path: keep-alive connections per worker, httptools
for parsing, response bodies handed over chunk by chunk as they arrive.

httpx measured at roughly 1 ms of CPU per proxied request on this path (its pool, anyio
wrappers and header models); this client does only what a reverse proxy needs. Control-plane
calls (discovery, health checks, scraping) still use httpx.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httptools

HIGH_WATER = 1 << 20  # pause reading from the worker when this much is buffered


class UpstreamConnectError(Exception):
    """The connection could not be made (nothing was sent)."""


class UpstreamClosed(Exception):
    """The worker closed the connection or sent something that is not HTTP."""

    def __init__(self, detail: str, *, before_response: bool) -> None:
        super().__init__(detail)
        self.before_response = before_response


class UpstreamAborted(UpstreamClosed):
    """kvroute gave up on the worker (found dead or hung) while the request was in flight."""


async def within(fut: asyncio.Future[None], seconds: float | None) -> None:
    """Wait for a future the connection resolves, failing it with TimeoutError after
    `seconds` (None: no limit). One timer per wait: `asyncio.timeout` (a context object,
    the current task, a reschedule and an exit check) cost ~2% of a request's CPU here."""
    if seconds is None:
        return await fut
    timer = fut.get_loop().call_later(seconds, _expire, fut)
    try:
        return await fut
    finally:
        timer.cancel()


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.status = 0
        self.keep_alive = True
        self.got_bytes = False
        self.head: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.waiter: asyncio.Future[None] | None = None
        self.complete = False
        self.error: BaseException | None = None
        self.paused = False
        self.interim = False

    def reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.headers = []
        self.status = 0
        self.got_bytes = False
        self.head = asyncio.get_running_loop().create_future()
        self.chunks.clear()
        self.buffered = 0
        self.complete = False
        self.interim = False

    # -- asyncio.Protocol --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamClosed("unexpected protocol upgrade", before_response=False))
        except httptools.HttpParserError as exc:
            self._fail(UpstreamClosed(f"bad HTTP from worker: {exc}", before_response=False))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.complete and exc is None and self._ends_at_close():
            self.complete = True  # a body without a length ends where the connection does
            self.keep_alive = False
            self._wake()
        if not self.complete:
            self._fail(
                UpstreamClosed(
                    f"worker closed the connection{': ' + str(exc) if exc else ''}",
                    before_response=not self.got_bytes,
                )
            )
        self.transport = None

    def _ends_at_close(self) -> bool:
        """The response head arrived and gave neither a length nor chunked framing."""
        head = self.head
        if self.error is not None or not head.done() or head.cancelled():
            return False
        if head.exception() is not None:
            return False
        for name, value in self.headers:
            if name == b"content-length":
                return False
            if name == b"transfer-encoding" and b"chunked" in value.lower():
                return False
        return True

    # -- httptools callbacks --
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            # an interim answer (100 Continue, 103 Early Hints): the real head follows on
            # this connection; taken as final, it would hand this request's answer to the
            # next one to reuse the connection
            self.headers = []
            self.interim = True
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()
        if not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and self.transport is not None and not self.paused:
            self.transport.pause_reading()
            self.paused = True
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.complete = True
        self._wake()

    # -- helpers --
    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        if not self.head.done():
            self.head.set_exception(exc)
            self.head.exception()  # retrieved: nobody may be waiting yet
        self._wake()
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing() and self.error is None


@dataclass(frozen=True)
class Timeouts:
    """How long the worker may take: for the response head, for the first body chunk (a
    stream's first token), and between chunks after that."""

    head: float
    first_chunk: float
    between_chunks: float


@dataclass
class Response:
    status: int
    headers: list[tuple[bytes, bytes]]
    _conn: _Conn
    _pool: UpstreamPool
    _key: tuple[str, int, bool]
    _timeouts: Timeouts
    _done: bool = field(default=False)

    async def chunks(self) -> AsyncIterator[bytes]:
        conn = self._conn
        timeout = self._timeouts.first_chunk
        while True:
            while conn.chunks:
                chunk = conn.chunks.popleft()
                conn.buffered -= len(chunk)
                if conn.paused and conn.buffered < HIGH_WATER // 2 and conn.transport is not None:
                    conn.transport.resume_reading()
                    conn.paused = False
                timeout = self._timeouts.between_chunks
                yield chunk
            if conn.complete:
                self._finish()
                return
            if conn.error is not None:
                raise conn.error
            await self._arrival(timeout)

    async def started(self) -> None:
        """Wait, within the first-chunk timeout, for the body's first chunk (or its end),
        leaving it for `chunks`."""
        conn = self._conn
        if not conn.chunks and not conn.complete and conn.error is None:
            await self._arrival(self._timeouts.first_chunk)
        if conn.error is not None and not conn.chunks:
            raise conn.error

    async def _arrival(self, timeout: float) -> None:
        """Until the connection has more for this response (a chunk, its end or an error);
        TimeoutError after `timeout` seconds."""
        conn = self._conn
        conn.waiter = asyncio.get_running_loop().create_future()
        try:
            await within(conn.waiter, timeout)
        finally:
            conn.waiter = None

    async def read(self) -> bytes:
        conn = self._conn
        if conn.complete:  # a small answer is usually whole by the time its head is read
            body = b"".join(conn.chunks)
            conn.chunks.clear()
            conn.buffered = 0
            if conn.paused and conn.transport is not None:
                conn.transport.resume_reading()
                conn.paused = False
            self._finish()
            return body
        return b"".join([c async for c in self.chunks()])

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._pool._busy_of(self._key).discard(self._conn)
            self._pool._release(self._key, self._conn)

    def close(self) -> None:
        """Abandon the response: the connection is closed, so the worker sees the client go."""
        if not self._done:
            self._done = True
            self._pool._busy_of(self._key).discard(self._conn)
            if self._conn.transport is not None:
                self._conn.transport.close()


class UpstreamPool:
    def __init__(self, connect_timeout: float, timeouts: Timeouts, max_idle: int = 256) -> None:
        self.connect_timeout = connect_timeout
        self.timeouts = timeouts
        self.max_idle = max_idle
        self._idle: dict[tuple[str, int, bool], list[_Conn]] = {}
        self._forgotten: set[tuple[str, int, bool]] = set()  # workers gone, requests not
        # connections with a request in flight, so that a worker found dead can fail them now
        self._busy: dict[tuple[str, int, bool], set[_Conn]] = {}
        self._tls: ssl.SSLContext | None = None
        self.connects_on_request = 0  # requests that found no open connection to reuse

    def _busy_of(self, key: tuple[str, int, bool]) -> set[_Conn]:
        busy = self._busy.get(key)
        if busy is None:
            busy = self._busy[key] = set()
        return busy

    def forget(self, host: str, port: int) -> None:
        """The worker left the fleet: close its idle connections and drop its keys; its
        requests in flight finish on theirs, which then close instead of idling."""
        for key in ((host, port, False), (host, port, True)):
            for conn in self._idle.pop(key, ()):
                if conn.transport is not None:
                    conn.transport.close()
            if self._busy.get(key):
                self._forgotten.add(key)
        # keys left by requests that ended without a release (abandoned, aborted): empty
        for key in [k for k, busy in self._busy.items() if not busy]:
            del self._busy[key]
            self._forgotten.discard(key)

    def abort(self, host: str, port: int, why: str) -> int:
        """The worker was found dead or hung: fail every request in flight to it. One still
        waiting for its response head fails as not started (`before_response`), so the door
        can retry it elsewhere; a response already streaming ends with an error."""
        n = 0
        for key in ((host, port, False), (host, port, True)):
            for conn in list(self._busy.pop(key, ())):
                conn._fail(UpstreamAborted(why, before_response=not conn.head.done()))
                n += 1
        return n

    async def _connect(self, host: str, port: int, tls: bool) -> _Conn:
        loop = asyncio.get_running_loop()
        if tls and self._tls is None:
            self._tls = ssl.create_default_context()
        try:
            # not wait_for: on Python 3.11 it swallows a cancellation that comes as the
            # connection does (a client's hang-up would go unseen)
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    _Conn,
                    host,
                    port,
                    ssl=self._tls if tls else None,
                    server_hostname=host if tls else None,
                )
        except (OSError, TimeoutError) as exc:
            raise UpstreamConnectError(f"connect to {host}:{port}: {exc or 'timed out'}") from None
        return conn

    def _acquire_idle(self, key: tuple[str, int, bool]) -> _Conn | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.usable():
                conn.reset()
                return conn
        return None

    def _release(self, key: tuple[str, int, bool], conn: _Conn) -> None:
        if key in self._forgotten:  # its worker left the fleet
            busy = self._busy.get(key)
            if not busy:
                self._forgotten.discard(key)
                self._busy.pop(key, None)
            if conn.transport is not None:
                conn.transport.close()
            return
        if not conn.keep_alive or not conn.usable():
            if conn.transport is not None:
                conn.transport.close()
            return
        idle = self._idle.setdefault(key, [])
        if len(idle) >= self.max_idle:
            assert conn.transport is not None
            conn.transport.close()
            return
        idle.append(conn)

    def _usable_idle(self, key: tuple[str, int, bool]) -> list[_Conn]:
        """The key's idle connections still open (those the worker closed are dropped)."""
        idle = self._idle[key] = [c for c in self._idle.get(key, ()) if c.usable()]
        return idle

    def idle(self, host: str, port: int, tls: bool = False) -> int:
        """Open connections to the worker waiting for a request."""
        return len(self._usable_idle((host, port, tls)))

    async def keep_warm(self, host: str, port: int, tls: bool, n: int) -> int:
        """Top the worker's idle connections up to `n`, so that requests find one open (the
        engine closes idle ones after its keep-alive timeout: called every second, this
        replaces them). Returns how many were opened; a worker that refuses is left to
        the health checks."""
        key = (host, port, tls)
        missing = min(n, self.max_idle) - len(self._usable_idle(key))
        if missing <= 0:
            return 0
        made = await asyncio.gather(
            *(self._connect(host, port, tls) for _ in range(missing)), return_exceptions=True
        )
        opened = [c for c in made if isinstance(c, _Conn)]
        for conn in opened:
            self._release(key, conn)
        return len(opened)

    async def request(
        self,
        host: str,
        port: int,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        tls: bool = False,
        timeouts: Timeouts | None = None,
    ) -> Response:
        """Send a request and wait for the response head. A reused connection the worker had
        already closed is retried once on a fresh one (nothing was processed)."""
        key = (host, port, tls)
        timeouts = timeouts or self.timeouts
        head = b"%s %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-length: %d\r\n" % (
            method,
            target,
            host.encode(),
            port,
            len(body),
        )
        data = head + b"".join(k + b": " + v + b"\r\n" for k, v in headers) + b"\r\n" + body
        self._forgotten.discard(key)  # in the fleet again
        conn = self._acquire_idle(key)
        reused = conn is not None
        for _ in range(2):
            if conn is None:
                self.connects_on_request += 1
                conn = await self._connect(host, port, tls)
            assert conn.transport is not None
            conn.transport.write(data)
            busy = self._busy_of(key)
            busy.add(conn)
            try:
                await within(conn.head, timeouts.head)
            except UpstreamClosed as exc:
                busy.discard(conn)
                if reused and exc.before_response and not isinstance(exc, UpstreamAborted):
                    conn, reused = None, False
                    continue
                raise
            except BaseException:
                busy.discard(conn)
                if conn.transport is not None:
                    conn.transport.close()
                raise
            return Response(conn.status, conn.headers, conn, self, key, timeouts)
        raise UpstreamClosed("worker closed the connection", before_response=True)

    def close(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                if c.transport is not None:
                    c.transport.close()
        self._idle.clear()
