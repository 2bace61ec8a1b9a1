"""Load and faults against a live server on 127.0.0.1, every loop bounded in count and time: 208
requests from 16 concurrent clients, mixed streamed and not, some with bad bodies, some clients
leaving mid-stream, the queue overflowing (server.max_waiting=6). Every request ends in a complete
answer or a clear error, none is lost or answered twice (the server's own count of the requests it
took equals the clients'), the process's memory stays flat and /health answers within 1 s throughout."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
from omegaconf import OmegaConf
from prometheus_client.parser import text_string_to_metric_families

import specfit
from specfit.serve.runner import BackgroundServer

CLIENTS, PER_CLIENT = 16, 13  # 208 requests
DEADLINE = 150.0  # seconds for the whole load: every loop stops by then


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def request_once(c: httpx.Client, url: str, rng: random.Random) -> str:
    """One request of a random kind; returns how it ended (raises on anything unclear)."""
    kind = rng.choices(["plain", "stream", "chat", "bad", "leave"], [3, 3, 2, 1, 1])[0]
    body = {"model": "specfit", "prompt": rng.choice(["Once upon a time", "And God said", "KING:"]),
            "max_tokens": rng.randint(2, 10), "temperature": rng.choice([0, 0.8]), "seed": rng.randint(0, 9)}
    if kind == "bad":
        raw = rng.choice([b"{oops", b"\xff\xfe", json.dumps({**body, "top_p": 2}).encode(),
                          json.dumps({**body, "n": 4}).encode(), json.dumps({**body, "model": "x"}).encode()])
        r = c.post(f"{url}/v1/completions", content=raw)
        assert 400 <= r.status_code < 500 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
        return "bad"
    if kind == "chat":
        body = {**body, "messages": [{"role": "user", "content": body.pop("prompt")}]}
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    if kind == "plain" or kind == "chat":
        r = c.post(f"{url}{path}", json=body)
        if r.status_code == 503:
            assert r.headers["retry-after"] and r.json()["error"]["code"] == "server_overloaded"
            return "overloaded"
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["usage"]["completion_tokens"] == len(out["choices"][0]["token_ids"]) <= body["max_tokens"]
        return f"done:{out['id']}"
    body = {**body, "stream": True, "max_tokens": 40 if kind == "leave" else body["max_tokens"]}
    with c.stream("POST", f"{url}{path}", json=body) as r:
        if r.status_code == 503:
            r.read()
            return "overloaded"
        assert r.status_code == 200
        events, ids = [], set()
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(line)
                if kind == "leave" and len(events) >= 2:
                    return "left"  # the connection closes as the stream is left
                if line != "data: [DONE]":
                    ids.add(json.loads(line[5:])["id"])
    assert events[-1] == "data: [DONE]" and len(ids) == 1, events[-3:]
    assert json.loads(events[-2][5:])["choices"][0]["finish_reason"] in ("stop", "length"), events[-2]
    return f"done:{ids.pop()}"


def served(url: str) -> float:
    """Requests the server took and ended, by its own count (request_success_total, all reasons)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "specfit:request_success_total")


def test_load_and_faults():
    cfg = specfit.compose(["model=demo", "drafter=eagle3", "selector=eagle3", "server.port=0",
                           "server.max_waiting=6", "server.request_timeout=60"], config_name="serve")
    with BackgroundServer(specfit.build(cfg), OmegaConf.to_object(cfg.server)) as server:
        url = server.url
        with httpx.Client(timeout=30) as c:  # warm: first requests, allocator pools
            for i in range(12):
                assert request_once(c, url, random.Random(1000 + i)) != ""
        base = served(url)
        rss_before = rss_mb()
        end = time.monotonic() + DEADLINE
        outcomes: list[str] = []
        failures: list[str] = []
        health: list[float] = []
        stop = threading.Event()

        def client(n: int) -> None:
            rng = random.Random(n)
            with httpx.Client(timeout=30) as c:
                for _ in range(PER_CLIENT):
                    if time.monotonic() > end:
                        failures.append("out of time")
                        return
                    try:
                        outcomes.append(request_once(c, url, rng))
                        if outcomes[-1] == "overloaded":
                            time.sleep(rng.uniform(0.05, 0.3))  # as Retry-After asks, briefly
                    except Exception as exc:  # noqa: BLE001 - gathered, then asserted
                        failures.append(f"{type(exc).__name__}: {exc}"[:300])

        def watch_health() -> None:
            with httpx.Client(timeout=5) as c:
                while not stop.is_set() and time.monotonic() < end:
                    t = time.monotonic()
                    r = c.get(f"{url}/health")
                    health.append(time.monotonic() - t)
                    assert r.status_code == 200 and r.json()["status"] == "ok"
                    time.sleep(0.1)

        watcher = threading.Thread(target=watch_health)
        watcher.start()
        threads = [threading.Thread(target=client, args=(n,)) for n in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(end - time.monotonic(), 1))
        # the requests left mid-stream end at their next cycle boundary: wait for the queue to empty
        while (server.worker.running is not None or server.worker.waiting()) and time.monotonic() < end + 20:
            time.sleep(0.05)
        time.sleep(0.3)
        stop.set()
        watcher.join(10)
        rss_after = rss_mb()
        counts = Counter(o.split(":")[0] for o in outcomes)
        done_ids = [o for o in outcomes if o.startswith("done:")]
        assert not failures, failures[:5]
        assert len(outcomes) == CLIENTS * PER_CLIENT >= 200
        assert len(set(done_ids)) == len(done_ids)  # no answer given twice
        assert counts["overloaded"] > 0 and counts["bad"] > 0 and counts["left"] > 0, counts
        # every request the server took ended there once: the answered ones and the ones left
        assert served(url) - base == counts["done"] + counts["left"], counts
        assert health and max(health) < 1.0, max(health)
        assert rss_after - rss_before < 150, (rss_before, rss_after)
        assert httpx.get(f"{url}/health", timeout=5).json() == {"status": "ok", "running": 0, "waiting": 0}
        print(f"load: {dict(counts)}; /health max {max(health) * 1e3:.0f} ms; RSS {rss_before:.0f} -> "
              f"{rss_after:.0f} MB")
