"""Serving the router: uvicorn with the choices a proxy in front of LLM workers needs.

- A client's request head must arrive within `header_timeout_s` (uvicorn has no such limit:
  a slowloris client could hold a connection forever); bodies are bounded by the app.
- An idle client connection stays open `keep_alive_timeout_s` (75 s), which must exceed the
  idle timeout of the proxy or client reusing it (75 s covers httpx, ingress-nginx and ALBs):
  with uvicorn's 5 s (httpx's own keep-alive expiry too), a client could send a request on a
  connection the router was closing.
- The worker's `date` and `server` headers pass through; uvicorn adds none of its own, so a
  response carries one of each.
- SIGTERM drains in two steps. First, for `drain_delay_s`, the router keeps serving but
  answers /ready 503 (the Service stops sending it traffic) and closes every connection after
  its response (`Connection: close`), so no idle keep-alive connection is left for a client
  to race a request into. Then the listener closes, in-flight requests and streams get up to
  `drain_timeout_s` to finish, and the process exits 0. A request still running then is
  cancelled, marked `DRAIN_EXPIRED` so the app ends it with a 503 in OpenAI's shape (a
  stream: with an error event and [DONE]); uvicorn's own timeout, `CUT_GRACE_S` later, is
  only the backstop. A second signal stops at once,
  except a second SIGTERM in a `--processes` child: the supervisor forwards the SIGTERM it
  gets, and a signal sent to the whole process group (systemd's control-group kill, `kill
  -TERM -PGID`) reaches the child too, so two arrive for one stop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import resource
import signal
import socket
import struct
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from router.asgi import CLIENT_GONE, CUT_RESPONSE, DRAIN_EXPIRED

log = logging.getLogger("kvroute.serve")

CUT_GRACE_S = 1.0  # after the drain timeout: the requests cut then send their answers


class RouterConfig(uvicorn.Config):
    """uvicorn's config, and how long in-flight requests may finish after SIGTERM: uvicorn's
    own graceful timeout is `CUT_GRACE_S` past it, for the cut requests' answers."""

    def __init__(self, app: Any, *, drain_timeout_s: float, **kwargs: Any) -> None:
        grace = math.ceil(drain_timeout_s + CUT_GRACE_S)
        super().__init__(app, timeout_graceful_shutdown=grace, **kwargs)
        self.drain_timeout_s = drain_timeout_s


_LINGER_NONE = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: a close resets the connection


def protocol_with_header_timeout(timeout_s: float) -> type[asyncio.Protocol]:
    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _last_request = False  # the server is shutting down: serve this one, then close

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            # requests whose answers are not complete: a pipelined request's cycle takes
            # the running one's place as `self.cycle`, yet a hang-up must reach that one
            self._open: list[RequestResponseCycle] = []
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            self.scope[CLIENT_GONE] = []  # type: ignore[literal-required]  # the cycle's scope
            self.scope[CUT_RESPONSE] = self._cut_response  # type: ignore[literal-required]
            super().on_headers_complete()
            self._open = [c for c in self._open if not c.response_complete]
            if self.cycle is not None and self.cycle not in self._open:
                self._open.append(self.cycle)
            if self._last_request and self.cycle is not None:
                self.cycle.keep_alive = False

        def shutdown(self) -> None:
            # A connection whose request has not been read yet may have one in flight (it
            # connected just before the listener closed): serve it, then close. If nothing
            # comes, the head timer closes it.
            if self.cycle is None and not self.transport.is_closing():
                self._last_request = True
                if self._head_timer is None:
                    self._arm()
                return
            super().shutdown()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            cycles = [c for c in self._open if not c.response_complete]
            self._open = []
            gone: list[Callable[[], None]] = [
                tell
                for c in cycles
                for tell in c.scope.get(CLIENT_GONE, ())  # type: ignore[attr-defined]
            ]
            super().connection_lost(exc)
            for c in cycles:
                c.disconnected = True  # uvicorn marks only `self.cycle`: the others stop too
            for tell in gone:
                tell()  # the door cancels the request: the worker's request is aborted

        def _cut_response(self) -> None:
            """Close the connection before the response's last chunk: a truncated transfer
            the client can tell from a complete one (uvicorn sends nothing more once its
            cycle counts the client gone). A client that stopped reading is reset."""
            for c in self._open:
                c.disconnected = True
            if self.flow.write_paused:
                self._reset()
            elif not self.transport.is_closing():
                self.transport.close()

        def _reset(self) -> None:
            """Reset the connection of a client that stopped reading: a close would wait for
            it to take the bytes still buffered (here, then the kernel's), holding the
            connection for as long as it stalls (nginx's `reset_timedout_connection`)."""
            sock = self.transport.get_extra_info("socket")
            try:
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_NONE)
            except OSError:
                pass  # closed meanwhile
            self.transport.abort()

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _too_slow(self) -> None:
            # a new connection, or a request head begun on a kept-alive one, without a
            # complete head in time (between requests, uvicorn's keep-alive timer rules)
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol


OPEN_FILES = 65535  # each client and worker connection holds one (vLLM asks as many)
OPEN_FILES_FLOOR = 4096  # below this after raising, a busy router may run out: say so


def raise_open_files(target: int = OPEN_FILES, floor: int = OPEN_FILES_FLOOR) -> str | None:
    """Raise the soft limit on open files toward `target`, as far as the hard limit allows
    (a 1,024 soft limit is still common: past it, accepting a connection fails and clients
    hang). Returns a warning naming the fix when the limit stays under `floor`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return None
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    if soft >= floor:
        return None
    shown = "unlimited" if hard == resource.RLIM_INFINITY else hard
    return (
        f"open files limited to {soft} (hard limit {shown}): each client and worker "
        f"connection takes one; raise the hard limit to {target} or more (ulimit -Hn, or "
        "the container runtime's nofile ulimit)"
    )


def server_config(
    app: Any,
    host: str,
    port: int,
    *,
    header_timeout_s: float = 10.0,
    keep_alive_timeout_s: float = 75.0,
    drain_timeout_s: float = 30.0,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    loop: str = "uvloop",
) -> RouterConfig:
    return RouterConfig(
        app,
        drain_timeout_s=drain_timeout_s,
        host=host,
        port=port,
        loop=loop,
        http=protocol_with_header_timeout(header_timeout_s),
        timeout_keep_alive=math.ceil(keep_alive_timeout_s),  # uvicorn takes whole seconds
        lifespan="on",
        access_log=False,
        log_level="warning",
        server_header=False,
        date_header=False,
        proxy_headers=False,  # X-Forwarded-* are ours to append, never trusted from clients
        ssl_certfile=tls_cert,
        ssl_keyfile=tls_key,
    )


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: RouterConfig,
        on_drain: Callable[[], None],
        delay_s: float,
        child: bool = False,
    ) -> None:
        super().__init__(config)
        self.on_drain = on_drain
        self.delay_s = delay_s
        self.child = child  # a `--processes` child: its supervisor ends a drain that hangs
        self.draining = False
        self.drain_timeout_s = config.drain_timeout_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self.draining and self.child:
            return  # the same stop, twice (module doc)
        if sig != signal.SIGTERM or self.draining:
            super().handle_exit(sig, frame)
            return
        self.draining = True
        log.warning("SIGTERM: draining (not ready, closing connections) for %.1f s", self.delay_s)
        self.on_drain()
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(loop.call_later, self.delay_s, self._stop)

    def _stop(self) -> None:
        # From SIGTERM on every response closes its connection, so a client moves to a new
        # one (the listener still accepts it) at its next request. A keep-alive connection
        # still idle now closes here: closing idle ones at SIGTERM lost the requests a busy
        # client had just sent on them (the fault suite's drain, 3 of 239 at c=16).
        for conn in list(self.server_state.connections):
            cycle = getattr(conn, "cycle", None)
            if cycle is not None and cycle.response_complete:
                conn.transport.close()
        log.warning("draining: listener closed, waiting for in-flight requests")
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        cut = asyncio.get_running_loop().call_later(self.drain_timeout_s, self._cut_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()

    def _cut_in_flight(self) -> None:
        """The drain timeout expired: each request still running is marked and cancelled,
        and its app answers why (uvicorn's own cancel would answer a plain-text 500, or
        reset a stream); connections with nothing in flight close."""
        cut = 0
        for conn in list(self.server_state.connections):
            cycle = getattr(conn, "cycle", None)
            if cycle is None or cycle.response_complete:
                conn.transport.close()
                continue
            cycle.scope[DRAIN_EXPIRED] = True
            cut += 1
        for task in list(self.server_state.tasks):
            task.cancel()
        if cut:
            log.warning(
                "drain timeout (%g s): %d requests still running were ended (503, or an "
                "error event on a stream)",
                self.drain_timeout_s,
                cut,
            )


def serve(
    config: RouterConfig,
    on_drain: Callable[[], None],
    drain_delay_s: float,
    sockets: list[socket.socket] | None = None,
    child: bool = False,
) -> None:
    """Serve until drained; `sockets`: listen on these (already bound) instead of the
    config's host and port; `child`: a `--processes` child (the shared port and a private
    one)."""
    DrainingServer(config, on_drain, drain_delay_s, child=child).run(sockets=sockets)
