"""What tests, benchmarks and the demo use to stand things up: the deterministic tiny model
(`tiny_model`), local server processes (`services`: a fake engine, a gateway, LiteLLM, HAProxy), a
throwaway PostgreSQL server (`postgres_local`) and a local multi-node Ray cluster (`ray_local`).
None of it is imported by the gateway itself."""
