"""Prefill->decode handoff over vLLM's NixlConnector: the door for fleets with prefill
workers (`door`), the protocol (`wire`), the cost model that decides when a split pays
(`model`), the two legs (`legs`), the proof of every pull (`ledger`, `verify`), the probe
handoff shared with router-check (`probe`, `calibrate`) and the metrics (`metrics`)."""
