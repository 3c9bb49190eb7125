"""build_app and run: the kvmemo application on Ray Serve (`kvmemo ray-serve`).

Two deployments: KvmemoIngress (OpenAI routes, prompt hashing, retries) and KvmemoReplica (one
engine each, `num_replicas` of them or autoscaled), joined by a handle whose request router is
chosen here: kvmemo's prefix router (default), Ray Serve LLM's PrefixCacheAffinityRouter, or
Ray's power-of-two-choices.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

ROUTERS = ("kvmemo", "prefix_affinity", "pow2")
APP_NAME = "kvmemo"


@dataclass(frozen=True)
class Autoscaling:
    """Ray Serve's autoscaling of the engine replicas (on ongoing requests per replica)."""

    min_replicas: int = 1
    max_replicas: int = 2
    target_ongoing_requests: float = 32.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(
                "autoscaling needs 0 <= min_replicas <= max_replicas and max_replicas >= 1, got "
                f"{self.min_replicas} and {self.max_replicas}"
            )
        if self.target_ongoing_requests <= 0:
            raise ValueError(
                f"target_ongoing_requests must be > 0, got {self.target_ongoing_requests}"
            )


def request_router_config(router: str, router_kwargs: dict[str, Any] | None = None) -> Any:
    """Ray Serve's RequestRouterConfig for a router name (None: Ray's default, power of two)."""
    from ray.serve.config import RequestRouterConfig

    if router not in ROUTERS:
        raise ValueError(f"router must be one of {list(ROUTERS)}, got {router!r}")
    if router == "pow2":
        return None
    if router == "kvmemo":
        from kvmemo.integrations.ray_serve.router import KvmemoPrefixRouter

        cls: Any = KvmemoPrefixRouter
    else:
        try:
            from ray.serve.llm.request_router import PrefixCacheAffinityRouter
        except ImportError as exc:
            raise ValueError(
                f"router 'prefix_affinity' needs Ray Serve LLM's dependencies (pip install "
                f"'ray[serve,llm]'): {exc}"
            ) from None
        cls = PrefixCacheAffinityRouter
    return RequestRouterConfig(request_router_class=cls, request_router_kwargs=router_kwargs or {})


def build_app(
    model: str | None = None,
    *,
    engine_options: dict[str, Any] | None = None,
    num_replicas: int = 2,
    autoscaling: Autoscaling | None = None,
    replica_cpus: float = 1,
    replica_gpus: float = 0,
    max_ongoing_requests: int = 64,
    router: str = "kvmemo",
    router_kwargs: dict[str, Any] | None = None,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_waiting: int = 256,
    max_attempts: int = 3,
) -> Any:
    """The Ray Serve application (pass it to serve.run). engine_options are LLM's keyword
    arguments (dtype, kv_cache_memory, kv_store, ...): every replica gets the same, so replicas
    given one Redis `kv_store` share that tier."""
    from ray import serve

    from kvmemo.integrations.ray_serve.ingress import KvmemoIngress
    from kvmemo.integrations.ray_serve.replica import KvmemoReplica

    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if replica_cpus <= 0:
        raise ValueError(f"replica_cpus must be > 0, got {replica_cpus}")
    if replica_gpus < 0:
        raise ValueError(f"replica_gpus must be >= 0, got {replica_gpus}")
    options: dict[str, Any] = {
        # Ray hides every GPU from an actor that reserved none (CUDA_VISIBLE_DEVICES="").
        "ray_actor_options": {"num_cpus": replica_cpus, "num_gpus": replica_gpus},
        "max_ongoing_requests": max_ongoing_requests,
        "health_check_period_s": 2.0,
    }
    if autoscaling is None:
        options["num_replicas"] = num_replicas
    else:
        options["autoscaling_config"] = {
            "min_replicas": autoscaling.min_replicas,
            "max_replicas": autoscaling.max_replicas,
            "target_ongoing_requests": autoscaling.target_ongoing_requests,
        }
    config = request_router_config(router, router_kwargs)
    if config is not None:
        options["request_router_config"] = config
    engine_options = dict(engine_options or {})
    replicas = serve.deployment(name="KvmemoReplica", **options)(KvmemoReplica).bind(
        model,
        engine_options=engine_options,
        served_model_name=served_model_name,
        api_key=api_key,
        max_waiting=max_waiting,
        num_threads=max(1, int(replica_cpus)),
    )
    ingress = serve.deployment(
        name="KvmemoIngress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000,
    )(KvmemoIngress)
    return ingress.bind(
        replicas, model, chat_template=engine_options.get("chat_template"),
        max_attempts=max_attempts,
    )


def run(
    app: Any, *, address: str | None = None, host: str = "127.0.0.1", port: int = 8000,
    blocking: bool = True,
) -> None:
    """Start (or join, with `address`) a Ray cluster, then serve `app` on host:port until
    Ctrl-C. address: None starts a local cluster; "auto" joins the one `ray start` began."""
    import ray
    from ray import serve

    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=blocking)
