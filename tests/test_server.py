"""specfit serve with real clients on 127.0.0.1: the official ``openai`` package (completions and
chat, streamed and not, greedy output token for token equal to ``specfit generate`` with the same
config, for AR, EAGLE-3 and SpecFit), raw HTTP for the errors, prometheus_client's parser for
/metrics against the requests' own stats, cancellation, deadlines, the queue, the API key and SIGTERM.
Every server listens on loopback on a free port and is stopped at the end; every wait is bounded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from omegaconf import OmegaConf

import specfit
from specfit.cli import main
from specfit.serve.chat import plain_transcript
from specfit.serve.runner import BackgroundServer

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
METHODS = {
    "ar": ["drafter=none", "selector=none"],
    "eagle3": ["drafter=eagle3", "selector=eagle3"],
    "specfit": ["drafter=eagle3", "selector=specfit", "cost_model=union", "predictor=history"],
}
PROMPTS = ["Once upon a time", "KING HENRY:\nWhat say you, my lord?"]
CHATS = [[{"role": "system", "content": "You speak verse."}, {"role": "user", "content": "Tell me of the sea."}]]
MAX_TOKENS = 20


def server_for(overrides: list[str], **server: object) -> BackgroundServer:
    cfg = specfit.compose(["model=demo", *overrides, *(f"server.{k}={v}" for k, v in server.items()), "server.port=0"],
                          config_name="serve")
    engine = specfit.build(cfg)
    return BackgroundServer(engine, OmegaConf.to_object(cfg.server)).start()


@pytest.fixture(scope="module", params=list(METHODS))
def method_server(request, tmp_path_factory):
    """A server per method, and `specfit generate`'s rows for the same config and prompts."""
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    folder = tmp_path_factory.mktemp(request.param)
    prompts = [*PROMPTS, *(plain_transcript(m) for m in CHATS)]
    workload = folder / "prompts.jsonl"
    workload.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    main(["generate", "model=demo", *METHODS[request.param], "workload=jsonl", f"workload.path={workload}",
          f"max_new_tokens={MAX_TOKENS}", f"hydra.run.dir={folder}"])
    rows = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]
    GlobalHydra.instance().clear()
    server = server_for(METHODS[request.param])
    yield request.param, server, dict(zip(prompts, rows))
    server.stop()


def client(server: BackgroundServer, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=kw.pop("api_key", "none"), max_retries=0, timeout=60,
                         **kw)


def stream_tokens(stream) -> tuple[list[int], str, list, str | None]:
    tokens, text, chunks, finish = [], "", [], None
    for chunk in stream:
        chunks.append(chunk)
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        tokens += choice.token_ids
        piece = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
        text += piece or ""
        finish = choice.finish_reason or finish
    return tokens, text, chunks, finish


def test_openai_client_greedy_equals_generate(method_server):
    name, server, rows = method_server
    api = client(server)
    assert [m.id for m in api.models.list().data] == ["specfit"]
    for prompt in PROMPTS:
        row = rows[prompt]
        out = api.completions.create(model="specfit", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        choice = out.choices[0]
        assert choice.token_ids == row["output_ids"], name
        assert choice.text == row["text"] and choice.finish_reason == row["finish_reason"]
        assert out.usage.prompt_tokens == row["num_prompt_tokens"]
        assert out.usage.completion_tokens == len(row["output_ids"]) == out.usage.total_tokens - row["num_prompt_tokens"]
        stream = api.completions.create(model="specfit", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                        stream=True, stream_options={"include_usage": True})
        tokens, text, chunks, finish = stream_tokens(stream)
        assert tokens == row["output_ids"] and text == row["text"] and finish == row["finish_reason"]
        assert chunks[-1].usage.completion_tokens == len(tokens) and not chunks[-1].choices
        if name != "specfit":  # a fixed tree (or none): the cycles are the generate run's; one chunk per cycle
            assert len(chunks) == 1 + row["cycles"] + 1 + 1  # the prefill's token, each cycle, the end, the usage
    for messages in CHATS:
        row = rows[plain_transcript(messages)]
        out = api.chat.completions.create(model="specfit", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        assert out.choices[0].message.role == "assistant"
        assert out.choices[0].message.content == row["text"] and out.choices[0].token_ids == row["output_ids"]
        stream = api.chat.completions.create(model="specfit", messages=messages, max_tokens=MAX_TOKENS,
                                             temperature=0, stream=True)
        tokens, text, chunks, finish = stream_tokens(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert tokens == row["output_ids"] and text == row["text"] and finish == row["finish_reason"]


def metrics_of(server: BackgroundServer) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            values[(sample.name, labels)] = sample.value
    return values


def delta(after: dict, before: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_equal_the_requests_own_stats(method_server):
    name, server, _ = method_server
    before = metrics_of(server)
    stats, usage = [], []
    for i, prompt in enumerate([*PROMPTS, "In the beginning"]):
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": "specfit", "prompt": prompt, "max_tokens": 8 + 4 * i, "temperature": 0.7 * (i == 2), "seed": i})
        assert r.status_code == 200, r.text
        stats.append(r.json()["specfit"])
        usage.append(r.json()["usage"])
    after = metrics_of(server)
    total = lambda key: sum(s[key] for s in stats)  # noqa: E731
    p = "specfit:"
    assert delta(after, before, p + "spec_decode_num_drafts_total") == total("num_drafts")
    assert delta(after, before, p + "spec_decode_num_draft_tokens_total") == total("draft_tokens")
    assert delta(after, before, p + "spec_decode_num_accepted_tokens_total") == total("accepted_tokens")
    per_pos = sum(v - before.get(k, 0.0) for k, v in after.items()
                  if k[0] == p + "spec_decode_num_accepted_tokens_per_pos_total")
    assert per_pos == total("accepted_tokens")
    if name == "ar":
        assert total("num_drafts") == 0
    elif name == "eagle3":  # (specfit's cost-aware gate may decline to draft on a host this slow)
        assert total("accepted_tokens") > 0
    assert delta(after, before, p + "spec_decode_verified_nodes_per_cycle_sum") == total("verified_nodes")
    assert delta(after, before, p + "spec_decode_verified_nodes_per_cycle_count") == total("cycles")
    assert delta(after, before, p + "prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    assert delta(after, before, p + "generation_tokens_total") == sum(u["completion_tokens"] for u in usage) \
        == total("num_output_tokens")
    assert delta(after, before, p + "expert_cache_hits_total") == total("expert_cache_hits")
    assert delta(after, before, p + "expert_cache_misses_total") == total("expert_cache_misses")
    assert delta(after, before, p + "h2d_bytes_total") == total("h2d_bytes") > 0
    assert delta(after, before, p + "h2d_stall_seconds_total") == pytest.approx(total("h2d_stall_seconds"))
    assert delta(after, before, p + "request_success_total", finished_reason="length") == len(stats)
    assert delta(after, before, p + "time_to_first_token_seconds_count") == len(stats)
    assert delta(after, before, p + "e2e_request_latency_seconds_count") == len(stats)
    assert delta(after, before, p + "inter_token_latency_seconds_count") == total("cycles")
    assert after[(p + "num_requests_running", ())] == 0 and after[(p + "num_requests_waiting", ())] == 0


# ------------------------------------------------------------------ errors, raw HTTP


@pytest.fixture(scope="module")
def demo_server():
    server = server_for(METHODS["eagle3"], max_body_bytes=65536)
    yield server
    server.stop()


def _post(server, body, path="/v1/completions", **kw):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, timeout=30, **kw)


GOOD = {"model": "specfit", "prompt": "Once upon a time", "max_tokens": 4}
BAD = [  # body, status, param
    (b"{not json", 400, None),
    (b"\xff\xfe\x00garbage", 400, None),
    (b"", 400, None),
    (b"[1, 2]", 400, None),
    ({"prompt": "x"}, 400, "model"),
    ({"model": 7, "prompt": "x"}, 400, "model"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ({"model": "specfit"}, 400, "prompt"),
    ({"model": "specfit", "prompt": 12}, 400, "prompt"),
    ({"model": "specfit", "prompt": ["a", "b"]}, 400, "prompt"),
    ({"model": "specfit", "prompt": [1, 2, 10**9]}, 400, "prompt"),
    ({"model": "specfit", "prompt": list(range(1, 3000))}, 400, "prompt"),
    ({**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ({**GOOD, "max_tokens": "many"}, 400, "max_tokens"),
    ({**GOOD, "max_tokens": 10**6}, 400, "max_tokens"),
    ({**GOOD, "temperature": -0.5}, 400, "temperature"),
    ({**GOOD, "temperature": "hot"}, 400, "temperature"),
    ({**GOOD, "top_p": 0}, 400, "top_p"),
    ({**GOOD, "top_p": 1.5}, 400, "top_p"),
    ({**GOOD, "n": 2}, 400, "n"),
    ({**GOOD, "stream": "yes"}, 400, "stream"),
    ({**GOOD, "stop": [1]}, 400, "stop"),
    ({**GOOD, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({**GOOD, "logprobs": 3}, 400, "logprobs"),
]


def test_bad_requests_get_openai_errors_and_leave_the_server_serving(demo_server):
    server = demo_server
    for body, status, param in BAD:
        r = _post(server, body)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, (body, error)
        assert "Traceback" not in r.text and error["message"]
    for raw in (b'{"model": "specfit", "prompt": "a", "temperature": NaN}',
                b'{"model": "specfit", "prompt": "a", "temperature": Infinity}'):
        r = _post(server, raw)
        assert r.status_code == 400 and "finite" in r.json()["error"]["message"]
    assert "not supported" in _post(server, {**GOOD, "n": 3}).json()["error"]["message"]
    assert "context" in _post(server, {**GOOD, "max_tokens": 10**6}).json()["error"]["message"]
    assert _post(server, {**GOOD, "prompt": "x" * 70000}).status_code == 413
    chat = [({"model": "specfit"}, "messages"), ({"model": "specfit", "messages": []}, "messages"),
            ({"model": "specfit", "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
            ({"model": "specfit", "messages": [{"role": "user", "content": 5}]}, "messages[0].content")]
    for body, param in chat:
        r = _post(server, body, "/v1/chat/completions")
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.get(f"{server.url}/v1/nothing", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(f"{server.url}/v1/completions", timeout=10)
    assert r.status_code == 405 and "error" in r.json()
    assert httpx.get(f"{server.url}/health", timeout=5).json()["status"] == "ok"
    r = _post(server, GOOD)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_stop_strings_and_sampling(demo_server):
    api = client(demo_server)
    full = api.completions.create(model="specfit", prompt="Once upon a time", max_tokens=24, temperature=0)
    text = full.choices[0].text
    stop = text[5:8]
    cut = api.completions.create(model="specfit", prompt="Once upon a time", max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
    tokens, streamed, _, finish = stream_tokens(api.completions.create(
        model="specfit", prompt="Once upon a time", max_tokens=24, temperature=0, stop=stop, stream=True))
    assert streamed == cut.choices[0].text and finish == "stop"
    a, b = (api.completions.create(model="specfit", prompt="Once", max_tokens=12, temperature=0.9, top_p=0.9, seed=5)
            for _ in range(2))
    assert a.choices[0].token_ids == b.choices[0].token_ids  # a seed reproduces the sample


def test_a_client_leaving_mid_stream_is_cancelled_and_the_engine_is_as_fresh(demo_server):
    server = demo_server
    body = {"model": "specfit", "prompt": "In the beginning", "max_tokens": 48, "temperature": 0}
    first = _post(server, body).json()["choices"][0]["token_ids"]
    before = metrics_of(server)
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", f"{server.url}/v1/completions", json={**body, "max_tokens": 1500, "stream": True}) as r:
            lines = 0
            for line in r.iter_lines():
                lines += bool(line.startswith("data:"))
                if lines >= 3:
                    break  # leave mid-stream: the connection closes with the client
    end = time.monotonic() + 20
    while time.monotonic() < end and delta(metrics_of(server), before, "specfit:request_success_total",
                                           finished_reason="abort") < 1:
        time.sleep(0.05)
    after = metrics_of(server)
    assert delta(after, before, "specfit:request_success_total", finished_reason="abort") == 1
    assert delta(after, before, "specfit:generation_tokens_total") < 1500
    assert _post(server, body).json()["choices"][0]["token_ids"] == first


# ------------------------------------------------------------------ tiny model: limits, key, SIGTERM


@pytest.fixture(scope="module")
def tiny_server():
    cfg = specfit.compose(["model=tiny", "server.port=0", "server.api_key=sekrit", "server.max_waiting=2",
                           "server.request_timeout=1.5"], config_name="serve")
    server = BackgroundServer(specfit.build(cfg), OmegaConf.to_object(cfg.server)).start()
    yield server
    server.stop()


def test_api_key_queue_limit_and_deadline(tiny_server):
    server = tiny_server
    url, key = f"{server.url}/v1/completions", {"Authorization": "Bearer sekrit"}
    small = {"model": "specfit", "prompt": [5, 17, 99], "max_tokens": 4}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
        r = httpx.post(url, json=small, headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # not behind the key
    with pytest.raises(openai.AuthenticationError):
        client(server, api_key="wrong").completions.create(model="specfit", prompt=[1, 2], max_tokens=2)
    out = client(server, api_key="sekrit").completions.create(model="specfit", prompt=[5, 17, 99], max_tokens=4)
    assert len(out.choices[0].token_ids) == 4 and out.choices[0].text == ""
    assert httpx.post(f"{server.url}/v1/chat/completions", headers=key, timeout=10, json={
        "model": "specfit", "messages": [{"role": "user", "content": "hi"}]}).json()["error"]["code"] == "no_tokenizer"
    # a long request holds the engine; 2 wait; the rest are refused at once
    long = {"model": "specfit", "prompt": [5, 17, 99], "max_tokens": 4000}
    results: list[httpx.Response] = []

    def one() -> None:
        results.append(httpx.post(url, json=long, headers=key, timeout=30))

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(30)
    statuses = sorted(r.status_code for r in results)
    assert len(results) == 6 and statuses.count(503) >= 3, statuses
    for r in results:
        if r.status_code == 503:
            assert r.headers["retry-after"] and r.json()["error"]["code"] == "server_overloaded"
        elif r.status_code == 504:
            assert r.json()["error"]["code"] == "deadline_exceeded" and "deadline" in r.json()["error"]["message"]
        else:
            assert r.status_code == 200, r.text
    assert 504 in statuses  # 4000 tokens take longer than 1.5 s
    with httpx.Client(timeout=30) as c, c.stream("POST", url, json={**long, "stream": True}, headers=key) as r:
        events = [line for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]" and "deadline_exceeded" in events[-2]
    assert httpx.get(f"{server.url}/health", timeout=5).json()["status"] == "ok"


def test_serve_command_sigterm_exits_0(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECFIT_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen([sys.executable, "-m", "specfit.cli", "serve", "model=tiny", "server.port=0",
                             "server.shutdown_timeout=2", f"hydra.run.dir={tmp_path}"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        line, end = "", time.monotonic() + 90
        while "http://" not in line and time.monotonic() < end and proc.poll() is None:
            line = proc.stdout.readline()
        url = line.split("http://", 1)[1].split("/v1")[0]
        assert url.startswith("127.0.0.1:")
        while httpx.get(f"http://{url}/health", timeout=5).status_code != 200:
            assert time.monotonic() < end
            time.sleep(0.1)
        result: dict = {}

        def long_stream() -> None:
            with httpx.Client(timeout=30) as c, c.stream("POST", f"http://{url}/v1/completions", json={
                    "model": "specfit", "prompt": [1, 2, 3], "max_tokens": 4000, "stream": True}) as r:
                result["events"] = [line for line in r.iter_lines() if line.startswith("data:")]

        t = threading.Thread(target=long_stream)
        t.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, proc.stderr.read()[-2000:]
        t.join(10)
        events = result["events"]  # finished within the grace, or cancelled when it ran out: either way, ended
        assert events[-1] == "data: [DONE]"
        assert "shutting down" in events[-2] or json.loads(events[-2][5:])["choices"][0]["finish_reason"] == "length"
        with pytest.raises(httpx.TransportError):  # it takes no more requests
            httpx.get(f"http://{url}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("setting, message", [("server.port=70000", "out of range"),
                                               ("server.max_waiting=-1", "server.max_waiting"),
                                               ("server.request_timeout=0", "positive"),
                                               ("server.log_level=loud", "server.log_level")])
def test_bad_server_settings_are_one_line(setting, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "model=tiny", setting])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_server_keys_belong_to_serve_only(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "model=tiny", "prompt_ids=[1,2]", "server.port=9"])
    assert "specfit serve" in capsys.readouterr().err
