"""Where the Envoy picker listens: an IPv6 host as the proxy's `--host ::` gives it, and a
port it cannot take refused naming the flag, not a gRPC traceback."""

from __future__ import annotations

import socket

import extproc_standin
import pytest

extproc_standin.install()

from router.core.errors import ConfigError  # noqa: E402
from router.extproc.server import ExtProcServer  # noqa: E402

pytestmark = pytest.mark.timeout(30)


def service() -> object:
    return extproc_standin.DecisionService(["127.0.0.1:18001"])


async def test_an_ipv6_host_is_listened_on() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    server = ExtProcServer(service(), "::1", 0)  # type: ignore[arg-type]  # the stand-in
    try:
        await server.start()
        assert server.port > 0
        with socket.create_connection(("::1", server.port), timeout=5):
            pass
    finally:
        await server.stop(0)


async def test_a_port_in_use_is_refused_naming_the_flags() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = ExtProcServer(service(), "127.0.0.1", port)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="--ext-proc-port: cannot listen on") as err:
            await server.start()
        assert "--ext-proc-host" in err.value.message
        await server.stop(0)
