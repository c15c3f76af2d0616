"""FAKE SGLang router for CPU tests: ``python -m tests.fakes.fake_sglang_router --worker-urls U... --host H --port P``
stands in for ``python -m sglang_router.launch_router`` (not installable here): round-robin /generate over the
workers, /health answers once every worker does. With ``--api-key KEY`` (sglang_router's flag) /generate needs
``Authorization: Bearer KEY`` and the router sends the same header to the workers."""

from __future__ import annotations

import argparse
import itertools


def main(argv: list[str] | None = None) -> int:
    from aiohttp import ClientSession, web

    p = argparse.ArgumentParser(prog="fake_sglang_router")
    p.add_argument("--worker-urls", nargs="+", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None)
    args = p.parse_args(argv)
    auth = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    workers = itertools.cycle(args.worker_urls)
    routed: dict[str, int] = {u: 0 for u in args.worker_urls}

    async def health(request):
        async with ClientSession() as s:
            for url in args.worker_urls:
                async with s.get(url + "/health") as r:
                    if r.status != 200:
                        return web.Response(status=503)
        return web.Response(status=200)

    async def generate(request):
        if auth and request.headers.get("Authorization") != auth["Authorization"]:
            return web.Response(status=401, text="missing or wrong API key")
        url = next(workers)
        routed[url] += 1
        async with ClientSession() as s:
            async with s.post(url + "/generate", data=await request.read(),
                              headers={"Content-Type": "application/json", **auth}) as r:
                return web.Response(body=await r.read(), status=r.status, content_type="application/json")

    async def stats(request):
        return web.json_response(routed)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/generate", generate)
    app.router.add_get("/fake_routed", stats)
    web.run_app(app, host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
