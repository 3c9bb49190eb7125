"""kvmemo on Ray Serve: engine replicas behind an OpenAI-compatible ingress, with a request
router that follows the replicas' KV events (needs the `ray` extra: pip install 'kvmemo[ray]').

    from kvmemo.integrations.ray_serve import build_app, run
    run(build_app(num_replicas=2))          # or: kvmemo ray-serve --num-replicas 2
"""

from kvmemo.integrations.ray_serve.app import ROUTERS, Autoscaling, build_app, run

__all__ = ["ROUTERS", "Autoscaling", "build_app", "run"]
