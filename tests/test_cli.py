"""The `vllm` console script as a newcomer meets it: every flag explained, each default
printed once, parity (numerics="invariant") by default, bad input as one line."""
from __future__ import annotations

import argparse
import re

import pytest

from vllm.entrypoints.cli import main as cli


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser(name)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("name", sorted(cli.SUBCOMMANDS))
def test_every_flag_has_help_and_one_default(name):
    p = _subparser(name)
    undocumented = [a.option_strings[0] for a in p._actions
                    if a.option_strings and not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]
    assert not undocumented, f"vllm {name}: flags without help: {undocumented}"
    text = p.format_help()
    # one paragraph per option: from its flag to the next flag
    blocks = re.split(r"\n  (?=-)", text.split("options:", 1)[1])
    twice = [b.split()[0] for b in blocks if b.count("default:") > 1]
    assert not twice, f"vllm {name}: default printed twice for {twice}"
    none_printed = [b.split()[0] for b in blocks if "default: None" in b or "default: False" in b]
    assert not none_printed, f"vllm {name}: a meaningless default is printed for {none_printed}"


@pytest.mark.parametrize("name", sorted(cli.SUBCOMMANDS))
def test_every_subcommand_defaults_to_invariant_numerics(name):
    args = _subparser(name).parse_args([])
    if name == "train":
        # `vllm train` flags override a recipe (unset flags are absent): the resolved
        # configuration carries the default
        from vllm.rl.config import TrainConfig
        assert not hasattr(args, "numerics") and TrainConfig().model.numerics == "invariant"
        return
    assert args.numerics == "invariant"


def test_engine_config_and_llm_default_to_invariant():
    import dataclasses
    import inspect

    from vllm.config import NumericsSpec
    from vllm.entrypoints.llm import LLM
    from vllm.training import Policy

    assert inspect.signature(Policy.from_pretrained).parameters["numerics"].default == "invariant"
    field = next(f for f in dataclasses.fields(NumericsSpec) if f.name == "numerics")
    assert field.default == "invariant"
    assert inspect.signature(LLM.__init__).parameters["numerics"].default == "invariant"


def test_bad_input_is_one_line_not_a_traceback(tmp_path, capsys):
    rc = cli.main(["generate", "--model", str(tmp_path / "nonexistent"), "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "nonexistent" in lines[0], err
    assert "Traceback" not in err


def test_unknown_dtype_is_a_usage_error(capsys):
    """--dtype takes the engine's dtypes as choices (upstream's): a wrong one is argparse's error,
    before anything is built."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--dtype", "int7", "--device", "cpu"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "invalid choice: 'int7'" in err and "Traceback" not in err, err


def test_keep_master_weights_flag_reaches_the_engine(tiny_qwen3, capsys):
    from vllm.entrypoints.cli.engine_args import engine_kwargs
    args = _subparser("serve").parse_args(["--quantization", "fp8", "--no-keep-master-weights"])
    assert engine_kwargs(args)["keep_master_weights"] is False
    assert engine_kwargs(_subparser("serve").parse_args([]))["keep_master_weights"] is True
    # without FP8 there is nothing to keep: one line, no traceback
    rc = cli.main(["generate", "--model", tiny_qwen3, "--device", "cpu", "--no-keep-master-weights"])
    err = capsys.readouterr().err
    assert rc != 0 and "keep_master_weights=False needs quantization='fp8'" in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["serve", "generate"])
def test_logprobs_mode_flag_reaches_the_engine(name):
    from vllm.entrypoints.cli.engine_args import engine_kwargs
    from vllm.sampling_params import LOGPROBS_MODES
    assert engine_kwargs(_subparser(name).parse_args([]))["logprobs_mode"] == "tempered_logprobs"
    for mode in LOGPROBS_MODES:
        assert engine_kwargs(_subparser(name).parse_args(["--logprobs-mode", mode]))["logprobs_mode"] == mode
    with pytest.raises(SystemExit):   # argparse names the choices
        _subparser(name).parse_args(["--logprobs-mode", "logits"])


def test_cuda_graph_batch_sizes_flag_reaches_the_engine(tiny_qwen3, capsys):
    """`--cuda-graph-batch-sizes` (the sizes the engine captures decode graphs at) reaches the
    engine; a size below 1 is one clear line, no traceback."""
    from vllm.entrypoints.cli.engine_args import engine_kwargs
    args = _subparser("serve").parse_args(["--cuda-graph-batch-sizes", "1", "4", "8"])
    assert engine_kwargs(args)["cuda_graph_batch_sizes"] == [1, 4, 8]
    assert engine_kwargs(_subparser("serve").parse_args([]))["cuda_graph_batch_sizes"] is None
    rc = cli.main(["generate", "--model", tiny_qwen3, "--device", "cpu", "--cuda-graph-batch-sizes", "0"])
    err = capsys.readouterr().err
    assert rc != 0 and "cuda_graph_batch_sizes must be a list of integers >= 1" in err and "Traceback" not in err
