"""One registry shape for every routing plugin (scorers, policies, filters): a name, a
factory, and a parameter dataclass whose typed fields (each with a default) are checked at
start, with errors naming the config field."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from router.core.errors import ConfigError
from router.core.typed import build

T = TypeVar("T")


@dataclass(frozen=True)
class Spec(Generic[T]):
    factory: Callable[[Any], T]  # takes an instance of `params`
    params: type[Any]  # a dataclass with defaults for every field
    doc: str = ""


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind  # "scorer", "policy", "filter": for error messages
        self._specs: dict[str, Spec[T]] = {}

    def register(
        self, name: str, factory: Callable[[Any], T], params: type[Any], doc: str = ""
    ) -> None:
        self._specs[name] = Spec(factory, params, doc)

    def unregister(self, name: str) -> None:
        del self._specs[name]

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __getitem__(self, name: str) -> Spec[T]:
        return self._specs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def params(self, name: str, raw: Mapping[str, Any] | None, path: str, where: str) -> Any:
        """The typed parameters of `name` from `raw` (a ConfigError names `path`); `where` is
        the config field that named it, for an unknown name."""
        spec = self._specs.get(name)
        if spec is None:
            raise ConfigError(
                f"config field {where}: unknown {self.kind} {name!r}; known: "
                f"{', '.join(sorted(self._specs))}",
                param=where,
            )
        return build(spec.params, dict(raw or {}), path)

    def build(self, name: str, raw: Mapping[str, Any] | None, path: str, where: str) -> T:
        typed = self.params(name, raw, path, where)  # first: it names an unknown `name`
        return self._specs[name].factory(typed)
