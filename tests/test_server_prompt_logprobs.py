"""Prompt logprobs over HTTP (tiny Qwen3, CPU): /v1/completions `prompt_logprobs` and `echo`
(with `max_tokens=0` for scoring), chat `prompt_logprobs`, and TRL's sequence scoring both
ways TRL asks for it: the installed trl's `VLLMClient.get_sequence_logprobs` (upstream's
/v1/completions + prompt_logprobs) and `trl vllm-serve`'s POST /get_sequence_logprobs/.
Every logprob is compared with the trainer's (Policy.token_logprobs) as float32 bits.
"""
from __future__ import annotations

import base64
import warnings

import numpy as np
import pytest
import torch

requests = pytest.importorskip("requests")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from vllm import LLM  # noqa: E402
from vllm.entrypoints.openai.api_server import build_app_from_llm  # noqa: E402
from vllm.testing.rollout_server import free_port, serve_in_thread  # noqa: E402
from vllm.training.policy import Policy  # noqa: E402

SEQS = [list(range(5, 25)), list(range(40, 52)), [7, 8, 9, 10, 11, 12, 13]]


def bits(values) -> list[int]:
    return torch.tensor(values, dtype=torch.float32).view(torch.int32).tolist()


@pytest.fixture(scope="module")
def policy(tiny_qwen3):
    return Policy.from_pretrained(tiny_qwen3, device="cpu")


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    # --max-logprobs -1, as `trl vllm-serve` starts upstream's server (TRL asks for 100)
    app = build_app_from_llm(LLM(tiny_qwen3, device="cpu", max_num_seqs=4, max_num_batched_tokens=16), ["tiny"],
                             max_logprobs=-1)
    with serve_in_thread(app) as url:
        yield url


def trainer_bits(policy, seqs, prompt_lens, temperature):
    return [bits(t.detach().tolist()) for t in policy.token_logprobs(seqs, prompt_lens, temperature=temperature)]


def test_completions_prompt_logprobs(server, policy):
    r = requests.post(f"{server}/v1/completions", json={"prompt": SEQS, "max_tokens": 2, "temperature": 0.7,
                                                        "prompt_logprobs": 3, "seed": 1})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    ref = trainer_bits(policy, SEQS, [1] * len(SEQS), 0.7)
    for seq, choice, want in zip(SEQS, choices, ref):
        pl = choice["prompt_logprobs"]
        assert len(pl) == len(seq) and pl[0] is None
        assert bits([pl[i][str(seq[i])]["logprob"] for i in range(1, len(seq))]) == want
        for entry in pl[1:]:
            assert sorted(v["rank"] for t, v in entry.items())[:3] == [1, 2, 3]
            assert all(v["decoded_token"] is not None for v in entry.values())


def test_echo_scores_the_prompt(server, policy, tiny_qwen3):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    text = "the quick brown fox jumps over the lazy dog"
    ids = tok.encode(text)
    ref = trainer_bits(policy, [ids], [1], 1.0)[0]
    # loglikelihood scoring: max_tokens=0 + echo -> the prompt only
    r = requests.post(f"{server}/v1/completions", json={"prompt": text, "max_tokens": 0, "echo": True,
                                                        "logprobs": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    c = body["choices"][0]
    assert c["text"] == text and c["token_ids"] == [] and body["usage"]["completion_tokens"] == 0
    lp = c["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert bits(lp["token_logprobs"][1:]) == ref
    assert all(len(t) in (1, 2) for t in lp["top_logprobs"][1:])
    assert lp["text_offset"] == sorted(lp["text_offset"])
    # lm-eval's shape: max_tokens=1, echo, logprobs=1: the prompt's logprobs, then the sampled token's
    r = requests.post(f"{server}/v1/completions", json={"prompt": [ids], "max_tokens": 1, "echo": True,
                                                        "logprobs": 1, "temperature": 0})
    c = r.json()["choices"][0]
    assert len(c["logprobs"]["token_logprobs"]) == len(ids) + 1 and len(c["token_ids"]) == 1
    assert bits(c["logprobs"]["token_logprobs"][1:-1]) == ref
    assert c["text"].startswith(tok.decode(ids))
    # echo without logprobs: the text only
    r = requests.post(f"{server}/v1/completions", json={"prompt": text, "max_tokens": 2, "echo": True})
    assert r.json()["choices"][0]["text"].startswith(text) and r.json()["choices"][0]["logprobs"] is None


def test_chat_prompt_logprobs(server, policy):
    r = requests.post(f"{server}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi there"}],
                                                             "max_tokens": 1, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    ids, pl = body["prompt_token_ids"], body["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    assert bits([pl[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]) == trainer_bits(policy, [ids], [1], 1.0)[0]


def test_bad_requests_are_400_and_lose_nothing(server):
    bad = [{"prompt": "x", "max_tokens": 0},                               # max_tokens=0 needs echo
           {"prompt": "x", "prompt_logprobs": -2},                         # -1 (every token) or >= 0
           {"prompt": "x", "prompt_logprobs": 10 ** 9},                    # beyond the vocabulary
           {"prompt": "x", "logprobs": -1},                                # upstream's completions: >= 0 only
           {"prompt": "x", "logit_bias": {"512": 1.0}},                    # out of the vocabulary
           {"prompt": "x", "logit_bias": {"five": 1.0}},
           {"prompt": "x", "echo": True, "stream": True, "prompt_logprobs": -2}]
    for body in bad:
        r = requests.post(f"{server}/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["message"], (body, r.text)
    r = requests.post(f"{server}/v1/completions", json={"prompt": SEQS[0], "max_tokens": 1, "prompt_logprobs": 0})
    assert r.status_code == 200 and len(r.json()["choices"][0]["prompt_logprobs"]) == len(SEQS[0])


def test_minus_one_asks_for_every_token(server, policy):
    """Completions and chat prompt_logprobs: -1 and chat top_logprobs: -1 (upstream's), on a
    server started with --max-logprobs -1: every token of the vocabulary (512) per position,
    the prompt tokens' values still the trainer's bits."""
    seq = SEQS[2]
    r = requests.post(f"{server}/v1/completions", json={"prompt": seq, "max_tokens": 1, "prompt_logprobs": -1})
    assert r.status_code == 200, r.text
    pl = r.json()["choices"][0]["prompt_logprobs"]
    assert all(len(entry) == 512 for entry in pl[1:])
    assert bits([pl[i][str(seq[i])]["logprob"] for i in range(1, len(seq))]) == trainer_bits(policy, [seq], [1], 1.0)[0]
    r = requests.post(f"{server}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 2, "logprobs": True, "top_logprobs": -1,
                                                             "prompt_logprobs": -1})
    assert r.status_code == 200, r.text
    body = r.json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and all(len(t["top_logprobs"]) == 512 for t in content)
    tops = [t["logprob"] for t in content[0]["top_logprobs"]]
    assert tops == sorted(tops, reverse=True) and content[0]["logprob"] in tops
    assert all(len(entry) == 512 for entry in body["prompt_logprobs"][1:])
    r = requests.post(f"{server}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "top_logprobs": -1})
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"]


def test_logit_bias(server):
    """OpenAI's logit_bias: token id strings -> bias, clamped to [-100, 100]; +100 forces a token."""
    r = requests.post(f"{server}/v1/completions", json={"prompt": SEQS[2], "max_tokens": 4, "temperature": 1.0,
                                                        "seed": 3, "logit_bias": {"123": 1000}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == [123] * 4
    chat = requests.post(f"{server}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                "max_tokens": 3, "temperature": 0,
                                                                "logit_bias": {"77": 100, "12": -5.5}})
    assert chat.status_code == 200 and chat.json()["choices"][0]["token_ids"] == [77] * 3


def test_trl_client_get_sequence_logprobs(server, policy):
    trl_client = pytest.importorskip("trl.generation.vllm_client")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        client = trl_client.VLLMClient(base_url=server, group_port=free_port())
    prompt_lens = [5, 3, 6]
    out = client.get_sequence_logprobs(SEQS, prompt_lens, temperature=0.8, chunk_size=2)
    ref = trainer_bits(policy, SEQS, prompt_lens, 0.8)
    for seq, pl, actual, ids, top, top_ids, want in zip(SEQS, prompt_lens, out["actual_logprobs"],
                                                         out["actual_token_ids"], out["logprobs"],
                                                         out["logprob_token_ids"], ref):
        assert [i[0] for i in ids] == seq[pl:]
        assert bits([a[0] for a in actual]) == want
        assert all(len(row) == 100 and row == sorted(row, reverse=True) for row in top)
        assert all(len(row) == 100 for row in top_ids)


def test_trl_server_get_sequence_logprobs(server, policy):
    prompt_lens = [0, 4, 6]
    body = {"sequences": SEQS, "prompt_lengths": prompt_lens, "top_logprobs": 4, "temperature": 0.9}
    r = requests.post(f"{server}/get_sequence_logprobs/", json=body)
    assert r.status_code == 200, r.text
    js = r.json()
    ref = trainer_bits(policy, SEQS, [1, 4, 6], 0.9)
    for b, (seq, pl) in enumerate(zip(SEQS, prompt_lens)):
        positions = list(zip(js["logprobs"][b], js["logprob_token_ids"][b]))
        assert len(positions) == len(seq) - pl
        if pl == 0:
            assert positions[0] == ([], [])      # the first token has no logprob
            positions = positions[1:]
        own = []
        for t, (values, ids) in enumerate(positions):
            assert 4 <= len(ids) <= 5 and values == sorted(values, reverse=True)
            own.append(values[ids.index(seq[len(seq) - len(positions) + t])])
        assert bits(own) == ref[b]
    # binary: TRL's base64 float32 arrays
    r = requests.post(f"{server}/get_sequence_logprobs/", json={**body, "response_format": "binary"})
    assert r.status_code == 200, r.text
    bj = r.json()
    shape = bj["shape"]
    assert shape == [3, max(len(s) - p for s, p in zip(SEQS, prompt_lens)), 4]
    actual = np.frombuffer(base64.b64decode(bj["actual_logprobs_b64"]), dtype="<f4").reshape(shape[:2] + [1])
    top = np.frombuffer(base64.b64decode(bj["logprobs_b64"]), dtype="<f4").reshape(shape)
    for b, (seq, pl) in enumerate(zip(SEQS, prompt_lens)):
        n = len(seq) - pl
        start = 1 if pl == 0 else 0
        got = actual[b, start:n, 0]
        assert got.view(np.int32).tolist() == ref[b]
        assert (np.diff(top[b, start:n], axis=-1) <= 0).all()
    # bad input: 400, nothing else affected
    for bad in ({"sequences": SEQS, "prompt_lengths": [1]}, {"sequences": [[1, 2]], "prompt_lengths": [3]},
                {"sequences": [], "prompt_lengths": []}, {"sequences": [[1, 2]], "prompt_lengths": [1],
                                                          "response_format": "xml"}):
        r = requests.post(f"{server}/get_sequence_logprobs/", json=bad)
        assert r.status_code in (400, 422) and r.text, (bad, r.text)


def test_unscored_prompt_positions_fail_with_409():
    """A request aborted before its prompt was scored (its missing positions are None) fails
    with a clear 409 instead of a partial or broken answer; a complete one passes."""
    import json
    from types import SimpleNamespace

    from vllm.entrypoints.openai.errors import PromptNotScoredError, exception_response, require_scored_prompts

    done = SimpleNamespace(request_id="a", prompt_logprobs=[None, {5: 0.0}, {6: 0.0}], outputs=[])
    cut = SimpleNamespace(request_id="b", prompt_logprobs=[None, {5: 0.0}, None],
                          outputs=[SimpleNamespace(finish_reason="abort")])
    require_scored_prompts([done])
    require_scored_prompts([SimpleNamespace(request_id="c", prompt_logprobs=None, prompt_token_ids=[1, 2], outputs=[])],
                           asked=False)
    with pytest.raises(PromptNotScoredError, match="1 of its 2 prompt positions") as err:
        require_scored_prompts([done, cut])
    resp = exception_response(err.value)
    assert resp.status_code == 409 and "send it again" in json.loads(resp.body)["error"]["message"]


def test_prompt_logprobs_missing_altogether_fail_when_asked():
    """Aborted before its first step, a request that asked for prompt logprobs has none: a
    409 too; one that did not ask passes."""
    from types import SimpleNamespace

    from vllm.entrypoints.openai.errors import PromptNotScoredError, require_scored_prompts

    out = SimpleNamespace(request_id="a", prompt_logprobs=None, prompt_token_ids=[1, 2, 3], outputs=[])
    require_scored_prompts([out], asked=False)
    with pytest.raises(PromptNotScoredError, match="before its prompt was scored"):
        require_scored_prompts([out], asked=True)
