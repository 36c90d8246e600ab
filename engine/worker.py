"""Tensor-parallel ranks: rank 0 lives in the engine-core process and schedules; the other
ranks run a ModelRunner each and replay every step that rank 0 broadcasts to them.

Ranks join one torch.distributed world (NCCL on CUDA, RCCL on ROCm, gloo on CPU) with a
gloo side group that carries the step inputs. A rank that dies takes the instance down
(a watchdog on each node exits loudly) instead of leaving collectives hanging.
"""
import ctypes
import datetime
import logging
import multiprocessing as mp
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from tandem.engine.config import EngineConfig
from tandem.engine.parallel import ExpertParallel, init_expert_parallel, init_tensor_parallel

logger = logging.getLogger(__name__)
START_GRACE_S = 10.0  # Workers._watch: how long rank 0's own start error may take to arrive


def ranks_on_node(config: EngineConfig) -> range:
    p = config.parallel
    if p.tensor_parallel_size % p.nnodes:
        raise ValueError(f"--tensor-parallel-size {p.tensor_parallel_size} must be a multiple of --nnodes {p.nnodes}")
    per_node = p.tensor_parallel_size // p.nnodes
    return range(p.node_rank * per_node, (p.node_rank + 1) * per_node)


def _on_cpu(config: EngineConfig) -> bool:
    return config.model.device == "cpu" or (config.model.device == "auto" and not torch.cuda.is_available())


def local_device(config: EngineConfig, rank: int) -> str:
    """The device of tensor-parallel rank `rank`: GPUs in order on each node, from the one
    --device cuda:N names (0 by default; several instances share a node that way, e.g. disagg)."""
    if _on_cpu(config):
        return "cpu"
    dev = config.model.device
    first = int(dev.split(":", 1)[1]) if dev.startswith("cuda:") else 0
    return f"cuda:{first + rank - ranks_on_node(config).start}"


def max_tokens_per_step(config: EngineConfig) -> int:
    return max(config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs)


def _join_world(config: EngineConfig, device: str, world_size: int, rank: int) -> dist.ProcessGroup:
    """init_process_group (NCCL on GPUs, gloo on CPU); returns a gloo group for host-side traffic."""
    p = config.parallel
    backend = "gloo" if device == "cpu" else "nccl"
    if device != "cpu":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://{p.master_addr}:{p.master_port}",
                            world_size=world_size, rank=rank, timeout=datetime.timedelta(minutes=10))
    return dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD


def init_distributed(config: EngineConfig, rank: int) -> dist.ProcessGroup:
    """Join the tensor-parallel world; returns the gloo group that carries step inputs. With
    --enable-expert-parallel the experts are sharded over the TP ranks (which hold the same
    tokens): each computes its own experts' share and the TP all-reduce sums them."""
    p = config.parallel
    group = _join_world(config, local_device(config, rank), p.tensor_parallel_size, rank)
    init_tensor_parallel(dist.group.WORLD)
    if p.enable_expert_parallel:
        init_expert_parallel(ExpertParallel(dist.group.WORLD, "local", p.expert_placement_strategy,
                                            max_tokens_per_step(config), uniform_tokens=True))
    return group


def data_parallel_device(config: EngineConfig, dp_rank: int) -> str:
    return "cpu" if _on_cpu(config) else f"cuda:{dp_rank}"


def init_data_parallel(config: EngineConfig, dp_rank: int) -> dist.ProcessGroup:
    """Join the data-parallel world for expert parallelism over the DP ranks; returns the gloo
    group on which the ranks agree, step by step, on what to run (see EngineCore.step)."""
    p = config.parallel
    group = _join_world(config, data_parallel_device(config, dp_rank), p.data_parallel_size, dp_rank)
    backend = p.all2all_backend
    if backend == "none":
        from tandem.kernels.ep.mori import mori_available
        backend = "mori" if mori_available() else "naive"
    logger.info("expert parallel over %d DP ranks: all2all backend %s, placement %s", p.data_parallel_size,
                backend, p.expert_placement_strategy)
    init_expert_parallel(ExpertParallel(dist.group.WORLD, backend, p.expert_placement_strategy,
                                        max_tokens_per_step(config), uniform_tokens=True, fp8=p.ep_dispatch_fp8))
    return group


_NCCL_TEARDOWN_S = 20.0


def leave_distributed() -> None:
    """Leave the process groups. NCCL groups are aborted, gloo ones destroyed. The caller must
    have released its CUDA graphs first (ModelRunner.close): aborting a communicator whose work
    is still captured in a live graph hung rank 0 on 2x H200. The abort runs on a thread with a
    deadline as a guard: past it, the process logs and carries on (it is exiting anyway)
    instead of hanging its parent."""
    init_tensor_parallel(None)
    init_expert_parallel(None)
    if not dist.is_initialized():
        return
    if dist.get_backend() != "nccl":
        dist.destroy_process_group()
        return
    torch.cuda.synchronize()
    done = threading.Event()

    def abort() -> None:
        dist.distributed_c10d._abort_process_group()
        done.set()

    threading.Thread(target=abort, daemon=True, name="nccl-abort").start()
    if not done.wait(_NCCL_TEARDOWN_S):
        logger.error("NCCL process group abort did not finish in %.0f s; leaving it behind", _NCCL_TEARDOWN_S)


def broadcast_step(group: dist.ProcessGroup, inputs) -> None:
    """Rank 0: hand one step's inputs (or None = stop) to the other ranks."""
    dist.broadcast_object_list([inputs], src=0, group=group)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _worker_main(config: EngineConfig, rank: int, max_model_len: int, stopped) -> None:
    _die_with_parent()
    from tandem.engine.hf_config import load_hf_config
    from tandem.engine.model_runner import ModelRunner

    hf_config = load_hf_config(config.model.model)
    group = init_distributed(config, rank)
    runner = ModelRunner(config, hf_config, max_model_len, device=local_device(config, rank))
    if config.kv_transfer.enabled:
        from tandem.connectors import build_connector
        _, runner.kv_worker = build_connector(config, runner, hf_config, group)
    from tandem.engine.model_runner import StepInputs
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        if box[0] is None:
            break
        if not isinstance(box[0], StepInputs):  # a step of KV transfers only
            runner.kv_worker.start(box[0])
            continue
        box[0].receive_ids(runner.device)
        runner.forward_logits(box[0])
    if runner.kv_worker is not None:
        runner.kv_worker.close()
    runner.close()
    leave_distributed()
    # Stay until rank 0 has left too: NCCL's abort can hang on a peer process that is gone.
    stopped.wait(30)


class Workers:
    """The non-zero ranks of this node, as child processes, with a liveness watchdog."""

    def __init__(self, config: EngineConfig, max_model_len: int, include_rank0: bool):
        ctx = mp.get_context("spawn")
        ranks = [r for r in ranks_on_node(config) if include_rank0 or r != 0]
        self.stopped = ctx.Event()  # set once rank 0 has left the process group
        self.procs = [ctx.Process(target=_worker_main, args=(config, r, max_model_len, self.stopped), daemon=True,
                                  name=f"tp-rank-{r}") for r in ranks]
        for proc in self.procs:
            proc.start()
        self._stopping = False
        self._armed = False  # (arm: the engine is up)
        self._aborted = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name="tp-watchdog").start()

    def _watch(self) -> None:
        while not self._stopping:
            for proc in self.procs:
                # Exit code 0 only follows rank 0's stop message; anything else is a crash.
                if proc.exitcode not in (None, 0) and not self._stopping:
                    # While the engine starts, a rank that died may have hit what rank 0 is about to hit
                    # (a checkpoint this TP size cannot split): rank 0's own error, raised to the caller
                    # after abort, wins over the exit for START_GRACE_S. An exit after that exception was
                    # handled took an offline LLM's host process (a test run, a notebook) down with it.
                    if not self._armed and (self._aborted.wait(START_GRACE_S) or self._stopping):
                        return
                    logger.error("tensor-parallel worker %s died (exit code %s); shutting the instance down",
                                 proc.name, proc.exitcode)
                    os._exit(1)
            time.sleep(0.5)

    def arm(self) -> None:
        """The engine is up: from now on a rank that dies takes the process down at once."""
        self._armed = True

    def abort(self) -> None:
        """The engine failed to start: the other ranks are killed (they may wait in a collective or
        have failed the same way) and the watchdog stops, so it never exits this process for them."""
        self._stopping = True
        self._aborted.set()
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(10)

    def join(self, timeout: float = 30.0) -> None:
        self._stopping = True
        for proc in self.procs:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()


def run_node_workers(config: EngineConfig) -> None:
    """On nodes other than 0 (--node-rank > 0): run this node's ranks until rank 0 stops them."""
    from tandem.engine.hf_config import load_hf_config
    from tandem.engine.loader import resolve_max_model_len

    workers = Workers(config, resolve_max_model_len(config, load_hf_config(config.model.model)), include_rank0=True)
    workers.arm()  # (no rank 0 here to report an error: a dead rank exits this node's process at once)
    for proc in workers.procs:
        proc.join()
    workers._stopping = True
