"""Moving KV cache between instances (PD disaggregation): the connector and its transports."""
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (not at run time: the router imports connectors.params, and engine.config imports torch)
    from tandem.engine.config import EngineConfig

logger = logging.getLogger(__name__)

CONNECTORS = ("TandemConnector",)


def build_connector(config: "EngineConfig", runner, hf_config, group=None):
    """The KV connector of one rank, per --kv-transfer-config: (scheduler side on rank 0 else
    None, this rank's worker side). Every rank of the instance calls this at the same point:
    the ranks exchange their data addresses over `group` (torch.distributed, TP > 1)."""
    kv = config.kv_transfer
    if kv.kv_connector not in CONNECTORS:
        raise ValueError(f"unknown kv_connector {kv.kv_connector!r}; expected one of {', '.join(CONNECTORS)}")
    import uuid

    import torch.distributed as dist

    from tandem.connectors.connector import TandemConnector
    from tandem.connectors.layout import KVLayout
    from tandem.connectors.worker import KVConnectorWorker
    from tandem.engine.parallel import tp_rank, tp_size

    extra = kv.kv_connector_extra_config
    cache = runner.kv_cache
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    layout = KVLayout(num_layers=cache.shape[1], block_size=cache.shape[3], num_kv_heads=num_kv_heads,
                      head_dim=cache.shape[5], dtype=str(cache.dtype).removeprefix("torch."), tp_size=tp_size())
    if layout.heads_per_rank != cache.shape[4]:
        raise ValueError(f"KV cache has {cache.shape[4]} heads per rank, the layout says {layout.heads_per_rank}")
    rank, transport = tp_rank(), extra.get("transport", "tcp")
    scheduler_side = None
    if rank == 0:
        if not extra.get("engine_id"):
            extra = {**extra, "engine_id": uuid.uuid4().hex[:12]}
            kv = type(kv)(kv.kv_connector, kv.kv_role, extra)
        scheduler_side = TandemConnector(kv, layout, transport, num_blocks=runner.num_blocks)
    worker = KVConnectorWorker(extra.get("engine_id", "?"), rank, cache, layout, transport,
                               extra.get("kv_host", "127.0.0.1"), float(extra.get("transfer_timeout_s", 30.0)),
                               data_port(extra, rank))
    mine = [worker.address, scheduler_side.address if scheduler_side else None]
    if tp_size() > 1:
        everyone = [None] * tp_size()
        dist.all_gather_object(everyone, mine, group=group)
    else:
        everyone = [mine]
    worker.notify = everyone[0][1]
    if scheduler_side is not None:
        scheduler_side.rank_addresses = [addr for addr, _ in everyone]
        logger.info("KV connector of %s: handshake at %s, rank data at %s", kv.kv_role, scheduler_side.address,
                    ", ".join(scheduler_side.rank_addresses))
    return scheduler_side, worker


def data_port(extra: dict, rank: int) -> int:
    """Rank `rank`'s KV data port: `data_port` + rank, by default the handshake port + 1 + rank
    (0, a free port, where neither is set)."""
    handshake = int(extra.get("handshake_port", 0))
    first = int(extra.get("data_port", handshake + 1 if handshake else 0))
    return first + rank if first else 0
