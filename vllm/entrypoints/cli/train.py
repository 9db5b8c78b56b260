"""`vllm train`: on-policy GRPO/DAPO with zero rollout-training mismatch (docs/training.md).

    vllm train                                   # the default recipe: the embedded model on arithmetic
    vllm train --recipe training/qwen3_dims_grpo.yaml --numerics fast --steps 5
    vllm train --data my.jsonl --prompt-field question --answer-field solution --group-size 16
    vllm train --resume --output-dir runs/arithmetic_grpo --steps 40

Precedence: the knobs' defaults < the recipe (YAML) < command-line flags. With --resume
the base is the checkpoint's own configuration instead of a recipe.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

DEFAULT_RECIPE = "arithmetic_grpo"


def _recipe_dirs() -> list[str]:
    dirs = []
    import importlib.util
    spec = importlib.util.find_spec("training")
    if spec is not None and spec.submodule_search_locations:
        dirs += list(spec.submodule_search_locations)
    # a source checkout: <repo>/training next to <repo>/vllm
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    dirs.append(os.path.join(repo, "training"))
    return dirs


def find_recipe(name: str) -> str:
    """A recipe path, or the name of one in the top-level training/ folder."""
    if os.path.isfile(name):
        return name
    for d in _recipe_dirs():
        for cand in (os.path.join(d, name), os.path.join(d, name + ".yaml")):
            if os.path.isfile(cand):
                return cand
    raise ValueError(f"recipe {name!r} not found (a YAML path, or a name in training/: "
                     f"{', '.join(sorted(available_recipes())) or 'none'})")


def available_recipes() -> set[str]:
    out = set()
    for d in _recipe_dirs():
        if os.path.isdir(d):
            out.update(f[:-5] for f in os.listdir(d) if f.endswith(".yaml"))
    return out


def _type_name(tp) -> str:
    import typing
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    return getattr(args[0], "__name__", str(args[0])).upper()


def add_parser(sub) -> None:
    from vllm.rl.config import SECTIONS, _base_type, field_index

    p = sub.add_parser(
        "train", help="on-policy GRPO/DAPO training with zero rollout-training mismatch",
        description="Reinforcement learning on the engine and its colocated training view. Every knob can be set "
                    "in a YAML recipe (--recipe) and overridden here; see docs/training.md. The defaults below are "
                    f"the knobs' own: the default recipe (training/{DEFAULT_RECIPE}.yaml) sets several of them; "
                    "--print-config shows the resolved values.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=None,
                   help=f"YAML recipe: a path or a name in training/ (default: {DEFAULT_RECIPE}; with --resume: the "
                        "checkpoint's own configuration)")
    p.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")
    index = field_index()
    groups = {sec: p.add_argument_group(f"{sec} knobs") for sec in SECTIONS}
    for name, (sec, f, tp) in index.items():
        flag = "--" + name.replace("_", "-")
        help_text = f.metadata["help"]
        if "(default" not in help_text and f.default is not None:
            # a None default means "decided later" (the help says how)
            shown = ("on" if f.default else "off") if _base_type(tp)[0] is bool else f.default
            help_text += f" (default: {shown})"
        g = groups[sec]
        choices = [c for c in (f.metadata.get("choices") or ()) if c is not None]
        if None in (f.metadata.get("choices") or ()):
            choices.append("none")   # "none" sets the knob to None (e.g. over a recipe's fp8)
        if name == "rollout_url":
            g.add_argument(flag, nargs="+", default=argparse.SUPPRESS, metavar="URL",
                           help=help_text + "; several URLs share the rollouts")
        elif name == "resume":
            g.add_argument(flag, nargs="?", const="latest", default=argparse.SUPPRESS, metavar="PATH",
                           help=help_text + "; without PATH: the latest checkpoint in --output-dir")
        elif _base_type(tp)[0] is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        else:
            g.add_argument(flag, default=argparse.SUPPRESS, help=help_text,
                           metavar="{" + ",".join(choices) + "}" if choices else _type_name(tp))


def build_config(args):
    """The configuration these arguments ask for (ValueError on anything wrong)."""
    from vllm.rl.checkpoint import Checkpoint, find_checkpoint
    from vllm.rl.config import TrainConfig, field_index

    overrides = {k: v for k, v in vars(args).items() if k in field_index()}
    if isinstance(overrides.get("rollout_url"), list):
        overrides["rollout_url"] = ",".join(overrides["rollout_url"])
    if "resume" in overrides and args.recipe is None:
        # continue the checkpoint's own run: its configuration, then these flags
        output_dir = overrides.get("output_dir") or TrainConfig.from_yaml(find_recipe(DEFAULT_RECIPE)).run.output_dir
        path = find_checkpoint(overrides["resume"], output_dir)
        import yaml
        ckpt = Checkpoint.open(path)
        cfg = TrainConfig.from_dict(yaml.safe_load(ckpt.config_yaml))
        cfg.update({"overwrite": False})
        # knobs the run derived by a rule (lr_decay_steps, overlong_buffer) are pinned in its
        # config; unset again, the trainer re-derives them as a resume through the API does
        for name in ckpt.trainer_state.get("derived_knobs", []):
            if name in field_index() and name not in overrides:
                cfg.set(name, None)
        overrides["resume"] = path
    else:
        cfg = TrainConfig.from_yaml(find_recipe(args.recipe or DEFAULT_RECIPE))
    cfg.update(overrides)
    return cfg


def run(args) -> int:
    from vllm.rl.server_rollout import RolloutServerError
    from vllm.rl.trainer import MismatchError, RewardError, Trainer

    try:
        cfg = build_config(args)
        if args.print_config:
            print(cfg.validate().to_yaml(), end="")
            return 0
        if cfg.cluster.backend == "ray":
            return _run_on_ray(cfg)
        trainer = Trainer(cfg)
    except ValueError as err:
        print(f"vllm train: error: {err}", file=sys.stderr)
        return 2
    # a scheduler's stop (SIGTERM: SLURM, Kubernetes, `kill`) ends the run as Ctrl-C does: the
    # trainer's cleanup runs (engines and rollout servers shut down), the last checkpoint stays
    previous = _stop_on_sigterm()
    try:
        trainer.run()
    except MismatchError as err:
        print(f"vllm train: {err}", file=sys.stderr)
        return 1
    except OSError as err:   # a checkpoint or log write (disk full, directory removed)
        print(f"vllm train: error: {err}", file=sys.stderr)
        return 1
    except (RolloutServerError, RewardError) as err:
        print(f"vllm train: error: {err}; {_resume_hint(trainer.output_dir)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:
        return _stopped(err, trainer.output_dir)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0


def _stopped(err: KeyboardInterrupt, output_dir: str) -> int:
    """Ctrl-C (130) or SIGTERM (143): one line, with whether there is a checkpoint to resume."""
    what = "terminated (SIGTERM)" if isinstance(err, Terminated) else "interrupted"
    print(f"vllm train: {what}; {_resume_hint(output_dir)}", file=sys.stderr)
    return 143 if isinstance(err, Terminated) else 130


def _resume_hint(output_dir: str) -> str:
    # the last complete checkpoint stays behind `latest` (saves are write-then-rename)
    if os.path.lexists(os.path.join(output_dir, "checkpoints", "latest")):
        return "continue with --resume latest"
    return ("no checkpoint was written before it (--checkpoint-interval N saves one every N steps): "
            "nothing to resume")


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: raised where the run is, so it unwinds as Ctrl-C does."""


def _stop_on_sigterm():
    """Turn SIGTERM into Terminated on the main thread; returns the handler it replaced (None
    where no handler can be set: not the main thread)."""
    def handler(signum, frame):
        raise Terminated()
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:   # not the main thread
        return None


def _run_on_ray(cfg) -> int:
    """The trainer and the rollout engines as Ray actors (vllm/rl/ray, docs/ray.md)."""
    from vllm.rl.trainer import MismatchError

    from vllm.rl.ray.driver import TrainerActorDied, run_on_ray

    previous = _stop_on_sigterm()
    try:
        run_on_ray(cfg)
    except ValueError as err:
        print(f"vllm train: error: {err}", file=sys.stderr)
        return 2
    except (MismatchError, TrainerActorDied) as err:
        print(f"vllm train: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:   # the actors are killed at once (RayTrainJob.shutdown)
        return _stopped(err, cfg.run.output_dir)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0
