"""Moving KV cache between instances (PD disaggregation): the connector and its transports."""
from tandem.engine.config import KVTransferConfig

CONNECTORS = ("TandemConnector",)


def build_connector(config: KVTransferConfig, runner):
    """The KV connector for an engine's model runner, per --kv-transfer-config."""
    if config.kv_connector not in CONNECTORS:
        raise ValueError(f"unknown kv_connector {config.kv_connector!r}; expected one of {', '.join(CONNECTORS)}")
    from tandem.connectors.connector import TandemConnector
    from tandem.connectors.protocol import KVLayout

    cache = runner.kv_cache
    layout = KVLayout(num_layers=cache.shape[1], block_size=cache.shape[3], num_kv_heads=cache.shape[4],
                      head_dim=cache.shape[5], dtype=str(cache.dtype).removeprefix("torch."))
    return TandemConnector(config, cache, layout)
