"""`vllm serve [MODEL]`: the OpenAI-compatible rollout server (docs/serving.md).

The engine runs in its own process (vllm/engine/core.py); this process runs the
HTTP server, tokenization and detokenization.
"""
from __future__ import annotations

import argparse
import json
import logging
import os

from vllm.entrypoints.cli.engine_args import HelpFormatter, add_engine_args, engine_kwargs
from vllm.entrypoints.openai.reasoning import REASONING_PARSERS
from vllm.entrypoints.openai.tool_parsers import DEFAULT_TOOL_CALL_PARSER, TOOL_CALL_PARSERS


# the stats line's period, upstream's default (its VLLM_LOG_STATS_INTERVAL)
STATS_LOG_INTERVAL_S = 10.0

# upstream `vllm serve` engine flags that change nothing here at some values: accepted at those,
# checked by the offline LLM's own table (vllm.entrypoints.llm.UPSTREAM_NOOP_ARGS, keyed by the
# flag's name), and refused at any other naming the flag and why.
# flag -> (short aliases, type, metavar, help: the values taken and what they mean here)
UPSTREAM_NOOP_FLAGS = {
    "--swap-space": ((), float, "GIB", "accepted at any value: nothing is swapped to the CPU here (a preempted "
                     "request is recomputed, from the prefix cache where its blocks are still cached)"),
    "--distributed-executor-backend": ((), str, "{uni,mp,ray,external_launcher}",
                                       "accepted (upstream's names), all one executor here: the engine and its "
                                       "tensor-parallel ranks run in the engine process (docs/parallelism.md)"),
    "--tokenizer-mode": ((), str, "{auto,hf}", "auto or hf only: the checkpoint's Hugging Face tokenizer is the one "
                         "tokenizer here"),
    "--model-impl": ((), str, "{auto,vllm}", "auto or vllm only: every architecture runs this engine's own "
                     "implementation (no Transformers modeling code)"),
    "--data-parallel-size": (("-dp",), int, "1", "1 only: one engine per server; run a server per replica "
                             "behind a load balancer"),
    "--pipeline-parallel-size": (("-pp",), int, "1", "1 only: no pipeline parallelism here (--tensor-parallel-size "
                                 "shards the layers)"),
    "--revision": ((), str, "main", "main only: the model is a local directory, read as it is"),
    "--hf-overrides": ((), "json", "JSON", "{} only: config.json is read as it is, as the trainer reads it "
                       "(an override on one side only would break parity): edit the checkpoint's config.json"),
    "--compilation-config": (("-O",), "json", "JSON|LEVEL", "accepted at any level or JSON: nothing is compiled with "
                             "torch.compile here (this engine's own kernels), and its CUDA graphs are captured at "
                             "--cuda-graph-batch-sizes; no result depends on it"),
    "--max-seq-len-to-capture": ((), int, "N", "accepted at any value: graphs here capture decode steps of any "
                                 "sequence length"),
    "--cuda-graph-sizes": ((), "ints", "N", "accepted: upstream's capture sizes; this server captures at "
                           "--cuda-graph-batch-sizes"),
    "--disable-cascade-attn": ((), "flag", None, "accepted: there is no cascade attention here (one attention "
                               "kernel, batch invariant)"),
    "--limit-mm-per-prompt": ((), "json", "JSON", "accepted: text-only models here; a request with images or "
                              "audio is refused"),
    "--disable-mm-preprocessor-cache": ((), "flag", None, "accepted: text-only models, no multimodal preprocessor"),
    "--enable-expert-parallel": (("-ep",), "flag", None, "accepted: experts over the tensor-parallel group give "
                                 "tensor parallelism's bits here (docs/parallelism.md)"),
    "--task": ((), str, "{auto,generate}", "auto or generate only: generative (causal LM) models"),
    "--runner": ((), str, "{auto,generate}", "auto or generate only: generative (causal LM) models"),
    "--download-dir": ((), str, "DIR", "accepted: the model is a local directory, nothing is downloaded"),
    "--enable-server-load-tracking": ((), "flag", None, "accepted: GET /load always reports the sequences in "
                                      "flight here"),
    "--disable-frontend-multiprocessing": ((), "flag", None, "accepted: the engine core runs in its own process "
                                           "either way; no result depends on where"),
    "--disable-custom-all-reduce": ((), "flag", None, "accepted: no all-reduce kernel of upstream's here (tensor "
                                    "parallelism's reductions are the fixed-order leaf tree)"),
    "--enable-log-outputs": ((), "flag", None, "accepted: --enable-log-requests logs what a request asked for; "
                             "outputs are not logged"),
    "--cpu-offload-gb": ((), float, "0", "0 only: the weights stay on the GPU"),
    "--guided-decoding-backend": ((), str, "{auto,xgrammar}", "auto or xgrammar only: xgrammar enforces every "
                                  "structured output here"),
    "--structured-outputs-config": ((), "json", "JSON", "accepted with no backend or backend auto / xgrammar: "
                                    "xgrammar enforces every structured output here"),
    "--speculative-config": ((), "json", "JSON", "{} or null only: no speculative decoding here"),
    "--enable-lora": ((), "flag", None, "refused: no LoRA adapters here (merge an adapter into the weights, or "
                      "sync merged weights)"),
}


def _json(flag: str):
    def parse(text: str):
        try:
            return json.loads(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{flag} takes JSON: {err}") from None
    parse.__name__ = "JSON"
    return parse


def _json_list(flag: str):
    def parse(text: str) -> list[str]:
        value = _json(flag)(text)
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON list of strings, e.g. '[\"*\"]'")
        return value
    parse.__name__ = "JSON list"
    return parse


def _json_object(flag: str):
    def parse(text: str) -> dict:
        value = _json(flag)(text)
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON object, e.g. '{{\"temperature\": 0.6}}'")
        return value
    parse.__name__ = "JSON object"
    return parse


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: an integer in 0..65535") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is out of range: 0..65535")
    return port


def _generation_config(text: str) -> str:
    """auto, vllm, or a folder holding generation_config.json (upstream's three forms)."""
    if text in ("auto", "vllm"):
        return text
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r}: auto, vllm, or a folder holding generation_config.json")
    if not os.path.isfile(os.path.join(text, "generation_config.json")):
        raise argparse.ArgumentTypeError(f"folder {text!r} has no generation_config.json")
    return text


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible rollout server", formatter_class=HelpFormatter)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="local HF checkpoint directory to serve (same as --model; default: the embedded model)")
    p.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="a YAML mapping of flags in long form (max-model-len: 32k, port: 8001, model: /ckpt, "
                        "served-model-name: [a, b], enable-sleep-mode: true); the command line wins over it")
    # where --config's `model:` lands: below the positional MODEL and --model (command line first)
    p.add_argument("--config-model", default=None, help=argparse.SUPPRESS)
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind; the default accepts local connections only (use 0.0.0.0 to expose it)")
    p.add_argument("--port", type=_port, default=8000,
                   help="TCP port to listen on (0: any free one); bound before the model loads, so a busy port "
                        "fails at once")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients may put in the 'model' field; a response echoes the name its request "
                        "used, and the first name stands for a request that names none (default: the model path, "
                        "or 'default' for the embedded model)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every /v1/ endpoint, TRL's generation routes and, "
                        "without --admin-key, the admin routes (default: the VLLM_API_KEY environment variable, as "
                        "upstream, which keeps the secret off the command line)")
    p.add_argument("--admin-key", default=None,
                   help="require 'Authorization: Bearer KEY' on the admin routes: pause / resume, /abort_requests, "
                        "/reset_prefix_cache, every weight update route (ours, upstream's weight transfer, TRL's "
                        "communicator); without it those need the --api-key, or nothing: keep the server on "
                        "127.0.0.1 then (docs/serving.md lists them)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="sequences (prompts x n) allowed to wait beyond --max-num-seqs; more get HTTP 429 "
                        "(default: no limit)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="largest number of logprobs (completions) / top_logprobs (chat) a request may ask for")
    p.add_argument("--generation-config", type=_generation_config, default="auto", metavar="{auto,vllm,FOLDER}",
                   help="auto: sampling fields a request leaves unset (temperature, top_p, top_k, min_p, "
                        "repetition_penalty; max_new_tokens as max_tokens) take the model's generation_config.json "
                        "values; FOLDER: those of FOLDER/generation_config.json instead; vllm: SamplingParams "
                        "defaults")
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
                        "starts inside it), nemotron_v3 (deepseek_r1's, and a request whose chat_template_kwargs "
                        "set enable_thinking false or force_nonempty_content true gets the reasoning as content "
                        "when no answer followed it); token ids and logprobs are unchanged")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="a request's final usage carries prompt_tokens_details.cached_tokens, the prompt tokens "
                        "served from the prefix cache (left out when none were), as upstream reports them")
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="every streamed response carries usage, on each chunk and in a last usage-only chunk, as "
                        "if it asked for stream_options include_usage and continuous_usage_stats")
    p.add_argument("--keep-alive-on-engine-death", action="store_true",
                   help="keep answering 503 after the engine process dies, instead of exiting with status 1 "
                        "(as upstream: a restart policy then starts a fresh server)")
    p.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction, default=False,
                   help="accepted for upstream command lines (--no-trust-remote-code too): architectures are "
                        "implemented here, no remote code runs")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="accepted for upstream command lines: requests are not logged one by one here")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="log level of the HTTP server (uvicorn)")
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no uvicorn access-log line per HTTP request")
    p.add_argument("--response-role", default="assistant",
                   help="the role of a chat response that opens a turn (add_generation_prompt); without it the "
                        "response takes the last message's role")
    p.add_argument("--chat-template-content-format", default="auto", choices=["auto", "string", "openai"],
                   help="how a message's list of text parts reaches the chat template (as LLM.chat's "
                        "chat_template_content_format): string joins them with newlines, openai passes the list, "
                        "auto picks openai for a template that loops over a message's content")
    p.add_argument("--override-generation-config", type=_json_object("--override-generation-config"), default=None,
                   metavar="JSON",
                   help="generation_config.json values over the checkpoint's, as sampling defaults of requests that "
                        "leave a field unset (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens); "
                        "applied under either --generation-config, as upstream")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info: the tokenizer's configuration, special tokens and chat template "
                        "(lm-eval's remote tokenizer reads it); off by default, as upstream, since it exposes the "
                        "chat template")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="log each request as it is added: its id, prompt (text or ids) and sampling params")
    p.add_argument("--max-log-len", type=int, default=None,
                   help="with --enable-log-requests: log the first N prompt characters or ids (default: all)")
    p.add_argument("--disable-log-stats", action="store_true",
                   help=f"do not log the stats line (throughputs, queues, KV-cache use, prefix-cache hit rate) "
                        f"every {STATS_LOG_INTERVAL_S:g} s while requests run")
    p.add_argument("--root-path", default=None,
                   help="the path prefix a reverse proxy serves the app under (FastAPI's root_path): routes answer "
                        "with and without it")
    p.add_argument("--disable-fastapi-docs", action="store_true",
                   help="no /docs, /redoc or /openapi.json")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="every answer carries X-Request-Id: the request's own header, else a new uuid4 hex")
    p.add_argument("--allowed-origins", type=_json_list("--allowed-origins"), default=None, metavar="JSON",
                   help="CORS: the origins browser pages may call this server from, a JSON list (e.g. '[\"*\"]'); "
                        "without it no CORS headers are sent (upstream allows every origin by default; here the "
                        "admin routes change the weights, so a browser page must be allowed by name)")
    p.add_argument("--allowed-methods", type=_json_list("--allowed-methods"), default=None, metavar="JSON",
                   help="CORS (with --allowed-origins): the methods allowed, a JSON list (default: every method)")
    p.add_argument("--allowed-headers", type=_json_list("--allowed-headers"), default=None, metavar="JSON",
                   help="CORS (with --allowed-origins): the request headers allowed, a JSON list (default: every "
                        "header)")
    p.add_argument("--allow-credentials", action="store_true",
                   help="CORS (with --allowed-origins): allow cookies and Authorization on cross-origin requests")
    p.add_argument("--enable-sleep-mode", action="store_true",
                   help="allocate the KV cache so that the engine can release and retake its memory (LLM's "
                        "enable_sleep_mode); the server itself has no sleep route")
    p.add_argument("--api-server-count", "-asc", type=int, default=None,
                   help="1 only: one API server process here (run several servers behind a load balancer)")
    p.add_argument("--worker-extension-cls", default=None,
                   help="refused: upstream's worker mix-in; use collective_rpc with a function, or the weight-update "
                        "routes (docs/serving.md)")
    for flag, (aliases, kind, metavar, text) in UPSTREAM_NOOP_FLAGS.items():
        if kind == "flag":
            p.add_argument(flag, *aliases, action="store_const", const=True, default=None, help=text)
        elif kind == "ints":
            p.add_argument(flag, *aliases, type=int, nargs="+", default=None, metavar=metavar, help=text)
        else:
            p.add_argument(flag, *aliases, type=_json(flag) if kind == "json" else kind, default=None,
                           metavar=metavar, help=text)


def _config_path(argv: list[str]) -> tuple[str | None, list[str]]:
    """(--config's value, argv without it); the last one counts, as argparse would take it."""
    path, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest.extend(argv[i:])
            break
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ValueError("--config needs a FILE.yaml")
            path, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            path = arg[len("--config="):]
        else:
            rest.append(arg)
        i += 1
    return path, rest


def config_file_args(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The command-line form of a --config YAML file (upstream's format): keys are flags in
    long form, hyphens or underscores; true switches a flag on (false leaves it off, or gives
    --no-X for a --X/--no-X flag); a list fills an option taking several values; null leaves
    the default. ValueError (one line) for an unreadable or non-mapping file or an unknown key."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as err:
        raise ValueError(f"--config {path}: cannot read it ({err.strerror or err})") from None
    except yaml.YAMLError as err:
        raise ValueError(f"--config {path}: not valid YAML ({' '.join(str(err).split())})") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: must be a mapping of flag: value, got a {type(data).__name__}")
    actions = {opt: a for a in parser._actions for opt in a.option_strings if opt.startswith("--")}
    out: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag == "--model":
            flag = "--config-model"   # below the command line's MODEL / --model (serve.run)
        action = actions.get(flag)
        hidden = action is not None and action.help is argparse.SUPPRESS and flag != "--config-model"
        if action is None or hidden or flag in ("--config", "--help"):
            raise ValueError(f"--config {path}: unknown key {key!r} (keys are `vllm serve` flags in long form, "
                             "e.g. max-model-len)")
        if value is None:
            continue
        if action.nargs == 0:   # a switch: store_true, store_false, --X/--no-X
            if not isinstance(value, bool):
                raise ValueError(f"--config {path}: {key} is a switch: true or false, got {value!r}")
            if isinstance(action, argparse.BooleanOptionalAction):
                out.append(flag if value else "--no-" + flag[2:])
            elif value == (action.const is True):   # store_true given true (store_false given false)
                out.append(flag)
            continue
        if getattr(action.type, "__name__", "").startswith("JSON") and isinstance(value, (dict, list)):
            out += [flag, json.dumps(value)]    # the JSON flags take the structure as JSON text
        elif isinstance(value, list):
            if action.nargs not in ("+", "*") or not value:
                raise ValueError(f"--config {path}: {key} takes one value, got a list")
            out += [flag, *(_config_scalar(path, key, v) for v in value)]
        else:
            out += [flag, _config_scalar(path, key, value)]
    return out


def _config_scalar(path: str, key, value) -> str:
    if isinstance(value, (dict, list)):
        raise ValueError(f"--config {path}: {key} takes a plain value, got {value!r}")
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def expand_argv(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`vllm serve ... --config FILE`: argv with the file's flags put before the command line's
    own, so that the command line wins (argparse keeps the last value) and the file wins over
    the defaults. `argv` starts with "serve"."""
    path, rest = _config_path(argv[1:])
    if path is None:
        return argv
    file_args = config_file_args(path, parser)
    # a leading MODEL stays first: after a file's list option (served-model-name: [a, b]) it
    # would be read as one more of the list's values
    head = rest[:1] if rest and not rest[0].startswith("-") else []
    return [argv[0], *head, *file_args, *rest[len(head):]]


def check_upstream_flags(args) -> None:
    """Refuse, naming the flag and why, the upstream flags given at values this server cannot
    honour (ValueError: `vllm` prints its one line)."""
    from vllm.entrypoints.llm import UPSTREAM_NOOP_ARGS, refuse_worker_extension

    refuse_worker_extension(args.worker_extension_cls)
    for flag, (_, _, _, text) in UPSTREAM_NOOP_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and not UPSTREAM_NOOP_ARGS[flag[2:].replace("-", "_")](value):
            shown = value if isinstance(value, str) else json.dumps(value)
            raise ValueError(f"{flag} {shown}: not supported here ({text})")
    if args.api_server_count not in (None, 1):
        raise ValueError(f"--api-server-count {args.api_server_count}: not supported here (one API server process; "
                         "run several servers behind a load balancer)")
    if args.allowed_origins is None:
        given = [flag for flag, on in (("--allowed-methods", args.allowed_methods is not None),
                                       ("--allowed-headers", args.allowed_headers is not None),
                                       ("--allow-credentials", args.allow_credentials)) if on]
        if given:
            raise ValueError(f"{', '.join(given)}: CORS is off unless --allowed-origins lists the origins allowed "
                             "(this server sends no CORS headers by default)")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError("--max-log-len must be >= 0")
    for flag in ("api_key", "admin_key"):   # an empty key would silently turn the check off
        if getattr(args, flag) is not None and not getattr(args, flag).strip():
            raise ValueError(f"--{flag.replace('_', '-')} is empty: give a key, or leave the flag out for none")


def _cors(args) -> dict | None:
    """CORSMiddleware's keywords from the CORS flags (None: no CORS)."""
    if args.allowed_origins is None:
        return None
    # an explicit [] allows none, as given; only an absent flag means every one
    return dict(allow_origins=args.allowed_origins,
                allow_methods=args.allowed_methods if args.allowed_methods is not None else ["*"],
                allow_headers=args.allowed_headers if args.allowed_headers is not None else ["*"],
                allow_credentials=args.allow_credentials)


def run(args) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise SystemExit(f"vllm serve: the model is given twice ({args.model_tag!r} and --model {args.model!r})")
        args.model = args.model_tag
    if args.model is None:
        args.model = getattr(args, "config_model", None)
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        raise SystemExit("vllm serve: --max-queued-requests must be >= 0")
    check_upstream_flags(args)
    if args.generation_config not in ("auto", "vllm"):
        # read now, so a malformed file fails before the model loads (ValueError: one line)
        from vllm.config import load_generation_defaults
        load_generation_defaults(args.generation_config)
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
                   chat_template_content_format=args.chat_template_content_format,
                   return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                   reasoning_parser=args.reasoning_parser,
                   enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                   enable_force_include_usage=args.enable_force_include_usage,
                   keep_alive_on_engine_death=args.keep_alive_on_engine_death,
                   override_generation_config=args.override_generation_config,
                   access_log=not args.disable_uvicorn_access_log, response_role=args.response_role,
                   enable_log_requests=args.enable_log_requests, max_log_len=args.max_log_len,
                   enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint, root_path=args.root_path,
                   disable_fastapi_docs=args.disable_fastapi_docs, cors=_cors(args),
                   enable_request_id_headers=args.enable_request_id_headers,
                   log_stats_interval=None if args.disable_log_stats else STATS_LOG_INTERVAL_S) == "engine_dead" else 0
    except EngineStartError as err:
        logging.getLogger(__name__).error("%s", err)
        return 1
