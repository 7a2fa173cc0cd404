"""leasekeeper's benchmark: ``make bench`` (``python -m bench``).

For each store it starts ``leasekeeper serve`` as a subprocess on a fresh
database, drives it with wrk and the Lua scripts in ``bench/lua``, and measures
in the same run an empty Starlette JSON endpoint on the same uvicorn stack
(``bench/_reference.py``): every rate is reported as a ratio to that endpoint.
Then the same workloads over 1,000,000 stored records, a cleanup of 1,000,000
expired records under load, etcd 3.4 as a peer, and last the latency the
Idempotency-Key middleware adds to a request. See docs/performance.md.

Modules: ``_driver`` (the command line and the plan), ``_procs`` (processes,
their CPU time and memory), ``_wrk`` (one wrk run), ``_stores`` (fresh stores,
bulk pre-filling), ``_report`` (the table), ``_plot`` (the picture), ``_reference`` (the
empty endpoint), ``middleware`` (the middleware's stage, also ``python -m
bench.middleware`` alone).
"""
