"""`vllm serve [MODEL]`: the OpenAI-compatible rollout server (docs/serving.md).

The engine runs in its own process (vllm/engine/core.py); this process runs the
HTTP server, tokenization and detokenization.
"""
from __future__ import annotations

import logging
import os

from vllm.entrypoints.cli.engine_args import HelpFormatter, add_engine_args, engine_kwargs
from vllm.entrypoints.openai.reasoning import REASONING_PARSERS
from vllm.entrypoints.openai.tool_parsers import DEFAULT_TOOL_CALL_PARSER, TOOL_CALL_PARSERS


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible rollout server", formatter_class=HelpFormatter)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="local HF checkpoint directory to serve (same as --model; default: the embedded model)")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind; the default accepts local connections only (use 0.0.0.0 to expose it)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in the 'model' field; the first is reported in responses "
                        "(default: the model path, or 'default' for the embedded model)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every /v1/ endpoint (default: the VLLM_API_KEY "
                        "environment variable, as upstream, which keeps the secret off the command line)")
    p.add_argument("--admin-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/pause, /v1/resume and /v1/weights/* updates "
                        "(without it those need the --api-key, or nothing: keep the server on 127.0.0.1 then)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="sequences (prompts x n) allowed to wait beyond --max-num-seqs; more get HTTP 429 "
                        "(default: no limit)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="largest number of logprobs (completions) / top_logprobs (chat) a request may ask for")
    p.add_argument("--generation-config", default="auto", choices=["auto", "vllm"],
                   help="auto: sampling fields a request leaves unset (temperature, top_p, top_k, min_p, "
                        "repetition_penalty; max_new_tokens as max_tokens) take the model's generation_config.json "
                        "values; vllm: SamplingParams defaults")
    p.add_argument("--tool-call-parser", default=DEFAULT_TOOL_CALL_PARSER, choices=TOOL_CALL_PARSERS,
                   help="the tool-call format tool_choice 'auto' reads from chat outputs (upstream's names): "
                        "hermes: <tool_call>{json}</tool_call> blocks (Hermes, Qwen); llama3_json: "
                        "{\"name\", \"parameters\"} objects separated by ';' (Llama 3.1/3.2); mistral: "
                        "[TOOL_CALLS] then a JSON array; pythonic: [f(a=1), g()] (Llama 3.2/4)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for upstream command lines: tool_choice 'auto' is always parsed here")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one, for every chat request and LLM-side "
                        "rendering (default: the tokenizer's)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="render chat requests that carry their own chat_template with it (refused otherwise)")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprob tokens as 'token_id:N' in every response, as a request's return_tokens_as_token_ids")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="chat responses carry the <think> part as message.reasoning (and reasoning_content), the "
                        "rest as content: qwen3 (reasoning when the output opens <think>), deepseek_r1 (the output "
                        "starts inside it); token ids and logprobs are unchanged")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="a request's final usage carries prompt_tokens_details.cached_tokens, the prompt tokens "
                        "served from the prefix cache (left out when none were), as upstream reports them")
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="every streamed response carries usage, on each chunk and in a last usage-only chunk, as "
                        "if it asked for stream_options include_usage and continuous_usage_stats")
    p.add_argument("--keep-alive-on-engine-death", action="store_true",
                   help="keep answering 503 after the engine process dies, instead of exiting with status 1 "
                        "(as upstream: a restart policy then starts a fresh server)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for upstream command lines: architectures are implemented here, no remote code runs")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="accepted for upstream command lines: requests are not logged one by one here")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="log level of the HTTP server (uvicorn)")


def run(args) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise SystemExit(f"vllm serve: the model is given twice ({args.model_tag!r} and --model {args.model!r})")
        args.model = args.model_tag
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        raise SystemExit("vllm serve: --max-queued-requests must be >= 0")
    if args.chat_template is not None:
        from vllm.entrypoints.chat_template import load_chat_template
        try:
            load_chat_template(args.chat_template)
        except (OSError, ValueError) as err:
            raise SystemExit(f"vllm serve: --chat-template: {err}")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise SystemExit(f"vllm serve needs fastapi and uvicorn: pip install 'vllm-parity[serve]' ({err})")
    from vllm.engine.core_client import EngineStartError
    from vllm.entrypoints.openai.api_server import run_server

    # the one environment variable read here: a secret, kept off the command line (and out of
    # `ps`) as upstream's deployments pass it; it chooses no behaviour but the key
    api_key = args.api_key if args.api_key is not None else (os.environ.get("VLLM_API_KEY") or None)
    try:
        return 1 if run_server(engine_kwargs(args), host=args.host, port=args.port, served_model_names=args.served_model_name,
                   max_logprobs=args.max_logprobs, generation_config=args.generation_config,
                   log_level=args.uvicorn_log_level, max_queued_requests=args.max_queued_requests,
                   api_key=api_key, admin_key=args.admin_key, tool_call_parser=args.tool_call_parser,
                   chat_template=args.chat_template, trust_request_chat_template=args.trust_request_chat_template,
                   return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                   reasoning_parser=args.reasoning_parser,
                   enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                   enable_force_include_usage=args.enable_force_include_usage,
                   keep_alive_on_engine_death=args.keep_alive_on_engine_death) == "engine_dead" else 0
    except EngineStartError as err:
        logging.getLogger(__name__).error("%s", err)
        return 1
