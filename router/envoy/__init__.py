"""kvroute behind Envoy: the bootstrap it needs (`kvroute envoy-config`) and Envoy as a
child process (tests, benchmarks, the demo)."""
