"""A simulated fleet behind a router served in this process, as the model-pool tests use it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

from engines.sim.fleet import Fleet
from router.app import RouterApp


@dataclass
class Setup:
    fleet: Fleet
    app: RouterApp
    client: httpx.AsyncClient

    def name(self, i: int) -> str:
        return f"127.0.0.1:{self.fleet.workers[i].port}"


async def settle(s: Setup) -> None:
    """Wait until the router knows every worker's models."""
    for _ in range(200):
        if all(w.models is not None for w in s.app.fleet.workers.values()):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("models never discovered")
