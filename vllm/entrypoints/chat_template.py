"""Chat messages -> prompt token ids: one function for LLM.chat, the server's chat completions
and /tokenize and TRL's chat endpoint, so the offline API and the server render the same
prompt for the same messages."""
from __future__ import annotations

import copy
import json
import os


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template` / `LLM(chat_template=...)`: a file holding a Jinja template, or the
    template itself (upstream vLLM takes both). None: the tokenizer's own."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:  # neither a template nor a file: most likely a mistyped path
        raise ValueError(f"chat template {value!r} is neither a file nor a Jinja template")
    return value


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as chat templates expect them, in a copy: an assistant message's tool
    calls carry `arguments` as a JSON value. OpenAI clients send them as a JSON string, and
    templates following transformers' tool-use convention (Llama 3.1's, Qwen 2.5's
    `arguments | tojson`) would render a string JSON-in-JSON; upstream vLLM parses them the same
    way. A missing or empty string is {}; a string that is not JSON is a ValueError."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            m = {**m, "tool_calls": copy.deepcopy(m["tool_calls"])}
            for j, call in enumerate(m["tool_calls"]):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict):
                    continue
                args = fn.get("arguments")
                if args is None or args == "":
                    fn["arguments"] = {}
                elif isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args)
                    except json.JSONDecodeError as err:
                        raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: "
                                         f"{err}") from None
        out.append(m)
    return out


def chat_prompt_ids(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    template_kwargs: dict | None = None, add_special_tokens: bool = False) -> list[int]:
    """One conversation's prompt token ids. `chat_template`: a template text that replaces the
    tokenizer's (None: the tokenizer's own); `template_kwargs`: extra template variables
    (tools, enable_thinking, ...); `add_special_tokens`: the rendered text tokenized with the
    tokenizer's special tokens added (templates write their own: off by default). Every
    failure of the template is a ValueError."""
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template (give one with --chat-template)")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    kwargs = dict(template_kwargs or {})
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    messages = template_messages(messages)
    try:
        if add_special_tokens:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 **kwargs)
            return list(tokenizer.encode(text, add_special_tokens=True))
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                            **kwargs)
    except Exception as err:  # jinja errors (raise_exception in templates, bad roles), bad kwargs
        raise ValueError(f"could not apply the chat template: {err}") from err
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
