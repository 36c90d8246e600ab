"""Port layouts of PD instances and `--role disagg` trees (server/disagg_ports.py, server/roles.py).
Reference: the layout the --base-port / --kv-port help states (HTTP, KV handshake, KV data per TP
rank, torch.distributed rendezvous), written out by hand."""
import pytest

from tandem.connectors import data_port
from tandem.engine.config import config_from_args
from tandem.server.__main__ import build_parser
from tandem.server.disagg_ports import InstancePorts, check_ports_free, plan_ports
from tandem.server.roles import pd_config
from tests.ports import free_port_range


def _args(*argv: str):
    return build_parser().parse_args(list(argv))


def _plan(*argv: str, prefill_tp: int = 2, decode_tp: int = 1):
    return plan_ports(_args("--role", "disagg", *argv), {"prefill": prefill_tp, "decode": decode_tp})


def test_base_port_layout_tp2_prefills_then_tp1_decode():
    ports = _plan("--base-port", "20000", "--num-prefill", "2")
    assert ports.registry == 20000
    assert ports.prefill == [InstancePorts(20001, 20002, 20003, 2, 20005), InstancePorts(20006, 20007, 20008, 2, 20010)]
    assert ports.decode == [InstancePorts(20011, 20012, 20013, 1, None)]
    assert [p for p, _ in ports.prefill[0].fixed()] == [20001, 20002, 20003, 20004, 20005]
    assert ports.describe(8000) == ("router http=8000 registry=20000; prefill-0 http=20001 kv=20002 "
                                    "kv-data=20003-20004 master=20005; prefill-1 http=20006 kv=20007 "
                                    "kv-data=20008-20009 master=20010; decode-0 http=20011 kv=20012 kv-data=20013")


def test_port_lists_derive_the_rest_from_kv():
    ports = _plan("--prefill-ports", "8100", "--decode-ports", "8200:8300", "--registry-port", "9000", decode_tp=2)
    assert ports.registry == 9000
    assert ports.prefill == [InstancePorts(8100, 8101, 8102, 2, 8104)]
    assert ports.decode == [InstancePorts(8200, 8300, 8301, 2, 8303)]


def test_base_port_zero_picks_a_free_block():
    ports = _plan("--base-port", "0", "--num-decode", "2")
    every = [ports.registry] + [p for inst in ports.prefill + ports.decode for p, _ in inst.fixed()]
    assert every == list(range(ports.registry, ports.registry + 1 + 5 + 3 + 3))
    check_ports_free(ports, "127.0.0.1", free_port_range(1))


def test_overlapping_lists_are_refused():
    ports = _plan("--prefill-ports", "8100", "--decode-ports", "8103", "--registry-port", "9000")
    with pytest.raises(SystemExit, match="8103 is given twice"):
        check_ports_free(ports, "127.0.0.1", 8000)


@pytest.mark.parametrize("flags, want", [
    ((), (1001, 1002, 1004)),  # KV = --port + 1, data 1002-1003, rendezvous 1004
    (("--kv-port", "5000"), (5000, 5001, 5003)),
    (("--kv-port", "5000", "--master-port", "6000"), (5000, 5001, 6000)),
    (("--kv-transfer-config", '{"kv_connector_extra_config": {"handshake_port": 7000}}'), (7000, 7001, 7003)),
])
def test_standalone_instance_ports_follow_its_flags(flags, want):
    args = _args("--role", "prefill", "--port", "1000", "--tensor-parallel-size", "2", *flags)
    config = pd_config(args, config_from_args(args))
    extra = config.kv_transfer.kv_connector_extra_config
    assert (extra["handshake_port"], extra["data_port"], config.parallel.master_port) == want
    assert [data_port(extra, r) for r in range(2)] == [want[1], want[1] + 1]


def test_kv_port_zero_asks_for_free_kv_ports():
    args = _args("--role", "decode", "--port", "1000", "--kv-port", "0")
    extra = pd_config(args, config_from_args(args)).kv_transfer.kv_connector_extra_config
    assert extra["handshake_port"] > 0 and extra["data_port"] == 0 and data_port(extra, 0) == 0
