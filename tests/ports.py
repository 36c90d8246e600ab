"""Free loopback TCP ports for test servers and process groups."""
import random
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(count: int) -> int:
    """The first of `count` consecutive ports that are all free now (for --base-port), below
    Linux's ephemeral range so that no outgoing connection takes one before its server binds it."""
    for _ in range(200):
        base = random.randint(10000, 32767 - count)
        try:
            socks = []
            for p in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports found")
