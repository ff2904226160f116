"""A simulated vLLM 0.32 worker that a router cannot tell apart from vLLM on the wire.

blockpool   vLLM v1's block pool and engine hashes (pure; the ground truth)
kvcache     per-request block bookkeeping (pure)
scheduler   vLLM's step scheduling: queueing, preemption, chunked prefill (pure)
latency     step cost model calibrated to the seeds' measurements (pure)
model       deterministic output tokens (pure)
engine      asyncio step loop with an injectable clock and sleeper
events_pub  ZMQ PUB + replay ROUTER, byte-compatible with vLLM's publisher
tokenizer   the Hugging Face tokenizer folder, used as vLLM uses it
protocol, validation, errors   request bodies checked and refused as vLLM does, in its order
openai, respond, asgi, http, routes_info, metrics   vLLM's HTTP surface (n > 1, batches)
worker      one worker on uvicorn; fleet: N of them; cli: `kvroute sim`
pd_*        prefill -> decode handoff over real NIXL, as vLLM's NixlConnector (pull mode):
            pd_config (flags), pd_wire (params, side channel), pd_nixl (agent, blocks),
            pd_connector (prefill leases), pd_pull (decode pulls), pd_metrics, pd_http,
            pd_fleet (P/D fleets); nixl_site: the progress-thread-delay sitecustomize
"""
