"""kvmemo on a real local Ray cluster: two CPU engine replicas behind the ingress, routed by
kvmemo's prefix router (issue 20's checks)."""

from __future__ import annotations

import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")

from ray import serve  # noqa: E402

from kvmemo.integrations.ray_serve import build_app  # noqa: E402
from kvmemo.integrations.ray_serve.http_call import REPLICA_HEADER  # noqa: E402

pytestmark = pytest.mark.model
PREFIX_TOKENS = 1024
REPLICA_DEPLOYMENT = "KvmemoReplica"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster with two 1-CPU kvmemo replicas; yields the ingress URL."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="kvmemo-test")
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app(engine_options={"kv_cache_memory": "256MiB"}, num_replicas=2)
        serve.run(app, name="kvmemo", route_prefix="/", blocking=False)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]  # ordinary vocabulary, no specials


def _complete(url: str, prompt: list[int], max_tokens: int = 8, **extra) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=300)


def _running_replicas() -> dict[str, int]:
    app = serve.status().applications["kvmemo"]
    return dict(app.deployments[REPLICA_DEPLOYMENT].replica_states)


def test_a_shared_prefix_goes_to_the_replica_that_holds_it_and_outputs_equal_one_engine(
    cluster, llm
):
    from kvmemo import SamplingParams

    prefix = _tokens(1, PREFIX_TOKENS)
    prompts = [prefix + _tokens(100 + i, 16) for i in range(7)]
    first = _complete(cluster, prompts[0])
    assert first.status_code == 200, first.text
    holder = first.headers[REPLICA_HEADER]
    responses = [first]
    with ThreadPoolExecutor(3) as pool:  # 3 at a time: within the router's balance threshold
        for wave in (prompts[1:4], prompts[4:7]):
            responses += list(pool.map(lambda p: _complete(cluster, p), wave))
    for r in responses[1:]:
        assert r.status_code == 200, r.text
        assert r.headers[REPLICA_HEADER] == holder  # routed to the replica holding the prefix
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= PREFIX_TOKENS  # and it proves it: the prefix was not computed again

    # A second prefix, sent while the holder is busy, and its followers: they stay together too.
    other = _tokens(2, PREFIX_TOKENS)
    second = [_complete(cluster, other + _tokens(200 + i, 16)) for i in range(2)]
    assert second[1].headers[REPLICA_HEADER] == second[0].headers[REPLICA_HEADER]
    assert second[1].json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= PREFIX_TOKENS

    expected = llm.generate(
        prompts, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False
    )
    assert [r.json()["choices"][0]["text"] for r in responses] == [
        out.outputs[0].text for out in expected
    ]


def test_a_responses_chain_stays_on_the_replica_that_stored_it(cluster):
    """previous_response_id and GET reach the replica whose id gives the response id's tag
    (two replicas: without the pin, a follow-up lands on the other one half the time, a 404)."""
    previous, used = None, set()
    for turn in range(4):
        body = {"input": f"Turn {turn}: name a colour.", "max_output_tokens": 2,
                "temperature": 0, "previous_response_id": previous}
        response = httpx.post(f"{cluster}/v1/responses", json=body, timeout=300)
        assert response.status_code == 200, response.text
        used.add(response.headers[REPLICA_HEADER])
        previous = response.json()["id"]
    assert len(used) == 1
    stored = httpx.get(f"{cluster}/v1/responses/{previous}", timeout=60)
    assert stored.status_code == 200 and stored.headers[REPLICA_HEADER] in used


def test_killing_a_replica_loses_no_request_that_had_not_started_and_ray_restarts_it(cluster):
    prefix = _tokens(3, PREFIX_TOKENS)
    warm = _complete(cluster, prefix + _tokens(300, 16))
    assert warm.status_code == 200, warm.text
    victim = warm.headers[REPLICA_HEADER]  # the prefix's holder: the next requests go there
    prompts = [prefix + _tokens(310 + i, 16) for i in range(4)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_complete, cluster, p, 48) for p in prompts]
        time.sleep(1.0)  # they are queued or running on the victim, none has answered
        assert not any(f.done() for f in futures)
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        results = [f.result() for f in futures]
    for r in results:  # non-streamed answers had sent nothing: each was retried elsewhere
        assert r.status_code == 200, r.text
        assert r.headers[REPLICA_HEADER] != victim
        assert r.json()["usage"]["completion_tokens"] == 48

    deadline = time.monotonic() + 120
    while _running_replicas().get("RUNNING", 0) < 2:  # Ray Serve replaces the dead replica
        assert time.monotonic() < deadline, f"replica not restarted: {_running_replicas()}"
        time.sleep(1.0)
    after = _complete(cluster, _tokens(4, 64))
    assert after.status_code == 200, after.text
