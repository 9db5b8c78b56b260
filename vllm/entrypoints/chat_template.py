"""Chat messages -> prompt token ids: one function for LLM.chat, the server's chat completions
and /tokenize and TRL's chat endpoint, so the offline API and the server render the same
prompt for the same messages."""
from __future__ import annotations

import copy
import json
import logging
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


logger = logging.getLogger(__name__)

# upstream's chat_template_content_format values: how a message's content reaches the template
CONTENT_FORMATS = ("auto", "string", "openai")


def detect_content_format(template) -> str:
    """upstream's "auto": "openai" when the template loops over a message's content (it reads
    lists of parts), else "string". A template that does not parse here (e.g. transformers'
    own tags) is taken as "string"."""
    if not isinstance(template, str):
        return "string"
    import jinja2
    import jinja2.nodes as nodes

    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateError:
        return "string"
    for loop in tree.find_all(nodes.For):
        it = loop.iter
        while isinstance(it, (nodes.Filter, nodes.Test)) and it.node is not None:
            it = it.node   # content | selectattr(...) and the like
        if isinstance(it, nodes.Getattr) and it.attr == "content":
            return "openai"
        if isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and it.arg.value == "content":
            return "openai"
    return "string"


def text_parts(content: list, where: str) -> list[dict]:
    """A content list's parts as {"type": "text", "text": ...}, as upstream's parser reads them: a
    bare string, "text" and "input_text" parts are text, a "refusal" part its refusal text; any
    other kind of part is a ValueError (text only here)."""
    parts = []
    for part in content:
        if isinstance(part, str):
            part = {"type": "text", "text": part}
        kind = part.get("type", "text") if isinstance(part, dict) else type(part).__name__
        key = "refusal" if kind == "refusal" else "text"
        if kind not in ("text", "input_text", "output_text", "refusal"):
            raise ValueError(f"{where}: only text content parts are supported, got {kind!r}")
        if not isinstance(part.get(key), str):
            raise ValueError(f"{where}: a {kind!r} content part needs a string {key!r} field")
        parts.append({"type": "text", "text": part[key]})
    return parts


def apply_content_format(messages: list[dict], content_format: str, template) -> list[dict]:
    """The messages with their content in `content_format` (upstream's rules, in a copy):
    "string" joins a list of text parts with newlines; "openai" makes a string content one text
    part; "auto" is what `detect_content_format(template)` says."""
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of {CONTENT_FORMATS}, got {content_format!r}")
    if content_format == "auto":
        content_format = detect_content_format(template)
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(m, dict) and content is None:
            # null or absent (OpenAI clients send null beside tool_calls): empty, as upstream
            # hands templates ("" / [] by format) rather than a missing attribute
            m = {**m, "content": "" if content_format == "string" else []}
        elif isinstance(content, list):
            parts = text_parts(content, f"messages[{i}].content")
            # a tool message's parts are joined in either format, as upstream does
            joined = content_format == "string" or m.get("role") == "tool"
            m = {**m, "content": "\n".join(p["text"] for p in parts) if joined else parts}
        elif isinstance(content, str) and content_format == "openai" and m.get("role") != "tool":
            m = {**m, "content": [{"type": "text", "text": content}]}
        out.append(m)
    return out


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as chat templates expect them, in a copy (upstream vLLM's rules): an
    assistant message's tool calls carry `arguments` as a JSON object. OpenAI clients send them
    as a JSON string, and templates following transformers' tool-use convention (Llama 3.1's,
    Qwen 2.5's `arguments | tojson`) would render a string JSON-in-JSON. A missing or empty
    string is {}; so is a string that is not JSON, or JSON that is not an object (with a
    warning): such arguments live in the conversation's history (a model's own malformed
    call in an agent's earlier turn), and refusing them would fail every later turn too. An
    empty tool_calls list is dropped (templates test for the key)."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            if not m["tool_calls"]:
                m = {k: v for k, v in m.items() if k != "tool_calls"}
                out.append(m)
                continue
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
                        logger.warning("messages[%d].tool_calls[%d] (%r): arguments are not valid JSON (%s); "
                                       "rendered as {} so the conversation can go on", i, j, fn.get("name"), err)
                        fn["arguments"] = {}
                    if not isinstance(fn["arguments"], dict):
                        logger.warning("messages[%d].tool_calls[%d] (%r): arguments are JSON but not an object; "
                                       "rendered as {}", i, j, fn.get("name"))
                        fn["arguments"] = {}
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
    kwargs = dict(template_kwargs or {})
    # chat_template_kwargs may set the rendering arguments themselves, and win over the named
    # ones, as upstream merges them (its kwargs dict is updated with chat_template_kwargs)
    add_generation_prompt = bool(kwargs.pop("add_generation_prompt", add_generation_prompt))
    continue_final_message = bool(kwargs.pop("continue_final_message", continue_final_message))
    if kwargs.get("chat_template") is not None:
        chat_template = kwargs.pop("chat_template")
    kwargs.pop("chat_template", None)
    # the rendering is tokenized here, as upstream renders to text and tokenizes after:
    # transformers' tokenization arguments given as template variables would otherwise cut,
    # pad or reshape the prompt ids
    for key in ("tokenize", "truncation", "max_length", "padding", "return_tensors", "return_dict",
                "return_assistant_tokens_mask", "tokenizer_kwargs", "add_special_tokens"):
        kwargs.pop(key, None)
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template (give one with --chat-template)")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    messages = template_messages(messages)
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **kwargs)
    except Exception as err:  # jinja errors (raise_exception in templates, bad roles), bad kwargs
        raise ValueError(f"could not apply the chat template: {err}") from err
    # without special tokens added, what apply_chat_template(tokenize=True) returns
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
