"""Free loopback TCP ports for test servers and process groups."""
import random
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_handed_out: set[int] = set()  # blocks given to servers of this test process, bound or not yet


def free_port_range(count: int) -> int:
    """The first of `count` consecutive ports that are all free now (for --base-port), below
    Linux's ephemeral range so that no outgoing connection takes one before its server binds it,
    and overlapping no block handed out before in this process (a server binds its block's ports
    one after another: two overlapping blocks collide while both are starting)."""
    for _ in range(200):
        base = random.randint(10000, 32767 - count)
        if _handed_out.intersection(range(base, base + count)):
            continue
        try:
            socks = []
            for p in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", p))
            _handed_out.update(range(base, base + count))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports found")
