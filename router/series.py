"""Labelled Prometheus series, remembered by their label values.

A child is cached at its first use (prometheus_client's `labels()` costs a few
microseconds a call, and the request path asks for several per request), and the series
naming a worker can go together when it leaves the fleet: pods that come back under new
addresses would otherwise grow them without bound. Under `--processes` the series live in
prometheus_client's files, which it cannot remove from: there they stay."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

Key = tuple[Any, tuple[str, ...]]  # (metric, label values)


class LabelledSeries:
    def __init__(self, removable: bool = True) -> None:
        self.removable = removable
        self._children: dict[Key, Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def naming(self, names: Iterable[str]) -> list[Key]:
        """The series one of whose label values is one of `names`."""
        wanted = set(names)
        return [key for key in self._children if wanted.intersection(key[1])]

    def drop(self, key: Key) -> None:
        """Remove one series (only where `removable`)."""
        if not self.removable:
            return
        self._children.pop(key, None)
        metric, labels = key
        with contextlib.suppress(KeyError):
            metric.remove(*labels)

    def forget(self, names: Iterable[str]) -> None:
        """Remove every series naming one of `names` (only where `removable`)."""
        for key in self.naming(names) if self.removable else ():
            self.drop(key)
