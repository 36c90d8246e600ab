"""Faults in a PD deployment end with a clear client error and no leaked KV blocks.
(Registration of an unreachable instance is covered in tests/router.)
Over tcp only: each fault here comes before the transport moves anything (a prefill stopped before
the handshake) or after its transfer is done (a decode killed, a client gone, while decoding), so
the path is the connector's scheduler side and the router's, the same for every transport. A fault
in the middle of a transfer: tests/e2e/test_faults_tp.py.

One prefill and one decode instance serve the module, each test behind a router of its own
(--kv-mode, --instance-timeout) on one registry port: the client abort first (no process dies),
then the killed decode, then the stopped prefill on a fresh decode. Each test has a prompt of its
own: a decode finding an earlier test's prompt in its prefix cache would receive only its tail."""
import threading
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import ENGINE_ARGS, KV_CONFIG, Proc, metric, wait_all_blocks_free
from tests.ports import free_port_range
from tests.server.conftest import stop_all

LONG = "Question: " + " ".join(f"item {i} costs {i} dollars." for i in range(6)) + "\nAnswer:"
PROMPTS = {"abort": LONG, "killed_decode": LONG.replace("Question:", "Task:", 1),
           "stopped_prefill": LONG.replace("Question:", "Problem:", 1)}


class Pair:
    """A prefill and a decode instance (tcp, KV_CONFIG's 4 s timeouts) registering at one registry
    port, where each test starts its own router."""

    def __init__(self, model_dir, log_dir):
        self.model_dir, self.log_dir = model_dir, log_dir
        self.registry = free_port_range(1)
        self.instances: dict[str, Proc] = {}

    def running(self, role: str) -> Proc:
        """The running instance of `role`, or a fresh one (an earlier test killed the last)."""
        for name, p in list(self.instances.items()):
            if name.startswith(role) and p.proc.poll() is None:
                return p
        name = f"{role}{len(self.instances)}"
        self.instances[name] = Proc(name, [
            "--role", role, "--model", str(self.model_dir), "--served-model-name", "default", "--router-address",
            f"127.0.0.1:{self.registry}", "--kv-transfer-config", KV_CONFIG, "--kv-transport", "tcp", *ENGINE_ARGS],
            self.log_dir)
        return self.instances[name]

    def route(self, name: str, mode: str, instance_timeout: float = 5.0) -> tuple[Proc, Proc, Proc]:
        """(router, prefill, decode): a router of `mode` named `name`, both instances registered with it."""
        prefill, decode = self.running("prefill"), self.running("decode")
        for p in (prefill, decode):
            p.wait_healthy()
        router = Proc(name, ["--role", "router", "--registry-port", str(self.registry), "--kv-mode", mode,
                             "--instance-timeout", str(instance_timeout), "--request-timeout", "60"], self.log_dir)
        try:
            router.wait_healthy(60)
            deadline = time.monotonic() + 30
            while len(httpx.get(f"{router.url}/instances").json().get("instances", [])) < 2:
                assert time.monotonic() < deadline, httpx.get(f"{router.url}/instances").text
                time.sleep(0.3)
        except BaseException:
            router.stop()
            raise
        return router, prefill, decode

    def drop(self, instance: Proc) -> None:
        """Reap a killed instance (the next test that needs its role starts a fresh one)."""
        self.instances = {n: p for n, p in self.instances.items() if p is not instance}
        instance.stop()

    def close(self) -> None:
        stop_all(self.instances.values())


@pytest.fixture(scope="module")
def pair(model_dir, tmp_path_factory):
    pair = Pair(model_dir, tmp_path_factory.mktemp("pd-faults"))
    try:
        yield pair
    finally:
        pair.close()


def _complete(url: str, prompt: str, **kw):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    return client.completions.create(model="default", prompt=prompt, temperature=0, **kw)


def _abort_count(url: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
               if line.startswith("tandem:request_success_total") and 'finished_reason="abort"' in line)


def test_client_abort_reaches_both_instances(pair):
    router, prefill, decode = pair.route("router-abort", "write")
    try:
        aborts = _abort_count(decode.url)
        body = {"model": "default", "prompt": PROMPTS["abort"], "max_tokens": 150, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for i, _ in enumerate(r.iter_lines()):
                if i >= 4:
                    break  # leaving the block closes the connection mid-stream
        deadline = time.monotonic() + 30
        while _abort_count(decode.url) == aborts:
            assert time.monotonic() < deadline, "decode never saw the abort"
            time.sleep(0.3)
        assert metric(decode.url, "num_requests_running") == 0
        wait_all_blocks_free([prefill.url, decode.url])
    finally:
        router.stop()


def test_killed_decode_gives_client_error_and_prefill_frees(pair):
    router, prefill, decode = pair.route("router-killed-decode", "read", instance_timeout=2)
    try:
        errors = []

        def stream():
            try:
                for _ in _complete(router.url, PROMPTS["killed_decode"], max_tokens=150, stream=True,
                                   extra_body={"ignore_eos": True}):
                    pass
            except (openai.APIError, httpx.HTTPError) as e:
                errors.append(e)

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 60
        while metric(decode.url, "num_requests_running") == 0:  # decode is generating
            assert time.monotonic() < deadline and t.is_alive(), errors
            time.sleep(0.05)
        decode.kill()
        t.join(60)
        assert not t.is_alive() and errors, "the client must get an error, not hang"
        wait_all_blocks_free([prefill.url])
        # The router drops the dead decode; with no decode left it answers 503 at once.
        deadline = time.monotonic() + 15
        while httpx.get(f"{router.url}/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.3)
        with pytest.raises(openai.APIStatusError) as err:
            _complete(router.url, PROMPTS["killed_decode"], max_tokens=4)
        assert err.value.status_code == 503
    finally:
        router.stop()
        pair.drop(decode)


def test_killed_prefill_times_out_on_decode_without_leak(pair):
    """Write mode: prefill dies before pushing; decode's transfer times out (4 s), the client
    gets an error and decode's blocks are all free again."""
    router, prefill, decode = pair.route("router-stopped-prefill", "write", instance_timeout=30)
    try:
        prefill.proc.send_signal(19)  # SIGSTOP: alive for the router, silent for the transfer
        start = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            _complete(router.url, PROMPTS["stopped_prefill"], max_tokens=8)
        assert err.value.status_code >= 500 and time.monotonic() - start < 40
        prefill.proc.send_signal(18)  # SIGCONT
        prefill.kill()
        wait_all_blocks_free([decode.url])
    finally:
        router.stop()
        pair.drop(prefill)
