"""One configuration object, loaded once (YAML file, then environment, then flags: flags
win) and validated at start with errors that name the field and the fix. Conversion is
typed (`router.core.typed`): an unknown key, a wrong type or a bad value is a one-line
ConfigError, never a traceback."""

from __future__ import annotations

import ipaddress
import math
import os
import random
import re
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit

from indexer.index import DEFAULT_MAX_ENTRIES
from router.core.errors import ConfigError
from router.core.policies import REGISTRY as POLICY_REGISTRY
from router.core.profiles import DEFAULT_FILTERS, PD_FILTERS, PD_ROLES, Profile, build_profile
from router.core.typed import build, convert, fail

MODES = ("events", "approx", "auto")
POLICIES = tuple(POLICY_REGISTRY)  # the names registered at import
ROLES = ("both", "prefill", "decode")
ENGINES = ("vllm",)  # the adapters in engines.ADAPTERS (a test keeps the two in step)
ENV_PREFIX = "KVROUTE_"
REMOTE = "remote"
CONTENT_FORMATS = ("auto", "string", "openai")  # vLLM's --chat-template-content-format


@dataclass(frozen=True)
class WorkerConfig:
    url: str
    events: str | None = None  # tcp://host:port; discovered from the engine if unset
    replay: str | None = None
    topic: str | None = None
    mode: str | None = None  # overrides the router-wide mode
    block_size: int | None = None  # learned from events or the engine's metrics if unset
    api_key: str | None = field(default=None, repr=False)  # the engine's --api-key; never shown
    engine: str = "vllm"  # which adapter in engines.ADAPTERS speaks to it
    role: str = "both"  # prefill | decode | both (prefill->decode handoff)

    @property
    def name(self) -> str:
        """host:port, the name used in metrics, logs and the chosen-worker header."""
        parts = urlsplit(self.url)
        return parts.netloc or self.url


@dataclass(frozen=True)
class ScoringConfig:
    weights: dict[str, float] = field(
        default_factory=lambda: {
            "prefix": 1.0,
            "load": 0.5,
            "headroom": 0.1,
            "placement": 1.0,
        }
    )
    params: dict[str, dict[str, Any]] = field(default_factory=dict)  # scorer -> its parameters
    # a worker may run this many requests above the least loaded... (32: at 8 a shuffled
    # prefix-repetition workload at c=16 split groups over workers, 0.725 cached vs 0.738;
    # at 16 a hot prefix spilled to workers that then prefilled it whole, hot-prefix 0.861 vs
    # 0.866 and long-short-mix TTFT p90 150 vs 136 ms, `kvroute bench routing`, medians of 3;
    # 64 made TTFT worse again; the busy bound is the overload guard)
    balance_abs: int = 32
    balance_rel: float = 1.5  # ...or this multiple of it, whichever is larger
    # a worker where this prompt would wait for more than this multiple of the fastest
    # worker's prefill tokens (queued + its own uncached part), plus the floor, is not
    # eligible: a cached prefix is not worth queueing behind a long cold prefill
    # (long-short-mix TTFT p90 113 -> 82 ms, cached 0.826 -> 0.821; 0 turns it off)
    prefill_wait_over: float = 2.0
    prefill_wait_floor_tokens: int = 2048


_PEER_ENDPOINT = re.compile(r"^tcp://[^\s:/]+:\d{1,5}$")
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # an HTTP token (RFC 9110)
MAX_PROCESSES = 64


@dataclass(frozen=True)
class Config:
    workers: tuple[WorkerConfig, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    mode: str = "auto"
    policy: str = "kv"
    policy_params: dict[str, Any] = field(default_factory=dict)
    tokenizer: str | None = None  # default for every model: a tokenizer folder, or "remote"
    tokenizers: dict[str, str] = field(default_factory=dict)  # model -> folder or "remote"
    # the engines' --chat-template (a file, or the template itself), for every model / one
    # model; local tokenizers render chats with it instead of their folder's
    chat_template: str | None = None
    chat_templates: dict[str, str] = field(default_factory=dict)
    chat_template_content_format: str = "auto"  # the engines' flag: auto | string | openai
    # the engines' --trust-request-chat-template: a request's own chat_template is rendered
    trust_request_chat_template: bool = False
    # the engines run with --exclude-tools-when-tool-choice-none: a chat whose tool_choice
    # is "none" renders without its tools
    exclude_tools_when_tool_choice_none: bool = False
    block_size: int | None = None
    model: str = ""  # the hash namespace's model part (kept "" unless chains must differ)
    # the engines run vLLM's LoRA resolver (VLLM_ALLOW_RUNTIME_LORA_UPDATING with a
    # resolver plugin): a model name no worker lists is routed as a LoRA adapter of this
    # served base model, to any worker serving it, which loads it at its first request;
    # None: such a name is a 404 listing the served models
    lora_resolver: str | None = None
    metrics: bool = True
    admin_token: str | None = field(default=None, repr=False)
    admin_insecure: bool = False  # admin and debug endpoints without a token (else off: 404)
    health_details: bool = True  # /health lists worker addresses and problems (else counts only)
    tls_cert: str | None = None  # serve HTTPS: certificate and key files (PEM)
    tls_key: str | None = None
    worker_api_key: str | None = field(default=None, repr=False)  # for workers without api_key
    worker_header: str = "x-kvroute-worker"
    health_degraded_ok: bool = False
    prediction_ttl_s: float = 5.0
    approx_ttl_s: float = 120.0
    event_grace_s: float = 10.0
    scrape_interval_s: float = 1.0
    health_check_interval_s: float = 2.0
    connect_timeout_s: float = 2.0
    # idle connections kept open to each worker, so that a burst (after start-up or a
    # quiet spell the engine's keep-alive timeout closed them in) does not connect on
    # the request path: 32 new connections at once held a burst's first requests
    # ~40 ms before the worker saw them; 0 turns it off
    warm_connections: int = 8
    request_timeout_s: float = 600.0  # a non-streaming request's whole answer
    first_byte_timeout_s: float = 120.0  # a stream's first chunk (the prefill)
    inter_chunk_timeout_s: float = 60.0  # between a stream's chunks
    health_timeout_s: float = 2.0  # a worker's /health probe
    eject_after_timeouts: int = 3  # consecutive request timeouts that eject a worker
    # a worker ejected for timeouts again, with no answer since its last such ejection, is
    # held out this long (doubling with each, to 32 times) however its /health answers
    timeout_hold_s: float = 10.0
    header_timeout_s: float = 10.0  # a client's request head (slowloris)
    # an idle client connection is kept this long, which must exceed the idle timeout of
    # whatever reuses it (ingress-nginx and ALBs 60 s: the default covers them; Google
    # Cloud's load balancers 600 s, Envoy's 1 h: set it higher), or that may send a request
    # on a connection the router is closing and get a 502 or a disconnect for it (uvicorn's
    # 5 s equals httpx's own: both ends time the same idle connection out together)
    keep_alive_timeout_s: float = 75.0
    body_timeout_s: float = 60.0  # a client's whole request body
    drain_delay_s: float = 2.0  # SIGTERM: serve on (not ready, closing connections) this long
    drain_timeout_s: float = 30.0  # ... then how long in-flight requests may finish
    forwarded_headers: bool = True  # add X-Forwarded-For/-Proto/-Host upstream
    access_log: bool = False  # one line per request: model, worker, overlap, status, TTFT
    otel: bool = False  # an OpenTelemetry span per routing decision (kvroute[otel])
    log_format: str = "text"  # text | json
    max_body_bytes: int = 32 * 1024 * 1024
    # worker x block pairs; <100 bytes each (C core; ~180 pure-Python), so ~400 MB at most.
    # A fleet's total KV blocks should fit well below it (see indexer.index on the bound).
    max_index_entries: int = DEFAULT_MAX_ENTRIES
    # each worker's entries are capped at its KV capacity (num_gpu_blocks) times this: a
    # worker whose removals were lost cannot crowd the others out of the index
    index_cap_margin: float = 2.0
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    # overload (the `busy` filter): a worker at a bound takes no new request while another
    # can; when every worker is busy it still serves, unless `shed` refuses with 429
    busy_max_requests: int | None = None  # running+waiting requests per worker
    busy_max_kv_usage: float | None = None  # KV cache use per worker, 0..1
    # busy at the engine's batch limit (vLLM's --max-num-seqs), learned from its /metrics
    # where requests queue with KV room and little prefill ahead of them (router/core/load.py)
    busy_learn_batch: bool = True
    shed: bool = False
    seed: int | None = None
    # router replicas behind one balancer share their placements (router/peers.py): this
    # replica's PUB endpoint, and the other replicas' endpoints it subscribes to
    peer_publish: str | None = None  # e.g. tcp://0.0.0.0:5570
    peers: tuple[str, ...] = ()  # e.g. tcp://kvroute-1.kvroute:5570
    peers_dns: str | None = None  # HOST:PORT of a headless Service of the router pods
    # a replica that is not the first (lowest id) of those it hears from waits this long
    # before placing a new prefix, and looks again: two replicas placing new prefixes at
    # the same instant otherwise both choose the worker that looks least demanded to each
    # (router/peers.py); 0 turns it off
    peer_wait_ms: float = 5.0
    # router processes behind the one port (router/processes.py): one event loop's Python
    # is one core's worth of requests
    processes: int = 1
    workers_file: str | None = None  # reloaded on change
    # HOST:PORT of a headless Service: one worker per A record (AAAA where it answers none)
    workers_dns: str | None = None
    dns_interval_s: float = 5.0
    # prefill->decode handoff (router/pd; on when some worker has role prefill)
    pd_threshold: str = "auto"  # auto | never | TOKENS (split at this many uncached tokens)
    pd_link_mb_s: float | None = None  # the P->D link until measured (auto needs it or a probe)
    pd_kv_bytes_per_token: int | None = None  # else learned from the decode workers' metrics
    pd_probe: bool = True  # a probe handoff at start measures the link (the one router-check runs)
    pd_max_prefill_inflight: int = 8  # prefill legs in flight that make a prefill worker busy
    pd_fault_strip_params: bool = False  # TEST FAULT: decode legs lose their kv_transfer_params

    def validate(self) -> Config:
        if not self.workers and not self.workers_file and not self.workers_dns:
            raise ConfigError(
                "workers: no workers configured; pass --worker http://HOST:PORT (repeatable), "
                "list them under `workers:` in kvroute.yaml, set --workers-file, or set "
                "--workers-dns HEADLESS_SERVICE:PORT",
                param="workers",
            )
        self._check_scalars()
        self.profile("default")  # scorers, policy and filters: names and parameters
        validate_workers(self.workers, self.mode, whole=not (self.workers_file or self.workers_dns))
        return self

    def _check_scalars(self) -> None:
        if self.workers_dns is not None:
            host, _, port = self.workers_dns.rpartition(":")
            _check(
                host_ok(host) and port.isdigit() and 1 <= int(port) <= 65535,
                "workers_dns",
                f"{self.workers_dns!r}: use HOST:PORT, e.g. vllm-workers.default.svc:8000",
            )
        _check(self.mode in MODES, "mode", f"{self.mode!r} is not one of {', '.join(MODES)}")
        _check(
            self.policy in POLICIES,
            "policy",
            f"{self.policy!r} is not one of {', '.join(POLICIES)}",
        )
        _check(1 <= self.port <= 65535, "port", f"{self.port} is not a TCP port")
        if self.block_size is not None:
            _check(self.block_size > 0, "block_size", "must be a positive number of tokens")
        for name in (
            "prediction_ttl_s",
            "approx_ttl_s",
            "event_grace_s",
            "scrape_interval_s",
            "connect_timeout_s",
            "request_timeout_s",
            "health_check_interval_s",
            "dns_interval_s",
            "first_byte_timeout_s",
            "inter_chunk_timeout_s",
            "health_timeout_s",
            "header_timeout_s",
            "keep_alive_timeout_s",
            "body_timeout_s",
            "drain_timeout_s",
        ):
            _check(getattr(self, name) > 0, name, "must be a positive number of seconds")
            _check(
                math.isfinite(getattr(self, name)),
                name,
                "must be a finite number of seconds (for no practical limit, e.g. 86400)",
            )
        _check(0 <= self.drain_delay_s < math.inf, "drain_delay_s", "must be >= 0 seconds, finite")
        _check(
            0 <= self.peer_wait_ms <= 1000,
            "peer_wait_ms",
            "must be 0..1000 ms (0: a follower replica places new prefixes at once)",
        )
        _check(self.max_body_bytes > 0, "max_body_bytes", "must be a positive number of bytes")
        _check(self.eject_after_timeouts >= 1, "eject_after_timeouts", "must be >= 1")
        _check(
            0 <= self.timeout_hold_s < math.inf,
            "timeout_hold_s",
            "must be >= 0 seconds, finite (0: no hold)",
        )
        _check(self.warm_connections >= 0, "warm_connections", "must be >= 0 (0: off)")
        _check(self.log_format in ("text", "json"), "log_format", "use text or json")
        _check(
            self.admin_token is None or self.admin_token.strip() != "",
            "admin_token",
            "is empty (an empty Secret key?): set a token, or leave it unset to turn /admin "
            "and /debug off",
        )
        _check(
            (self.tls_cert is None) == (self.tls_key is None),
            "tls_cert",
            "give both --tls-cert and --tls-key, or neither",
        )
        _check(self.max_index_entries > 0, "max_index_entries", "must be positive")
        _check(self.index_cap_margin >= 1, "index_cap_margin", "must be >= 1")
        for scorer, weight in self.scoring.weights.items():
            _check(weight >= 0, f"scoring.weights.{scorer}", "weights must be >= 0")
        _check(self.scoring.balance_abs >= 0, "scoring.balance_abs", "must be >= 0")
        _check(self.scoring.balance_rel >= 1, "scoring.balance_rel", "must be >= 1")
        _check(
            self.scoring.prefill_wait_over == 0 or self.scoring.prefill_wait_over >= 1,
            "scoring.prefill_wait_over",
            "must be >= 1 (or 0: off)",
        )
        _check(
            self.scoring.prefill_wait_floor_tokens >= 0,
            "scoring.prefill_wait_floor_tokens",
            "must be >= 0 tokens",
        )
        self._check_busy()
        self._check_peers()
        self._check_processes()
        for model, spec in self.tokenizers.items():
            _check(bool(model) and bool(spec), f"tokenizers.{model}", "give MODEL: PATH|remote")
        for model, spec in self.chat_templates.items():
            _check(
                bool(model) and bool(spec),
                f"chat_templates.{model}",
                "give MODEL: FILE (or the template itself)",
            )
        _check(self.chat_template != "", "chat_template", "is empty: give a file or a template")
        _check(
            self.lora_resolver is None or self.lora_resolver.strip() != "",
            "lora_resolver",
            "is empty: give the served base model name whose workers load adapters on demand",
        )
        _check(
            self.chat_template_content_format in CONTENT_FORMATS,
            "chat_template_content_format",
            f"{self.chat_template_content_format!r} is not one of {', '.join(CONTENT_FORMATS)} "
            "(the engines' --chat-template-content-format)",
        )
        _check(
            self.tokenizer != "",
            "tokenizer",
            "is empty: give the model's tokenizer folder, or remote to ask the workers' /tokenize",
        )
        _check(
            self.worker_header == "" or _HEADER_NAME.fullmatch(self.worker_header) is not None,
            "worker_header",
            f"{self.worker_header!r} is not an HTTP header name (letters, digits and - are; "
            "'' sends none)",
        )
        self._check_pd()

    def _check_peers(self) -> None:
        for name, value in [("peer_publish", self.peer_publish)] + [
            (f"peers[{i}]", p) for i, p in enumerate(self.peers)
        ]:
            if value is not None:
                _check(
                    _PEER_ENDPOINT.match(value) is not None
                    and _endpoint_ok(value, wildcard=name == "peer_publish"),  # ZMQ binds `*`
                    name,
                    f"{value!r}: use tcp://HOST:PORT (tcp://0.0.0.0:5570 to publish on every "
                    "interface, tcp://kvroute-1.kvroute:5570 for a peer)",
                )
        if self.peers_dns is not None:
            host, _, port = self.peers_dns.rpartition(":")
            _check(
                host_ok(host) and port.isdigit() and 1 <= int(port) <= 65535,
                "peers_dns",
                f"{self.peers_dns!r}: use HOST:PORT, e.g. kvroute-peers.default.svc:5570",
            )
        _check(
            self.peer_publish is None or self.peer_publish not in self.peers,
            "peers",
            "a replica does not subscribe to itself: list the other replicas' endpoints",
        )

    def _check_processes(self) -> None:
        _check(
            1 <= self.processes <= MAX_PROCESSES,
            "processes",
            f"{self.processes}: use 1 to {MAX_PROCESSES} (about one per core the router may use)",
        )

    def _check_busy(self) -> None:
        if self.busy_max_requests is not None:
            _check(
                self.busy_max_requests >= 1,
                "busy_max_requests",
                f"{self.busy_max_requests}: a worker needs room for at least 1 request; "
                "use e.g. vLLM's --max-num-seqs, or leave it unset for no bound",
            )
        if self.busy_max_kv_usage is not None:
            _check(
                0 < self.busy_max_kv_usage <= 1,
                "busy_max_kv_usage",
                f"{self.busy_max_kv_usage}: a fraction of the KV cache in (0, 1], e.g. 0.95, "
                "or leave it unset for no bound",
            )
        _check(
            not self.shed
            or self.busy_max_requests is not None
            or self.busy_max_kv_usage is not None,
            "shed",
            "sheds nothing without a bound: set busy_max_requests (--busy-max-requests) "
            "or busy_max_kv_usage (--busy-max-kv-usage)",
        )

    def _check_pd(self) -> None:
        pd_threshold(self.pd_threshold)  # raises naming the field
        if self.pd_link_mb_s is not None:
            _check(self.pd_link_mb_s > 0, "pd_link_mb_s", "must be > 0 MB/s (or leave it unset)")
        if self.pd_kv_bytes_per_token is not None:
            _check(self.pd_kv_bytes_per_token > 0, "pd_kv_bytes_per_token", "must be > 0")
        _check(self.pd_max_prefill_inflight >= 1, "pd_max_prefill_inflight", "must be >= 1")

    def profile(self, name: str, rng: random.Random | None = None) -> Profile:
        """The routing profile `name` this config describes: `default`, or the handoff's
        `decode` and `prefill` (the same scoring, only workers of that role)."""
        s = self.scoring
        filter_params: dict[str, dict[str, Any]] = {
            "load_bound": {"balance_abs": s.balance_abs, "balance_rel": s.balance_rel},
            "prefill_wait": {
                "over": s.prefill_wait_over,
                "floor_tokens": s.prefill_wait_floor_tokens,
            },
            "busy": {
                "max_requests": self.busy_max_requests,
                "max_kv_usage": self.busy_max_kv_usage,
                "learn_batch": self.busy_learn_batch,
                # a busy prefill pool means prefilling on the decode worker, never a 429
                "shed": self.shed and name != "prefill",
            },
        }
        roles = PD_ROLES.get(name)
        if roles is not None:
            filter_params["role"] = {"roles": list(roles)}
        placement = dict(s.params.get("placement", {}))
        if self.shares_placements:
            # replicas must agree where a new prefix goes, so only what they all see alike
            # may decide it; their in-flight load differs by the requests of the last
            # milliseconds (placing by load while caches had room split groups:
            # vllm-prefix-repetition with two replicas 0.720 cached against 0.737); the
            # new prefixes each worker was given lately (placement's `homes`, on for every
            # router) they count alike from their own and their peers' placements
            placement.setdefault("room", 0.0)
        scorer_params = {**s.params, "placement": placement} if placement else s.params
        return build_profile(
            name,
            policy=self.policy,
            policy_params=self.policy_params,
            weights=s.weights,
            scorer_params=scorer_params,
            filters=DEFAULT_FILTERS if roles is None else PD_FILTERS,
            filter_params=filter_params,
            rng=rng,
        )

    @property
    def has_replica_peers(self) -> bool:
        """Other router replicas (not only this replica's own processes)."""
        return bool(self.peers or self.peer_publish or self.peers_dns)

    @property
    def shares_placements(self) -> bool:
        """Other router replicas or processes place requests on the same workers."""
        return self.has_replica_peers or self.processes > 1

    def worker_mode(self, w: WorkerConfig) -> str:
        return w.mode or self.mode

    def api_key_for(self, w: WorkerConfig) -> str | None:
        return w.api_key or self.worker_api_key


def pd_threshold(value: str) -> str | int:
    """`auto`, `never`, or a number of uncached tokens at or above which to split (0: every
    request that can be split)."""
    text = value.strip().lower()
    if text in ("auto", "never"):
        return text
    if text.isdigit():
        return int(text)
    raise fail("pd_threshold", f"{value!r}: use auto, never or a number of tokens (e.g. 2048)")


def validate_workers(
    workers: tuple[WorkerConfig, ...], mode: str = "auto", whole: bool = True
) -> None:
    """Every source of workers (config, file, DNS, admin API) goes through this. `whole`:
    this is the whole fleet, not one source's part of it (a workers file of prefill workers
    may hand off to decode workers another source lists)."""
    seen: set[str] = set()
    for i, w in enumerate(workers):
        where = f"workers[{i}]"
        parts = urlsplit(w.url)
        # first, as the messages below show the URL; a worker's name (host:port) is in
        # headers, metrics and logs, so credentials in it would be on show
        _check(
            "@" not in parts.netloc,
            f"{where}.url",
            f"the URL of {parts.netloc.rpartition('@')[2]} carries credentials: give "
            "http(s)://HOST:PORT, and the engine's --api-key as api_key (or --worker-api-key)",
        )
        _check(
            parts.scheme in ("http", "https") and host_ok(parts.hostname or ""),
            f"{where}.url",
            f"{w.url!r} is not an http(s)://HOST:PORT URL",
        )
        try:
            parts.port  # noqa: B018  # raises on a port that is not a number
        except ValueError:
            raise fail(f"{where}.url", f"{w.url!r} has a bad port") from None
        # requests go to the worker's root: a path would reach only the probes
        _check(
            parts.path in ("", "/") and not parts.query and not parts.fragment,
            f"{where}.url",
            f"{w.url!r}: give http(s)://HOST:PORT only; requests are sent to the worker's "
            "/v1/... at its root",
        )
        _check(w.name not in seen, f"{where}.url", f"{w.url} is listed twice")
        seen.add(w.name)
        if w.mode is not None:
            _check(w.mode in MODES, f"{where}.mode", f"{w.mode!r} not in {', '.join(MODES)}")
        for key in ("events", "replay"):
            ep = getattr(w, key)
            if ep is not None:
                _check(
                    _endpoint_ok(ep, wildcard=True),
                    f"{where}.{key}",
                    f"{ep!r}: use tcp://HOST:PORT (tcp://*:PORT: the worker's own host)",
                )
        if w.block_size is not None:
            _check(w.block_size > 0, f"{where}.block_size", "must be positive")
        _check(w.role in ROLES, f"{where}.role", f"{w.role!r} not in {', '.join(ROLES)}")
        _check(w.engine in ENGINES, f"{where}.engine", f"{w.engine!r} not in {', '.join(ENGINES)}")
    roles = {w.role for w in workers}
    _check(
        not whole or "prefill" not in roles or bool(roles - {"prefill"}),
        "workers",
        "prefill workers need a decode worker to hand off to: add --decode-worker URL (or a "
        "worker with role decode or both)",
    )


def host_ok(host: str) -> bool:
    """A host name a resolver can take (no empty label or one over 63 characters), or an
    IP address."""
    if not host:
        return False
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        pass
    try:
        host.encode("idna")
    except UnicodeError:
        return False
    return all(c.isalnum() or c in "-._" for c in host)


def _endpoint_ok(endpoint: str, wildcard: bool = False) -> bool:
    """tcp://HOST:PORT with a port in 1..65535; `wildcard`: HOST may be `*` (how an
    engine binds: dialled at the worker's host)."""
    if not endpoint.startswith("tcp://"):
        return False
    # ZMQ's tcp://SOURCE;HOST:PORT dials from a given local address: HOST:PORT is the peer
    host, _, port = endpoint[len("tcp://") :].rpartition(";")[2].rpartition(":")
    if not (port.isdigit() and 1 <= int(port) <= 65535):
        return False
    return (wildcard and host == "*") or host_ok(host)


def _check(ok: bool, field_name: str, problem: str) -> None:
    if not ok:
        raise fail(field_name, problem)


def from_mapping(doc: Any, base: Config | None = None) -> Config:
    """A Config from a YAML-shaped mapping over `base` (unknown keys are errors: typos must
    not pass silently). Workers may be URLs or mappings; scoring weights and params merge
    into the defaults."""
    base = base or Config()
    if not isinstance(doc, dict):
        raise ConfigError("config: the top level must be a mapping of fields")
    values: dict[str, Any] = dict(doc)
    if "workers" in values:
        values["workers"] = worker_entries(values["workers"])
    if isinstance(values.get("scoring"), dict):
        values["scoring"] = _merged_scoring(values["scoring"])
    return build(Config, values, "", base)  # type: ignore[no-any-return]


def worker_entries(raw: Any, path: str = "workers") -> list[dict[str, Any]]:
    """Worker entries as mappings: a bare string is a URL."""
    if raw is None:
        return []
    if not isinstance(raw, (list, tuple)):
        raise fail(path, "expected a list of URLs or {url: ...} mappings")
    out = []
    for i, entry in enumerate(raw):
        if isinstance(entry, str):
            entry = {"url": entry}
        if isinstance(entry, WorkerConfig):
            entry = {f.name: getattr(entry, f.name) for f in fields(WorkerConfig)}
        if not isinstance(entry, dict) or "url" not in entry:
            raise fail(f"{path}[{i}]", "give a URL or a mapping with url:")
        out.append(entry)
    return out


def parse_workers(raw: Any, path: str = "workers") -> tuple[WorkerConfig, ...]:
    """Typed worker configs from a list of URLs or mappings."""
    return tuple(convert(worker_entries(raw, path), tuple[WorkerConfig, ...], path))


def _merged_scoring(raw: dict[str, Any]) -> dict[str, Any]:
    base = ScoringConfig()
    out = dict(raw)
    if isinstance(raw.get("weights"), dict):
        out["weights"] = {**base.weights, **raw["weights"]}
    return out


# KVROUTE_* variables that are not configuration fields: read elsewhere (the process
# supervisor's, the index backend, the log format, NIXL's, the test and bench tools')
OTHER_ENV = frozenset(
    {
        "INDEX_BACKEND",
        "LOG_FORMAT",
        "PROCESS_INDEX",
        "PROCESS_DIR",
        "PROCESS_COUNT",
        "NIXL_PTHR_DELAY_US",
        "ENVOY",
        "VLLM_VENV",
        "PEERS_VENV",
        "NO_SKIPS",
        "SOAK_MINUTES",
        "KEEP_LOGS",
        "MODEL_DIR",
    }
)
# What Kubernetes injects for each Service in the namespace (service links), for one named
# kvroute: KVROUTE_PORT=tcp://10.0.0.5:8000, KVROUTE_SERVICE_HOST, KVROUTE_SERVICE_PORT,
# KVROUTE_PORT_8000_TCP_ADDR, ... (kvroute-epp: KVROUTE_EPP_...)
_LINK_URL = re.compile(r"^(tcp|udp|sctp)://[^/\s]+:\d+$")
_LINK_NAME = re.compile(
    r"^KVROUTE(_[A-Z0-9]+)*_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT_\d+_(TCP|UDP|SCTP)"
    r"(_[A-Z]+)?)$"
)


def service_link(var: str, value: str) -> bool:
    """Is this variable one Kubernetes injected for a Service, not a setting?"""
    if var.endswith("_PORT") and _LINK_URL.match(value):
        return True
    return bool(_LINK_NAME.match(var))


# mappings, which a variable cannot spell: the config file sets them (and the flags that
# take MODEL=VALUE)
ENV_UNREAD = {
    "scoring": "set scoring in the config file",
    "tokenizers": "set tokenizers in the config file, or --tokenizer MODEL=PATH",
    "chat_templates": "set chat_templates in the config file, or --chat-template MODEL=FILE",
    "policy_params": "set policy_params in the config file",
}


def env_read(var: str, value: str) -> bool:
    """Whether `from_env` takes this KVROUTE_* variable: not a mapping field, and not a
    Kubernetes service link."""
    return var.removeprefix(ENV_PREFIX).lower() not in ENV_UNREAD and not service_link(var, value)


def env_notes(environ: dict[str, str] | None = None) -> list[str]:
    """What an operator should hear of the KVROUTE_* environment: variables kvroute does
    not read (a misspelt field), with the nearest field, and service links it skipped."""
    import difflib

    env = os.environ if environ is None else environ
    names = {ENV_PREFIX + f.name.upper() for f in fields(Config)}
    notes = []
    for var, value in sorted(env.items()):
        if not var.startswith(ENV_PREFIX) or var[len(ENV_PREFIX) :] in OTHER_ENV:
            continue
        if service_link(var, value):
            if var in names:
                notes.append(
                    f"{var}={value!r} is a Kubernetes service link, not kvroute's setting: "
                    "ignored (set enableServiceLinks: false in the pod spec)"
                )
            continue
        field_name = var[len(ENV_PREFIX) :].lower()
        if var in names and field_name in ENV_UNREAD:
            notes.append(f"{var} is not read from the environment: {ENV_UNREAD[field_name]}")
            continue
        if var in names:
            continue
        near = difflib.get_close_matches(var, sorted(names), n=1, cutoff=0.75)
        hint = f": did you mean {near[0]}?" if near else ""
        notes.append(f"{var} is not a kvroute setting and is ignored{hint}")
    return notes


_SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|WORKERS|PEERS")


def shown(var: str, value: str) -> str:
    """A variable for an error message: its value too, unless it may hold a secret (a key,
    a token, a worker list with api_key entries)."""
    return f"{var} (value not shown)" if _SECRET.search(var) else f"{var}={value!r}"


def env_var(err: ConfigError) -> str:
    """The KVROUTE_ variable of the field a config error names (`workers[0].url`:
    KVROUTE_WORKERS)."""
    return ENV_PREFIX + (err.param or "").split(".")[0].split("[")[0].upper()


def from_env(base: Config, environ: dict[str, str] | None = None) -> Config:
    """KVROUTE_<FIELD> for scalar fields; KVROUTE_WORKERS and KVROUTE_PEERS are
    comma-separated lists. A Kubernetes service link (KVROUTE_PORT=tcp://IP:PORT) is not
    kvroute's port."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in fields(Config):
        var = ENV_PREFIX + f.name.upper()
        raw = env.get(var)
        if raw is None or not env_read(var, raw):
            continue
        if f.name in ("workers", "peers"):
            values[f.name] = [u.strip() for u in raw.split(",") if u.strip()]
        else:
            values[f.name] = raw
    try:
        return from_mapping(values, base)
    except ConfigError as err:
        var = env_var(err)
        raise ConfigError(
            f"{shown(var, env.get(var, ''))}: {err.message}", param=err.param
        ) from None
