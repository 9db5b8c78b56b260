"""The real lm-eval package (`lm-eval[api]`, in the `test` extra; skipped where it is not
installed) against `vllm serve`'s /v1/completions as its
`local-completions` model: a multiple-choice (loglikelihood: echo + logprobs) task and a
generate_until task, both local JSONL, everything offline (tiny Qwen3, CPU).

Each loglikelihood lm-eval reports is the sum of the prompt logprobs of the choice's
tokens: they must be the trainer's (Policy.token_logprobs) bits, summed the same way.
"""
from __future__ import annotations

import json
import os

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")   # lm-eval[api]: its API models need it
uvicorn = pytest.importorskip("uvicorn")

from vllm import LLM  # noqa: E402
from vllm.entrypoints.openai.api_server import build_app_from_llm  # noqa: E402
from vllm.testing.rollout_server import serve_in_thread  # noqa: E402
from vllm.training.policy import Policy  # noqa: E402

MC_DOCS = [
    {"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
    {"question": "Fire is", "choices": [" hot", " cold", " wet", " quiet"], "answer": 0},
]
GEN_DOCS = [{"question": "Say hi:", "answer": "hi"}, {"question": "Count: one two", "answer": "three"}]


def _write_tasks(root) -> str:
    (root / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (root / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN_DOCS))
    (root / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    (root / "tiny_gen.yaml").write_text(f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
metric_list:
  - metric: exact_match
""")
    return str(root)


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    # --enable-tokenizer-info-endpoint: lm-eval's remote tokenizer reads /tokenizer_info
    app = build_app_from_llm(LLM(tiny_qwen3, device="cpu", max_num_seqs=8), ["tiny"],
                             enable_tokenizer_info_endpoint=True)
    with serve_in_thread(app) as url:
        yield url


def test_lm_eval_remote_tokenizer(server, tiny_qwen3):
    """lm-eval's RemoteTokenizer (tokenizer_backend="remote"): its special tokens from
    /tokenizer_info, its ids from /tokenize, its chat template rendered client-side: the
    checkpoint tokenizer's."""
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    assert check_remote_tokenizer_support(f"{server}/v1/completions")
    remote = RemoteTokenizer(f"{server}/v1/completions")
    assert (remote.eos_token, remote.bos_token, remote.pad_token) == (tok.eos_token, tok.bos_token, tok.pad_token)
    assert remote.eos_token_id == tok.eos_token_id
    text = "The sky is blue. Two plus two is four."
    assert remote.encode(text) == tok.encode(text, add_special_tokens=False)
    assert remote.decode(remote.encode(text)) == text
    if tok.chat_template:
        chat = [{"role": "user", "content": "hi"}]
        assert remote.apply_chat_template(chat) == tok.apply_chat_template(chat, tokenize=False,
                                                                          add_generation_prompt=True)


@pytest.mark.parametrize("backend", ["huggingface", "remote"])
def test_lm_eval_local_completions(server, tiny_qwen3, tmp_path, monkeypatch, backend):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets_cache"))
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=_write_tasks(tmp_path))
    # remote: the tokenizer is the server's (/tokenizer_info, /tokenize, /detokenize)
    tokenizer = {"tokenizer": tiny_qwen3} if backend == "huggingface" else {}
    res = simple_evaluate(
        model="local-completions",
        model_args={"model": "tiny", "base_url": f"{server}/v1/completions", **tokenizer,
                    "tokenizer_backend": backend, "tokenized_requests": True, "num_concurrent": 1,
                    "max_retries": 1, "max_length": 256},
        tasks=["tiny_mc", "tiny_gen"], task_manager=tasks, log_samples=True, limit=None,
        bootstrap_iters=0)
    assert "acc,none" in res["results"]["tiny_mc"] and "exact_match,none" in res["results"]["tiny_gen"]
    gens = [s["resps"][0][0] for s in res["samples"]["tiny_gen"]]
    assert len(gens) == len(GEN_DOCS) and all(isinstance(g, str) for g in gens)

    # every choice's loglikelihood: the trainer's per-token bits, summed as lm-eval sums them
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    policy = Policy.from_pretrained(tiny_qwen3, device="cpu")
    checked = 0
    for sample in res["samples"]["tiny_mc"]:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            n_spaces = len(context) - len(context.rstrip())
            if n_spaces:
                context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
            whole = tok.encode(context + continuation, add_special_tokens=False)
            ctxlen = len(tok.encode(context, add_special_tokens=False))
            lps = policy.token_logprobs([whole], [ctxlen], temperature=0)[0].detach().tolist()
            assert resp[0][0] == sum(lps)          # float64 sums of the same float32 values: equal
            checked += 1
    assert checked == sum(len(d["choices"]) for d in MC_DOCS)
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
