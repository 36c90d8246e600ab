"""Where the ipc transport opens a peer's exported KV cache (connectors/ipc.py open_peer_cache):
in this process's GPU context when that GPU has peer access to the cache's GPU (so the transfer's
kernels run here, never on the peer's GPU), else on the cache's own GPU; one GPU shared by both
instances opens it there. Reference: the device index handed to torch's rebuild_cuda_tensor,
which is where CUDA opens the IPC handle. No GPU needed: torch's two calls are stand-ins."""
import pickle

import pytest
import torch

from tandem.connectors import ipc


@pytest.mark.parametrize("owner,here,peer_access,opened_on", [
    (0, 1, True, 1),  # NVLink/XGMI peers: mapped into our context
    (0, 1, False, 0),  # no peer access: opened where it lives (a copy crosses between the GPUs)
    (1, 1, True, 1),  # both instances on one GPU
])
def test_handle_opens_in_this_gpus_context_when_it_can(monkeypatch, owner, here, peer_access, opened_on):
    args = ["cls", (2,), (1,), 0, "storage", torch.bfloat16, owner, b"handle", 64, 0, False, b"ref", 0, b"ev", True]
    seen = {}
    monkeypatch.setattr(ipc, "rebuild_cuda_tensor", lambda *a: seen.setdefault("args", a))
    monkeypatch.setattr(ipc.torch.cuda, "can_device_access_peer",
                        lambda a, b: seen.setdefault("asked", (a, b)) and peer_access)
    ipc.open_peer_cache(pickle.dumps(args), torch.device("cuda", here))
    assert seen["args"][ipc._DEVICE_ARG] == opened_on
    assert [a for i, a in enumerate(seen["args"]) if i != ipc._DEVICE_ARG] == \
        [a for i, a in enumerate(args) if i != ipc._DEVICE_ARG]  # the rest is the export, untouched
    assert seen.get("asked") == ((here, owner) if owner != here else None)  # can HERE reach the owner's memory
