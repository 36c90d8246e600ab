"""The listening socket the API server and the router hand to uvicorn (server/lifecycle.bind_socket).

Reference: TCP_NODELAY on every accepted connection. With Nagle on, a streamed chunk that
follows the response headers by a millisecond (the router relaying a decode instance's first
token) waited for the client's delayed ACK, ~40 ms, on every PD request."""
import asyncio
import socket

from tandem.server.lifecycle import bind_socket


async def _accepted_nodelay(sock: socket.socket) -> int:
    """TCP_NODELAY of a connection accepted by asyncio on sock, as uvicorn serves it (create_server(sock=))."""
    got: asyncio.Future = asyncio.get_running_loop().create_future()

    async def on_connect(reader, writer):
        got.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(on_connect, sock=sock)
    try:
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        value = await asyncio.wait_for(got, 5)
        writer.close()
        return value
    finally:
        server.close()
        await server.wait_closed()


def test_accepted_connections_have_nagle_off():
    assert asyncio.run(_accepted_nodelay(bind_socket("127.0.0.1", 0, "test"))) != 0


def test_the_check_can_fail():
    """A socket made the old way (proto 0) keeps Nagle on: the test above would catch a regression."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    assert asyncio.run(_accepted_nodelay(sock)) == 0
