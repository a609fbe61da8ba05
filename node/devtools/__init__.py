"""For tests, demos and benchmarks only: a local Hub speaking the Hub's protocol (local_hub.py),
link emulation (link_emulation.py), `expertmesh bench` (bench.py) and tiny models (tiny/)."""
