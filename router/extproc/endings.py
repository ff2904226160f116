"""How each request really ended, from Envoy's gRPC access log, for the exchanges whose
ext_proc stream closed before their response ended.

Envoy 1.40 closes an ext_proc stream the same way (a half-close, then a reset) when the
response completed, when the client hung up and when the worker broke off its response, and
it sends nothing more first: no response trailers unless the worker sent some, no
end_of_stream when response bodies are skipped, and `response_attributes` are evaluated
once, at the response headers. Its access log does tell them apart, by the response flags
and `response_code_details`. Pointed at the picker's own gRPC port
(`envoy.access_loggers.http_grpc`, `buffer_size_bytes: 0` so that each entry goes at once),
each entry arrives within milliseconds of the stream's close, before or after it, and names
the request by its `x-request-id`, which the exchange read from the request headers.

    endings = Endings()
    endings.expect(rid)                   # a ticket started for this request
    endings.tell(rid, ending_of(entry))   # the access log (any order with the close)
    endings.when_known(rid, conclude)     # the stream closed: conclude(ending or None)
    endings.ended_in_band(rid)            # the response ended in band: no verdict needed

`conclude` gets None when no access log is streaming here (Envoy not configured for it),
when two requests share an id (a client-chosen one that Envoy kept), or after `wait_s`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from envoy.data.accesslog.v3 import accesslog_pb2

from router.asgi import CLIENT_GONE_OUTCOME

COMPLETED = "completed"
CLIENT_GONE = CLIENT_GONE_OUTCOME
UPSTREAM_BROKE = "upstream_broke"  # the worker reset or closed a response that had started
# Envoy's response code details for a worker that broke off after its response headers
_BROKE_DETAILS = "upstream_reset_after_response_started"
# Envoy sends an entry at once with buffer_size_bytes 0; its default batching flushes every
# second: a verdict later than this is given up on (the exchange concludes with None).
WAIT_S = 2.0
# A request marked as logged (the bootstrap's x-kvroute-access-log) is waited for with no
# log stream open only until the first one opens, or this long after the first marked
# request when none ever does: a gateway that passes a client's own mark through and sends
# no log would otherwise hold every such request's load WAIT_S longer.
MARK_TRUST_S = 60.0
# Ids of requests that ended in band, whose access-log entry is still to come: a client may
# reuse an id (Envoy keeps a client's x-request-id by default), and the late entry of one
# request must not become the verdict of the next. Kept WAIT_S, as many as this at most.
MAX_TOMBSTONES = 16384

Conclude = Callable[[str | None], None]


class Timer(Protocol):
    def cancel(self) -> None: ...


Later = Callable[[float, Callable[[], None]], Timer]


def ending_of(entry: accesslog_pb2.HTTPAccessLogEntry) -> str | None:
    """The ending an access-log entry reports; None for any other (a local reply, say)."""
    details = entry.response.response_code_details
    flags = entry.common_properties.response_flags
    if details.startswith(_BROKE_DETAILS):
        return UPSTREAM_BROKE
    if flags.stream_idle_timeout or flags.upstream_request_timeout:
        # the worker went quiet past the gateway's timeout: as the proxy counts a worker
        # that stopped answering mid-response (a 502 on it)
        return UPSTREAM_BROKE
    if flags.downstream_connection_termination or flags.downstream_remote_reset:
        return CLIENT_GONE
    if details == "via_upstream" and not flags.ListFields():
        return COMPLETED
    return None


@dataclass
class _Slot:
    live: int = 1  # exchanges with a ticket open under this id, listening or not
    ending: str | None = None
    told: bool = False
    shared: bool = False  # two live requests had this id at once: no verdict is trusted
    waiter: Conclude | None = None
    timer: Timer | None = None


def _call_later(delay: float, fn: Callable[[], None]) -> Timer:
    return asyncio.get_running_loop().call_later(delay, fn)


class Endings:
    """Verdicts by request id, kept only while a request with that id has a ticket open
    (bounded by the requests in flight). `streams` counts the access-log streams Envoy
    holds open here. Every exchange that `expect`s an id ends with `forget` or (listening)
    `when_known`: an id stays distrusted while any request that shared it is live."""

    def __init__(
        self,
        wait_s: float = WAIT_S,
        later: Later = _call_later,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.wait_s = wait_s
        self.later = later
        self.clock = clock
        self.streams = 0
        self.streamed = False  # an access-log stream has opened here since start
        self._first_mark: float | None = None
        self._slots: dict[str, _Slot] = {}
        # id -> (entries still to come, when they are given up), oldest first
        self._tombstones: dict[str, tuple[int, float]] = {}

    def opened(self) -> None:
        self.streams += 1
        self.streamed = True

    def closed(self) -> None:
        self.streams -= 1

    def _trusts_mark(self) -> bool:
        if self.streamed:
            return True
        now = self.clock()
        if self._first_mark is None:
            self._first_mark = now
        return now - self._first_mark < MARK_TRUST_S

    def expect(self, rid: str) -> bool:
        """A ticket started under this id; True: this exchange listens for its verdict (the
        only one live with the id), False: it must not (empty id, or shared)."""
        if not rid:
            return False
        slot = self._slots.get(rid)
        if slot is not None:
            slot.live += 1
            slot.shared = True
            return False
        self._slots[rid] = _Slot()
        return True

    def forget(self, rid: str) -> None:
        """An exchange with this id ended without needing a verdict."""
        slot = self._slots.get(rid)
        if slot is None:
            return
        slot.live -= 1
        if slot.live <= 0 and slot.waiter is None:
            self._drop(rid, slot)

    def ended_in_band(self, rid: str) -> None:
        """The exchange saw its response end: no verdict is needed, and the access-log
        entry still to come for it is dropped when it arrives."""
        slot = self._slots.get(rid)
        if rid and self.streamed and not (slot is not None and slot.told):
            self._bury(rid)
        self.forget(rid)

    def _bury(self, rid: str) -> None:
        now = self.clock()
        graves = self._tombstones
        count = graves.pop(rid, (0, 0.0))[0]
        graves[rid] = (count + 1, now + self.wait_s)
        while graves:
            oldest = next(iter(graves))
            if len(graves) <= MAX_TOMBSTONES and graves[oldest][1] > now:
                break
            del graves[oldest]

    def _is_late(self, rid: str) -> bool:
        """The entry is the one still to come of a request that ended in band."""
        grave = self._tombstones.pop(rid, None)
        if grave is None or grave[1] <= self.clock():
            return False
        if grave[0] > 1:
            self._tombstones[rid] = (grave[0] - 1, grave[1])
        return True

    def tell(self, rid: str, ending: str | None) -> None:
        if self._is_late(rid):
            return
        slot = self._slots.get(rid)
        if slot is None or slot.shared:
            return
        slot.ending, slot.told = ending, True
        if slot.waiter is not None:
            self._conclude(rid, ending)

    def when_known(self, rid: str, then: Conclude, logged: bool = False) -> None:
        """The listening exchange's stream closed: `then` gets its verdict, or None.
        `logged`: the gateway marked the request as one whose access log comes here, so
        its entry is waited for even while no log stream is open (Envoy opens it at its
        first entry, just after the first requests' streams close)."""
        slot = self._slots.get(rid)
        waits = self.streams or (logged and self._trusts_mark())
        if slot is None or slot.shared or slot.told or not waits:
            ending = None if slot is None or slot.shared else slot.ending
            self.forget(rid)
            then(ending)
            return
        slot.waiter = then
        slot.timer = self.later(self.wait_s, lambda: self._conclude(rid, None))

    def close(self) -> None:
        """Conclude every request still waiting (the server stops)."""
        for rid in [r for r, s in self._slots.items() if s.waiter is not None]:
            self._conclude(rid, None)
        self._slots.clear()
        self._tombstones.clear()

    def _conclude(self, rid: str, ending: str | None) -> None:
        slot = self._slots.get(rid)
        if slot is None or slot.waiter is None:
            return
        waiter, slot.waiter = slot.waiter, None
        if slot.timer is not None:
            slot.timer.cancel()
            slot.timer = None
        slot.live -= 1
        if slot.live <= 0:
            self._drop(rid, slot)
        waiter(ending)

    def _drop(self, rid: str, slot: _Slot) -> None:
        if self._slots.get(rid) is slot:
            del self._slots[rid]
        if slot.timer is not None:
            slot.timer.cancel()


def log_entries(message: Any) -> list[tuple[str, str | None]]:
    """(request id, ending) of each HTTP entry in one StreamAccessLogsMessage."""
    return [(e.request.request_id, ending_of(e)) for e in message.http_logs.log_entry]
