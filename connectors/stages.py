"""Stage stamps of a PD request for profiling its time to first token (benchmarks/pd_ttft.py --trace).

Each part (router, API servers, engine cores, connectors) logs, at DEBUG level only, one line
`pdtrace <side>.<stage> <request id> <unix time>` when a request passes a stage; with one request
at a time the benchmark lines the stamps of all processes up against the client's send times.
"""
import logging
import time

from tandem.connectors.params import KVTransferParams

MARK = "pdtrace"


def side_of(params: KVTransferParams | None) -> str:
    """Which instance of a PD pair a request's kv_transfer_params put it on."""
    if params is None:
        return "colloc"
    return "prefill" if params.do_remote_decode else "decode" if params.do_remote_prefill else "colloc"


def stamp(logger: logging.Logger, side: str, stage: str, request_id: str) -> None:
    """Log that request_id reached `stage` now (DEBUG; nothing is formatted otherwise)."""
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s %s.%s %s %.6f", MARK, side, stage, request_id, time.time())
