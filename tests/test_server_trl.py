"""`vllm serve` under the RL tools' own protocols, on CPU (tiny Qwen3, gloo):

* the installed TRL's `VLLMClient` (trl 1.16: upstream vLLM's routes) drives the server
  unchanged: generate / chat through /v1 with token-id logprobs, a weight update through
  /init_weight_transfer_engine + /start_weight_update + /update_weights +
  /finish_weight_update (its trainer side: vllm.distributed's adapter), generate again
  and see the new weights; refused updates are HTTP 400s that change nothing;
* TRL's own server protocol (`trl vllm-serve`'s trailing-slash routes), spoken the way
  its client speaks it: /generate/, /chat/, /init_communicator/, one
  /update_named_param/ + broadcast + barrier per tensor, committed atomically;
* upstream's Python names on `LLM`.
The server is the real app under uvicorn on a loopback port, engine loop on a thread.
"""
from __future__ import annotations

import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

requests = pytest.importorskip("requests")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
trl_client = pytest.importorskip("trl.generation.vllm_client")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.entrypoints.openai.api_server import build_app_from_llm  # noqa: E402
from vllm.testing.rollout_server import free_port, serve_in_thread  # noqa: E402

PROMPT = [5, 6, 7, 8, 9, 10]


def greedy(llm, prompt=PROMPT, n=6):
    return llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def refs(tiny_qwen3, new_weights):
    return {"old": greedy(LLM(tiny_qwen3, device="cpu")), "new": greedy(LLM(new_weights, device="cpu"))}


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    app = build_app_from_llm(LLM(tiny_qwen3, device="cpu", max_num_seqs=4), ["tiny"])
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture
def client(server, monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                      # "TRL supports vLLM 0.22-0.31": our version is 0.1.0
        c = trl_client.VLLMClient(base_url=server, group_port=free_port())
    yield c
    c.close_communicator()


def _join(client) -> None:
    """VLLMClient.init_communicator's steps: it refuses a CPU device before any of them
    (asserted below), so on CPU the test performs them; on a GPU the method itself runs."""
    init_info = {"master_address": trl_client.get_ip(), "master_port": client.group_port, "rank_offset": 1,
                 "world_size": client.get_world_size() + 1}
    with ThreadPoolExecutor(max_workers=1) as ex:
        fut = ex.submit(client._post, f"{client.base_url}/init_weight_transfer_engine", json={"init_info": init_info})
        client.communicator = trl_client.NCCLWeightTransferEngine.trainer_init(init_info)
        fut.result()


def _trl_greedy(client, prompts=(PROMPT,), **kw):
    return client.generate([list(p) for p in prompts], temperature=0.0, max_tokens=6,
                           generation_kwargs={"ignore_eos": True}, **kw)


def test_trl_client_generates_updates_weights_and_sees_them(client, server, refs, new_weights):
    from transformers import AutoModelForCausalLM

    out = _trl_greedy(client, logprobs=2)
    assert out["prompt_ids"] == [PROMPT] and out["completion_ids"] == [refs["old"]]
    for toks, ids, lps in zip(out["completion_ids"][0], out["logprob_token_ids"][0], out["logprobs"][0]):
        assert toks in ids and len(ids) <= 3 and lps == sorted(lps, reverse=True)
    chat = client.chat([[{"role": "user", "content": "hi"}]], temperature=0.0, max_tokens=4,
                       generation_kwargs={"ignore_eos": True})
    assert len(chat["completion_ids"][0]) == 4 and chat["prompt_ids"][0]
    assert [len(x) for x in chat["logprob_token_ids"][0]] == [1] * 4
    assert client.get_server_info()["weight_transfer_config"] == {"backend": "gloo"}
    with pytest.raises(NotImplementedError, match="CUDA"):
        client.init_communicator(device="cpu")
    _join(client)

    model = AutoModelForCausalLM.from_pretrained(new_weights)
    client.update_model_params(model)                         # start, update_weights + broadcast, finish
    client.reset_prefix_cache()
    assert _trl_greedy(client)["completion_ids"] == [refs["new"]]
    version = requests.get(f"{server}/v1/weights/version").json()["weight_version"]

    # refused updates: a 400 naming the problem, the weights and the session unchanged
    name, param = next(iter(model.named_parameters()))
    with pytest.raises(Exception, match=r"400.*non-finite"):
        with client.weight_update():
            client.update_named_param(name, torch.full_like(param.data, float("nan")))
    with pytest.raises(Exception, match=r"400.*unknown weight"):
        client.update_named_param("model.layers.99.mlp.up_proj.weight", torch.zeros(2, 2))
    assert requests.get(f"{server}/is_paused").json() == {"is_paused": False}
    assert requests.get(f"{server}/v1/weights/version").json()["weight_version"] == version
    assert _trl_greedy(client)["completion_ids"] == [refs["new"]]
    client.update_named_params([(name, "float32", list(param.shape))], iter([(name, param.data)]))
    assert requests.get(f"{server}/v1/weights/version").json()["weight_version"] == version + 1


def test_upstream_four_phase_routes_labels_and_bad_bodies(client, server, refs, tiny_qwen3):
    from vllm.model_loader.loader import checkpoint_files, iterate_weights

    _join(client)
    named = list(iterate_weights(checkpoint_files(tiny_qwen3)))
    client._post(f"{server}/start_weight_update", json={"is_checkpoint_format": True})
    assert requests.get(f"{server}/is_paused").json() == {"is_paused": True}
    half = len(named) // 2
    for part in (named[:half], named[half:]):                # two update_weights calls, one version
        _update(client, part)
    fin = requests.post(f"{server}/finish_weight_update", json={"weight_version": "step-7"}).json()
    assert fin["label"] == "step-7" and requests.get(f"{server}/weight_info").json() == {"weight_version": "step-7"}
    assert requests.get(f"{server}/is_paused").json() == {"is_paused": False}
    assert _trl_greedy(client)["completion_ids"] == [refs["old"]]
    assert requests.post(f"{server}/update_weight_version", json={"new_version": "v-x"}).json() == \
        {"success": True, "new_version": "v-x"}
    bad = {
        "/update_weights": {"update_info": {"names": ["a"], "dtype_names": [], "shapes": []}},
        "/init_weight_transfer_engine": {"init_info": {"master_address": "127.0.0.1", "master_port": 1,
                                                        "rank_offset": 1, "world_size": 3}},
        "/finish_weight_update": {},
        "/start_weight_update": {"is_checkpoint_format": False},
        "/update_weight_version": {},
    }
    for path, body in bad.items():
        r = requests.post(server + path, json=body)
        assert r.status_code == 400 and r.json()["error"]["message"], (path, r.text)
    assert requests.get(f"{server}/weight_info").json() == {"weight_version": "v-x"}
    # a pause asked for while an update is open stands after it
    client._post(f"{server}/start_weight_update", json={"is_checkpoint_format": True})
    assert requests.post(f"{server}/pause", params={"mode": "keep"}).json()["status"] == "paused"
    requests.post(f"{server}/finish_weight_update", json={"weight_version": "v-y"})
    assert requests.get(f"{server}/is_paused").json() == {"is_paused": True}
    assert requests.post(f"{server}/resume").json()["status"] == "resumed"
    # a started update whose update_weights body is no manifest ends: the engine does not stay paused
    client._post(f"{server}/start_weight_update", json={"is_checkpoint_format": True})
    r = requests.post(f"{server}/update_weights", json={"update_info": {"names": ["a"], "dtype_names": []}})
    assert r.status_code == 400 and requests.get(f"{server}/is_paused").json() == {"is_paused": False}
    assert requests.get(f"{server}/weight_info").json() == {"weight_version": "v-y"}
    assert requests.post(f"{server}/pause", params={"mode": "keep"}).json()["status"] == "paused"
    assert requests.post(f"{server}/resume").json()["status"] == "resumed"
    r = requests.post(f"{server}/v1/completions", json={"prompt": [[5, 6, 7]], "max_tokens": 1, "prompt_logprobs": -1})
    assert r.status_code == 400 and "prompt_logprobs" in r.json()["error"]["message"]


def _update(client, named):
    """One /update_weights call with its broadcast (VLLMClient.update_named_params inside a session)."""
    client._updating_weights = True
    try:
        client.update_named_params([(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in named],
                                   iter(named))
    finally:
        client._updating_weights = False


def test_trl_server_protocol_per_tensor_updates(server, refs, new_weights, tiny_qwen3):
    """TRL's own routes, as its `trl vllm-serve` client calls them (with the names that
    client imports from vllm.distributed)."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup
    from vllm.model_loader.loader import checkpoint_files, iterate_weights

    s = requests.Session()
    assert s.get(f"{server}/health/").json() == {"status": "ok"}
    world = s.get(f"{server}/get_world_size/").json()["world_size"] + 1
    gen = s.post(f"{server}/generate/", json={"prompts": [PROMPT, PROMPT], "n": 2, "temperature": 0.0,
                                             "max_tokens": 6, "logprobs": 1, "generation_kwargs": {"ignore_eos": True}})
    body = gen.json()
    assert body["prompt_ids"] == [PROMPT, PROMPT] and len(body["completion_ids"]) == 4
    assert len(body["logprobs"][0]) == 6 and all(len(x) <= 2 for x in body["logprob_token_ids"][0])
    assert s.post(f"{server}/chat/", json={"messages": [[{"role": "user", "content": "hi"}]], "max_tokens": 3,
                                           "generation_kwargs": {"ignore_eos": True}}).json()["completion_ids"][0]
    text = s.post(f"{server}/generate/", json={"prompts": ["Hello"], "max_tokens": 2, "logprobs": None}).json()
    assert len(text["completion_ids"][0]) <= 2 and text["logprobs"] is None

    port = free_port()
    assert s.post(f"{server}/init_communicator/", json={"host": "127.0.0.1", "port": port, "world_size": world,
                                                        "client_device_uuid": "42"}).status_code == 200
    time.sleep(0.1)
    comm = PyNcclCommunicator(StatelessProcessGroup.create("127.0.0.1", port, world - 1, world), device="cpu")

    def push(named):
        for name, t in named:
            r = s.post(f"{server}/update_named_param/", json={"name": name, "dtype": str(t.dtype), "shape": list(t.shape)})
            assert r.status_code == 200, r.text
            comm.broadcast(t, src=comm.rank)
            comm.group.barrier()

    version = requests.get(f"{server}/v1/weights/version").json()["weight_version"]
    push(list(iterate_weights(checkpoint_files(new_weights))))
    assert s.post(f"{server}/reset_prefix_cache/").status_code == 200      # commits the staged tensors at once
    assert requests.get(f"{server}/v1/weights/version").json()["weight_version"] == version + 1
    greedy_body = {"prompts": [PROMPT], "temperature": 0.0, "max_tokens": 6, "generation_kwargs": {"ignore_eos": True}}
    assert s.post(f"{server}/generate/", json=greedy_body).json()["completion_ids"] == [refs["new"]]

    # refused before any byte moves: 400, nothing staged
    for bad in ({"name": "model.nope.weight", "dtype": "torch.float32", "shape": [2]},
                {"name": "lm_head.weight", "dtype": "torch.float32", "shape": [3, 3]},
                {"name": "lm_head.weight", "dtype": "torch.nofloat", "shape": [3]}):
        r = s.post(f"{server}/update_named_param/", json=bad)
        assert r.status_code == 400 and r.json()["error"]["message"], r.text
    for path, b in (("/generate/", {"prompts": [PROMPT], "generation_kwargs": {"nonsense": 1}}),
                    ("/generate/", {"prompts": [PROMPT], "generation_kwargs": {"n": "2"}}),
                    ("/generate/", {"prompts": [PROMPT], "generation_kwargs": {"n": None}}),
                    ("/generate/", {"prompts": [PROMPT], "generation_kwargs": {"logprobs": "3"}}),
                    ("/generate/", {"prompts": [PROMPT], "generation_kwargs": {"prompt_logprobs": "3"}}),
                    ("/generate/", {"prompts": [PROMPT], "images": [["x"]]}),
                    ("/generate/", {"prompts": [[10 ** 6]]}),
                    ("/chat/", {"messages": []})):
        r = s.post(server + path, json=b)
        assert r.status_code == 400 and r.json()["error"]["message"], (path, r.text)
    r = s.post(f"{server}/get_sequence_logprobs/", json={"sequences": [[1, 2]], "prompt_lengths": [3]})
    assert r.status_code == 400 and "prompt_length" in r.json()["error"]["message"]

    # a non-finite tensor: accepted on announce, refused on arrival; the next call says so, old weights kept
    named = list(iterate_weights(checkpoint_files(tiny_qwen3)))
    push(named[1:3] + [(named[0][0], torch.full_like(named[0][1], float("nan")))])
    r = s.post(f"{server}/generate/", json=greedy_body)
    assert r.status_code == 400 and "non-finite" in r.json()["error"]["message"]
    assert s.post(f"{server}/generate/", json=greedy_body).json()["completion_ids"] == [refs["new"]]
    push(named)
    assert s.post(f"{server}/close_communicator/").status_code == 200      # commits, then closes
    assert s.post(f"{server}/generate/", json=greedy_body).json()["completion_ids"] == [refs["old"]]
    r = s.post(f"{server}/update_named_param/", json={"name": named[0][0], "dtype": "float32", "shape": [1]})
    assert r.status_code == 400 and "init_communicator" in r.json()["error"]["message"]


def test_llm_upstream_weight_transfer_names(tiny_qwen3, new_weights, refs):
    from vllm.model_loader.loader import checkpoint_files, iterate_weights

    llm = LLM(tiny_qwen3, device="cpu")
    named = list(iterate_weights(checkpoint_files(new_weights)))
    llm.start_weight_update()
    llm.update_weights(dict(named[:5]))
    with pytest.raises(ValueError, match="weight update is open"):
        greedy(llm)
    llm.update_weights(dict(named[5:]))
    assert llm.finish_weight_update(weight_version="step-1") == 1
    assert llm.get_weight_version() == "step-1" and greedy(llm) == refs["new"]
    llm.update_weight_version("renamed")
    assert llm.get_weight_version() == "renamed"
    llm.start_weight_update()
    with pytest.raises(ValueError, match="non-finite"):
        llm.update_weights({named[0][0]: torch.full_like(named[0][1], float("nan"))})
        llm.finish_weight_update()
    with pytest.raises(ValueError, match="aborted"):
        llm.finish_weight_update()
    assert llm.weight_version == 1 and greedy(llm) == refs["new"]
    with pytest.raises(ValueError, match="init_weight_transfer_engine"):
        llm.update_weights({"update_info": {"names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[1]]}})
