"""Where the worker list comes from, merged and validated in one place before the pool sees
it: the config's `workers` (replaced by `POST /admin/workers`), `workers_file` (a YAML list,
re-read when it changes) and `workers_dns` (a headless Service's A records, or its AAAA
records where it has no A record; re-resolved).
Every entry from every source is typed and checked like the config itself; a bad file or
admin body is refused with the field named and the current list kept."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

import yaml

from router.core.config import Config, WorkerConfig, parse_workers, validate_workers
from router.core.errors import ConfigError
from router.workers import WorkerPool, one_family

log = logging.getLogger("kvroute.workers")

FILE_POLL_S = 2.0


class WorkerSources:
    def __init__(self, config: Config, pool: WorkerPool, admin_state: Path | None = None) -> None:
        self.config = config
        self.pool = pool
        self.admin_state = admin_state  # `--processes`: the siblings' admin changes
        self.listed: tuple[WorkerConfig, ...] = config.workers  # config, or the admin API
        self.from_file: tuple[WorkerConfig, ...] = ()
        self.from_dns: tuple[WorkerConfig, ...] = ()
        self._tasks: list[asyncio.Task[None]] = []
        self._file_mtime = 0.0
        self._dns_said = ""  # what the last resolve said of the address families answered

    def merged(self, listed: tuple[WorkerConfig, ...] | None = None) -> tuple[WorkerConfig, ...]:
        """Every source's workers, each worker once (the first source naming it wins);
        `listed`: in place of the config's or admin API's list."""
        out: dict[str, WorkerConfig] = {}
        for w in (*(self.listed if listed is None else listed), *self.from_file, *self.from_dns):
            out.setdefault(w.name, w)
        return tuple(out.values())

    async def start(self) -> None:
        draining = self._read_admin_state()
        if self.config.workers_file:
            self._read_file()
        if self.config.workers_dns:
            await self._resolve()
        merged = self.merged()
        try:
            validate_workers(merged, self.config.mode)
        except ConfigError as err:  # the other sources may complete it later
            log.error("worker list at start: %s", err.message)
        await self.pool.start(merged)
        for name in draining:
            h = self.pool.handles.get(name)
            if h is not None:
                h.set_draining(True)
        if self.config.workers_file:
            self._tasks.append(asyncio.create_task(self._watch_file()))
        if self.config.workers_dns:
            self._tasks.append(asyncio.create_task(self._watch_dns()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.pool.stop()

    # ---- the admin API's changes, across --processes --------------------------------

    def save_admin_state(self) -> None:
        """Record the admin API's list and the drained workers (atomically) for a sibling
        process that starts later."""
        if self.admin_state is None:
            return
        doc = {
            "listed": [dataclasses.asdict(w) for w in self.listed],
            "draining": sorted(n for n, h in self.pool.handles.items() if h.draining),
        }
        tmp = self.admin_state.with_name(f".{self.admin_state.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # keys in the list
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, self.admin_state)

    def _read_admin_state(self) -> list[str]:
        """The list and drains the siblings applied (a restarted child); the drained
        names."""
        if self.admin_state is None or not self.admin_state.exists():
            return []
        try:
            doc = json.loads(self.admin_state.read_text())
            self.listed = parse_workers(doc["listed"], "admin state: listed")
            draining = [str(n) for n in doc.get("draining", [])]
        except (OSError, ValueError, KeyError, TypeError, ConfigError) as exc:
            log.error(
                "admin state %s unreadable (%s): starting from the config", self.admin_state, exc
            )
            return []
        log.warning(
            "worker list and drains as the other processes last applied them: %s%s",
            ", ".join(w.name for w in self.listed) or "none listed",
            f"; draining {', '.join(draining)}" if draining else "",
        )
        return draining

    async def replace_listed(self, raw: Any) -> tuple[WorkerConfig, ...]:
        """The admin API's new list (URLs or mappings), checked like the config's."""
        workers = parse_workers(raw, "workers")
        validate_workers(workers, self.config.mode, whole=False)
        merged = self.merged(listed=workers)
        validate_workers(merged, self.config.mode)  # refused: the current list stays
        self.listed = workers
        await self._set(merged, "the admin API")
        return workers

    async def _apply(self, origin: str) -> None:
        merged = self.merged()
        try:
            validate_workers(merged, self.config.mode)
        except ConfigError as err:
            # a file or DNS change that leaves no whole fleet (prefill workers with no
            # decode worker): the pool keeps the workers it has
            log.error(
                "worker list from %s refused: %s (keeping the current list)", origin, err.message
            )
            return
        await self._set(merged, origin)

    async def _set(self, merged: tuple[WorkerConfig, ...], origin: str) -> None:
        await self.pool.set_workers(merged)
        # a worker removed and added again (a file, DNS) comes back undrained: so must it
        # in a sibling that starts later
        self.save_admin_state()
        log.warning("worker list from %s: %s", origin, ", ".join(w.name for w in merged) or "none")

    # ---- file ------------------------------------------------------------------------

    def _read_file(self) -> bool:
        """Re-read the workers file if it changed; True when the list changed."""
        path = self.config.workers_file
        assert path is not None
        try:
            mtime = os.stat(path).st_mtime
            if mtime == self._file_mtime:
                return False
            self._file_mtime = mtime
            with open(path) as f:
                raw = yaml.safe_load(f)
            if raw is None and self.from_file:
                # an editor truncates before it writes: mid-save is not "no workers"
                log.warning(
                    "workers file %s is empty: keeping the current list (write `workers: []` "
                    "to remove every worker)",
                    path,
                )
                return False
            raw = raw or []
            entries = raw.get("workers", raw) if isinstance(raw, dict) else raw
            workers = parse_workers(entries, f"workers_file {path}: workers")
            validate_workers(workers, self.config.mode, whole=False)
        except (OSError, UnicodeError, yaml.YAMLError) as exc:  # not UTF-8: a half-written save
            log.error("workers file %s: %s (keeping the current list)", path, exc)
            return False
        except ConfigError as err:
            log.error("workers file %s: %s (keeping the current list)", path, err.message)
            return False
        changed = workers != self.from_file
        self.from_file = workers
        return changed

    async def _watch_file(self) -> None:
        while True:
            await asyncio.sleep(FILE_POLL_S)
            # a pass that fails is logged and the next one tried: a watcher that died would
            # leave every later edit unread, silently
            try:
                if self._read_file():
                    await self._apply(f"workers file {self.config.workers_file}")
            except Exception:
                log.exception("workers file %s: re-reading failed", self.config.workers_file)

    # ---- DNS -------------------------------------------------------------------------

    async def _resolve(self) -> bool:
        """One worker per address of the headless Service, of one family (`one_family`);
        True when the set changed."""
        assert self.config.workers_dns is not None
        host, _, port = self.config.workers_dns.rpartition(":")
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, int(port), type=socket.SOCK_STREAM
            )
        except (OSError, UnicodeError) as exc:
            log.error("workers_dns %s: %s (keeping the current workers)", host, exc)
            return False
        ips, said = one_family(infos)
        if said and said != self._dns_said:
            log.info("workers_dns %s %s", host, said)
        self._dns_said = said
        urls = [f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}" for ip in ips]
        found = parse_workers(urls, "workers_dns")
        changed = found != self.from_dns
        self.from_dns = found
        return changed

    async def _watch_dns(self) -> None:
        while True:
            await asyncio.sleep(self.config.dns_interval_s)
            try:  # as the file's watcher: one failed pass must not end the watching
                if await self._resolve():
                    await self._apply(f"workers_dns {self.config.workers_dns}")
            except Exception:
                log.exception("workers_dns %s: resolving failed", self.config.workers_dns)
