"""`--otel`: one OpenTelemetry span per routing decision (`kvroute.route`), a child of the
request's `traceparent`, with the decision's facts as attributes. The exporter is the
standard OTLP one, configured by the usual OTEL_EXPORTER_OTLP_* environment variables
(`pip install 'kvroute[otel]'`)."""

from __future__ import annotations

import time
from typing import Any

from router.core.decision import Decision
from router.core.errors import ConfigError


class DecisionTracer:
    def __init__(self, provider: Any = None) -> None:
        try:
            from opentelemetry import propagate, trace
        except ImportError:
            raise ConfigError(
                "config field otel: OpenTelemetry is not installed; pip install 'kvroute[otel]'",
                param="otel",
            ) from None
        if provider is None:
            provider = _otlp_provider()
        self._tracer = trace.get_tracer("kvroute", tracer_provider=provider)
        self._extract = propagate.extract

    def record(
        self, headers: list[tuple[bytes, bytes]], decision: Decision, started_ns: int
    ) -> None:
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers}
        span = self._tracer.start_span(
            "kvroute.route", context=self._extract(carrier), start_time=started_ns
        )
        best = decision.best
        span.set_attributes(
            {
                "kvroute.model": decision.request.model,
                "kvroute.profile": decision.profile,
                "kvroute.policy": decision.policy,
                "kvroute.worker": best.worker,
                "kvroute.prompt_tokens": decision.prompt_tokens,
                "kvroute.overlap_tokens": best.overlap_blocks * best.block_size,
                "kvroute.score": best.total,
                "kvroute.eligible": len(decision.ranked),
                "kvroute.excluded": len(decision.excluded),
            }
        )
        span.end(end_time=time.time_ns())


def _otlp_provider() -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise ConfigError(
            "config field otel: the OpenTelemetry SDK or OTLP exporter is missing; "
            "pip install 'kvroute[otel]'",
            param="otel",
        ) from None
    provider = TracerProvider(resource=Resource.create({"service.name": "kvroute"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider
