"""PD with tensor (and expert) parallelism, prefill and decode TP sizes differing, end to end
through the router with real `server` processes (CPU, gloo, tcp transport).
Reference: the greedy text of a collocated TP=1 server on the same model.

One tree per model serves every case: P(TP2) with D(TP2) and D(TP1) behind a round-robin router
(requests sent one by one alternate (P2, D2), (P2, D1)); then, on the dense model, P(TP2) and D(TP1)
leave and P(TP1) joins for (P1, D2). Each layout runs in read and write mode (the router restarts on
the same registry port with the other --kv-mode; the instances serve both). The seeds' kind of model
runs too: the MoE as a block-scaled FP8 checkpoint with an fp8 KV cache, whose blocks move between
the TP layouts as fp8."""
import json
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import ENGINE_ARGS, Proc, collocated_answers, wait_all_blocks_free
from tests.ports import free_port_range
from tests.server.conftest import stop_all

pytestmark = pytest.mark.slow

PROMPTS = [f"Question: Tom has {n} apples and buys {n + 3} more. How many now?\nAnswer:" for n in range(4)]


def generate(url: str) -> list[str]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    out = []
    for i, prompt in enumerate(PROMPTS):  # one by one: round robin pairs them predictably
        kw = dict(model="default", prompt=prompt, max_tokens=12, temperature=0)
        if i % 2:
            out.append("".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)))
        else:
            out.append(client.completions.create(**kw).choices[0].text)
    return out


@pytest.fixture(scope="module", params=["dense", "moe_ep", "moe_fp8_ep"])
def model(request, model_dir, tmp_path_factory):
    """(model folder, extra flags for TP > 1 instances, flags for every server, the collocated TP=1
    reference texts)."""
    flags = []
    if request.param == "dense":
        path, tp_flags = model_dir, []
    else:
        path, tp_flags = _moe_model(model_dir, tmp_path_factory.mktemp("moe")), ["--enable-expert-parallel"]
    if request.param == "moe_fp8_ep":
        from tests.engine.fp8_writer import write_fp8_checkpoint
        fp8 = tmp_path_factory.mktemp("moe_fp8") / "model"
        write_fp8_checkpoint(str(path), fp8, "hf_block")
        path, flags = fp8, ["--kv-cache-dtype", "fp8"]
    return path, tp_flags, flags, collocated_answers(path, tmp_path_factory.mktemp("colloc"), generate, tuple(flags))


def _moe_model(model_dir, out):
    import shutil

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    for f in model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    torch.manual_seed(0)
    tok = json.loads((model_dir / "config.json").read_text())
    cfg = Qwen3MoeConfig(vocab_size=tok["vocab_size"], hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
                         initializer_range=0.2, bos_token_id=tok["bos_token_id"], eos_token_id=tok["eos_token_id"],
                         tie_word_embeddings=False)
    Qwen3MoeForCausalLM(cfg).eval().save_pretrained(out)
    return out


class Tree:
    def __init__(self, path, tp_flags, log_dir, flags=()):
        self.path, self.tp_flags, self.log_dir, self.flags = path, tp_flags, log_dir, flags
        self.registry = free_port_range(1)  # kept across router restarts; the rest: each process's block
        self.router = None
        self.instances: dict[str, Proc] = {}

    def start(self, name: str, role: str, tp: int) -> None:
        kv = json.dumps({"kv_connector_extra_config": {"transfer_timeout_s": 8, "hold_timeout_s": 8,
                                                       "engine_id": name}})
        self.instances[name] = Proc(name, [
            "--role", role, "--model", str(self.path), "--served-model-name", "default", "--router-address",
            f"127.0.0.1:{self.registry}", "--kv-transfer-config", kv, *ENGINE_ARGS,
            "--tensor-parallel-size", str(tp), *(self.tp_flags if tp > 1 else []), *self.flags], self.log_dir)

    def stop(self, *names: str) -> None:
        stop_all([self.instances.pop(name) for name in names])

    def route(self, mode: str) -> str:
        if self.router is not None:
            self.router.stop()
        for p in self.instances.values():
            p.wait_healthy()
        self.router = Proc(f"router-{mode}", ["--role", "router", "--registry-port", str(self.registry), "--kv-mode",
                                              mode, "--instance-timeout", "3", "--request-timeout", "60"],
                           self.log_dir).wait_healthy(60)
        deadline = time.monotonic() + 30
        while len(httpx.get(f"{self.router.url}/instances").json().get("instances", [])) < len(self.instances):
            assert time.monotonic() < deadline, httpx.get(f"{self.router.url}/instances").text
            time.sleep(0.3)
        return self.router.url

    def close(self) -> None:
        stop_all([*self.instances.values(), *([self.router] if self.router else [])])


def test_pd_with_tp_matches_collocated(model, tmp_path):
    path, tp_flags, flags, expected = model
    tree = Tree(path, tp_flags, tmp_path, flags)
    try:
        tree.start("p-a", "prefill", 2)
        tree.start("d-a", "decode", 2)
        tree.start("d-b", "decode", 1)
        for mode in ("read", "write"):  # (P2, D2) and (P2, D1), alternating
            assert generate(tree.route(mode)) == expected, mode
            wait_all_blocks_free([p.url for p in tree.instances.values()])
        if tp_flags:  # MoE: EP changes the instances' experts, not their KV layout; (P1, D2)'s split is the dense one
            return
        tree.start("p-b", "prefill", 1)  # (starting while the two it replaces stop)
        tree.stop("p-a", "d-b")
        for mode in ("write", "read"):  # (P1, D2)
            assert generate(tree.route(mode)) == expected, mode
            wait_all_blocks_free([p.url for p in tree.instances.values()])
    finally:
        tree.close()
