"""What router-check knows of one worker: the router's entries for it (one per data-parallel
rank, named host:port#dpN, or the worker's own host:port), what the worker says of itself,
and what the probes saw. The router routes, indexes and counts each rank apart; a check
about the worker speaks for all of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from engines.base import EngineMetrics, EventSource
from engines.vllm.discovery import event_sources
from router.check.httpio import Fetched
from router.check.zmqprobe import Observation, Reach


def worker_name(url: str) -> str:
    """host:port, as the router names a worker."""
    return urlsplit(url).netloc or url


def worker_of(endpoint: str) -> str:
    """The worker an endpoint the router lists belongs to: a data-parallel rank is named
    host:port#dpN, the worker host:port."""
    return endpoint.split("#dp", 1)[0]


@dataclass(frozen=True)
class Rank:
    """One engine of a worker as the router lists it: the worker itself, or one of its
    data-parallel ranks (its own index, load and event feed, named host:port#dpN)."""

    name: str
    rank: int | None  # None: the worker runs one engine
    entry: dict[str, Any]  # the router's /admin/workers entry, before probes
    report: dict[str, Any] | None  # the router's /health entry

    @property
    def label(self) -> str:
        return rank_label(self.rank)


def rank_label(rank: int | None) -> str:
    """How the checks' evidence names a data-parallel rank ("" for a worker's one engine)."""
    return "" if rank is None else f"dp{rank}"


@dataclass(frozen=True)
class Publisher:
    """Where one engine of a worker publishes its KV events: what the router dials for it
    and what the engine advertises for the same rank (GET /kv_event_sources)."""

    name: str  # the router's name for the engine: its index and metrics are keyed by it
    rank: int | None  # the data-parallel rank to ask for; None: the worker runs one engine
    router: str | None
    router_replay: str | None
    advertised: EventSource | None

    @property
    def label(self) -> str:
        return rank_label(self.rank)

    @property
    def endpoint(self) -> str | None:
        """The publisher the router subscribes to, else the one the engine advertises."""
        return self.router or (self.advertised.endpoint if self.advertised else None)

    @property
    def replay(self) -> str | None:
        adv = self.advertised
        return self.router_replay or (adv.replay_endpoint if adv and not self.router else None)

    @property
    def candidates(self) -> list[str]:
        """The router's endpoint first; the engine's own if different."""
        adv = self.advertised.endpoint if self.advertised else None
        return list(dict.fromkeys(e for e in (self.router, adv) if e))


@dataclass
class WorkerFacts:
    """One worker: fetched once up front, then filled in by the probes for later checks."""

    name: str
    url: str
    ranks: list[Rank] = field(default_factory=list)  # the router's entries for it, by rank
    health: Fetched | None = None
    models: Fetched | None = None
    metrics_fetch: Fetched | None = None
    metrics: EngineMetrics | None = None  # parsed from metrics_fetch
    sources: Fetched | None = None
    reach: dict[str, Reach] = field(default_factory=dict)  # endpoint -> handshake result
    seen: dict[str, Observation] = field(default_factory=dict)  # publisher name -> probe saw

    @property
    def reachable(self) -> bool:
        return any(f is not None and f.status is not None for f in (self.health, self.models))

    @property
    def model(self) -> str:
        card = self._card()
        return str(card.get("id", "")) if card else ""

    @property
    def max_model_len(self) -> int | None:
        card = self._card()
        value = card.get("max_model_len") if card else None
        return value if isinstance(value, int) else None

    def _card(self) -> dict[str, Any] | None:
        doc = self.models.body if self.models is not None and self.models.ok else None
        data = doc.get("data") if isinstance(doc, dict) else None
        return data[0] if data and isinstance(data[0], dict) else None

    @property
    def advertised(self) -> list[EventSource]:
        """The publishers the engine names in GET /kv_event_sources (one per data-parallel
        rank), made dialable."""
        if self.sources is None or not self.sources.ok:
            return []
        return event_sources(self.sources.body, self.url)

    @property
    def publishers(self) -> list[Publisher]:
        """One per engine: the router's ranks where it lists the worker, else the engine's."""
        adv = self.advertised
        if not self.ranks:
            ranked = len(adv) > 1
            return [
                Publisher(
                    f"{self.name}#dp{s.rank}" if ranked else self.name,
                    s.rank if ranked else None,
                    None,
                    None,
                    s,
                )
                for s in adv
            ]
        by_rank = {s.rank: s for s in adv}
        return [
            Publisher(
                r.name,
                r.rank,
                _str(r.entry, "events_endpoint"),
                _str(r.entry, "replay_endpoint"),
                by_rank.get(r.rank) if r.rank is not None else next(iter(adv), None),
            )
            for r in self.ranks
        ]

    @property
    def router_endpoints(self) -> list[str]:
        """The publishers the router subscribes to for this worker, one per rank."""
        return [e for r in self.ranks if (e := _str(r.entry, "events_endpoint"))]

    @property
    def observed(self) -> Observation | None:
        """What the events-flowing probes saw, every rank together (None: not probed)."""
        return Observation.union(self.seen.values()) if self.seen else None

    @property
    def mode_setting(self) -> str | None:
        """events | approx | auto as the router is configured for this worker."""
        for r in self.ranks:
            for doc, key in ((r.report, "mode_setting"), (r.entry, "mode")):
                if doc is not None and doc.get(key):
                    return str(doc[key])
        return None

    def problems(self, needle: str) -> list[str]:
        """The router's own /health problems for this worker that mention `needle` (a
        worker-wide problem is repeated in each of its ranks' entries: said once here)."""
        found = [p for r in self.ranks for p in (r.report or {}).get("problems") or []]
        return list(dict.fromkeys(str(p) for p in found if needle in str(p).lower()))


def _str(doc: dict[str, Any], key: str) -> str | None:
    value = doc.get(key)
    return str(value) if value else None


def group_workers(
    urls: list[str], entries: list[dict[str, Any]], reports: list[dict[str, Any]]
) -> list[WorkerFacts]:
    """One `WorkerFacts` per worker URL (once, however often given), each with every entry
    the router lists for it (/admin/workers) and its /health report."""
    by_name = {str(e.get("name")): e for e in reports}
    out: dict[str, WorkerFacts] = {}
    for url in urls:
        name = worker_name(url)
        if name not in out:
            mine = [e for e in entries if _belongs(e, name, url)]
            ranks = [Rank(_name(e), _rank(e), e, by_name.get(_name(e))) for e in mine]
            out[name] = WorkerFacts(name, url, sorted(ranks, key=lambda r: r.rank or 0))
    return list(out.values())


def _name(entry: dict[str, Any]) -> str:
    return str(entry.get("name") or worker_name(str(entry.get("url", ""))))


def _rank(entry: dict[str, Any]) -> int | None:
    rank = entry.get("data_parallel_rank")
    return rank if isinstance(rank, int) and not isinstance(rank, bool) else None


def _belongs(entry: dict[str, Any], name: str, url: str) -> bool:
    same_url = str(entry.get("url", "")).rstrip("/") == url.rstrip("/")
    return same_url or worker_of(_name(entry)) == name
