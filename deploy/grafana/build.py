"""Writes deploy/grafana/kvroute.json, the Grafana dashboard for kvroute's /metrics (the
README's metrics table): traffic, latency, routing quality, KV-event health, the index,
failures and replicas, and the prefill->decode handoff. Edit this file, not the JSON, then:

    .venv/bin/python deploy/grafana/build.py

tests/test_deploy_dashboard.py fails when the JSON is not what this writes, and when a query
names a metric or label that a real `kvroute serve` does not expose.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("kvroute.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job=~"$job"'  # every query: the kvroute targets chosen at the top
W = f'{SEL}, worker=~"$worker"'
M = f'{SEL}, model=~"$model"'
RATE = "$__rate_interval"

Panel = dict[str, Any]


def q(expr: str, legend: str = "") -> dict[str, str]:
    return {"expr": expr, "legendFormat": legend or "__auto"}


def rate(metric: str, by: str, sel: str = SEL) -> str:
    return f"sum by ({by}) (rate({metric}{{{sel}}}[{RATE}]))"


def fleet_rate(metric: str, by: str, sel: str = W) -> str:
    """A per-worker counter every replica keeps alike (each consumes every worker's events
    and scrapes every decode worker's NIXL counters): the highest replica's rate, never N
    replicas times it; summed over the workers when `by` does not keep them apart."""
    if "worker" in by.split(", "):
        return f"max by ({by}) (rate({metric}{{{sel}}}[{RATE}]))"
    return f"sum by ({by}) (max by (worker, {by}) (rate({metric}{{{sel}}}[{RATE}])))"


def fleet_gauge(metric: str, by: str, sel: str = W) -> str:
    """Workers per `by` value of a 0/1 gauge that every replica reports alike: the highest
    replica's value per worker, summed over the workers."""
    return f"sum by ({by}) (max by (worker, {by}) ({metric}{{{sel}}}))"


def quantiles(metric: str, sel: str) -> list[dict[str, str]]:
    """p50 / p90 / p99 of a histogram."""
    return [
        q(
            f"histogram_quantile({p}, sum by (le) (rate({metric}_bucket{{{sel}}}[{RATE}])))",
            f"p{round(p * 100)}",
        )
        for p in (0.5, 0.9, 0.99)
    ]


def series(title: str, targets: list[dict[str, str]], unit: str, text: str = "") -> Panel:
    return {
        "type": "timeseries",
        "title": title,
        "description": text,
        "datasource": DS,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": targets,
    }


def stat(title: str, expr: str, unit: str, text: str = "") -> Panel:
    return {
        "type": "stat",
        "title": title,
        "description": text,
        "datasource": DS,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value"},
        "targets": [q(expr)],
    }


def traffic() -> list[Panel]:
    req = "kvroute_requests_total"
    return [
        stat("Requests/s", f"sum(rate({req}{{{M}}}[{RATE}]))", "reqps"),
        stat(
            "Not ok",
            f'sum(rate({req}{{{M}, outcome!="ok"}}[{RATE}])) / sum(rate({req}{{{M}}}[{RATE}]))',
            "percentunit",
            "Share of requests whose outcome is not ok (worker errors, timeouts, the router's "
            "own 4xx/5xx, client disconnects)",
        ),
        stat("In flight", f"sum(kvroute_inflight_requests{{{W}}})", "short"),
        stat("Version", f"count by (version) (kvroute_build_info{{{SEL}}})", "short"),
        series("Requests by model and status", [q(rate(req, "model, status", M))], "reqps"),
        series(
            "Requests by outcome",
            [q(rate(req, "outcome", M))],
            "reqps",
            "ok, http_error, connect_failed, timeout, client_disconnected, drain_timeout; "
            "router = the router's own answer (worker none)",
        ),
        series("Requests by worker", [q(rate(req, "worker", f'{M}, worker=~"$worker"'))], "reqps"),
        series(
            "In flight by worker",
            [
                q(f"sum by (worker) (kvroute_inflight_requests{{{W}}})", "{{worker}} requests"),
                q(
                    f"sum by (worker) (kvroute_inflight_prefill_tokens{{{W}}})",
                    "{{worker}} prefill tokens",
                ),
                q(
                    f"max by (worker) (kvroute_worker_batch_limit{{{W}}})",
                    "{{worker}} batch limit (learned)",
                ),
            ],
            "short",
            "Load as the router counts it: requests, and uncached prompt tokens awaiting their "
            "first token; and each engine's batch limit where kvroute learned it (a worker is "
            "busy at that many requests)",
        ),
    ]


def latency() -> list[Panel]:
    return [
        series("Time to first token", quantiles("kvroute_ttft_seconds", M), "s"),
        series("Request duration", quantiles("kvroute_request_duration_seconds", M), "s"),
        series(
            "TTFT p90 by worker",
            [
                q(
                    "histogram_quantile(0.9, sum by (le, worker) "
                    f'(rate(kvroute_ttft_seconds_bucket{{{M}, worker=~"$worker"}}[{RATE}])))',
                    "{{worker}}",
                )
            ],
            "s",
        ),
        series(
            "Routing decision time",
            quantiles("kvroute_route_decision_seconds", SEL),
            "s",
            "Tokenize + hash + index look-up + score, per request",
        ),
    ]


def quality() -> list[Panel]:
    return [
        series(
            "Prediction fidelity",
            [q(rate("kvroute_prediction_fidelity_total", "result", W))],
            "reqps",
            "Predicted cached tokens vs the engine's cached_tokens: exact, over, under",
        ),
        series(
            "Cached tokens: predicted vs reported",
            [
                q(f"sum(rate(kvroute_predicted_cached_tokens_total{{{W}}}[{RATE}]))", "predicted"),
                q(f"sum(rate(kvroute_reported_cached_tokens_total{{{W}}}[{RATE}]))", "reported"),
            ],
            "short",
        ),
        series(
            "Predicted overlap (mean)",
            [
                q(
                    f"sum(rate(kvroute_predicted_overlap_ratio_sum{{{SEL}}}[{RATE}])) / "
                    f"sum(rate(kvroute_predicted_overlap_ratio_count{{{SEL}}}[{RATE}]))",
                    "overlap",
                )
            ],
            "percentunit",
            "Predicted cached fraction of each prompt",
        ),
    ]


def events() -> list[Panel]:
    accidents = [
        "sequence_gaps",
        "replays",
        "replay_failures",
        "resyncs",
        "restarts",
        "out_of_order",
        "unknown_parent",
        "skipped_events",
        "subscriber_restarts",
    ]
    return [
        series(
            "Workers in rotation",
            [q(f"max by (worker) (kvroute_worker_available{{{W}}})", "{{worker}}")],
            "short",
            "1 while the worker passes health checks (on any replica: each checks on its own)",
        ),
        series(
            "Event health",
            [q(fleet_gauge("kvroute_worker_event_health", "state"), "{{state}}")],
            "short",
            "Workers per state: OK, NO_EVENTS, STALE, RESYNCING, DISABLED (a worker counts in "
            "a state when any replica sees it there)",
        ),
        series(
            "Routing mode",
            [q(fleet_gauge("kvroute_worker_mode", "mode"), "{{mode}}")],
            "short",
            "Workers routed from their KV events (events) or approximately (approx)",
        ),
        series(
            "Event age",
            [q(f"max by (worker) (kvroute_kv_event_age_seconds{{{W}}})", "{{worker}}")],
            "s",
            "Seconds since each worker's last KV event message",
        ),
        series(
            "KV events applied",
            [q(fleet_rate("kvroute_kv_events_total", "type"))],
            "ops",
        ),
        series(
            "Event stream accidents",
            [
                q(f"sum(max by (worker) (rate(kvroute_kv_{a}_total{{{W}}}[{RATE}])))", a)
                for a in accidents
            ],
            "ops",
        ),
        series(
            "Malformed batches",
            [q(fleet_rate("kvroute_kv_malformed_total", "worker, reason"))],
            "ops",
        ),
    ]


def index_and_failures() -> list[Panel]:
    return [
        series(
            "Index blocks by worker",
            [q(f"max by (worker) (kvroute_index_blocks{{{W}}})", "{{worker}}")],
            "short",
            "Each replica holds the whole index: the highest replica's count",
        ),
        series(
            "Index evictions",
            [q(fleet_rate("kvroute_index_evicted_total", "worker, cause"))],
            "ops",
            "Entries dropped at a worker's cap (num_gpu_blocks x index_cap_margin)",
        ),
        series(
            "Blocks stored again after eviction",
            [q(fleet_rate("kvroute_kv_refetched_blocks_total", "worker"))],
            "ops",
            "GPU blocks a worker prefilled again soon after evicting them: its KV cache is "
            "too small for the prefixes routed to it",
        ),
        series(
            "Streams cut",
            [q(rate("kvroute_stream_errors_total", "worker, cause", W))],
            "ops",
            "Streams that ended with an error event after they started",
        ),
        series("Retries", [q(rate("kvroute_retries_total", "worker", W))], "ops"),
        series(
            "Peer placements",
            [q(rate("kvroute_peer_placements_total", "result"))],
            "ops",
            "Placements and load reports received from the other replicas (--peer); "
            "unknown_worker: the replicas' worker lists differ",
        ),
        series(
            "Placement waits",
            [q(rate("kvroute_placement_waits_total", "changed"))],
            "ops",
            "New prefixes a replica placed after waiting --peer-wait-ms for the others' "
            "placements; changed=true: the second look chose another worker (a collision "
            "the wait avoided)",
        ),
        series(
            "Peer replicas heard",
            [q(f"kvroute_peer_replicas{{{SEL}}}", "{{instance}}")],
            "short",
            "Other router processes whose in-flight load each replica counts (its --processes "
            "siblings and every process of the other replicas; with --processes the fewest any "
            "of its processes hears): below replicas x processes - 1, a peer link is down "
            "(check --peer / --peers-dns and port 5570)",
        ),
        series(
            "Shed (429)",
            [q(rate("kvroute_requests_shed_total", "model", M))],
            "reqps",
            "Requests refused because every eligible worker was busy (--shed): raise "
            "--busy-max-requests / --busy-max-kv-usage or add workers",
        ),
    ]


def handoff() -> list[Panel]:
    """The prefill->decode handoff (README: Prefill->decode handoff); empty on a fleet
    without prefill workers."""
    return [
        series(
            "P/D decisions",
            [q(rate("kvroute_pd_decisions_total", "decision, reason"))],
            "reqps",
            "split or local, with the reason code each response carries in x-kvroute-pd",
        ),
        series(
            "Split requests: arrival to first byte",
            quantiles("kvroute_pd_handoff_seconds", SEL),
            "s",
            "Prefill leg, KV transfer and the decode leg's first token",
        ),
        series("Prefill leg", quantiles("kvroute_pd_prefill_leg_seconds", SEL), "s"),
        series(
            "KV pulled by decode workers",
            [q(fleet_rate("kvroute_pd_kv_bytes_total", "worker"))],
            "Bps",
            "From the decode workers' vllm:nixl_bytes_transferred",
        ),
        series(
            "Handoffs proved and silent recomputes",
            [
                q(rate("kvroute_pd_verified_handoffs_total", "worker", W), "{{worker}} proved"),
                q(rate("kvroute_pd_silent_recomputes_total", "worker", W), "{{worker}} silent"),
            ],
            "ops",
            "A silent recompute: the decode worker answered without pulling the KV (/health "
            "turns degraded naming it)",
        ),
        series(
            "Handoff failures",
            [
                q(rate("kvroute_pd_local_fallbacks_total", "cause"), "fallback {{cause}}"),
                q(fleet_rate("kvroute_pd_failed_pulls_total", "worker"), "failed pull {{worker}}"),
                q(rate("kvroute_pd_orphaned_prefills_total", "cause"), "orphaned {{cause}}"),
                q(rate("kvroute_pd_decode_errors_total", "cause"), "decode error {{cause}}"),
            ],
            "ops",
            "Splits prefilled on the decode worker instead, failed NIXL transfers, prefills "
            "no decode leg read (held for the lease), decode legs failed after the prefill",
        ),
        series(
            "Cost model: link",
            [q(f"max(kvroute_pd_link_mb_per_second{{{SEL}}})", "MB/s")],
            "short",
            "The P->D link the split decision assumes, measured from the handoffs",
        ),
        series(
            "Cost model: KV size and overhead",
            [
                q(f"max(kvroute_pd_kv_bytes_per_token{{{SEL}}})", "KV bytes per token"),
                q(f"max(kvroute_pd_overhead_ms{{{SEL}}})", "split overhead ms"),
            ],
            "short",
        ),
    ]


def variable(name: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": name},
        "definition": query,
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
    }


def layout(rows: list[tuple[str, list[Panel]]]) -> list[Panel]:
    """Rows of panels, four stats or two graphs across (Grafana's grid is 24 wide)."""
    panels: list[Panel] = []
    y = 0
    for title, row in rows:
        panels.append({"type": "row", "title": title, "collapsed": False, "panels": []})
        panels[-1]["gridPos"] = _at(0, y, 24, 1)
        x, y, line = 0, y + 1, 0
        for panel in row:
            w, h = (6, 4) if panel["type"] == "stat" else (12, 8)
            if x + w > 24:
                x, y, line = 0, y + line, 0
            panel["gridPos"] = _at(x, y, w, h)
            x, line = x + w, max(line, h)
        y += line
        panels += row
    for n, panel in enumerate(panels, 1):
        panel["id"] = n
        for ref, target in zip("ABCDEFGHIJ", panel.get("targets", []), strict=False):
            target["refId"] = ref
    return panels


def _at(x: int, y: int, w: int, h: int) -> dict[str, int]:
    return {"x": x, "y": y, "w": w, "h": h}


def dashboard() -> dict[str, Any]:
    rows = [
        ("Traffic", traffic()),
        ("Latency", latency()),
        ("Routing quality", quality()),
        ("Workers and KV events", events()),
        ("Index and failures", index_and_failures()),
        ("Prefill->decode handoff", handoff()),
    ]
    return {
        "title": "kvroute",
        "uid": "kvroute",
        "description": "KV-cache-aware router for vLLM fleets: kvroute's /metrics",
        "tags": ["kvroute", "vllm"],
        "editable": True,
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus"},
                variable("job", "label_values(kvroute_build_info, job)"),
                variable("model", 'label_values(kvroute_requests_total{job=~"$job"}, model)'),
                variable("worker", 'label_values(kvroute_worker_available{job=~"$job"}, worker)'),
            ]
        },
        "panels": layout(rows),
    }


def main() -> None:
    OUT.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
