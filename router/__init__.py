"""The integrated router/proxy of a PD deployment: instance registry (ZMQ), health, routing
policy, read/write-mode orchestration and streaming relay. Holds no KV and no model.

`python -m tandem.router` (what `server --role router` and `--role disagg` start) calls
`add_router_args(parser)`, `RouterConfig.from_args(ns)` and `run_router(config)`. Instances
register with `tandem.server.registration.RegistrationClient` (the messages: server/registry_protocol.py).
"""
from tandem.router.app import build_app, run_router
from tandem.router.config import RouterConfig, add_router_args

__all__ = ["RouterConfig", "add_router_args", "run_router", "build_app"]
