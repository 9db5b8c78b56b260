"""`vllm` console script: a lazy registry of subcommands.

Each subcommand is a module exposing `add_parser(subparsers)` and `run(args)`;
only the chosen one is imported, so `vllm --help` does not import torch.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("vllm.entrypoints.cli.generate", "offline generation (defaults to the embedded model)"),
    "serve": ("vllm.entrypoints.cli.serve", "OpenAI-compatible rollout server"),
    "parity": ("vllm.parity", "find the first op where rollout and training bits differ"),
    "train": ("vllm.entrypoints.cli.train", "on-policy GRPO/DAPO training with zero rollout-training mismatch"),
}


def register(name: str, module: str, help_text: str) -> None:
    SUBCOMMANDS[name] = (module, help_text)


def build_parser(chosen: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm", description="vllm-parity: rollout and training with bitwise-identical logprobs")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        if name == chosen:
            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    if chosen is not None and chosen not in SUBCOMMANDS:
        print(f"vllm: unknown command {chosen!r}; choose one of {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    parser = build_parser(chosen)
    expand = getattr(importlib.import_module(SUBCOMMANDS[chosen][0]), "expand_argv", None) if chosen else None
    if expand is not None:
        # a subcommand's own pre-parse (serve's --config FILE): its flags join argv here
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[chosen]
        at = argv.index(chosen)
        try:
            argv = argv[:at] + expand(argv[at:], sub)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
    args = parser.parse_args(argv)
    if args.version:
        from vllm import __version__
        print(__version__)
        return 0
    if args.command is None:
        parser.print_help()
        return 0
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except ValueError as err:
        # Bad input (a missing model directory, an unknown dtype, ...) is reported by a
        # ValueError whose message says what to change: print that, not a traceback.
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
