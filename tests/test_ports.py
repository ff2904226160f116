"""The one free-port picker (conformance/procs.py, re-exported by router/procs.py)."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from conformance import procs


class _Probe:
    """A socket whose `bind(port 0)` is answered from a script, as the kernel may answer:
    a port released by a closed probe is free again at once."""

    answers: list[int] = []

    def __init__(self, *args: Any) -> None:
        self.port = 0

    def __enter__(self) -> _Probe:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def bind(self, addr: tuple[str, int]) -> None:
        self.port = _Probe.answers.pop(0)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


def test_a_port_the_kernel_hands_back_twice_is_given_out_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two children started a moment apart (a replica's HTTP port and its placement link)
    must not be told the same port: the kernel may hand back a port whose probe just
    closed, before the first child has bound it."""
    monkeypatch.setattr(procs, "_GIVEN", type(procs._GIVEN)(maxlen=8))
    monkeypatch.setattr(procs.socket, "socket", _Probe)
    _Probe.answers = [41001, 41001, 41001, 41002, 41003]
    assert procs.free_port() == 41001
    assert procs.free_port() == 41002
    assert procs.free_ports(1) == (41003,)
    assert not _Probe.answers


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = procs.free_ports(16)
    assert len(set(ports)) == 16
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))
