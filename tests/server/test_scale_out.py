"""Scale-out end to end: a real redis-server, two `kvmemo serve` replicas sharing it as a KV store
and publishing KV events, and `kvmemo router` in front of them (all real processes)."""

from __future__ import annotations

import contextlib
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.redis_server import RedisServer, free_port, require_redis_server
from tests.server.conftest import RunningServer, launch_server

pytestmark = pytest.mark.model

BLOCK_SIZE = 16
REPLICA = "x-kvmemo-replica"


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("redis")
    pytest.importorskip("zmq")
    require_redis_server()
    with contextlib.ExitStack() as stack:
        redis_server = stack.enter_context(RedisServer())

        def replica_flags() -> tuple[str, ...]:
            return (
                "--num-blocks", "256",
                "--max-model-len", "1024",
                "--kv-store", f"{redis_server.url}?timeout=0.5",
                "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}",
            )  # fmt: skip

        managers = [launch_server(*replica_flags()) for _ in range(2)]
        with ThreadPoolExecutor(2) as pool:  # start both replicas at once
            futures = [pool.submit(cm.__enter__) for cm in managers]
            replicas = []
            for cm, future in zip(managers, futures):
                replicas.append(future.result())
                stack.push(cm.__exit__)
        flags = ["--health-interval", "0.25"]
        for replica in replicas:
            flags += ["--replica", replica.base_url]
        router = stack.enter_context(launch_server(*flags, command="router"))
        yield redis_server, replicas, router


def _prompt(words: int = 100) -> str:
    # A unique head: no other test's blocks can match.
    return f"[{uuid.uuid4().hex}] " + " ".join(f"item{i} is number {i}." for i in range(words // 4))


def _complete(server: RunningServer, prompt: str, max_tokens: int = 16):
    with server.http() as client:
        response = client.post(
            "/v1/completions",
            json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        )
    assert response.status_code == 200, response.text
    return response


def _metric(server: RunningServer, name: str) -> float:
    return server.metrics().get(name, 0.0)


def _redis_hits(server: RunningServer) -> float:
    return _metric(server, 'kvmemo_store_tier_served_blocks{tier=redis}')


def _wait_for_saves(
    redis_server: RedisServer, keys_before: int, num_blocks: int, timeout_s: float = 30.0
) -> None:
    client = redis_server.client()
    deadline = time.monotonic() + timeout_s
    while client.dbsize() - keys_before < num_blocks:
        assert time.monotonic() < deadline, "the replica never saved its blocks to Redis"
        time.sleep(0.05)


def test_a_prompt_served_by_a_is_served_by_b_from_redis(cluster):
    redis_server, (a, b), _ = cluster
    prompt = _prompt(120)
    keys_before = redis_server.client().dbsize()
    first = _complete(a, prompt, max_tokens=24).json()
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert prompt_tokens > 10 * BLOCK_SIZE
    _wait_for_saves(redis_server, keys_before, prompt_tokens // BLOCK_SIZE)

    hits_before, served_before = _metric(b, "kvmemo_store_hit_tokens"), _redis_hits(b)
    second = _complete(b, prompt, max_tokens=24).json()
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    loadable = (prompt_tokens - 1) // BLOCK_SIZE  # the last token is always computed
    assert _metric(b, "kvmemo_store_hit_tokens") - hits_before == loadable * BLOCK_SIZE
    assert _redis_hits(b) - served_before == loadable


def test_router_sends_a_repeated_prefix_to_its_holder_and_spreads_cold_prompts(cluster):
    _, replicas, router = cluster
    by_url = {r.base_url: r for r in replicas}
    shared = _prompt(120)
    holder_url = _complete(router, shared).headers[REPLICA]
    holder = by_url[holder_url]
    # The router learns the holder's blocks from its KV events.
    with router.http() as client:
        deadline = time.monotonic() + 20
        while True:
            state = {r["url"]: r for r in client.get("/router/state").json()["replicas"]}
            if state[holder_url]["events_seq"] and state[holder_url]["cached_blocks"] >= 10:
                break
            assert time.monotonic() < deadline, state
            time.sleep(0.1)
    for i in range(2):
        hits_before = _metric(holder, "kvmemo_prefix_cache_hit_tokens")
        response = _complete(router, f"{shared} Question {i}: what is item {i}?")
        assert response.headers[REPLICA] == holder_url
        assert _metric(holder, "kvmemo_prefix_cache_hit_tokens") - hits_before >= 10 * BLOCK_SIZE
    routed = router.metrics()
    assert routed[f"kvmemo_router_requests_total{{reason=prefix,replica={holder_url}}}"] >= 2

    cold = [_complete(router, _prompt(24), max_tokens=2).headers[REPLICA] for _ in range(4)]
    assert set(cold) == set(by_url), cold


@pytest.fixture(scope="module")
def router_tokenizer():
    from kvmemo.model.loading.loader import load_tokenizer

    return load_tokenizer(None)  # what `kvmemo router` loads: tokenizer only, no weights


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.mark.parametrize(
    "kind", ["completion", "chat", "chat_tools", "messages_tools", "responses_tools"])
def test_router_hashes_prompts_exactly_like_the_replica(cluster, router_tokenizer, kind):
    """The router's PromptHasher (tokenizer only + /kv/info) against the replica's own block map;
    a chat request with tools, a tool choice and chat options too (its tools are rendered into
    the prompt by the same code on both sides), an Anthropic Messages request with tools, and an
    OpenAI Responses request with instructions and a function tool."""
    from kvmemo.kv.hashing import BlockHash
    from kvmemo.routing.prompt_hasher import PromptHasher

    _, (a, _), _ = cluster
    text = _prompt(60)
    if kind.startswith("chat"):
        path, body = "/v1/chat/completions", {
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": text}]},
            ],
            "max_tokens": 2,
            "temperature": 0,
        }
        if kind == "chat_tools":
            body.update(tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False,
                        chat_template_kwargs={"enable_thinking": False})
    elif kind == "messages_tools":
        function = WEATHER_TOOL["function"]
        path, body = "/v1/messages", {
            "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
            "tools": [{"name": function["name"], "description": function["description"],
                       "input_schema": function["parameters"]}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "max_tokens": 2, "temperature": 0,
        }
    elif kind == "responses_tools":
        function = WEATHER_TOOL["function"]
        path, body = "/v1/responses", {
            "instructions": "Be brief.", "store": False,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": text}]}],
            "tools": [{"type": "function", "name": function["name"],
                       "description": function["description"],
                       "parameters": function["parameters"]}],
            "tool_choice": "required", "max_output_tokens": 16, "temperature": 0,
        }
    else:
        path, body = "/v1/completions", {"prompt": text, "max_tokens": 2, "temperature": 0}
    with a.http() as client:
        assert client.post(path, json=body).status_code == 200
        info = client.get("/kv/info").json()
        held = {bytes.fromhex(h) for h in client.get("/kv/blocks").json()["block_hashes"]}
    tokenizer, template, fingerprint = router_tokenizer
    assert fingerprint == info["weights_fingerprint"]
    hasher = PromptHasher(
        tokenizer, template, BlockHash(bytes.fromhex(info["namespace_root"])),
        info["block_size"], info["hash_algorithm"],
    )
    hashes = hasher.block_hashes(path, body)
    assert len(hashes) >= 5 and set(hashes) <= held
    if kind.endswith("_tools"):  # the tools are in the predicted prompt, not left out
        plain = {k: v for k, v in body.items() if k not in ("tools", "tool_choice")}
        assert hasher.block_hashes(path, plain) != hashes
    salted = hasher.block_hashes(path, {**body, "cache_salt": "tenant"})
    assert not set(salted) & held  # a salt changes every block of the chain


def test_router_streams_through(cluster):
    _, replicas, router = cluster
    with router.http() as client:
        with client.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Say hi."}],
                "max_tokens": 8,
                "temperature": 0,
                "stream": True,
            },
        ) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert len(lines) >= 3 and lines[-1] == "data: [DONE]"


def test_redis_killed_mid_run_means_misses_then_recovery(cluster):
    redis_server, (a, b), _ = cluster
    redis_server.stop()
    try:
        errors_before = _metric(a, "kvmemo_store_tier_errors{tier=redis}")
        for server in (a, b, a):
            _complete(server, _prompt(80), max_tokens=4)  # still served, from compute
        assert _metric(a, "kvmemo_store_tier_errors{tier=redis}") > errors_before
    finally:
        redis_server.start()  # same port, empty
    # Both replicas reconnect (after their backoff) and share blocks again.
    deadline = time.monotonic() + 60
    while True:
        prompt = _prompt(80)
        keys_before = redis_server.client().dbsize()
        response = _complete(a, prompt, max_tokens=4).json()
        num_blocks = response["usage"]["prompt_tokens"] // BLOCK_SIZE
        with contextlib.suppress(AssertionError):
            _wait_for_saves(redis_server, keys_before, num_blocks, timeout_s=3.0)
            served_before = _redis_hits(b)
            _complete(b, prompt, max_tokens=4)
            if _redis_hits(b) > served_before:
                break
        assert time.monotonic() < deadline, "the replicas never recovered their Redis tier"
        time.sleep(0.5)


def test_router_keeps_a_responses_chain_on_the_replica_that_stored_it(cluster):
    """previous_response_id, GET and DELETE reach the replica whose tag the id carries, and a
    prompt_cache_key's requests follow its first one, each turn reading the last from cache."""
    _, replicas, router = cluster
    urls = {r.base_url for r in replicas}
    with router.http() as client:
        previous, used, cached = None, set(), []
        for turn in range(3):
            response = client.post("/v1/responses", json={
                "input": f"{_prompt(40)} Turn {turn}: name one item.", "max_output_tokens": 4,
                "temperature": 0, "previous_response_id": previous})
            assert response.status_code == 200, response.text
            used.add(response.headers[REPLICA])
            previous = response.json()["id"]
            cached.append(response.json()["usage"]["input_tokens_details"]["cached_tokens"])
        assert len(used) == 1 and used <= urls
        assert cached[1] > 0 and cached[2] > cached[1]  # each turn reads the ones before
        got = client.get(f"/v1/responses/{previous}")
        assert got.status_code == 200 and got.json()["id"] == previous
        assert got.headers[REPLICA] in used
        assert client.delete(f"/v1/responses/{previous}").json()["deleted"] is True
        gone = client.get(f"/v1/responses/{previous}")
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "response_id"
        unknown = client.get("/v1/responses/resp_" + "0" * 32)
        assert unknown.status_code == 404, unknown.text
        # Cold prompts spread over both replicas (above), but not when they share a key.
        keyed = {client.post("/v1/responses", json={
            "input": _prompt(24), "max_output_tokens": 2, "temperature": 0, "store": False,
            "prompt_cache_key": "tenant-a/agent-7"}).headers[REPLICA] for _ in range(4)}
        assert len(keyed) == 1


def test_a_dead_replica_is_routed_around(cluster):
    # Last in the module: it kills replica B (the fixture's teardown copes with a dead process).
    _, (a, b), router = cluster
    b.process.kill()
    b.process.wait()
    used = {_complete(router, _prompt(24), max_tokens=2).headers[REPLICA] for _ in range(4)}
    assert used == {a.base_url}
    with router.http() as client:
        deadline = time.monotonic() + 10
        while True:
            state = {r["url"]: r for r in client.get("/router/state").json()["replicas"]}
            if not state[b.base_url]["healthy"]:
                break
            assert time.monotonic() < deadline, state
            time.sleep(0.1)
        assert client.get("/health").status_code == 200  # one replica is enough


def test_router_proxies_anthropic_messages(cluster):
    _, _, router = cluster
    with router.http() as client:
        response = client.post("/v1/messages", json={
            "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hi."}]})
    assert response.status_code == 200, response.text
    message = response.json()
    assert message["type"] == "message" and message["content"][0]["type"] == "text"
    assert message["usage"]["output_tokens"] >= 1
