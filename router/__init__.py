"""The integrated router/proxy of a PD deployment: instance registry (ZMQ), health, routing
policy, read/write-mode orchestration and streaming relay. Holds no KV and no model.

`server --role router` calls `add_router_args(parser)`, `RouterConfig.from_args(ns)` and
`run_router(config)`; prefill/decode/collocated servers register with `RegistrationClient`.
"""
from tandem.router.app import build_app, run_router
from tandem.router.config import RouterConfig, add_router_args
from tandem.router.protocol import InstanceInfo, LoadReport, RegisterMessage, UnregisterMessage
from tandem.router.registration import RegistrationClient

__all__ = ["RouterConfig", "add_router_args", "run_router", "build_app", "RegistrationClient", "InstanceInfo",
           "LoadReport", "RegisterMessage", "UnregisterMessage"]
