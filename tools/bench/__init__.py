"""Benchmarks, each a side-by-side measurement in its own processes:
`python -m tools.bench.NAME --help` (swap, tiers, host_update, landing, documents, gossip,
outer, clients, attacks, flood, wan, vs_pipeline, sweep_plans, shakespeare). `rounds`,
`cpuload` and `attack_runs` are shared helpers (`impersonate` runs as `attacks
impersonate`); docs/benchmarks.md has each one's command and figures."""
