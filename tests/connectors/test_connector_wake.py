"""An idle engine with transfers in flight naps in TandemConnector.wait between steps; a peer's
message ends the nap at once (a write-mode prefill waiting for decode's block ids, a decode
waiting for the prefill's first token: both on the TTFT path). Reference: the nap's length
without any message."""
import threading
import time

from tandem.connectors.agent import KVAgent
from tandem.connectors.connector import TandemConnector
from tandem.connectors.layout import KVLayout
from tandem.connectors.protocol import FreeBlocks
from tandem.engine.config import KVTransferConfig


def test_a_peer_message_ends_the_idle_wait_at_once():
    conn = TandemConnector(KVTransferConfig("TandemConnector", "kv_both"), KVLayout(2, 4, 2, 16, "float32"))
    peer = KVAgent("test-peer", "127.0.0.1", 0, 5.0, lambda msg, payload: None)
    try:
        start = time.monotonic()
        conn.wait(0.05)
        assert time.monotonic() - start >= 0.045  # no news: it naps (no spinning)
        timer = threading.Timer(0.1, lambda: peer.submit(lambda: peer.send(conn.address, FreeBlocks("nobody"))))
        timer.start()
        start = time.monotonic()
        conn.wait(10.0)
        waited = time.monotonic() - start
        timer.join()
        assert 0.09 <= waited < 2.0, waited
        start = time.monotonic()
        conn.wait(0.05)  # the news was taken: the next nap is a full one again
        assert time.monotonic() - start >= 0.045
    finally:
        peer.close()
        conn.close()
