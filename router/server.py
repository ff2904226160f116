"""Serving the router: uvicorn with the choices a proxy in front of LLM workers needs.

- A client's request head must arrive within `header_timeout_s` (uvicorn has no such limit:
  a slowloris client could hold a connection forever); bodies are bounded by the app.
- The worker's `date` and `server` headers pass through; uvicorn adds none of its own, so a
  response carries one of each.
- SIGTERM drains: the listener closes (readiness fails, new connections go to the other
  replicas), keep-alive connections close after their current response, in-flight requests
  and streams get up to `drain_timeout_s` to finish, then the process exits.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("kvroute.serve")


def protocol_with_header_timeout(timeout_s: float) -> type[asyncio.Protocol]:
    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

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


def server_config(
    app: Any,
    host: str,
    port: int,
    *,
    header_timeout_s: float = 10.0,
    drain_timeout_s: float = 30.0,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    loop: str = "uvloop",
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop=loop,
        http=protocol_with_header_timeout(header_timeout_s),
        lifespan="on",
        access_log=False,
        log_level="warning",
        server_header=False,
        date_header=False,
        proxy_headers=False,  # X-Forwarded-* are ours to append, never trusted from clients
        timeout_graceful_shutdown=max(1, round(drain_timeout_s)),
        ssl_certfile=tls_cert,
        ssl_keyfile=tls_key,
    )


def serve(config: uvicorn.Config) -> None:
    uvicorn.Server(config).run()
