"""The pure core imports no network, no web framework, and reads no clock of its own; the
neutral index knows no engine and no router, and the routing core none of the project's IO."""

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
    "indexer/demand.py",
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


def project_imports(path: Path) -> set[str]:
    """Dotted names of the project's own modules a file imports."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n for n in names if n.split(".")[0] in {"indexer", "router", "engines", "conformance"}}


@pytest.mark.parametrize(
    "rel", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "indexer").glob("*.py"))
)
def test_indexer_knows_no_engine_and_no_router(rel: str) -> None:
    bad = {n for n in project_imports(ROOT / rel) if n.split(".")[0] != "indexer"}
    assert not bad, f"{rel} imports {sorted(bad)}: engine specifics belong in engines/"


@pytest.mark.parametrize(
    "rel", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "router/core").glob("*.py"))
)
def test_routing_core_imports_only_pure_modules(rel: str) -> None:
    pure_modules = {f.removesuffix(".py").replace("/", ".") for f in pure_files()}
    pure_modules.add("indexer.clock")
    bad = {n for n in project_imports(ROOT / rel) if n not in pure_modules}
    assert not bad, f"{rel} imports {sorted(bad)}: router/core stays free of the project's IO"


def test_the_checker_catches_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import zmq\nimport time\nx = time.time()\n")
    assert "zmq" in imported_modules(bad)
    assert wall_clock_or_random_calls(bad) == ["time.time"]
