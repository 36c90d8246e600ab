"""Start and stop one topology's process tree: `python -m tandem.server` processes on 127.0.0.1
(a router, and collocated or prefill/decode instances), each on its own GPUs, health-waited.

Every process sees all of the harness's GPUs (CUDA_VISIBLE_DEVICES = --gpus) and an instance picks
its first with `--device cuda:N` (its TP ranks take the ones after it), as `server --role disagg`
does: the ipc KV transport opens the peer's memory by device index, which needs both GPUs visible
in both processes.

Collocated instances behind the router are registered with it from here (the harness pings
the router's registry for them, zero load, so the router's round-robin spreads requests);
prefill/decode instances register themselves (`--router-address`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.goodput.topology import Topology
from tandem.server.disagg_ports import block_size, free_port_block

logger = logging.getLogger(__name__)

PARALLEL_FLAGS = ("--tensor-parallel-size", "--data-parallel-size")


@dataclass(frozen=True)
class LaunchOptions:
    server_args: tuple[str, ...] = ()  # `server` flags for every instance (model, load format, ...)
    gpus: tuple[str, ...] = ()  # GPU ids to hand out, in order; empty: CPU (nothing set)
    startup_timeout_s: float = 900.0
    router_args: tuple[str, ...] = ("--request-timeout", "3600")
    python: str = field(default_factory=lambda: sys.executable)


def free_port(size: int = 1) -> int:
    """The first of `size` free consecutive ports for a server this harness starts (its HTTP port,
    then the ports an instance derives from it: KV handshake, KV data per rank, TP rendezvous),
    below the ephemeral range and apart from every block handed out before
    (tandem.server.disagg_ports.free_port_block)."""
    return free_port_block(size)


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: no orphans if the harness dies


class Process:
    """One `server` process logging to log_path."""

    def __init__(self, name: str, argv: list[str], log_path: Path, python: str, gpus: tuple[str, ...] = (),
                 ports: int = 1, visible: tuple[str, ...] = ()):
        self.name, self.port, self.log_path = name, free_port(ports), log_path
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        if visible:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible)
        cmd = [python, "-m", "tandem.server", "--host", "127.0.0.1", "--port", str(self.port), *argv]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=_die_with_parent)
        logger.info("started %s (pid %d%s): %s", name, self.proc.pid,
                    f", GPUs {','.join(gpus)}" if gpus else "", " ".join(cmd))

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} during start-up; "
                               f"log {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %.0f s of SIGTERM; killing it", self.name, timeout_s)
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def instance_gpus(topology: Topology, gpus: tuple[str, ...]) -> list[tuple[str, ...]]:
    """GPUs of each instance in launch order (prefill first): consecutive groups of topology.gpus;
    empty groups on CPU (no GPU ids given)."""
    n = topology.num_instances
    if not gpus:
        return [()] * n
    need = n * topology.gpus
    if need > len(gpus):
        raise ValueError(f"{topology.name} needs {need} GPUs ({n} instances x {topology.gpus}); "
                         f"only {len(gpus)} given ({','.join(gpus)})")
    return [tuple(gpus[i * topology.gpus:(i + 1) * topology.gpus]) for i in range(n)]


def instance_argv(topology: Topology, role: str, options: LaunchOptions, registry: str | None,
                  gpus: tuple[str, ...] = ()) -> list[str]:
    """The instance's `server` flags; on GPUs (`gpus`: its group from instance_gpus) `--device
    cuda:N`, N its first GPU's place among options.gpus (the process sees all of them)."""
    argv = [*options.server_args, *topology.server_args]
    if role == "prefill":
        argv += topology.prefill_args
    elif role == "decode":
        argv += topology.decode_args
    given = {a.split("=")[0] for a in argv}
    if topology.gpus > 1 and options.gpus and not given & set(PARALLEL_FLAGS):
        argv += ["--tensor-parallel-size", str(topology.gpus)]
    if gpus and "--device" not in given:
        argv += ["--device", f"cuda:{options.gpus.index(gpus[0])}"]
    if role in ("prefill", "decode"):
        argv = ["--role", role, "--router-address", registry, "--kv-transport", topology.transport, *argv]
    return argv


class Deployment:
    """A topology's running tree; `with Deployment(...) as url:` starts it and stops it cleanly."""

    def __init__(self, topology: Topology, options: LaunchOptions, log_dir: Path):
        self.topology, self.options, self.log_dir = topology, options, log_dir
        self.router: Process | None = None
        self.instances: list[Process] = []
        self._registrations: list = []

    def __enter__(self) -> str:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> str:
        """Launch every process, wait until each answers /health and the router routes to all of
        them; returns the URL clients use."""
        t, o = self.topology, self.options
        groups = instance_gpus(t, o.gpus)
        registry = None
        if not t.direct:
            registry_port = free_port()
            registry = f"127.0.0.1:{registry_port}"
            self.router = Process("router", ["--role", "router", "--registry-port", str(registry_port),
                                             "--kv-mode", t.kv_mode, "--routing-policy", "round_robin",
                                             *o.router_args], self.log_dir / "router.log", o.python)
        roles = ["collocated"] * t.instances if t.kind == "colloc" else ["prefill"] * t.prefill + ["decode"] * t.decode
        counts: dict[str, int] = {}
        for role, gpus in zip(roles, groups):
            i = counts[role] = counts.get(role, -1) + 1
            name = f"{role}{i}"
            self.instances.append(Process(name, instance_argv(t, role, o, registry, gpus), self.log_dir / f"{name}.log",
                                          o.python, gpus, ports=block_size(max(1, t.gpus)), visible=o.gpus))
        deadline = time.monotonic() + o.startup_timeout_s
        for p in self.instances:
            self._wait_healthy(p, deadline)
        if self.router is None:
            return self.instances[0].url
        self._wait_healthy(self.router, deadline)
        if t.kind == "colloc":
            self._register_collocated(registry)
        self._wait_routable(deadline)
        return self.router.url

    def phase_totals(self) -> dict[str, dict[str, tuple[float, float]]]:
        """Each instance's engine phase histograms (tandem:request_*_time_seconds) as they stand:
        {instance name: {phase: (sum seconds, count)}}."""
        out = {}
        for p in self.instances:
            text = httpx.get(f"{p.url}/metrics", timeout=10.0).text
            phases = {}
            for family in text_string_to_metric_families(text):
                if family.type != "histogram" or not family.name.startswith("tandem:request_"):
                    continue
                value = {sample.name.removeprefix(family.name): sample.value for sample in family.samples
                         if sample.name in (family.name + "_sum", family.name + "_count")}
                phase = family.name.removeprefix("tandem:request_").removesuffix("_time_seconds")
                phases[phase] = (value["_sum"], value["_count"])
            out[p.name] = phases
        return out

    def _wait_healthy(self, p: Process, deadline: float) -> None:
        while True:
            p.check_alive()
            with contextlib.suppress(httpx.TransportError):
                status = httpx.get(f"{p.url}/health", timeout=2.0).status_code
                # the router answers 503 until instances register: any answer means it is up
                if status == 200 or (p is self.router and status == 503):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{p.name} not healthy within {self.options.startup_timeout_s:.0f} s; "
                                   f"log {p.log_path}:\n{p.log_tail()}")
            time.sleep(0.5)

    def _register_collocated(self, registry: str) -> None:
        from tandem.server.registry_protocol import InstanceInfo
        from tandem.server.registration import RegistrationClient

        for p in self.instances:
            info = InstanceInfo(instance_id=f"{self.topology.name}-{p.name}", role="collocated", http_address=p.url)
            client = RegistrationClient(registry, info, 1.0)
            client.start()
            self._registrations.append(client)

    def _wait_routable(self, deadline: float) -> None:
        want = len(self.instances)
        while True:
            self.router.check_alive()
            for p in self.instances:
                p.check_alive()
            with contextlib.suppress(httpx.TransportError, ValueError):
                listed = httpx.get(f"{self.router.url}/instances", timeout=2.0).json().get("instances", [])
                if sum(1 for i in listed if i.get("healthy")) >= want:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the router lists fewer than {want} healthy instances; "
                                   f"log {self.router.log_path}:\n{self.router.log_tail()}")
            time.sleep(0.3)

    def stop(self) -> None:
        """Unregister, then SIGTERM every process (router first) and wait for each."""
        for client in self._registrations:
            client.stop()
        self._registrations.clear()
        for p in ([self.router] if self.router else []) + self.instances:
            p.stop()
        self.router, self.instances = None, []
