"""A `sitecustomize` that stops NIXL agents from spinning a core (DESIGN.md section 4,
gotcha 2). Put this folder on PYTHONPATH of any process that creates NIXL agents (the
conformance harness does so for vLLM); the simulator imports it directly."""
