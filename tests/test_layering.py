"""The pure core imports no network, no web framework, and reads no clock of its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {"zmq", "httpx", "fastapi", "starlette", "uvicorn", "grpc", "aiohttp", "socket"}
PURE = [
    "indexer/hashing.py",
    "indexer/events.py",
    "indexer/index.py",
    "indexer/ingest.py",
    "indexer/sequencing.py",
    "indexer/health.py",
    "indexer/ttl.py",
]
PURE_PACKAGES = ["router/core"]


def pure_files() -> list[str]:
    files = list(PURE)
    for pkg in PURE_PACKAGES:
        files += [str(p.relative_to(ROOT)) for p in sorted((ROOT / pkg).glob("*.py"))]
    return files


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def wall_clock_or_random_calls(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "time" and node.attr in {"time", "monotonic", "sleep"}:
                bad.append(f"time.{node.attr}")
            if node.value.id == "random" and node.attr != "Random":
                bad.append(f"random.{node.attr}")
    return bad


@pytest.mark.parametrize("rel", pure_files())
def test_pure_core_imports_no_io(rel: str) -> None:
    path = ROOT / rel
    assert path.exists(), f"{rel} listed as pure core but missing"
    assert not imported_modules(path) & FORBIDDEN
    assert wall_clock_or_random_calls(path) == []


def test_the_checker_catches_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import zmq\nimport time\nx = time.time()\n")
    assert "zmq" in imported_modules(bad)
    assert wall_clock_or_random_calls(bad) == ["time.time"]
