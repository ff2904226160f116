"""`router-check`: prove, against a live fleet, that KV-aware routing really works.

It asks the router and every worker what they are configured to do, then watches them do it:
it subscribes to each worker's KV event stream itself, sends a probe prompt and waits for the
matching `BlockStored`; compares block sizes and token ids between router and engines; sends a
long prompt twice through the router and times the first token. Each finding is a `Result`
(PASS / WARN / FAIL, the evidence in numbers, and for a FAIL the fix).

    router-check --router http://127.0.0.1:8000            # human report, exit 0/1/2
    router-check --router URL --json                       # the same as JSON

Python: `await run_checks(Options(router=URL))` returns a `Report` (see `runner`).
"""
