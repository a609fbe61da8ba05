"""For tests, demos and benchmarks only: a local Hub speaking the Hub's protocol (local_hub.py),
link emulation (link_emulation.py), `expertmesh bench` (bench.py, bench_k3.py), the household lab
(lab/) and tiny models (tiny/). It sits above the node (it builds nodes with expertmesh/assembly.py)
and below the command, which runs it; nothing in the node imports it."""
