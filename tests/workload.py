"""Load generators for the fault runs; each worker process writes its history as JSON lines.

Run as ``python -m tests.workload CONFIG.json`` (the fault tests start several). The
config names the mode, the server URLs, the namespace, the keys, the number of
threads and a deadline; every loop is bounded by ``duration`` and ``max_ops``.

``contention``
    Threads fight over a few hot keys with short TTLs: acquire (half the time
    waiting on the server for a held key, ``wait_seconds``), sometimes renew,
    then release, complete, walk away, or pause past the expiry and try to act
    as the stale owner it now is. Requests go to any of the URLs (several
    instances share one store).
``crash``
    Each thread works its own fresh keys one after another (acquire, renew,
    release and re-acquire, complete or keep), with long TTLs, while the server
    is killed underneath it. A request refused before it was sent is retried; one
    whose answer was lost makes the thread move on to a new key. The fault test
    then checks every key's final state against what was acknowledged.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.history import History, Kind, Op, Recorder


@dataclass(frozen=True)
class Config:
    mode: str
    process: str
    urls: list[str]
    namespace: str
    keys: list[str]
    threads: int
    duration: float
    out: str
    seed: int = 0
    ttl_min: int = 1
    ttl_max: int = 2
    max_ops: int = 200_000
    timeout: float = 5.0
    #: The run ends early once this file exists.
    stop_file: str | None = None

    @classmethod
    def load(cls, path: str) -> Config:
        return cls(**json.loads(Path(path).read_text()))


class Worker:
    """One thread of load: a client, a random source and a shared recorder."""

    def __init__(self, config: Config, recorder: Recorder, index: int, deadline: float) -> None:
        self.config = config
        self.recorder = recorder
        self.index = index
        self.deadline = deadline
        self.rng = random.Random(f"{config.seed}-{config.process}-{index}")
        self.client = httpx.Client(timeout=config.timeout)
        self.ops = 0
        self.completed = 0

    def more(self) -> bool:
        stop = self.config.stop_file
        return (
            time.monotonic() < self.deadline
            and self.ops < self.config.max_ops
            and not (stop and os.path.exists(stop))
        )

    def call(self, kind: Kind, key: str, **body: Any) -> Op:
        self.ops += 1
        url = self.rng.choice(self.config.urls)
        body = {"namespace": self.config.namespace, "key": key, **body}
        return self.recorder.call(self.client, url, kind, key, body)

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, min(seconds, self.deadline - time.monotonic())))

    def ttl(self) -> int:
        return self.rng.randint(self.config.ttl_min, self.config.ttl_max)

    # -- contention --------------------------------------------------------------------

    def contention(self) -> None:
        rng = self.rng
        while self.more():
            key = rng.choice(self.config.keys)
            ttl = self.ttl()
            # Half the acquires wait on the server for a held key (the answer within timeout).
            wait = rng.choice([0, rng.randint(1, max(1, int(self.config.timeout) - 2))])
            got = self.call(
                "acquire", key, ttl_seconds=ttl, fingerprint=f"fp-{key}", wait_seconds=wait
            )
            if got.status == 201 and got.token:
                self.hold(key, got.token, ttl)
            elif got.status == 409 and wait:
                continue  # the server waited already
            elif got.status == 409:
                wait = (got.body or {}).get("retry_after_seconds", 1)
                self.sleep(min(float(wait), rng.uniform(0.01, 0.3)))
            else:
                self.sleep(rng.uniform(0.01, 0.1))

    def hold(self, key: str, token: str, ttl: int) -> None:
        rng = self.rng
        owner = {"owner_token": token}
        for _ in range(rng.randint(0, 2)):
            self.sleep(rng.uniform(0.0, ttl * 0.5))
            ttl = self.ttl()
            if self.call("renew", key, ttl_seconds=ttl, **owner).status != 200:
                return
        self.sleep(rng.uniform(0.0, 0.2))
        choice = rng.random()
        if self.index == 0 and not self.completed:
            choice = 0.5  # every process completes at least once (the run needs results)
        if choice < 0.65:
            if choice < 0.45:
                self.call("release", key, **owner)
            else:
                result = {"by": self.config.process, "thread": self.index, "nul": "a\u0000b"}
                self.completed += self.call("complete", key, result=result, **owner).status == 200
            if rng.random() < 0.2:
                self.call("renew", key, **owner)  # the owner has ended: must be lost
        elif choice < 0.85:
            # Pause past the expiry, then act as the stale owner this worker now is.
            self.sleep(ttl + rng.uniform(0.1, 1.5))
            kind: Kind = rng.choice(["renew", "release", "complete"])
            extra: dict[str, Any] = {"result": "late"} if kind == "complete" else {}
            self.call(kind, key, **owner, **extra)
        # Otherwise walk away and let the lease expire.

    # -- crash -------------------------------------------------------------------------

    def sent(self, kind: Kind, key: str, **body: Any) -> Op:
        """Call until the request is sent (connection refused while the server restarts)."""
        while True:
            op = self.call(kind, key, **body)
            if op.outcome != "fail" or op.status is not None or not self.more():
                return op
            self.sleep(0.05)

    def crash(self) -> None:
        rng = self.rng
        n = 0
        while self.more():
            key = f"{self.config.process}-{self.index}-{n}"
            n += 1
            wait = rng.choice([0, 2])  # a fresh key: waiting changes nothing, must break nothing
            got = self.sent(
                "acquire", key, ttl_seconds=3600, fingerprint=f"fp-{key}", wait_seconds=wait
            )
            if got.status != 201 or not got.token:
                continue
            token = got.token
            ttl = rng.randint(1800, 3600)
            if self.sent("renew", key, owner_token=token, ttl_seconds=ttl).status != 200:
                continue
            if rng.random() < 0.3:
                if self.sent("release", key, owner_token=token).status != 200:
                    continue
                again = self.sent("acquire", key, ttl_seconds=3600, fingerprint=f"fp-{key}")
                if again.status != 201 or not again.token:
                    continue
                token = again.token
            if rng.random() < 0.75:
                result = {"key": key, "n": n, "blob": rng.randbytes(12).hex(), "nul": "\u0000"}
                self.sent("complete", key, owner_token=token, result=result)


def main(path: str) -> None:
    config = Config.load(path)
    recorder = Recorder(config.process)
    deadline = time.monotonic() + config.duration
    workers = [Worker(config, recorder, i, deadline) for i in range(config.threads)]
    threads = [
        threading.Thread(target=getattr(worker, config.mode), name=f"w{i}")
        for i, worker in enumerate(workers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for worker in workers:
        worker.client.close()
    History(recorder.ops).dump(Path(config.out))


if __name__ == "__main__":
    main(sys.argv[1])
