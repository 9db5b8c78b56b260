"""`vllm serve`: the OpenAI-compatible rollout server (docs/serving.md)."""
from __future__ import annotations

import logging

from vllm.entrypoints.cli.engine_args import HelpFormatter, add_engine_args, engine_kwargs


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible rollout server", formatter_class=HelpFormatter)
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind; the default accepts local connections only (use 0.0.0.0 to expose it)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in the 'model' field; the first is reported in responses "
                        "(default: the --model path, or 'default' for the embedded model)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="largest number of logprobs (completions) / top_logprobs (chat) a request may ask for")
    p.add_argument("--generation-config", default="auto", choices=["auto", "vllm"],
                   help="auto: sampling fields a request leaves unset (temperature, top_p, top_k, min_p) take the "
                        "model's generation_config.json values; vllm: SamplingParams defaults")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="log level of the HTTP server (uvicorn)")


def run(args) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise SystemExit(f"vllm serve needs fastapi and uvicorn: pip install 'vllm-parity[serve]' ({err})")
    from vllm import LLM
    from vllm.entrypoints.openai.api_server import run_server

    llm = LLM(**engine_kwargs(args))
    run_server(llm, host=args.host, port=args.port, served_model_names=args.served_model_name,
               max_logprobs=args.max_logprobs, generation_config=args.generation_config,
               log_level=args.uvicorn_log_level)
    return 0
