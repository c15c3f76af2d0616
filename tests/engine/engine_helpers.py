"""Helpers for the embedded engine tests: an HTTP client, a thread runner, an in-process engine, HF reference."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any


def http(url: str, route: str, body: Any = None, method: str | None = None, timeout: float = 60) -> tuple[int, Any]:
    """(status, parsed JSON or text or None); never raises on HTTP errors. ``body``: JSON-able, or bytes sent as
    they are."""
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + route, data=data, method=method or ("GET" if body is None else "POST"),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    text = raw.decode()
    try:
        return status, json.loads(text) if text else None
    except json.JSONDecodeError:
        return status, text


def generate(url: str, **body: Any) -> Any:
    status, out = http(url, "/generate", body)
    assert status == 200, out
    return out


@contextlib.contextmanager
def stream_started(url: str, body: dict):
    """A raw streaming /generate request, held open until its first chunk arrived; leaving the block closes the
    socket (a client that disconnects)."""
    data = json.dumps({**body, "stream": True})
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n{data}".encode())
        received = b""
        while b"data: " not in received:
            received += sock.recv(4096)
        yield sock


def in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    """Run ``fn`` in a thread; its result lands in ``box["result"]``."""
    box: dict = {}
    t = threading.Thread(target=lambda: box.__setitem__("result", fn(*args, **kwargs)), daemon=True)
    t.start()
    return t, box


def start_engine(model_dir, **kwargs):
    from slime_lite.engine.server import EngineServer

    server = EngineServer(str(model_dir), device="cpu", **kwargs)
    server.start()
    return server


def hf_logprobs(model, prompt_ids: list[int], output_ids: list[int], temperature: float = 1.0) -> list[float]:
    """Log-probs of ``output_ids`` under one full forward of prompt + output, logits divided by the temperature."""
    import torch

    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt_ids) - 1 : -1] / temperature, dim=-1)
    return logp.gather(1, torch.tensor(output_ids)[:, None])[:, 0].tolist()


def assert_greedy_run_matches_hf(model, prompt_ids: list[int], out: dict, tol: float = 1e-5) -> None:
    """A greedy result (with return_logprob) is what a full HF forward gives: equal log-probs, and every token is
    the argmax (up to ``tol``, since near-ties may break either way under a different batch composition)."""
    import torch

    ids = out["output_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ids])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
    chosen = logp.gather(1, torch.tensor(ids)[:, None])[:, 0]
    engine = torch.tensor([t[0] for t in out["meta_info"]["output_token_logprobs"]])
    assert (engine - chosen).abs().max() < tol
    assert (logp.max(-1).values - chosen).max() < tol


def captured(fn):
    """``fn`` (CUDA kernels) run once on a side stream (Triton compiles there, outside the capture), then captured:
    ``(graph, out)``, ``out`` the tensor that every ``graph.replay()`` rewrites."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def one_chunk_per_token(monkeypatch: Any, engine: Any, delay: float = 0.02) -> None:
    """After each output of ``engine``'s scheduler its model thread waits until the server's event loop has gone
    round a few times (the output handed over, the stream's task woken to take it), then ``delay`` seconds: a stream,
    which sends a request's newest output whenever it can, then has one chunk per token, also on a loaded machine."""
    scheduler = engine.scheduler
    emit = scheduler._emit

    def slow_emit(req: Any) -> None:
        emit(req)
        for _ in range(3):
            turned = threading.Event()
            engine._loop.call_soon_threadsafe(turned.set)
            turned.wait(10)
        time.sleep(delay)

    monkeypatch.setattr(scheduler, "_emit", slow_emit)
