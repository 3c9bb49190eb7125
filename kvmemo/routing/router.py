"""`kvmemo router`: an OpenAI-compatible proxy sending each prompt to the replica that holds the
longest prefix of its KV blocks (kept from the replicas' KV events), else to the least loaded; a
Responses follow-up and a stored response's GET / DELETE go to the replica that stored it, and a
prompt_cache_key's requests to where the key went first (affinity.py).

Invariant: requests only go to replicas that passed their last health check and agree on the
namespace (root hash, block size, hash algorithm); a replica that fails to connect is marked
down and the request goes to the next choice; response bodies (streams too) pass through as
bytes, untouched.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

from kvmemo.kv.hashing import BlockHash
from kvmemo.routing.affinity import Affinity
from kvmemo.routing.block_index import ReplicaBlockIndex, follow_events
from kvmemo.routing.policy import Candidate, RoutingPolicy
from kvmemo.routing.prompt_hasher import PromptHasher

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-kvmemo-replica"
_HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}


@dataclass
class Replica:
    """The router's view of one replica."""

    url: str
    index: ReplicaBlockIndex = field(default_factory=ReplicaBlockIndex)
    healthy: bool = False
    in_flight: int = 0
    info: dict[str, Any] | None = None  # GET /kv/info, once fetched
    events_task: asyncio.Task | None = None


class _Metrics:
    def __init__(self, router: Router) -> None:
        self.registry = r = CollectorRegistry()
        self.routed = Counter(
            "kvmemo_router_requests",
            "Requests routed, by replica and reason (prefix, cold, balance, round_robin, "
            "response, cache_key)",
            ["replica", "reason"],
            registry=r,
        )
        self.matched_blocks = Counter(
            "kvmemo_router_matched_blocks",
            "Prompt blocks the chosen replica held when routed",
            ["replica"],
            registry=r,
        )
        self.retries = Counter(
            "kvmemo_router_retries",
            "Requests re-sent after a replica failed to connect",
            registry=r,
        )
        per_replica: dict[str, tuple[str, Callable[[Replica], float]]] = {
            "kvmemo_router_replica_healthy": (
                "1 if the last health check passed", lambda x: x.healthy
            ),
            "kvmemo_router_replica_in_flight": ("Requests in flight", lambda x: x.in_flight),
            "kvmemo_router_replica_cached_blocks": (
                "Block hashes the router believes the replica holds", lambda x: len(x.index.hashes)
            ),
            "kvmemo_router_replica_event_gaps": (
                "KV event gaps detected (cumulative)", lambda x: x.index.num_gaps
            ),
            "kvmemo_router_replica_resyncs": (
                "Snapshots installed (cumulative)", lambda x: x.index.num_resyncs
            ),
        }
        for name, (doc, read) in per_replica.items():
            gauge = Gauge(name, doc, ["replica"], registry=r)
            for replica in router.replicas:
                gauge.labels(replica.url).set_function(functools.partial(_read, read, replica))


def _read(read: Callable[[Replica], float], replica: Replica) -> float:
    return float(read(replica))


class Router:
    """Owns the replicas, the routing policy, the prompt hasher and the HTTP client."""

    def __init__(
        self,
        replica_urls: list[str],
        tokenizer: Any,
        chat_template: str | None,
        weights_fingerprint: str,
        *,
        policy: RoutingPolicy,
        health_interval_s: float = 1.0,
        request_timeout_s: float = 600.0,
    ) -> None:
        if not replica_urls:
            raise ValueError("replica: give at least one --replica http://host:port")
        for url in replica_urls:
            if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).netloc:
                raise ValueError(f"replica must be an http(s)://host:port URL, got {url!r}")
        self.replicas = [Replica(url.rstrip("/")) for url in replica_urls]
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.weights_fingerprint = weights_fingerprint
        self.policy = policy
        self.health_interval_s = health_interval_s
        self.hasher: PromptHasher | None = None  # from the first replica's /kv/info
        self.affinity = Affinity()
        self.metrics = _Metrics(self)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=2.0))
        self._health_task: asyncio.Task | None = None

    # ---- replicas: health, namespace, events -----------------------------------------------

    async def start(self) -> None:
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        tasks = [t for t in [self._health_task, *(r.events_task for r in self.replicas)] if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.client.aclose()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_health()
            except Exception:  # the loop must outlive any one bad answer
                logger.exception("health check failed")

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(r) for r in self.replicas))

    async def _check(self, replica: Replica) -> None:
        try:
            ok = (await self.client.get(f"{replica.url}/health", timeout=2.0)).status_code == 200
            if ok and replica.info is None:
                ok = await self._adopt(replica)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            # Unreachable, or not a kvmemo replica (no usable /kv/info): not routable.
            if replica.healthy:
                logger.warning("replica %s: %s", replica.url, exc)
            ok = False
        if ok != replica.healthy:
            logger.warning("replica %s is %s", replica.url, "up" if ok else "DOWN")
        replica.healthy = ok

    async def _adopt(self, replica: Replica) -> bool:
        """Reads the replica's /kv/info; refuses one whose namespace differs from the others'."""
        info = (await self.client.get(f"{replica.url}/kv/info", timeout=5.0)).json()
        if info["weights_fingerprint"] != self.weights_fingerprint:
            logger.error(
                "replica %s serves other weights than the router's --model; not routing to it",
                replica.url,
            )
            return False
        key = (info["namespace_root"], info["block_size"], info["hash_algorithm"])
        if self.hasher is None:
            self.hasher = PromptHasher(
                self.tokenizer, self.chat_template, BlockHash(bytes.fromhex(key[0])), key[1], key[2]
            )
        elif key != self.hasher.key:
            logger.error("replica %s hashes blocks differently; not routing to it", replica.url)
            return False
        replica.info = info
        endpoint = info.get("kv_events_endpoint")
        if endpoint:
            endpoint = _reachable(endpoint, replica.url)
            replica.events_task = asyncio.create_task(
                follow_events(endpoint, replica.index,
                              functools.partial(self._snapshot, replica), name=replica.url)
            )
        else:
            logger.warning(
                "replica %s publishes no KV events; routing it by load only", replica.url
            )
        return True

    async def _snapshot(self, replica: Replica) -> tuple[str, int, list[bytes]]:
        body = (await self.client.get(f"{replica.url}/kv/blocks", timeout=10.0)).json()
        return body["epoch"], body["seq"], [bytes.fromhex(h) for h in body["block_hashes"]]

    # ---- proxying --------------------------------------------------------------------------

    def route(
        self, path: str, body: dict[str, Any] | None, exclude: set[int]
    ) -> tuple[int, list[BlockHash]]:
        """(replica index, prompt block hashes); raises ValueError if no replica is up."""
        hashes = self.hasher.block_hashes(path, body) if self.hasher and body is not None else []
        pinned = self.affinity.pinned(self.replicas, body, exclude)
        if pinned is not None:
            index, reason = pinned
            matched = self.replicas[index].index.matched_blocks(hashes)
        else:
            candidates = [
                Candidate(i, r.index.matched_blocks(hashes), r.in_flight)
                for i, r in enumerate(self.replicas)
                if r.healthy and i not in exclude
            ]
            decision = self.policy.choose(candidates)
            index, reason, matched = decision.index, decision.reason, decision.matched_blocks
        self.affinity.note(body, index)
        replica = self.replicas[index]
        self.metrics.routed.labels(replica.url, reason).inc()
        self.metrics.matched_blocks.labels(replica.url).inc(matched)
        return index, hashes

    async def proxy(self, request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
            body = body if isinstance(body, dict) else None
        except ValueError:
            body = None  # the replica answers with the right error
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        tried: set[int] = set()
        while True:
            try:
                index, hashes = self.route(path, body, tried)
            except ValueError:
                return JSONResponse(
                    {"error": {"message": "no healthy replica", "type": "server_error",
                               "param": None, "code": "no_replica"}},
                    status_code=503,
                )
            replica = self.replicas[index]
            upstream = self.client.build_request("POST", f"{replica.url}{path}", content=raw,
                                                 headers=headers)
            # Predicted now, not when the response starts (a non-streamed one starts when it is
            # done): the burst of requests behind this one must follow it to this replica.
            replica.index.note_routed(hashes)
            replica.in_flight += 1
            try:
                response = await self.client.send(upstream, stream=True)
            except httpx.TransportError as exc:
                replica.in_flight -= 1
                replica.healthy = False
                logger.warning(
                    "replica %s failed (%s); marked down, trying another", replica.url, exc
                )
                self.metrics.retries.inc()
                tried.add(index)
                continue
            return StreamingResponse(
                self._relay(replica, response),
                status_code=response.status_code,
                headers={
                    "content-type": response.headers.get("content-type", "application/json"),
                    REPLICA_HEADER: replica.url,
                },
            )

    async def forward_stored(self, request: Request, response_id: str) -> Response:
        """GET or DELETE /v1/responses/{id}, answered by the replica that stored it."""
        index = self.affinity.holder(self.replicas, response_id)
        if index is None or not self.replicas[index].healthy:
            why = "no replica" if index is None else "the replica that stored it is down: no one"
            return JSONResponse({"error": {
                "message": f"{why} stores response {response_id!r}",
                "type": "invalid_request_error", "param": "response_id",
                "code": "response_not_found"}}, status_code=404)
        replica = self.replicas[index]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        response = await self.client.request(
            request.method, f"{replica.url}/v1/responses/{response_id}",
            params=request.query_params, headers=headers)
        return Response(response.content, response.status_code,
                        media_type=response.headers.get("content-type"),
                        headers={REPLICA_HEADER: replica.url})

    async def _relay(self, replica: Replica, response: httpx.Response):
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        finally:
            replica.in_flight -= 1
            await response.aclose()

    def state(self) -> dict[str, Any]:
        return {
            "policy": self.policy.policy,
            "replicas": [
                {
                    "url": r.url,
                    "healthy": r.healthy,
                    "in_flight": r.in_flight,
                    "cached_blocks": len(r.index.hashes),
                    "events_epoch": r.index.epoch,
                    "events_seq": r.index.last_seq,
                    "event_gaps": r.index.num_gaps,
                    "resyncs": r.index.num_resyncs,
                }
                for r in self.replicas
            ],
        }


def _reachable(endpoint: str, replica_url: str) -> str:
    """tcp://*:5557 or tcp://0.0.0.0:5557 as the replica's own host (what it bound to)."""
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme == "tcp" and host in ("*", "0.0.0.0", "[::]", "::"):
        return f"tcp://{urlsplit(replica_url).hostname}:{port}"
    return endpoint


# The generation routes, proxied to the replica the prompt's blocks point at.
PROXIED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/messages",
                 "/v1/messages/count_tokens", "/v1/responses")


def create_router_app(router: Router) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        yield
        await router.stop()

    app = FastAPI(title="kvmemo router", version="0.1.0", lifespan=lifespan)

    def add_proxy(path: str) -> None:
        async def proxy(request: Request) -> Response:
            return await router.proxy(request, path)

        app.add_api_route(path, proxy, methods=["POST"], name=path)

    for path in PROXIED_PATHS:
        add_proxy(path)

    async def stored_response(request: Request, response_id: str) -> Response:
        return await router.forward_stored(request, response_id)

    app.add_api_route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"])

    @app.get("/v1/models")
    async def models(request: Request):
        for replica in router.replicas:
            if replica.healthy:
                auth = {k: v for k, v in request.headers.items()
                        if k.lower() in ("authorization", "x-api-key")}
                response = await router.client.get(f"{replica.url}/v1/models", headers=auth)
                return Response(response.content, response.status_code,
                                media_type=response.headers.get("content-type"))
        return JSONResponse({"error": {"message": "no healthy replica", "type": "server_error",
                                       "param": None, "code": "no_replica"}}, status_code=503)

    @app.get("/health")
    async def health():
        up = sum(r.healthy for r in router.replicas)
        return JSONResponse({"status": "ok" if up else "no_replica", "healthy_replicas": up},
                            status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/router/state")
    async def state():
        return router.state()

    return app


def run_router(
    replica_urls: list[str],
    *,
    model: str | None,
    host: str = "127.0.0.1",
    port: int = 8080,
    policy: str = "prefix",
    balance_threshold: int = 4,
    health_interval_s: float = 1.0,
) -> None:
    import uvicorn

    from kvmemo.model.loading.loader import load_tokenizer

    routing = RoutingPolicy(policy, balance_threshold)
    if health_interval_s <= 0:
        raise ValueError(f"health_interval_s must be > 0, got {health_interval_s!r}")
    tokenizer, template, fingerprint = load_tokenizer(model)
    router = Router(replica_urls, tokenizer, template, fingerprint, policy=routing,
                    health_interval_s=health_interval_s)
    logger.info(
        "routing %s over %d replicas on http://%s:%d/v1", policy, len(replica_urls), host, port
    )
    uvicorn.run(create_router_app(router), host=host, port=port, log_level="warning",
                access_log=False)
