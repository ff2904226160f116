"""The decode workers' metrics loop (router/pd/verify.py): with a sweep (the first process
of --processes, which alone counts every decode worker's KV bytes and failed pulls), each
decode worker is read at least every `sweep_s`, whatever its own splits do, and so is one
that joined after start."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from router.pd.ledger import Ledger
from router.pd.metrics import PDMetrics
from router.pd.verify import Verifier, WorkerAccount

pytestmark = pytest.mark.timeout(30)


class _Every(dict[str, object]):
    """A pool's handles where every worker is still in the fleet."""

    def __contains__(self, key: object) -> bool:
        return True


def _verifier(decode: list[str]) -> tuple[Verifier, dict[str, int]]:
    reads: dict[str, int] = {}
    pool = SimpleNamespace(handle_of=lambda e: None, handles=_Every())
    v = Verifier(pool, model=None, metrics=None, interval_s=0.01, sweep_s=0.3)  # type: ignore[arg-type]
    v.decode_workers = lambda: decode

    async def check(worker: str) -> None:
        reads[worker] = reads.get(worker, 0) + 1
        v.ledgers.setdefault(worker, Ledger()).last = object()  # type: ignore[assignment]
        v.ledgers[worker].pending_splits = 0

    v._check = check  # type: ignore[method-assign]
    return v, reads


async def test_the_sweep_runs_while_the_processs_own_splits_keep_waking_it() -> None:
    v, reads = _verifier(["A", "B"])
    v.ledgers["A"] = Ledger(last=object())  # type: ignore[arg-type]
    v.ledgers["B"] = Ledger(last=object())  # type: ignore[arg-type]
    task = asyncio.create_task(v.run())
    try:
        for _ in range(15):  # 1.5 s: one of its own splits on A every 0.1 s (< sweep_s)
            v.started("A")
            v.ended("A", 10)
            await asyncio.sleep(0.1)
    finally:
        task.cancel()
    assert reads.get("B", 0) >= 3, reads  # every 0.3 s


async def test_the_sweep_reads_a_decode_worker_that_joined_later() -> None:
    decode = ["A"]
    v, reads = _verifier(decode)
    task = asyncio.create_task(v.run())
    try:
        await asyncio.sleep(0.1)
        decode.append("C")  # no split of this process has gone there
        await asyncio.sleep(0.8)
    finally:
        task.cancel()
    assert reads.get("C", 0) >= 1 and reads.get("A", 0) >= 2, reads


def test_a_data_parallel_decode_worker_removed_mid_leg_is_forgotten() -> None:
    """The leg started on rank 1 of worker W and ended after W left the fleet: its end is
    booked on W's ledger (not one of the rank's own), which is then dropped, its totals
    kept."""
    handles: dict[str, object] = {"W": object()}
    pool = SimpleNamespace(
        handle_of=lambda e: SimpleNamespace(name="W") if "W" in handles else None,
        handles=handles,
    )
    metrics = PDMetrics(CollectorRegistry(), dict, owner=True)
    v = Verifier(pool, model=None, metrics=metrics)  # type: ignore[arg-type]
    metrics.child(metrics.verified, "W").inc(3)
    v.started("W#dp1")
    v.accounts["W"] = WorkerAccount(verified=3)
    del handles["W"]
    v.ended("W#dp1", None)
    v.forget_removed()
    assert v.ledgers == {} and v.accounts == {}
    assert v.totals()["verified_handoffs"] == 3
    assert 'worker="W"' not in generate_latest(metrics.verified).decode()  # its series too
