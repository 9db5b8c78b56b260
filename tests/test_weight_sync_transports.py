"""Weight transports across processes, on CPU: shared-memory IPC buckets (the CUDA IPC
protocol's CPU twin) and a gloo broadcast group between a trainer (this process) and a
`vllm serve` subprocess, through the HTTP endpoints; contracts compared on both sides."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.weight_sync.client import WeightSyncClient

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADMIN = "admin-test"


def bits(model):
    return {n: p.detach().clone().view(torch.int32) for n, p in model.named_parameters()}


EXPORTER = r"""
import json, sys
from vllm.model_loader.loader import checkpoint_files, iterate_weights
from vllm.weight_sync.ipc import IpcExport
export = IpcExport(list(iterate_weights(checkpoint_files(sys.argv[1]))), bucket_bytes=96 << 10)
print(json.dumps(export.message()), flush=True)
sys.stdin.readline()          # the engine answered: the next version goes into the same buckets
export.refill(list(iterate_weights(checkpoint_files(sys.argv[2]))))
print(json.dumps(export.message()), flush=True)
sys.stdin.readline()          # the engine answered: the buckets may go
export.release()
print("released", flush=True)
"""


def test_shared_memory_buckets_across_processes(tiny_qwen3, new_weights):
    """Two versions through one export (the second refilled into the same buffers, same
    message), each equal to a fresh engine loaded from its checkpoint, bit for bit."""
    llm = LLM(tiny_qwen3, device="cpu")
    model = llm.llm_engine.executor.model
    proc = subprocess.Popen([sys.executable, "-c", EXPORTER, new_weights, tiny_qwen3], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": REPO})
    try:
        message = json.loads(proc.stdout.readline())
        assert len(message) > 2 and all(m["handle"]["kind"] == "shm" for m in message)
        assert llm.update_weights_from_ipc(message) == 1
        got, want = bits(model), bits(LLM(new_weights, device="cpu").llm_engine.executor.model)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
        proc.stdin.write("done\n")
        proc.stdin.flush()
        again = json.loads(proc.stdout.readline())
        assert again == message                                 # refilled in place: same handles
        assert llm.update_weights_from_ipc(again) == 2
        got, want = bits(model), bits(LLM(tiny_qwen3, device="cpu").llm_engine.executor.model)
        assert all(torch.equal(got[k], want[k]) for k in got)
        proc.stdin.write("done\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "released"
    finally:
        proc.wait(30)
    with pytest.raises(ValueError, match="does not exist"):   # released: a stale handle is a clear error
        llm.update_weights_from_ipc(message)
    assert llm.weight_version == 2


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    from vllm.testing.rollout_server import cpu_server
    with cpu_server(tiny_qwen3, "--admin-key", ADMIN, "--max-num-seqs", "8", env=dict(os.environ)) as srv:
        yield srv


def _greedy(url, prompt):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    r = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    return r


def test_gloo_group_update_through_http(server, tiny_qwen3, new_weights):
    from vllm.training import Policy

    prompt = [5, 6, 7, 8]
    policy = Policy.from_pretrained(new_weights, device="cpu")
    client = WeightSyncClient(server.url, admin_key=ADMIN)
    v0 = client.version()
    client.init_group(policy.execution_contract(), backend="gloo")
    version = client.push(policy.model.hf_state_dict(), bucket_bytes=128 << 10)
    assert version == v0 + 1 == client.version()
    want = LLM(new_weights, device="cpu").generate({"prompt_token_ids": prompt},
                                                  SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                                                  use_tqdm=False)[0].outputs[0].token_ids
    got = _greedy(server.url, prompt)
    assert got.choices[0].model_extra["token_ids"] == want
    assert got.model_extra["weight_version"] == version
    # a bad update (NaN in a middle bucket): refused, old weights keep serving, group still usable
    sd = policy.model.hf_state_dict()
    names = list(sd)
    bad = dict(sd)
    bad[names[len(names) // 2]] = torch.full_like(sd[names[len(names) // 2]], float("nan"))
    with pytest.raises(ValueError, match="non-finite"):
        client.push(bad, bucket_bytes=128 << 10)
    assert client.version() == version
    assert _greedy(server.url, prompt).choices[0].text == got.choices[0].text
    # the manifest is checked before any byte moves
    with pytest.raises(ValueError, match="unknown weight"):
        client.push({"model.layers.99.mlp.up_proj.weight": torch.zeros(3)})
    assert client.push(policy.model.hf_state_dict()) == version + 1
    client.close()


def test_contract_mismatch_names_fields(server, tiny_qwen3):
    from vllm.training import Policy

    client = WeightSyncClient(server.url, admin_key=ADMIN)
    fast = Policy.from_pretrained(tiny_qwen3, device="cpu", numerics="fast").execution_contract()
    with pytest.raises(ValueError, match=r"numerical differs in \[.*numerics"):
        client.init_group(fast, backend="gloo")
    # the server checks too (a client that skipped its own check)
    body = {"host": "127.0.0.1", "port": 1, "backend": "gloo", "contract": fast.to_dict()}
    with pytest.raises(ValueError, match=r"400 .*numerical differs in"):
        client.request("POST", "/v1/weights/init_group", body)
    with pytest.raises(ValueError, match="contract"):
        client.request("POST", "/v1/weights/init_group", {"host": "127.0.0.1", "port": 1, "backend": "gloo"})
    with pytest.raises(ValueError, match="401"):
        WeightSyncClient(server.url).request("POST", "/v1/weights/init_group", body)


def test_wrong_admin_key_fails_fast(server, tiny_qwen3):
    """A refused init_group (here a wrong admin key) is raised as soon as the server answers,
    not after the group's join timeout; the server still takes the right key afterwards."""
    import time

    from vllm.training import Policy

    contract = Policy.from_pretrained(tiny_qwen3, device="cpu").execution_contract()
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="401"):
        WeightSyncClient(server.url, admin_key="wrong").init_group(contract, backend="gloo", timeout_s=120)
    assert time.monotonic() - t0 < 30
    client = WeightSyncClient(server.url, admin_key=ADMIN)
    client.init_group(contract, backend="gloo")
    client.close()


@pytest.mark.parametrize("message,error", [
    ({"layout": {}}, "non-empty list"),
    ([], "non-empty list"),
    (["x"], "expected"),
    ([{"layout": {"entries": [["w", "bfloat16", [2], 0]]}, "handle": {"kind": "shm", "name": "x", "nbytes": 4}}],
     "malformed layout"),
    ([{"layout": {"entries": [], "nbytes": 0}, "handle": {"kind": "tcp"}}], "handle kind"),
    ([{"layout": {"entries": [], "nbytes": 0}, "handle": {"kind": "cuda", "args": []}}], "CUDA"),
])
def test_malformed_ipc_messages_are_value_errors(tiny_qwen3, message, error):
    llm = LLM(tiny_qwen3, device="cpu")
    with pytest.raises(ValueError, match=error):
        llm.update_weights_from_ipc(message)
    assert llm.weight_version == 0 and llm.generate({"prompt_token_ids": [5, 6]}, use_tqdm=False)
