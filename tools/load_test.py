#!/usr/bin/env python3
"""Load test for `lily serve`: N concurrent clients for a fixed time against a server on this
machine (loopback only), sending a mix of chat requests (streaming and not, varied prompts,
small max_tokens). Bounded in time (--duration) and in count (--max-requests).

    .venv-ci/bin/python tools/load_test.py http://127.0.0.1:8000 [--clients 16] [--duration 60]
        [--max-tokens 32] [--max-requests 100000] [--api-key KEY] [--json-out FILE]

Records responses by status, complete vs incomplete responses (a stream must end with
`data: [DONE]` after a finish_reason; a non-stream response must have choices and usage),
latency percentiles (and time to first token for streams), tokens and tok/s. Exits 1 if any
response was a 5xx or incomplete (transport errors count as incomplete), 2 on bad arguments
(a non-loopback URL among them). Requests still running --grace seconds (default 30) after the
deadline are abandoned and count as incomplete. 429s are expected under load: counted, not failures; the
client waits for Retry-After (at most 1 s) before its next request.

Needs httpx (tests/api/requirements.txt).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import socket
import sys
import time
from urllib.parse import urlsplit

import httpx

PROMPTS = [
    "Give me a short introduction to large language models.",
    "What is 2+2?",
    "Write a haiku about the sea.",
    "Explain recursion to a child.",
    "List three prime numbers.",
    "Translate 'good morning' into French.",
    "Why is the sky blue?",
    "Summarize the plot of Hamlet in one sentence.",
    "What is the capital of Japan?",
    "Name a sorting algorithm and its complexity.",
]
SYSTEMS = [None, "You are a helpful assistant.", "Answer tersely."]


def loopback_only(url: str) -> str:
    """Returns the URL without a trailing slash, or raises ValueError unless every address the
    host names is a loopback address. Checked before any request is sent."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    host = parts.hostname
    try:
        addrs = [ipaddress.ip_address(host)]
    except ValueError:
        if host != "localhost":
            raise ValueError(f"refusing {host!r}: only loopback targets (127.0.0.0/8, ::1, localhost) are allowed") from None
        infos = socket.getaddrinfo(host, parts.port or 80, proto=socket.IPPROTO_TCP)
        addrs = [ipaddress.ip_address(i[4][0]) for i in infos]
    bad = [str(a) for a in addrs if not a.is_loopback]
    if not addrs or bad:
        raise ValueError(f"refusing {url!r}: {bad or 'no address'} is not loopback; only loopback targets are allowed")
    return url.rstrip("/")


class Stats:
    def __init__(self) -> None:
        self.status: dict[str, int] = {}
        self.complete = 0
        self.incomplete = 0
        self.transport_errors = 0
        self.latencies: list[float] = []
        self.ttft: list[float] = []
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.streams = 0
        self.in_flight = 0
        self.started = 0
        self.connect_errors_in_a_row = 0
        self.unreachable = False
        self.examples: list[str] = []  # first few failures, for the report

    def note_failure(self, what: str) -> None:
        if len(self.examples) < 5:
            self.examples.append(what[:400])


def make_request(rng: random.Random, model: str | None, max_tokens: int) -> dict:
    msgs = []
    sys_prompt = rng.choice(SYSTEMS)
    if sys_prompt:
        msgs.append({"role": "system", "content": sys_prompt})
    msgs.append({"role": "user", "content": rng.choice(PROMPTS)})
    if rng.random() < 0.25:  # a second turn now and then
        msgs += [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": rng.choice(PROMPTS)}]
    body: dict = {"messages": msgs, "max_tokens": rng.randint(max(1, max_tokens // 4), max_tokens),
                  "chat_template_kwargs": {"enable_thinking": rng.random() < 0.3}}
    if model:
        body["model"] = model
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=0.8, top_p=0.95, seed=rng.randint(0, 1 << 30))
    if rng.random() < 0.5:
        body["stream"] = True
        body["stream_options"] = {"include_usage": rng.random() < 0.8}
    return body


async def one_request(client: httpx.AsyncClient, body: dict, st: Stats) -> float:
    """Sends one request; returns seconds to wait before the next (Retry-After on 429)."""
    t0 = time.perf_counter()
    stream = bool(body.get("stream"))
    st.in_flight += 1
    st.started += 1
    try:
        return await _send(client, body, st, t0, stream)
    finally:
        st.in_flight -= 1


async def _send(client: httpx.AsyncClient, body: dict, st: Stats, t0: float, stream: bool) -> float:
    try:
        if stream:
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                code = str(r.status_code)
                st.status[code] = st.status.get(code, 0) + 1
                st.connect_errors_in_a_row = 0
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    return _not_ok(r, text, st, t0)
                finish = None
                done = False
                usage = None
                pieces = 0
                first = None
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if obj.get("usage"):
                        usage = obj["usage"]
                    for ch in obj.get("choices") or []:
                        d = ch.get("delta") or {}
                        if d.get("content") or d.get("reasoning_content"):
                            pieces += 1
                            if first is None:
                                first = time.perf_counter() - t0
                        if ch.get("finish_reason"):
                            finish = ch["finish_reason"]
                dt = time.perf_counter() - t0
                want_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                if done and finish in ("stop", "length") and (usage is not None or not want_usage):
                    st.complete += 1
                    st.streams += 1
                    st.latencies.append(dt)
                    if first is not None:
                        st.ttft.append(first)
                    if usage:
                        st.prompt_tokens += usage.get("prompt_tokens", 0)
                        st.completion_tokens += usage.get("completion_tokens", 0)
                    else:
                        st.completion_tokens += pieces  # about one delta per token
                else:
                    st.incomplete += 1
                    st.note_failure(f"stream incomplete: [DONE] {done}, finish_reason {finish}, usage chunk {usage is not None} (asked: {want_usage})")
        else:
            r = await client.post("/v1/chat/completions", json=body)
            code = str(r.status_code)
            st.status[code] = st.status.get(code, 0) + 1
            st.connect_errors_in_a_row = 0
            if r.status_code != 200:
                return _not_ok(r, r.text, st, t0)
            dt = time.perf_counter() - t0
            try:
                obj = r.json()
                ok = bool(obj.get("choices")) and obj["choices"][0].get("finish_reason") in ("stop", "length") and bool(obj.get("usage"))
            except (ValueError, KeyError, IndexError, AttributeError):
                ok = False
            if ok:
                st.complete += 1
                st.latencies.append(dt)
                st.prompt_tokens += obj["usage"].get("prompt_tokens", 0)
                st.completion_tokens += obj["usage"].get("completion_tokens", 0)
            else:
                st.incomplete += 1
                st.note_failure(f"non-stream 200 without choices/finish_reason/usage: {r.text[:200]}")
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        st.transport_errors += 1
        st.incomplete += 1
        st.note_failure(f"{type(e).__name__}: {e}")
        if isinstance(e, httpx.ConnectError):
            st.connect_errors_in_a_row += 1
            if st.connect_errors_in_a_row >= 20:
                st.unreachable = True  # the server is gone: stop instead of spinning
            return 0.5
        return 0.1
    return 0.0


def _not_ok(r: httpx.Response, text: str, st: Stats, t0: float) -> float:
    if r.status_code == 429:
        try:
            return min(1.0, float(r.headers.get("retry-after", "1")))
        except ValueError:
            return 1.0
    st.note_failure(f"{r.status_code}: {text[:300]}")
    return 0.0


async def client_loop(i: int, args, base: str, model: str | None, deadline: float, budget: list[int], st: Stats) -> None:
    rng = random.Random(args.seed * 1000 + i)
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(args.request_timeout)
    async with httpx.AsyncClient(base_url=base, timeout=timeout, headers=headers) as client:
        while time.monotonic() < deadline and budget[0] > 0 and not st.unreachable:
            budget[0] -= 1
            wait = await one_request(client, make_request(rng, model, args.max_tokens), st)
            if wait:
                await asyncio.sleep(min(wait, max(0.0, deadline - time.monotonic())))


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))
    return s[k]


async def main_async(args) -> dict:
    base = args.url
    model = args.model
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=base, timeout=10, headers=headers) as c:
        h = await c.get("/health")
        if h.status_code != 200:
            raise SystemExit(f"{base}/health answered {h.status_code} {h.text[:200]}: is the server ready?")
        if model is None:
            m = await c.get("/v1/models")
            m.raise_for_status()
            model = m.json()["data"][0]["id"]
    st = Stats()
    t0 = time.monotonic()
    deadline = t0 + args.duration
    budget = [args.max_requests]
    tasks = [asyncio.create_task(client_loop(i, args, base, model, deadline, budget, st)) for i in range(args.clients)]
    # In-flight requests get --grace seconds after the deadline; then they are abandoned and
    # count as incomplete (a healthy server finishes small requests well within it).
    _, pending = await asyncio.wait(tasks, timeout=args.duration + args.grace)
    abandoned = st.in_flight
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    if abandoned:
        st.incomplete += abandoned
        st.note_failure(f"{abandoned} requests still running {args.grace:.0f}s after the deadline, abandoned")
    wall = time.monotonic() - t0
    requests = st.started
    server_errors = sum(n for s, n in st.status.items() if s.startswith("5"))
    r3 = lambda x: None if x is None else round(x, 4)  # noqa: E731
    return {
        "url": base,
        "model": model,
        "clients": args.clients,
        "duration_s": round(wall, 3),
        "requests": requests,
        "abandoned": abandoned,
        "unreachable": st.unreachable,
        "status": dict(sorted(st.status.items())),
        "transport_errors": st.transport_errors,
        "complete": st.complete,
        "incomplete": st.incomplete,
        "server_errors": server_errors,
        "streams": st.streams,
        "latency_s": {p: r3(pct(st.latencies, q)) for p, q in (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))},
        "ttft_s": {p: r3(pct(st.ttft, q)) for p, q in (("p50", 50), ("p90", 90), ("p99", 99))},
        "prompt_tokens": st.prompt_tokens,
        "completion_tokens": st.completion_tokens,
        "completion_tok_s": round(st.completion_tokens / wall, 2) if wall > 0 else 0.0,
        "requests_per_s": round(requests / wall, 3) if wall > 0 else 0.0,
        "failures": st.examples,
    }


def summary(rep: dict) -> str:
    lat, tt = rep["latency_s"], rep["ttft_s"]
    f = lambda x: "-" if x is None else f"{x:.3f}s"  # noqa: E731
    lines = [
        f"lily load test: {rep['url']} model {rep['model']}, {rep['clients']} clients, {rep['duration_s']:.1f}s",
        f"  requests   {rep['requests']} ({rep['requests_per_s']:.2f}/s), {rep['streams']} streamed ok",
        "  status     " + (", ".join(f"{k}: {v}" for k, v in rep["status"].items()) or "-") + (f", transport errors: {rep['transport_errors']}" if rep["transport_errors"] else ""),
        f"  complete   {rep['complete']}   incomplete {rep['incomplete']}   5xx {rep['server_errors']}",
        f"  latency    p50 {f(lat['p50'])}  p90 {f(lat['p90'])}  p99 {f(lat['p99'])}  max {f(lat['max'])}",
        f"  ttft       p50 {f(tt['p50'])}  p90 {f(tt['p90'])}  p99 {f(tt['p99'])}  (streams)",
        f"  tokens     prompt {rep['prompt_tokens']}, completion {rep['completion_tokens']} ({rep['completion_tok_s']:.1f} tok/s)",
    ]
    if rep.get("unreachable"):
        lines.append("  stopped    early: the server stopped accepting connections")
    for ex in rep["failures"]:
        lines.append(f"  failure    {ex}")
    ok = rep["server_errors"] == 0 and rep["incomplete"] == 0
    lines.append("  result     " + ("OK" if ok else "FAIL (5xx or incomplete responses)"))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("url", help="server base URL on loopback, e.g. http://127.0.0.1:8000")
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds to send requests (default 60)")
    ap.add_argument("--max-requests", type=int, default=100_000, help="stop after this many requests in all")
    ap.add_argument("--grace", type=float, default=30.0, help="seconds in-flight requests may run past --duration before they are abandoned (and count as incomplete)")
    ap.add_argument("--max-tokens", type=int, default=32, help="max_tokens is drawn from [this/4, this] (default 32)")
    ap.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--request-timeout", type=float, default=120.0, help="per-request timeout in seconds")
    ap.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    ap.add_argument("--json-out", default=None, help="also write the report as JSON here")
    args = ap.parse_args(argv)
    try:
        args.url = loopback_only(args.url)
    except (ValueError, OSError) as e:
        print(f"load_test: {e}", file=sys.stderr)
        return 2
    if not (1 <= args.clients <= 1024) or not (0 < args.duration <= 3600) or args.max_requests < 1 or not (0 <= args.grace <= 600):
        print("load_test: need 1 <= --clients <= 1024, 0 < --duration <= 3600, --max-requests >= 1, 0 <= --grace <= 600", file=sys.stderr)
        return 2
    rep = asyncio.run(main_async(args))
    print(summary(rep))
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(rep, fh, indent=2)
    return 0 if rep["server_errors"] == 0 and rep["incomplete"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
