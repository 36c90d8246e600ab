"""Free loopback TCP ports for test servers and process groups."""
import socket

from tandem.server.disagg_ports import free_port_block


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(count: int) -> int:
    """The first of `count` consecutive ports that are all free now (for --base-port), below
    Linux's ephemeral range and overlapping no block handed out before in this process: the
    server's own helper for --base-port 0 (tandem.server.disagg_ports.free_port_block)."""
    return free_port_block(count)
