"""When a prefill->decode split pays: the cost model and what it learns. Pure (no IO, no
clock: every observation carries its own duration).

Decode-first: the decode worker D is chosen by the decode profile; `uncached` is the part of
the prompt not cached on D. Both ways, in milliseconds:

    local = queue_D + prefill_D(uncached) + stall(prefill_D(uncached))
    split = queue_P + prefill_P(uncached on P) + transfer + step_D + overhead + stall(step_D)
            transfer = kv_bytes_per_token * uncached / link_bytes_per_s
            step_D   = D's step that computes the pulled request's first token: prefill_D of one
                       token after the prompt
            overhead = what a decode leg's time to first token shows beyond the transfer and
                       step_D (the second HTTP leg, the notification)
            stall(x) = x when D is running other requests (each of their streams waits that
                       long for its next token), else 0

`auto` splits when split < local by a margin (2 ms or 5%). It splits nothing until it knows
the link (a probe handoff at start, `--pd-link-mb-s`, or the decode workers' NIXL metrics)
and a prefill rate.
Prefill times are fitted per worker on observed (new tokens, cached tokens, ms):
ms = a + b * new + c * (new * cached + new^2 / 2) / 1e6, the attention term making long
prefills super-linear; a worker with few observations uses the fleet's pooled fit.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_OVERHEAD_MS = 5.0  # until measured: a second HTTP leg
SPLIT_TERMS = (
    "remote_queue",
    "remote_prefill",
    "transfer",
    "decode_step",
    "overhead",
    "split_stall",
)
MIN_OWN_SAMPLES = 6  # observations before a worker's own fit replaces the pooled one
# a split must win by this much: on a close call the prediction's noise decides, and the
# local path is the simpler one (no second leg, no transfer, no lease)
MARGIN_MS = 2.0
MARGIN_FRACTION = 0.05

# reason codes: why a request was split, or kept on its decode worker
SPLIT_FASTER = "split_faster"
SPLIT_THRESHOLD = "above_threshold"
LOCAL_FASTER = "local_faster"
LOCAL_BELOW = "below_threshold"
LOCAL_NEVER = "never"
LOCAL_LINK_UNKNOWN = "link_unknown"
LOCAL_RATE_UNKNOWN = "prefill_rate_unknown"
LOCAL_CACHED = "cached_on_decode"
LOCAL_NO_PREFILL = "no_prefill_worker"
LOCAL_SATURATED = "prefill_saturated"
LOCAL_NOT_SPLITTABLE = "not_splittable"
REASONS = (
    SPLIT_FASTER,
    SPLIT_THRESHOLD,
    LOCAL_FASTER,
    LOCAL_BELOW,
    LOCAL_NEVER,
    LOCAL_LINK_UNKNOWN,
    LOCAL_RATE_UNKNOWN,
    LOCAL_CACHED,
    LOCAL_NO_PREFILL,
    LOCAL_SATURATED,
    LOCAL_NOT_SPLITTABLE,
)


@dataclass
class Rate:
    """Bytes per second over recent transfers, weighted by their bytes (a small transfer's
    fixed latency must not drag the estimate down); `decay` per observation."""

    decay: float = 0.7
    bytes: float = 0.0
    seconds: float = 0.0
    samples: int = 0

    @property
    def value(self) -> float | None:
        return self.bytes / self.seconds if self.seconds > 0 else None

    def add(self, nbytes: float, seconds: float) -> None:
        self.bytes = self.bytes * self.decay + nbytes
        self.seconds = self.seconds * self.decay + seconds
        self.samples += 1


@dataclass
class Ewma:
    """An exponentially weighted mean; the first sample sets it."""

    alpha: float = 0.3
    value: float | None = None
    samples: int = 0

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)
        self.samples += 1


class Median:
    """The median of the last `size` samples: one stalled request must not move it."""

    def __init__(self, size: int = 15) -> None:
        self._values: deque[float] = deque(maxlen=size)

    def add(self, x: float) -> None:
        self._values.append(x)

    @property
    def value(self) -> float | None:
        return statistics.median(self._values) if self._values else None


def _features(new: int, cached: int) -> tuple[float, float, float]:
    return 1.0, float(new), (new * cached + new * new / 2) / 1e6


class PrefillFit:
    """Milliseconds to prefill `new` tokens after `cached` ones, fitted by least squares on
    the last `size` observations; coefficients that come out negative are dropped."""

    def __init__(self, size: int = 64) -> None:
        self.samples: deque[tuple[int, int, float]] = deque(maxlen=size)
        self._coef: tuple[float, float, float] | None = None
        self._stale = False

    def add(self, new: int, cached: int, ms: float) -> None:
        if new > 0 and ms > 0:
            self.samples.append((new, cached, ms))
            self._stale = True

    @property
    def coefficients(self) -> tuple[float, float, float] | None:
        if self._stale:
            self._coef = _fit(list(self.samples))
            self._stale = False
        return self._coef

    def predict(self, new: int, cached: int = 0) -> float | None:
        coef = self.coefficients
        if coef is None:
            return None
        return sum(c * f for c, f in zip(coef, _features(new, cached), strict=True))


def _fit(samples: list[tuple[int, int, float]]) -> tuple[float, float, float] | None:
    """a, b, c >= 0; None until two distinct lengths were seen (one sample: b only)."""
    if not samples:
        return None
    rows = [_features(n, c) for n, c, _ in samples]
    ys = [ms for _, _, ms in samples]
    if len({n for n, _, _ in samples}) < 2:
        return (0.0, sum(ys) / sum(r[1] for r in rows), 0.0)
    return _nonnegative(rows, ys)


def _nonnegative(
    rows: list[tuple[float, float, float]], ys: list[float]
) -> tuple[float, float, float] | None:
    """Least squares on the three terms, dropping any that come out negative."""
    for keep in ((0, 1, 2), (0, 1), (1,)):
        coef = _least_squares([[r[i] for i in keep] for r in rows], ys)
        if coef is not None and all(c >= 0 for c in coef):
            full = [0.0, 0.0, 0.0]
            for i, c in zip(keep, coef, strict=True):
                full[i] = c
            return full[0], full[1], full[2]
    return None


def _least_squares(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    """Normal equations, Gaussian elimination; None when singular."""
    k = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    b = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda i: abs(a[i][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for i in range(col + 1, k):
            f = a[i][col] / a[col][col]
            a[i] = [x - f * y for x, y in zip(a[i], a[col], strict=True)]
            b[i] -= f * b[col]
    out = [0.0] * k
    for i in reversed(range(k)):
        out[i] = (b[i] - sum(a[i][j] * out[j] for j in range(i + 1, k))) / a[i][i]
    return out


@dataclass(frozen=True)
class Side:
    """One worker as the plan sees it: the prompt's uncached and cached tokens there, and
    its load (requests in flight, prompt tokens still to prefill)."""

    worker: str
    new: int
    cached: int
    requests: int = 0
    queued_tokens: int = 0


@dataclass(frozen=True)
class Plan:
    """One request's P/D decision: split or not, the reason code, and the terms."""

    split: bool
    reason: str
    decode: str
    prefill: str | None = None
    uncached: int = 0  # prompt tokens not cached on the decode worker
    detail: str = ""
    terms: dict[str, float] = field(default_factory=dict)

    def explain(self) -> str:
        verdict = "split" if self.split else "local"
        where = f"prefill {self.prefill} -> decode {self.decode}" if self.split else self.decode
        terms = ", ".join(f"{k} {v:.1f}" for k, v in self.terms.items())
        extra = f"; {self.detail}" if self.detail else ""
        return f"{verdict} ({self.reason}): {where}, {self.uncached} uncached tokens{extra}" + (
            f"; ms: {terms}" if terms else ""
        )


class CostModel:
    """What the router knows about the P/D path, and the decision from it."""

    def __init__(
        self,
        threshold: str | int,
        link_bytes_per_s: float | None = None,
        kv_bytes_per_token: float | None = None,
    ) -> None:
        self.threshold = threshold
        self.link = Rate()
        if link_bytes_per_s is not None:  # as if one second at that rate had been seen
            self.link.add(link_bytes_per_s, 1.0)
        self.kv_bytes_per_token = Ewma(0.3, kv_bytes_per_token)
        self.kv_fixed = kv_bytes_per_token is not None  # given: from the model's config
        self.overhead = Median()
        self.fits: dict[str, PrefillFit] = {}
        self.pooled = PrefillFit(256)

    # ---- learning -------------------------------------------------------------------

    def observe_prefill(self, worker: str, new: int, cached: int, ms: float) -> None:
        self.fits.setdefault(worker, PrefillFit()).add(new, cached, ms)
        self.pooled.add(new, cached, ms)

    def observe_transfer(self, nbytes: float, seconds: float, tokens: float) -> None:
        """The decode workers' NIXL counters moved: bytes in seconds for `tokens` tokens."""
        if nbytes > 0 and seconds > 0:
            self.link.add(nbytes, seconds)
        if nbytes > 0 and tokens > 0 and not self.kv_fixed:
            self.kv_bytes_per_token.add(nbytes / tokens)

    def observe_overhead(
        self, decode: str, decode_ttft_ms: float, tokens: int, prompt_tokens: int
    ) -> None:
        """A decode leg's time to first token (`tokens` pulled of `prompt_tokens`); what
        the transfer and the decode worker's step do not explain is overhead."""
        transfer = self.transfer_ms(tokens) or 0.0
        step = self.prefill_ms(decode, 1, max(prompt_tokens - 1, 0)) or 0.0
        self.overhead.add(max(decode_ttft_ms - transfer - step, 0.0))

    # ---- predictions ----------------------------------------------------------------

    def prefill_ms(self, worker: str, new: int, cached: int = 0) -> float | None:
        own = self.fits.get(worker)
        if own is not None and len(own.samples) >= MIN_OWN_SAMPLES:
            found = own.predict(new, cached)
            if found is not None:
                return found
        return self.pooled.predict(new, cached)

    def transfer_ms(self, tokens: int) -> float | None:
        link, per_token = self.link.value, self.kv_bytes_per_token.value
        if not link or not per_token:
            return None
        return per_token * tokens / link * 1000

    def queue_ms(self, worker: str, tokens: int) -> float:
        """Prompt tokens already waiting there, as time."""
        if tokens <= 0:
            return 0.0
        full, base = self.prefill_ms(worker, tokens), self.prefill_ms(worker, 0)
        return max((full or 0.0) - (base or 0.0), 0.0)

    # ---- the decision ---------------------------------------------------------------

    def decide(self, d: Side, p: Side | None, block_size: int, why_not: str = "") -> Plan:
        """`p`: the prefill worker its profile chose (None: none eligible, `why_not` says
        which reason code)."""
        if self.threshold == "never":
            return Plan(False, LOCAL_NEVER, d.worker, uncached=d.new)
        if d.new < max(block_size, 1):
            return Plan(False, LOCAL_CACHED, d.worker, uncached=d.new)
        if p is None:
            return Plan(False, why_not or LOCAL_NO_PREFILL, d.worker, uncached=d.new)
        if isinstance(self.threshold, int):
            split = d.new >= self.threshold
            reason = SPLIT_THRESHOLD if split else LOCAL_BELOW
            return Plan(split, reason, d.worker, p.worker, d.new, f"threshold {self.threshold}")
        return self._auto(d, p)

    def _auto(self, d: Side, p: Side) -> Plan:
        transfer = self.transfer_ms(d.new)
        if transfer is None:
            return Plan(False, LOCAL_LINK_UNKNOWN, d.worker, p.worker, d.new)
        local_prefill = self.prefill_ms(d.worker, d.new, d.cached)
        remote_prefill = self.prefill_ms(p.worker, p.new, p.cached)
        if local_prefill is None or remote_prefill is None:
            return Plan(False, LOCAL_RATE_UNKNOWN, d.worker, p.worker, d.new)
        step = self.prefill_ms(d.worker, 1, d.new + d.cached - 1) or 0.0
        busy = d.requests > 0
        overhead = self.overhead.value
        terms = {
            "local_queue": self.queue_ms(d.worker, d.queued_tokens),
            "local_prefill": local_prefill,
            "local_stall": local_prefill if busy else 0.0,
            "remote_queue": self.queue_ms(p.worker, p.queued_tokens),
            "remote_prefill": remote_prefill,
            "transfer": transfer,
            "decode_step": step,
            "overhead": DEFAULT_OVERHEAD_MS if overhead is None else overhead,
            "split_stall": step if busy else 0.0,
        }
        local = terms["local_queue"] + local_prefill + terms["local_stall"]
        split = sum(terms[k] for k in SPLIT_TERMS)
        terms |= {"local": local, "split": split}
        pays = split < local - max(MARGIN_MS, MARGIN_FRACTION * local)
        reason = SPLIT_FASTER if pays else LOCAL_FASTER
        return Plan(pays, reason, d.worker, p.worker, d.new, terms=terms)

    def fits_doc(self) -> dict[str, dict[str, object]]:
        """Each worker's prefill fit (ms = a + b*new + c*pairs/1e6), and the pooled one."""
        out: dict[str, dict[str, object]] = {}
        for name, fit in [*self.fits.items(), ("pooled", self.pooled)]:
            coef = fit.coefficients
            out[name] = {
                "samples": len(fit.samples),
                "a_ms": None if coef is None else round(coef[0], 2),
                "b_ms_per_token": None if coef is None else round(coef[1], 5),
                "c_ms_per_mpair": None if coef is None else round(coef[2], 3),
            }
        return out

    def snapshot(self) -> dict[str, float | None]:
        """The estimates, for /health, /debug/route and the metrics."""
        link = self.link.value
        return {
            "link_mb_s": None if link is None else round(link / 1e6, 1),
            "kv_bytes_per_token": _round(self.kv_bytes_per_token.value),
            "overhead_ms": _round(self.overhead.value),
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def split_above(
    prefill_ms: Callable[[int], float],
    kv_bytes_per_token: float,
    link_bytes_per_s: float,
    overhead_ms: float,
    limit: int = 1 << 20,
) -> int | None:
    """The shortest uncached length a busy decode worker would hand off (the same model
    as `CostModel._auto`, with equal prefill workers and empty queues); None: never up
    to `limit` tokens. For the README and the benchmark's cost-model table."""

    def pays(n: int) -> bool:
        transfer = kv_bytes_per_token * n / link_bytes_per_s * 1000
        local = 2 * prefill_ms(n)
        margin = max(MARGIN_MS, MARGIN_FRACTION * local)
        return prefill_ms(n) + transfer + 2 * prefill_ms(1) + overhead_ms < local - margin

    n = 16
    while n <= limit and not pays(n):
        n *= 2
    if n > limit:
        return None
    lo, hi = n // 2, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if pays(mid) else (mid, hi)
    return hi
