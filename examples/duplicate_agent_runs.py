"""Duplicate agent runs: four runs of one agent task start at once; one does the work.

The task's identity is the key and a hash of its input the fingerprint. The first run to
take the lease does the work and stores its result; the others wait for it and get that
result instead of doing the work again.

    python examples/duplicate_agent_runs.py      # against `make serve`; LEASEKEEPER_URL for another
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time

from leasekeeper import LeaseClient
from leasekeeper.client import current_lease

URL = os.environ.get("LEASEKEEPER_URL", "http://127.0.0.1:8787")


def main() -> None:
    client = LeaseClient(URL)
    namespace = client.create_namespace()  # once, kept in the agent platform's secrets
    task = {"task": "summarize", "document": "reports/q3.pdf"}
    fingerprint = hashlib.sha256(json.dumps(task, sort_keys=True).encode()).hexdigest()
    work_done: list[str] = []

    @client.once(namespace, key="agent-task:summarize:q3", fingerprint=fingerprint, ttl=30)
    def run_agent(run: str) -> dict[str, object]:
        current_lease().check()  # still ours? check before every side effect
        work_done.append(run)
        time.sleep(1)  # the expensive part: model calls, tools
        return {"summary": "Revenue grew 12 % over Q2.", "done_by": run}

    results: dict[str, object] = {}

    def agent_run(run: str) -> None:
        results[run] = run_agent(run)

    runs = [threading.Thread(target=agent_run, args=(f"run-{n}",)) for n in range(4)]
    for thread in runs:
        thread.start()
    for thread in runs:
        thread.join()
    client.close()

    print(json.dumps({"runs": len(results), "did_the_work": work_done, "results": results}))
    assert len(work_done) == 1, work_done  # one run did the work ...
    assert all(result == results[work_done[0]] for result in results.values())  # ... all got it


if __name__ == "__main__":
    main()
