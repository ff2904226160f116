"""`kvroute serve --processes N` (router/processes.py), as an operator runs it: a real
supervisor and its children on one loopback port in front of a simulated fleet. Both
processes answer; in-flight load is counted once whichever process is asked; /metrics sums
the processes; an admin drain reaches every process; a killed child is restarted; SIGTERM
drains them all and leaves nothing behind."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from proc_state import alive

from conformance.procs import free_ports
from router.core.config import Config, from_env, from_mapping
from router.core.errors import ConfigError
from router.procs import FleetProcess, RouterProcess, free_port
from router.tokenize import PACKAGED_TOKENIZER

pytestmark = pytest.mark.timeout(180)


def children_of(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def fresh(url: str, path: str, **kw: Any) -> httpx.Response:
    """One request on its own connection: the kernel picks a process per connection."""
    with httpx.Client(timeout=30) as client:
        return client.request(kw.pop("method", "GET"), url + path, **kw)


def admin(r: RouterProcess) -> dict[str, str]:
    return {"authorization": f"Bearer {r.admin_token}"}


def until(check: Callable[[], bool], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def fleet() -> Iterator[FleetProcess]:
    # slow decoding: a stream of 40 tokens takes ~4 s, long enough to look at in flight
    with FleetProcess(2, extra=["--decode-ms-per-step", "100"]) as f:
        yield f


@contextlib.contextmanager
def router(fleet: FleetProcess, n: int = 2) -> Iterator[RouterProcess]:
    extra = ["--processes", str(n), "--drain-delay", "0.2"]
    # the engines' /metrics are read once at start only: what a process counts of its
    # sibling's requests then comes from the sibling, not from the engines' gauges
    env = {"KVROUTE_SCRAPE_INTERVAL_S": "300"}
    with RouterProcess(fleet.urls, tokenizer=PACKAGED_TOKENIZER, extra=extra, env=env) as r:
        until(lambda: len(processes_answering(r)) == n, 30, "every process answers")
        yield r


def processes_answering(r: RouterProcess, tries: int = 60) -> set[int]:
    seen = set()
    for _ in range(tries):
        seen.add(fresh(r.url, "/health").json()["process"]["index"])
    return seen


def complete(url: str, prompt: str, **extra: Any) -> httpx.Response:
    body = {"model": "kvroute-sim", "prompt": prompt, "max_tokens": 4, **extra}
    return fresh(url, "/v1/completions", method="POST", json=body)


def test_load_is_counted_once_and_metrics_are_summed(fleet: FleetProcess) -> None:
    with router(fleet) as r:
        assert processes_answering(r) == {1, 2}
        for i in range(12):
            assert complete(r.url, f"request {i}: " + "shared words of a prompt " * 8).is_success
        for _ in range(8):  # whichever process answers the scrape, every process is in it
            scrape = fresh(r.url, "/metrics").text
            served = re.findall(
                r'^kvroute_requests_total\{[^}]*status="200"[^}]*\} (\S+)$', scrape, re.M
            )
            assert sum(float(v) for v in served) == 12
            assert re.search(r"^kvroute_build_info\{[^}]*\} 1\.0$", scrape, re.M)
            assert re.search(r"^kvroute_peer_replicas 1\.0$", scrape, re.M)
        # six long streams in flight: every process counts all six (its own and its
        # sibling's), never twelve
        streams = 6
        body = {"model": "kvroute-sim", "max_tokens": 40, "stream": True}
        with ThreadPoolExecutor(streams) as pool:
            futures = [
                pool.submit(
                    fresh,
                    r.url,
                    "/v1/completions",
                    method="POST",
                    json={**body, "prompt": f"stream {i}: " + "a long enough prompt " * 10},
                )
                for i in range(streams)
            ]
            until(lambda: inflight_requests(r.url) == streams, 10, "all six in flight")
            time.sleep(1.1)  # a scrape of the engines since: nothing counted twice
            counted = []
            for _ in range(8):
                probe = {"model": "kvroute-sim", "prompt": "where would this go?"}
                doc = fresh(r.url, "/debug/route", method="POST", json=probe, headers=admin(r))
                doc = doc.json()
                assert "workers" in doc, doc
                counted.append(sum(w["requests_in_flight"] for w in doc["workers"]))
            assert all(f.result().is_success for f in futures)
        assert counted == [streams] * 8, counted


def test_an_admin_drain_reaches_every_process(fleet: FleetProcess) -> None:
    with router(fleet) as r:
        name = fleet.urls[0].removeprefix("http://")
        resp = fresh(r.url, f"/admin/workers/{name}/drain", method="POST", headers=admin(r))
        assert resp.status_code == 200, resp.text
        for _ in range(12):
            listed = {
                w["name"]: w["draining"]
                for w in fresh(r.url, "/admin/workers", headers=admin(r)).json()["workers"]
            }
            assert listed[name] is True
        for i in range(6):  # no process sends new requests to the drained worker
            served = complete(r.url, f"after the drain {i}").headers["x-kvroute-worker"]
            assert served != name


def test_a_restarted_process_keeps_the_admin_apis_changes(fleet: FleetProcess) -> None:
    """A child the supervisor restarts starts from the list and drains its siblings
    applied, not from its command line: else, by which process a connection reaches, a
    request goes to a removed or a drained worker."""
    with router(fleet) as r:
        kept, _ = fleet.urls
        name = kept.removeprefix("http://")
        body = {"workers": [kept]}
        assert fresh(r.url, "/admin/workers", method="POST", json=body, headers=admin(r)).is_success
        drain = fresh(r.url, f"/admin/workers/{name}/drain", method="POST", headers=admin(r))
        assert drain.is_success
        victim = child_by_index(r)[1]
        os.kill(victim, signal.SIGKILL)
        until(
            lambda: len(kids := children_of(r.proc.pid)) == 2 and victim not in kids,
            15,
            "the supervisor starts a new process",
        )
        until(lambda: processes_answering(r, 20) == {1, 2}, 30, "both answer again")
        for _ in range(12):
            listed = fresh(r.url, "/admin/workers", headers=admin(r)).json()["workers"]
            assert [(w["name"], w["draining"]) for w in listed] == [(name, True)]
        for i in range(6):
            assert complete(r.url, f"after the restart {i}").status_code == 503


def test_a_killed_process_is_restarted_and_sigterm_stops_all(fleet: FleetProcess) -> None:
    with router(fleet) as r:
        first = children_of(r.proc.pid)
        assert len(first) == 2
        os.kill(first[0], signal.SIGKILL)
        until(
            lambda: len(children_of(r.proc.pid)) == 2 and first[0] not in children_of(r.proc.pid),
            15,
            "the supervisor starts a new process",
        )
        until(lambda: processes_answering(r, 20) == {1, 2}, 30, "both answer again")
        kids = children_of(r.proc.pid)
        directory = Path(f"/proc/{kids[0]}/environ").read_bytes().split(b"\0")
        rundir = next(v for v in directory if v.startswith(b"KVROUTE_PROCESS_DIR="))
        rundir_path = Path(rundir.split(b"=", 1)[1].decode())
        assert rundir_path.is_dir()
        r.proc.send_signal(signal.SIGTERM)
        assert r.proc.wait(20) == 0
        for pid in kids:
            assert not alive(pid)
        assert not rundir_path.exists()


def test_a_start_up_error_stops_the_supervisor(fleet: FleetProcess, tmp_path: Path) -> None:
    """Every process failing at start (here: no tokenizer there) exits non-zero, once."""
    with pytest.raises(RuntimeError, match="exited") as err:
        RouterProcess(
            fleet.urls,
            tokenizer=tmp_path / "missing",
            extra=["--processes", "2"],
            ready_timeout=20,
            log_dir=tmp_path / "logs",  # a failed child keeps its log: here, in pytest's folder
        )
    assert f"log {tmp_path / 'logs' / 'router.log'}" in str(err.value)


@pytest.mark.parametrize(
    ("fields", "fix"),
    [
        ({"processes": 0}, "use 1 to"),
        ({"processes": 65}, "use 1 to"),
    ],
)
def test_bad_processes_name_the_field(fields: dict[str, Any], fix: str) -> None:
    with pytest.raises(ConfigError) as err:
        from_mapping({"workers": ["http://127.0.0.1:8000"], **fields}, Config()).validate()
    assert err.value.param == "processes" and fix in err.value.message


def test_processes_from_the_environment() -> None:
    env = {"KVROUTE_WORKERS": "http://127.0.0.1:8000", "KVROUTE_PROCESSES": "4"}
    assert from_env(Config(), env).validate().processes == 4


def test_processes_with_the_envoy_picker_is_refused() -> None:
    cmd = [sys.executable, "-m", "router.cli", "serve", "--worker", "http://127.0.0.1:9"]
    cmd += ["--processes", "2", "--ext-proc-port", "9002"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--processes N serves HTTP only" in done.stderr


def test_a_replica_of_two_processes_and_a_replica_of_one(fleet: FleetProcess) -> None:
    """Replica A runs two processes, replica B one, linked by --peer-publish/--peer: B hears
    both of A's processes (A's first relays its sibling), and every A process hears B; every
    request sent through A reaches B as a placement, whichever process served it."""
    a_pub, b_pub = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    env = {"KVROUTE_SCRAPE_INTERVAL_S": "300"}
    a_extra = ["--processes", "2", "--peer-publish", a_pub, "--peer", b_pub]
    with (
        RouterProcess(fleet.urls, tokenizer=PACKAGED_TOKENIZER, extra=a_extra, env=env) as a,
        RouterProcess(
            fleet.urls,
            tokenizer=PACKAGED_TOKENIZER,
            extra=["--peer-publish", b_pub, "--peer", a_pub],
            env=env,
        ) as b,
    ):

        def gauge(r: RouterProcess, name: str) -> float:
            found = re.search(rf"^{name} (\S+)$", fresh(r.url, "/metrics").text, re.M)
            return float(found[1]) if found else -1.0

        until(lambda: gauge(b, "kvroute_peer_replicas") == 2, 20, "B hears both of A's")
        # A's scrape: the fewest any of its processes hears (a sibling and B)
        until(lambda: gauge(a, "kvroute_peer_replicas") == 2, 20, "each A process hears 2")
        sent = 16
        for i in range(sent):
            assert complete(a.url, f"through A {i}: " + "words of a shared context " * 8).is_success

        def applied() -> float:
            text = fresh(b.url, "/metrics").text
            found = re.search(
                r'^kvroute_peer_placements_total\{result="applied"\} (\S+)$', text, re.M
            )
            return float(found[1]) if found else 0.0

        until(lambda: applied() == sent, 10, "B applied every placement A made")


def test_a_port_already_served_is_refused() -> None:
    """SO_REUSEPORT would let a second instance quietly take half of the first's
    connections: the supervisor checks the port without it first."""
    port = free_port()
    cmd = [sys.executable, "-m", "router.cli", "serve", "--worker", "http://127.0.0.1:9"]
    cmd += ["--processes", "2", "--port", str(port)]
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as a child binds it
        held.bind(("127.0.0.1", port))
        held.listen()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr


def serve_on_a_taken_port(
    preexec: Callable[[], None] | None = None,
) -> tuple[int, subprocess.CompletedProcess[str]]:
    """One-process `kvroute serve` on a port another socket holds: it exits 2 at the bind."""
    port = free_port()
    cmd = [sys.executable, "-m", "router.cli", "serve", "--worker", "http://127.0.0.1:9"]
    cmd += ["--port", str(port)]
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, preexec_fn=preexec)
    return port, done


def test_one_process_on_a_taken_port_exits_naming_it() -> None:
    """uvicorn, left to bind it, logged its error after "serving" and hung (SIGTERM too)."""
    port, done = serve_on_a_taken_port()
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr
    assert "serving" not in done.stderr


def test_serve_raises_its_open_files_limit() -> None:
    """A 1,024 soft limit is still common; past it a proxy fails to accept connections.
    `kvroute serve` raises its own toward 65,535 (vLLM asks as many), as far as the hard
    limit allows, and warns after its start-up line when that leaves it under 4,096."""
    import resource

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 2048))

    cmd = [sys.executable, "-m", "router.cli", "serve", "--worker", "http://127.0.0.1:9"]
    cmd += ["--port", str(free_port()), "--tokenizer", "remote"]
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, preexec_fn=low_limit
    )
    try:
        assert proc.stderr is not None
        lines = [proc.stderr.readline() for _ in range(2)]
        assert "serving" in lines[0], lines
        assert "open files limited to 2048 (hard limit 2048)" in lines[1], lines
        assert "ulimit -Hn" in lines[1]
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        assert re.search(r"Max open files\s+2048\s+2048", limits), limits
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stderr is not None:
            proc.stderr.close()
    script = (  # where the hard limit allows it, far enough and nothing is said
        "import resource; from router.server import raise_open_files; "
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096)); "
        "print(raise_open_files(3000, 3000), resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.stdout.split() == ["None", "3000"], out.stderr


def test_metric_files_are_written_once_per_loop_turn_and_on_every_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a --processes child the updates of one event-loop turn reach the process's file
    together, after the turn; with no loop running, at once; a loop that ended with a write
    still queued does not stop the next loop's writes."""
    import asyncio

    from prometheus_client import CollectorRegistry, Counter, values
    from prometheus_client.multiprocess import MultiProcessCollector

    from router.metrics import _coalesce_file_writes

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())
    _coalesce_file_writes()
    counter = Counter("kvroute_test_total", "a test counter", registry=None)

    def on_file() -> float:
        scrape = CollectorRegistry()
        MultiProcessCollector(scrape, path=str(tmp_path))  # type: ignore[no-untyped-call]
        return scrape.get_sample_value("kvroute_test_total") or 0.0

    counter.inc()  # no loop: written at once
    assert on_file() == 1.0

    async def turn() -> tuple[float, float]:
        counter.inc(2)
        counter.inc(3)
        before = on_file()
        await asyncio.sleep(0)  # one turn
        return before, on_file()

    assert asyncio.run(turn()) == (1.0, 6.0)

    loop = asyncio.new_event_loop()

    def last_callback() -> None:
        counter.inc(10)  # its write is queued behind this callback...
        loop.stop()  # ...and the loop stops before it runs

    loop.call_soon(last_callback)
    loop.run_forever()
    loop.close()
    assert on_file() == 6.0
    assert asyncio.run(turn()) == (6.0, 21.0)  # the next loop's first turn writes it all


def test_a_router_child_leaves_no_folder_after_a_clean_stop(
    fleet: FleetProcess, tmp_path: Path
) -> None:
    with RouterProcess(fleet.urls, tokenizer=PACKAGED_TOKENIZER) as r:
        assert r.log_path.exists()
    assert not r.log_path.parent.exists()
    kept = tmp_path / "logs"  # a caller's folder (a report names it) is never removed
    with RouterProcess(fleet.urls, tokenizer=PACKAGED_TOKENIZER, log_dir=kept) as r:
        assert r.log_path.parent == kept
    assert r.log_path.exists()


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(16)
    assert len(set(ports)) == 16
    with contextlib.ExitStack() as stack:  # each is free once handed out
        for port in ports:
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", port))


def test_sigterm_during_a_restart_back_off_stops_everything(fleet: FleetProcess) -> None:
    """The supervisor waits a moment before restarting a dead child; a SIGTERM in that moment
    once let it start the new child anyway, which never heard of the stop."""
    with router(fleet) as r:
        first = children_of(r.proc.pid)
        os.kill(first[0], signal.SIGKILL)
        time.sleep(0.5)  # it polls every 0.2 s, then backs off for 1 s
        r.proc.send_signal(signal.SIGTERM)
        assert r.proc.wait(20) == 0
        assert not any(alive(pid) for pid in first)


def test_a_sigterm_to_every_process_still_drains(fleet: FleetProcess) -> None:
    """A signal to the whole process group (systemd's control-group kill) reaches each child
    twice: from the group, and forwarded by the supervisor. The second must not cut the
    drain short."""
    extra = ["--processes", "2", "--drain-delay", "2"]
    env = {"KVROUTE_SCRAPE_INTERVAL_S": "300"}
    with RouterProcess(fleet.urls, tokenizer=PACKAGED_TOKENIZER, extra=extra, env=env) as r:
        until(lambda: len(processes_answering(r)) == 2, 30, "every process answers")
        kids = children_of(r.proc.pid)
        for pid in [r.proc.pid, *kids]:
            os.kill(pid, signal.SIGTERM)
        time.sleep(0.8)  # well inside the drain delay: still serving, /ready 503
        assert fresh(r.url, "/live").status_code == 200
        assert fresh(r.url, "/ready").status_code == 503
        assert r.proc.wait(20) == 0
        assert not any(alive(pid) for pid in kids)


def child_by_index(r: RouterProcess) -> dict[int, int]:
    """KVROUTE_PROCESS_INDEX -> pid of each running child."""
    out = {}
    for pid in children_of(r.proc.pid):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        index = next(v for v in env if v.startswith(b"KVROUTE_PROCESS_INDEX="))
        out[int(index.split(b"=", 1)[1])] = pid
    return out


def samples(text: str, name: str) -> dict[str, float]:
    """Every sample of the families whose names start with `name`: series -> value."""
    return {m[1]: float(m[2]) for m in re.finditer(rf"^({name}\S*) (\S+)$", text, re.M)}


def kv_counters(url: str) -> dict[str, float]:
    text = fresh(url, "/metrics").text
    found = samples(text, "kvroute_kv_") | samples(text, "kvroute_index_evicted_total")
    return {k: v for k, v in found.items() if "_total" in k}


def never_back(scrapes: list[dict[str, float]]) -> None:
    """Each series, once seen, is there in every later scrape and never smaller."""
    for before, after in itertools.pairwise(scrapes):
        for key, value in before.items():
            assert after.get(key, -1.0) >= value, (key, value, after.get(key))


def test_kv_event_counters_are_one_count_whichever_process_answers(fleet: FleetProcess) -> None:
    """Every process consumes every worker's events, but only the first writes their
    counters: every scrape agrees, and killing that process (its successor subscribes anew,
    counting from 0) never takes a series back."""
    with router(fleet) as r:
        for i in range(6):
            assert complete(r.url, f"kv counters {i}: " + "words for the events " * 8).is_success
        stored = 'kvroute_kv_events_total{type="BlockStored"'
        until(lambda: any(k.startswith(stored) for k in kv_counters(r.url)), 10, "events counted")

        def settled() -> bool:
            # the first process mirrors its counters into its file every MIRROR_EVERY_S
            # at most, and idle only at the next heartbeat: two scrapes further apart agree
            before = kv_counters(r.url)
            time.sleep(2.0)
            return kv_counters(r.url) == before

        until(settled, 20, "the first process's file caught up with what it applied")
        scrapes = [kv_counters(r.url) for _ in range(12)]
        assert all(s == scrapes[0] for s in scrapes), scrapes
        first = child_by_index(r)[0]
        os.kill(first, signal.SIGKILL)
        until(
            lambda: len(children_of(r.proc.pid)) == 2 and first not in children_of(r.proc.pid),
            15,
            "the supervisor starts a new first process",
        )
        until(lambda: processes_answering(r, 20) == {1, 2}, 30, "both answer again")
        for i in range(6):
            assert complete(r.url, f"after the restart {i}: " + "more words " * 12).is_success
        for _ in range(20):
            scrapes.append(kv_counters(r.url))
            time.sleep(0.05)
        until(lambda: kv_counters(r.url) != scrapes[0], 10, "the new first process counts on")
        scrapes.append(kv_counters(r.url))
        never_back(scrapes)


def prefill_tokens(url: str) -> float:
    return sum(samples(fresh(url, "/metrics").text, "kvroute_inflight_prefill_tokens").values())


def inflight_requests(url: str) -> float:
    return sum(samples(fresh(url, "/metrics").text, "kvroute_inflight_requests").values())


def test_inflight_prefill_tokens_are_the_replicas_own() -> None:
    """Replica A (two processes) and replica B (one) count each other's load for their
    picks, but each one's kvroute_inflight_prefill_tokens is its own requests' (summed over
    its processes, as kvroute_inflight_requests), whichever of A's processes answers."""
    a_pub, b_pub = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    env = {"KVROUTE_SCRAPE_INTERVAL_S": "300"}
    a_extra = ["--processes", "2", "--peer-publish", a_pub, "--peer", b_pub]
    b_extra = ["--peer-publish", b_pub, "--peer", a_pub]
    # every prefill step takes 3 s: requests sit before their first token long enough
    with (
        FleetProcess(2, extra=["--ttft-base-ms", "3000"]) as slow,
        RouterProcess(slow.urls, tokenizer=PACKAGED_TOKENIZER, extra=a_extra, env=env) as a,
        RouterProcess(slow.urls, tokenizer=PACKAGED_TOKENIZER, extra=b_extra, env=env) as b,
        ThreadPoolExecutor(4) as pool,
    ):
        until(lambda: len(processes_answering(a)) == 2, 30, "both of A's processes answer")
        prompt = "a prompt long enough to count its prefill tokens " * 6
        through_b = [pool.submit(complete, b.url, f"via B {i}: {prompt}") for i in range(3)]
        until(lambda: prefill_tokens(b.url) > 0, 5, "B counts its own prefill")
        assert [prefill_tokens(a.url) for _ in range(8)] == [0.0] * 8  # B's are not A's
        assert all(f.result().is_success for f in through_b)
        through_a = [pool.submit(complete, a.url, f"via A {i}: {prompt}") for i in range(4)]
        # a request's prefill tokens are counted before it is counted in flight: once all
        # four are in flight, every one's prefill is in the gauge
        until(lambda: inflight_requests(a.url) == 4, 5, "all four of A's requests in flight")
        seen = [prefill_tokens(a.url) for _ in range(8)]
        assert seen[0] > 0
        assert len(set(seen)) == 1, seen  # both processes' summed, whichever answers
        assert prefill_tokens(b.url) == 0.0  # A's are not B's
        assert all(f.result().is_success for f in through_a)
        until(lambda: prefill_tokens(a.url) == 0, 5, "none left once they all answered")


def test_pd_counters_read_from_the_decode_worker_are_counted_once() -> None:
    """Each process proves its own splits from the decode worker's counters, which show
    every process's pulls: the KV bytes the replica reports are the worker's, never a
    multiple of them."""
    from engines.sim.pd_fleet import start_pd_fleet
    from engines.sim.pd_metrics import pd_snapshot
    from router.pd.door import SWEEP_S

    common = ["--kv-bytes-per-token", "4096", "--kv-lease-s", "5"]
    extra = ["--processes", "2", "--pd-threshold", "256", "--no-pd-probe"]
    with (
        start_pd_fleet(1, 1, common) as pd,
        RouterProcess(
            [], tokenizer=PACKAGED_TOKENIZER, extra=[*pd.router_args, *extra], ready_timeout=60
        ) as r,
    ):
        until(lambda: len(processes_answering(r)) == 2, 30, "every process answers")
        decode = pd.decode_urls[0]
        worker = decode.split("//")[1]

        def engine_bytes() -> float:
            return pd_snapshot(httpx.get(decode + "/metrics", timeout=10).text).bytes_transferred

        def reported() -> float:
            found = samples(fresh(r.url, "/metrics").text, "kvroute_pd_kv_bytes_total")
            return found.get(f'kvroute_pd_kv_bytes_total{{worker="{worker}"}}', 0.0)

        def split(i: int) -> None:
            text = " ".join(f"s{i}x{j} lorem" for j in range(300))
            body = {"prompt": text, "max_tokens": 2, "ignore_eos": True}
            answer = fresh(r.url, "/v1/completions", method="POST", json=body)
            assert answer.headers.get("x-kvroute-pd", "").startswith("split"), answer.text

        def verified_by_each() -> dict[int, int]:
            out = {}
            for _ in range(12):
                doc = fresh(r.url, "/health").json()
                out[doc["process"]["index"]] = doc["pd"]["verified_handoffs"]
            return out

        i = 0
        while min(verified_by_each().get(p, 0) for p in (1, 2)) == 0:  # both proved some
            assert i < 40, verified_by_each()
            split(i)
            i += 1
            time.sleep(0.7)  # each process checks the decode worker ~0.5 s after its split
        counted = []
        for _ in range(30):  # the first process's count is the worker's once it checked last
            counted.append(reported())
            assert counted[-1] <= engine_bytes(), (counted, engine_bytes())
            if counted[-1] == engine_bytes():
                break
            split(i)
            i += 1
            time.sleep(1.0)
        assert counted[-1] == engine_bytes() > 0, counted
        assert counted == sorted(counted)

        # splits made by the second process alone (one keep-alive connection to it): the
        # first reads the decode worker on its own sweep, so the count still catches up
        for _ in range(40):
            second = httpx.Client(base_url=r.url, timeout=30)
            if second.get("/health").json()["process"]["index"] == 2:
                break
            second.close()
        else:
            raise AssertionError("no connection reached the second process")
        try:
            for j in range(3):
                body = {"prompt": " ".join(f"t{j}x{k} ipsum" for k in range(300)), "max_tokens": 2}
                answer = second.post("/v1/completions", json=body)
                assert answer.headers.get("x-kvroute-pd", "").startswith("split"), answer.text
                assert second.get("/health").json()["process"]["index"] == 2
        finally:
            second.close()
        until(lambda: reported() == engine_bytes(), SWEEP_S + 5, "the first process's sweep")
        assert reported() > counted[-1]


SUPERVISE = """
import signal, shutil, sys, time
from pathlib import Path
from router.processes import Supervisor
folder = Path(sys.argv[1])
exe = folder / "child.sh"
exe.write_text("#!/bin/sh\\n" + sys.argv[2] + "\\n")
exe.chmod(0o755)
sys.executable = str(exe)  # children run the stand-in in place of kvroute serve
sup = Supervisor([], 1, drain_s=float(sys.argv[3]))
try:
%s
finally:
    for child in sup.children.values():
        child.kill()
        child.wait()
    shutil.rmtree(sup.directory, ignore_errors=True)
"""


def _supervise(folder: Path, child: str, drain_s: float, body: str) -> str:
    """`body` run against a Supervisor whose children run `child` (sh), in a fresh
    interpreter: one that loaded gRPC (this suite's) aborts a child forked with a
    preexec_fn, before its exec."""
    code = SUPERVISE % "\n".join("    " + line for line in body.strip().splitlines())
    out = subprocess.run(
        [sys.executable, "-c", code, str(folder), child, str(drain_s)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_child_started_as_a_stop_comes_is_stopped_too(tmp_path: Path) -> None:
    """A SIGTERM forwarded while a child was being started passed it by: that child served
    on, and the supervisor waited for it forever."""
    said = _supervise(
        tmp_path,
        "exec sleep 30",
        1.0,
        """
sup.stopping = True  # the signal came while Popen ran
sup._spawn(0)
print(sup.children[0].wait(10))
""",
    )
    assert said == str(-signal.SIGTERM)


def test_a_stopping_supervisor_gives_up_on_a_child_past_its_drain(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    said = _supervise(
        tmp_path,
        f"trap '' TERM; touch {ready}; sleep 30 & wait",
        0.5,
        f"""
sup._spawn(0)
deadline = time.monotonic() + 10
while not Path({str(ready)!r}).exists():  # it ignores SIGTERM from here on
    assert time.monotonic() < deadline
    time.sleep(0.01)
sup._forward(signal.SIGTERM, None)
started = time.monotonic()
sup._watch()
sup._stop_all()
print(round(time.monotonic() - started, 1), sup.killed)
""",
    )
    took, killed = said.split()
    # one drain + 5 s from the stop in all, not the child's whim nor two drains
    assert float(took) < 7.5 and killed == "True"
