"""The fault suite: checks that break things on purpose (workers killed, hung, restarted; a
router drained and restarted; malformed and hostile clients) and print the figures. They
run only when named: `python -m conformance --target sim --only fault-worker-killed ...`
(`.ci/run` names them all but the soak)."""

from conformance.faults import clients, events, router, workers

FAULTS = (
    "fault-worker-killed",
    "fault-worker-hung",
    "fault-worker-restarted",
    "fault-http-fuzz",
    "fault-slowloris",
    "fault-big-prompts",
    "fault-drain",
    "fault-events-fuzz",
)

__all__ = ["FAULTS", "clients", "events", "router", "workers"]
