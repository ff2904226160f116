"""What /proc says of processes a test started: whether one still runs, and every process
below one (tests that check a command leaves nothing behind when it stops)."""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """Running: it exists and is not a zombie waiting for its parent to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (children, their children, ...), from each process's
    parent in /proc: a process started from any thread of its parent is found."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d.name))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out
