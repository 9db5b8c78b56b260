"""RL data: jsonl/parquet records, prompt fields as strings or chat messages, the
tokenizer's chat template, and a data order that one integer restores."""
from __future__ import annotations

import json

import pytest

from vllm.rl.data import PromptRenderer, PromptSampler, load_examples, read_records, to_examples


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from vllm.tokenizer import load_tokenizer
    return load_tokenizer(tokenizer_dir)


def test_jsonl_and_json_list(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"q": "1+1=", "a": 2}\n\n{"q": [{"role": "user", "content": "hi"}], "a": "x"}\n')
    ex = load_examples(str(p), None, prompt_field="q", answer_field="a", size=0, seed=0, split="train")
    assert [(e.index, e.prompt, e.answer) for e in ex] == [(0, "1+1=", "2"), (1, [{"role": "user", "content": "hi"}],
                                                                                 "x")]
    assert ex[0].record == {"q": "1+1=", "a": 2}
    j = tmp_path / "d.json"
    j.write_text(json.dumps([{"prompt": "a", "answer": 1.5}]))
    assert read_records(str(j)) == [{"prompt": "a", "answer": 1.5}]
    # evaluation takes the first `size` records
    ev = load_examples(str(p), None, prompt_field="q", answer_field="a", size=1, seed=0, split="test")
    assert len(ev) == 1


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="parquet support is the optional 'train' extra (pyarrow)")
    import pyarrow.parquet as pq
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"problem": ["2+2=", "3+3="], "solution": ["4", "6"]}), str(path))
    ex = load_examples(str(path), None, prompt_field="problem", answer_field="solution", size=0, seed=0,
                       split="train")
    assert [(e.prompt, e.answer) for e in ex] == [("2+2=", "4"), ("3+3=", "6")]


def test_record_errors_name_the_record():
    with pytest.raises(ValueError, match=r"src: record 2 has no field 'answer'.*\['prompt', 'solution'\]"):
        to_examples([{"prompt": "a", "answer": "1"}, {"prompt": "b", "solution": "2"}], "prompt", "answer", "src")
    with pytest.raises(ValueError, match="chat messages are empty"):
        to_examples([{"prompt": [], "answer": "1"}], "prompt", "answer", "src")
    with pytest.raises(ValueError, match="non-empty string"):
        to_examples([{"prompt": "", "answer": "1"}], "prompt", "answer", "src")
    with pytest.raises(ValueError, match="string or a number"):
        to_examples([{"prompt": "a", "answer": True}], "prompt", "answer", "src")


def test_chat_template_rendering(tokenizer):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    expected = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    auto = PromptRenderer(tokenizer, "auto")
    assert auto(msgs) == expected
    assert auto("What is 2+2?") == tokenizer.encode("What is 2+2?", add_special_tokens=True)  # strings as they are
    assert PromptRenderer(tokenizer, "always")("What is 2+2?") == expected
    with_system = PromptRenderer(tokenizer, "auto", system_prompt="Be brief.")(msgs)
    sys_expected = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}] + msgs, tokenize=True,
                                                 add_generation_prompt=True)
    sys_expected = list(sys_expected["input_ids"] if hasattr(sys_expected, "keys") else sys_expected)
    assert with_system == sys_expected
    text = tokenizer.decode(with_system)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="chat template"):
        PromptRenderer(tokenizer, "never")(msgs)


def test_prompt_sampler_order_and_restore():
    a = PromptSampler(10, seed=3)
    first = a.take(25)  # 2.5 epochs
    assert sorted(first[:10]) == list(range(10)) and sorted(first[10:20]) == list(range(10))
    assert first[:10] != first[10:20]  # a new permutation each epoch
    b = PromptSampler(10, seed=3)
    b.take(7)
    c = PromptSampler(10, seed=3)
    c.load_state_dict(b.state_dict())
    assert c.take(18) == first[7:25]
    assert PromptSampler(10, seed=3, shuffle=False).take(12) == list(range(10)) + [0, 1]
    with pytest.raises(ValueError, match="differs from this run"):
        PromptSampler(11, seed=3).load_state_dict(b.state_dict())
