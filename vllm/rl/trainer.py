"""The RL loop: sample prompts -> roll out `group_size` responses each -> score ->
recompute logprobs with the Policy -> update(s) -> sync weights in place.

With one update per rollout batch the PPO ratio is exp(logp - logp.detach()) = 1, and
in invariant mode the trainer's logprobs equal the rollout's bit for bit; every step
measures |logp_train - logp_rollout| over all response tokens (same weight version) and,
in invariant mode, stops the run if any bit differs (`require_zero_mismatch`).

Everything a step consumes is a function of the saved state: the data order of
(seed, consumed count), each group's sampling seed of (seed, step, batch, index), the
learning rate of the step number, the weights, the optimizer state. A checkpoint holds
all of it, so a resumed run continues bit for bit.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch

from vllm.rl import losses
from vllm.rl.checkpoint import (Checkpoint, CheckpointWriter, checkpoint_path, find_checkpoint, set_rng_state,
                                 snapshot_checkpoint)
from vllm.rl.config import SECTIONS, TrainConfig, with_absolute_paths
from vllm.rl.data import Example, PromptRenderer, PromptSampler, load_examples
from vllm.rl.metrics import WANDB_ID_FILE, MetricsLogger, summary_line
from vllm.rl.rewards import InvalidReward, build_reward
from vllm.rl.rollout import ColocatedRollout, Completion, RolloutClient, RolloutRequest, RolloutSettings

logger = logging.getLogger(__name__)

# knobs that may differ between a run and its resumption without changing its bits
RESUME_FREE_KNOBS = {"rollout_url", "weight_sync", "sync_host", "rollout_admin_key", "steps", "eval_interval", "checkpoint_interval",
                     "wandb_project",
                     "checkpoint_background", "output_dir", "resume", "overwrite",
                     "progress", "tensorboard", "plots", "eval_data", "eval_size", "require_zero_mismatch",
                     # where the actors run: a run continues bit-exactly on another layout (docs/ray.md)
                     "backend", "ray_address", "rollout_engines", "placement", "cpus_per_bundle", "ray_num_cpus",
                     "engine_restarts"}


class MismatchError(RuntimeError):
    """Invariant mode: a rollout logprob differs from the trainer's under the same weights."""


class RewardError(RuntimeError):
    """The reward function raised, or returned something other than a finite number, on a
    record (named in the message)."""


def rollout_seed(seed: int, step: int, batch: int, index: int) -> int:
    """Sampling seed of one group: a fixed function of (run seed, step, rollout batch, prompt index)."""
    h = hashlib.sha256(f"rollout:{seed}:{step}:{batch}:{index}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 62) - 1)


def _mean_finite(norms: list[float]) -> float:
    """The mean of a step's finite gradient norms (its updates'); with none finite, the first
    norm (inf or nan: what skipped the update); 0.0 without updates."""
    finite = [n for n in norms if math.isfinite(n)]
    return sum(finite) / len(finite) if finite else (norms[0] if norms else 0.0)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of 0-based step `step`: linear warmup, then constant / linear / cosine decay
    over `lr_decay_steps` (the run's steps when unset), then the floor."""
    o = cfg.optim
    total = o.lr_decay_steps if o.lr_decay_steps is not None else cfg.run.steps
    if o.warmup_steps > 0 and step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.lr_schedule == "constant":
        return o.lr
    progress = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
    if o.lr_schedule == "linear":
        factor = 1.0 - (1.0 - o.min_lr_ratio) * progress
    else:
        factor = o.min_lr_ratio + (1.0 - o.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return o.lr * factor


@dataclass
class ScoredGroup:
    example: Example
    prompt_ids: list[int]
    completions: list[Completion]
    scores: list[float]        # task reward of each response
    rewards: list[float]       # score + overlong penalty: what the advantages see


@dataclass
class StepResult:
    metrics: dict
    sequences: list[list[int]]            # prompt + response of every trained response
    prompt_lens: list[int]
    rollout_logprobs: list[torch.Tensor]  # as the engine reported them
    train_logprobs: list[torch.Tensor]    # as the Policy recomputed them (same weights)


def _default_model_dir() -> str:
    from vllm.config import default_model_path
    return default_model_path()


def model_dir_of(cfg: TrainConfig) -> str:
    """The model directory a run loads: the checkpoint, the embedded model, or for a
    config.json with load_format=dummy a directory under output_dir holding that config and
    the embedded model's tokenizer."""
    m = cfg.model
    path = m.model or _default_model_dir()
    if path.endswith(".json"):
        # random weights of the dims in this config.json, with the embedded model's tokenizer
        if not os.path.isfile(path):
            raise ValueError(f"model config {path!r} does not exist")
        with open(path) as f:
            hf = json.load(f)
        if "architectures" not in hf:
            raise ValueError(f"{path!r} is not an HF config.json (no 'architectures')")
        out = os.path.join(cfg.run.output_dir, "model_config")
        os.makedirs(out, exist_ok=True)
        shutil.copy(path, os.path.join(out, "config.json"))
        src = _default_model_dir()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if os.path.isfile(os.path.join(src, name)):
                shutil.copy(os.path.join(src, name), os.path.join(out, name))
        return out
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model {path!r} is not a checkpoint directory with a config.json")
    return path



def _claim_output_dir(out: str) -> None:
    """Mark `out` as this process's run (its pid in `.vllm-train.pid`), refusing a directory
    another live process has marked: a second run into it would interleave its metrics and
    checkpoints. A mark left by a process that has ended is taken over."""
    path = os.path.join(out, ".vllm-train.pid")
    try:
        with open(path) as f:
            other = int(f.read().strip() or 0)
    except (OSError, ValueError):
        other = 0
    if other > 0 and other != os.getpid():
        try:
            os.kill(other, 0)
            alive = True
        except ProcessLookupError:
            alive = False
        except PermissionError:   # a process of another user
            alive = True
        if alive:
            raise ValueError(f"--output-dir {out!r} is in use by another vllm train run (process {other}, "
                             f"{path}): wait for it or choose another --output-dir")
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(tmp, path)


def _writable_dir(out: str, path: str, what: str, before=None) -> None:
    """`path` (under the run's --output-dir `out`) exists and takes a file, after `before()`;
    an OSError of any of it is one ValueError naming the directory."""
    try:
        os.makedirs(out, exist_ok=True)
        if before is not None:
            before()
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as err:
        raise ValueError(f"--output-dir {out!r} cannot hold this run's {what}: {err.strerror or err} "
                         f"({err.filename or path})") from err


class Trainer:
    """`Trainer(config)` checks the configuration, the data and the reward function,
    then builds the engine and the Policy (and restores a checkpoint with
    `resume`); `run()` trains. `rollout` replaces the colocated engine (tests, or
    a client of a separate rollout server)."""

    def __init__(self, config: TrainConfig, rollout: RolloutClient | None = None, stream=None):
        # resolved knobs get pinned in it (_pin_resolved_knobs); absolute paths: a checkpoint's
        # copy resumes from any directory
        self.raw_config = with_absolute_paths(copy.deepcopy(config))
        self.cfg = cfg = config.validate()
        self.stream = stream
        self.device = cfg.model.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device is cuda but no CUDA device is available")
        self.output_dir = cfg.run.output_dir
        # ---- everything that can be wrong is checked before any model is loaded -------------
        self.model_dir = self._model_dir()
        self._prepare_data()
        self.resume_from = None
        if cfg.run.resume is not None:
            self.resume_from = Checkpoint.open(find_checkpoint(cfg.run.resume, self.output_dir))
        elif not cfg.run.overwrite and os.path.isdir(os.path.join(self.output_dir, "checkpoints")) \
                and os.listdir(os.path.join(self.output_dir, "checkpoints")):
            raise ValueError(f"{self.output_dir!r} holds checkpoints of an earlier run: continue it with --resume, "
                             "start over with --overwrite, or choose another --output-dir")
        self._prepare_output_dir()
        self._pin_resolved_knobs()
        # ---- engine, policy, optimizer ---------------------------------------------------
        self.sleep = cfg.model.sleep_mode if cfg.model.sleep_mode is not None else self.device.startswith("cuda")
        if rollout is None and cfg.cluster.backend == "ray":
            raise ValueError("backend ray runs this Trainer inside a Ray actor: start it with `vllm train --backend "
                             "ray` or vllm.rl.ray.driver.run_on_ray(config)")
        if rollout is None:
            rollout = self._build_server_rollout() if cfg.model.rollout_url else self._build_colocated()
        self.client = rollout
        self._start_checkpoints()
        self.policy = self.client.policy(activation_checkpointing=cfg.model.activation_checkpointing)
        self.params = [p for p in self.policy.parameters()]
        if self.params and self.params[0].dtype == torch.float16:   # dtype auto on a float16 checkpoint
            raise ValueError("the model resolved to float16, which is not trained here (no loss scaling: its "
                             "gradients underflow); set dtype bfloat16 (float32 master weights) or float32")
        dtype = self.params[0].dtype
        use_master = cfg.optim.master_weights if cfg.optim.master_weights is not None else dtype != torch.float32
        self.master = [p.detach().to(torch.float32).clone() for p in self.params] if use_master else None
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.master if self.master is not None else self.params, lr=o.lr,
                                           betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                                           weight_decay=o.weight_decay)
        self.checkpoints = CheckpointWriter(background=cfg.run.checkpoint_background)
        self.reference = None
        if cfg.algorithm.kl_coef > 0:
            self.reference = self._frozen_copy()
        self.step_count = 0           # completed steps
        self.weight_version = 0       # optimizer updates synced to the rollout
        self.sampler = PromptSampler(len(self.train_examples), cfg.run.seed, cfg.data.shuffle)
        if self.resume_from is not None:
            self._restore(self.resume_from)

    # ---- set-up ----------------------------------------------------------------------------
    def _pin_resolved_knobs(self) -> None:
        """Write the knobs whose defaults are rules (lr_decay_steps: the run's steps;
        overlong_buffer: the algorithm's share of max_response_tokens) into the config saved
        with every checkpoint, so a resumed run keeps what the run used even when the rule or
        --steps changes: a fresh run's own values, a resumed run's from its checkpoint. An
        explicit value stands (a changed one is reported as a changed knob on resume)."""
        saved = None if self.resume_from is None else \
            _as_resolved_then(TrainConfig.from_dict(_yaml_load(self.resume_from.config_yaml)))
        raw_o, raw_a = self.raw_config.optim, self.raw_config.algorithm
        # named in the checkpoint's trainer state: a resume through the CLI, which starts from
        # the saved config, unsets them again and so takes this same path
        self.derived_knobs = sorted(n for n, v in (("lr_decay_steps", raw_o.lr_decay_steps),
                                                   ("overlong_buffer", raw_a.overlong_buffer)) if v is None)
        if raw_o.lr_decay_steps is None:
            steps = saved.optim.lr_decay_steps if saved is not None else self.cfg.run.steps
            self.cfg.optim.lr_decay_steps = raw_o.lr_decay_steps = steps
        if raw_a.overlong_buffer is None:
            if saved is not None and saved.algorithm.max_response_tokens == self.cfg.algorithm.max_response_tokens \
                    and saved.algorithm.algorithm == self.cfg.algorithm.algorithm:
                self.cfg.algorithm.overlong_buffer = saved.algorithm.overlong_buffer
            raw_a.overlong_buffer = self.cfg.algorithm.overlong_buffer

    def _model_dir(self) -> str:
        return model_dir_of(self.cfg)

    def _prepare_data(self) -> None:
        cfg = self.cfg
        d = cfg.data
        self.reward_fn = build_reward(cfg.reward.reward, cfg.reward.correct_reward, cfg.reward.wrong_reward)
        self.train_examples = load_examples(d.data, d.task, prompt_field=d.prompt_field, answer_field=d.answer_field,
                                            size=d.train_size, seed=cfg.run.seed, split="train")
        self.eval_examples: list[Example] = []
        # evaluation data: --eval-data, else the test split of the task the run trains on
        eval_task = d.task if d.data is None else None
        self.eval_note = None
        if cfg.run.eval_interval > 0 and d.eval_data is None and eval_task is None:
            self.eval_note = "no evaluation: --data without --eval-data"
        elif cfg.run.eval_interval > 0:
            self.eval_examples = load_examples(d.eval_data, None if d.eval_data else eval_task,
                                               prompt_field=d.prompt_field, answer_field=d.answer_field,
                                               size=d.eval_size, seed=cfg.run.seed, split="test")
        from vllm.tokenizer import load_tokenizer
        self.tokenizer = load_tokenizer(self.model_dir)
        render = PromptRenderer(self.tokenizer, d.chat_template, d.system_prompt)
        from vllm.model_loader.build import read_model_config
        # the model's context (linear rope scaling included); a longer max_model_len is a ValueError
        model_config = read_model_config(self.model_dir, cfg.model.max_model_len)
        max_len, vocab = model_config.max_model_len, model_config.vocab_size
        budget = max_len - cfg.algorithm.max_response_tokens
        if budget < 1:
            raise ValueError(f"max_response_tokens={cfg.algorithm.max_response_tokens} leaves no room for a prompt "
                             f"in the model's context ({max_len} tokens): lower it below {max_len}")
        self.train_prompt_ids, self.eval_prompt_ids = [], []
        for examples, out, what in ((self.train_examples, self.train_prompt_ids, "training"),
                                    (self.eval_examples, self.eval_prompt_ids, "evaluation")):
            for ex in examples:
                ids = render(ex.prompt)
                if len(ids) > budget:
                    raise ValueError(f"{what} record {ex.index + 1}: the prompt has {len(ids)} tokens; with "
                                     f"max_response_tokens={cfg.algorithm.max_response_tokens} the context "
                                     f"({max_len}) allows at most {budget}")
                if not ids:
                    raise ValueError(f"{what} record {ex.index + 1}: the prompt renders to no tokens")
                if vocab is not None and max(ids) >= vocab:
                    raise ValueError(f"{what} record {ex.index + 1}: the tokenizer gives token id {max(ids)}, outside "
                                     f"the model's vocabulary of {vocab}")
                out.append(ids)

    def _build_colocated(self) -> ColocatedRollout:
        from vllm import LLM

        m, a = self.cfg.model, self.cfg.algorithm
        llm = LLM(self.model_dir, dtype=m.dtype, device=self.device, seed=self.cfg.run.seed, numerics=m.numerics,
                  max_model_len=m.max_model_len, gpu_memory_utilization=m.gpu_memory_utilization,
                  enforce_eager=m.enforce_eager, load_format=m.load_format, enable_sleep_mode=self.sleep,
                  max_num_seqs=max(1, min(512, a.prompts_per_step * a.group_size)),
                  tensor_parallel_size=m.tensor_parallel_size, tp_leaves=m.tp_leaves,
                  kv_cache_dtype=m.kv_cache_dtype, quantization=m.quantization)
        return ColocatedRollout(llm, sleep=self.sleep)

    def _build_server_rollout(self):
        from vllm.rl.server_rollout import ServerRollout

        m = self.cfg.model
        self.sleep = False
        return ServerRollout([u.strip() for u in m.rollout_url.split(",") if u.strip()], self.model_dir, dtype=m.dtype,
                             device=self.device, numerics=m.numerics, weight_sync=m.weight_sync, sync_host=m.sync_host,
                             admin_key=m.rollout_admin_key, checkpoint_dir=self.output_dir, tp_leaves=m.tp_leaves,
                             kv_cache_dtype=m.kv_cache_dtype, quantization=m.quantization)

    def _frozen_copy(self):
        from vllm.training import Policy

        model = copy.deepcopy(self.policy.model)
        ref = Policy(model, self.policy.model_config, self.policy.numerics_spec, self.policy.device,
                     self.policy.tokenizer, block_size=self.policy.block_size,
                     logprob_chunk_rows=self.policy.logprob_chunk_rows)
        for p in model.parameters():
            p.requires_grad_(False)
        return ref

    def _ignored_knobs(self) -> list[str]:
        """The rollout-server knobs set away from their defaults on a run without rollout servers."""
        from vllm.rl.config import ModelSection
        m = self.cfg.model
        if m.rollout_url:
            return []
        return ["--" + name.replace("_", "-") for name in ("weight_sync", "sync_host", "rollout_admin_key")
                if getattr(m, name) != ModelSection.__dataclass_fields__[name].default]

    # ---- one step -----------------------------------------------------------------------------
    def _reward(self, response: str, example: Example) -> float:
        """reward_fn on one response, its failures named by the data record they happened on."""
        where = f"the reward {self.cfg.reward.reward!r} on record {example.index} of the data"
        try:
            return self.reward_fn(response, example.answer, example.record)
        except InvalidReward as err:
            raise RewardError(f"{where} {err}") from None
        except Exception as err:   # noqa: BLE001 -- a user's function: any exception, named
            raise RewardError(f"{where} raised {type(err).__name__}: {err} (response {response[:80]!r})") from err

    def _score(self, example: Example, group) -> ScoredGroup:
        a = self.cfg.algorithm
        scores = [self._reward(c.text, example) for c in group.completions]
        lengths = torch.tensor([len(c.token_ids) for c in group.completions])
        pen = losses.overlong_penalty(lengths, a.max_response_tokens, a.overlong_buffer, a.overlong_penalty)
        rewards = [s + float(p) for s, p in zip(scores, pen)]
        return ScoredGroup(example, group.prompt_token_ids, group.completions, scores, rewards)

    def _rollout(self, step: int) -> tuple[list[ScoredGroup], list[ScoredGroup], int]:
        """(kept groups, every sampled group, rollout batches) of one step."""
        a = self.cfg.algorithm
        settings = RolloutSettings(a.temperature, a.top_p, a.max_response_tokens)
        kept, sampled, batches = [], [], 0
        for b in range(a.max_gen_batches if a.dynamic_sampling else 1):
            idx = self.sampler.take(a.prompts_per_step)
            reqs = [RolloutRequest(self.train_prompt_ids[i], a.group_size, rollout_seed(self.cfg.run.seed, step, b, j))
                    for j, i in enumerate(idx)]
            groups = [self._score(self.train_examples[i], g) for i, g in zip(idx, self.client.generate(reqs, settings))]
            sampled += groups
            batches += 1
            if not a.dynamic_sampling:
                kept = groups
                break
            informative = losses.informative_groups(torch.tensor([g.scores for g in groups]))
            kept += [g for g, keep in zip(groups, informative.tolist()) if keep]
            if len(kept) >= a.prompts_per_step:
                break
        if a.dynamic_sampling and len(kept) < a.prompts_per_step:
            # verl's DAPO stops the run here; this step trains on the groups it has (groups_kept
            # in the metrics), and says so
            logger.warning("step %d: dynamic sampling found %d of %d informative groups in %d rollout batches "
                           "(max_gen_batches): training on those", step, len(kept), a.prompts_per_step, batches)
        return kept[:a.prompts_per_step], sampled, batches

    def _micro_batches(self, order: list[int], lengths: list[int]) -> list[list[int]]:
        budget = self.cfg.optim.micro_batch_tokens
        if budget is None:
            return [order]
        out, cur, used = [], [], 0
        for i in order:
            if cur and used + lengths[i] > budget:
                out.append(cur)
                cur, used = [], 0
            cur.append(i)
            used += lengths[i]
        if cur:
            out.append(cur)
        return out

    def _logprobs(self, policy, seqs, plens, idx: list[int], entropy: bool = False):
        """The micro-batch's logprobs; with `entropy`, (logprobs, entropies)."""
        return policy.token_logprobs([seqs[i] for i in idx], [plens[i] for i in idx],
                                     temperature=self.cfg.algorithm.temperature, return_entropy=entropy)

    def _accumulate_master_grads(self) -> None:
        """Move the bf16 parameter gradients of one micro-batch into the float32 master
        gradients, so micro-batches accumulate in float32."""
        for p, m in zip(self.params, self.master):
            if p.grad is not None:
                g = p.grad.to(torch.float32)
                m.grad = g if m.grad is None else m.grad.add_(g)
                p.grad = None

    def _optimizer_step(self, step: int) -> tuple[float, bool]:
        lr = lr_at(step, self.cfg)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        if self.master is not None:
            self._accumulate_master_grads()
            for m in self.master:
                if m.grad is None:
                    m.grad = torch.zeros_like(m)
        targets = self.master if self.master is not None else self.params
        max_norm = self.cfg.optim.max_grad_norm if self.cfg.optim.max_grad_norm > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(targets, max_norm))
        # inf / nan: a broken gradient. 0: no learning signal (every token's weight or advantage
        # is 0 and no other term is in the loss), where AdamW would still move the weights by
        # its momentum and weight decay and count a step. Either way no step is taken.
        if not math.isfinite(norm) or norm == 0.0:
            self.optimizer.zero_grad(set_to_none=True)
            for p in self.params:
                p.grad = None
            return norm, False
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.master is not None:
            with torch.no_grad():
                for p, m in zip(self.params, self.master):
                    p.copy_(m)  # the bf16 bits the rollout and the forward will use
        return norm, True

    def _train(self, step: int, groups: list[ScoredGroup]) -> tuple[dict, list, list, list, list]:
        cfg, a = self.cfg, self.cfg.algorithm
        seqs, plens, roll, adv, group_of, cut = [], [], [], [], [], []
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
        advantages = losses.group_advantages(rewards, a.norm_adv_by_std)
        for gi, g in enumerate(groups):
            for ci, c in enumerate(g.completions):
                seqs.append(g.prompt_ids + c.token_ids)
                plens.append(len(g.prompt_ids))
                roll.append(c.logprobs)
                adv.append(float(advantages[gi, ci]))
                group_of.append(gi)
                # overlong filtering: a response cut by the length limit takes no part in the loss
                cut.append(a.overlong_filter and c.finish_reason == "length")
        n = len(seqs)
        resp_len = [len(s) - p for s, p in zip(seqs, plens)]
        seq_len = [len(s) for s in seqs]
        dev = self.policy.device
        train_lps: list[torch.Tensor | None] = [None] * n
        chunks = [c.tolist() for c in np.array_split(np.arange(len(groups)), a.updates_per_step)]
        old: list[torch.Tensor | None] = [None] * n
        if a.updates_per_step > 1:
            # the logprobs of the rollout's weights, before the first of several updates
            with torch.no_grad():
                for mb in self._micro_batches(list(range(n)), seq_len):
                    for i, lp in zip(mb, self._logprobs(self.policy, seqs, plens, mb)):
                        old[i] = lp.detach()
                        train_lps[i] = old[i]
        low = high = tokens = 0
        kl_sum, loss_sum, norms, updated = 0.0, 0.0, [], False   # loss: the mean over the updates made
        ent_sum, ent_tokens = 0.0, 0   # the policy's entropy at the response tokens it trains on
        skipped = 0   # updates whose gradient was not finite or carried no signal: no step taken
        for chunk in chunks:
            in_chunk = set(chunk)
            members = [i for i in range(n) if group_of[i] in in_chunk]
            if not members:
                continue
            scored = [i for i in members if not cut[i]]
            total_tokens = max(1, sum(resp_len[i] for i in scored))
            for mb in self._micro_batches(members, seq_len):
                lps, ents = self._logprobs(self.policy, seqs, plens, mb, entropy=True)
                lp = torch.cat(lps)
                ent_sum, ent_tokens = ent_sum + float(torch.cat(ents).sum()), ent_tokens + lp.numel()
                if a.updates_per_step == 1:
                    for i, x in zip(mb, lps):
                        old[i] = x.detach()
                        train_lps[i] = old[i]
                old_t = torch.cat([old[i] for i in mb])
                roll_t = torch.cat([roll[i] for i in mb]).to(dev)
                adv_t = torch.cat([torch.full((resp_len[i],), adv[i]) for i in mb]).to(dev)
                w = losses.aggregation_weights([resp_len[i] for i in mb], a.loss_agg, total_tokens,
                                               max(1, len(scored)), a.max_response_tokens)
                if any(cut[i] for i in mb):
                    w = w * torch.cat([torch.full((resp_len[i],), 0.0 if cut[i] else 1.0) for i in mb])
                w = w.to(dev)
                tis = losses.truncated_is_weight(old_t, roll_t, a.tis_cap) if a.tis_cap > 0 else None
                ref_t = None
                if self.reference is not None:
                    with torch.no_grad():
                        ref_t = torch.cat(self._logprobs(self.reference, seqs, plens, mb))
                loss, st = losses.policy_loss(lp, old_t, adv_t, w, eps_low=a.clip_eps_low, eps_high=a.clip_eps_high,
                                              tis_weight=tis, ref_logp=ref_t, kl_coef=a.kl_coef)
                loss.backward()
                if self.master is not None:
                    self._accumulate_master_grads()
                loss_sum += float(loss.detach())
                low, high, tokens, kl_sum = low + st.clipped_low, high + st.clipped_high, tokens + st.tokens, \
                    kl_sum + st.kl_sum
            norm, ok = self._optimizer_step(step)
            norms.append(norm)
            skipped += not ok
            updated = updated or ok
        mism = losses.mismatch_stats(torch.cat([t.cpu() for t in train_lps]), torch.cat(roll))
        metrics = {**mism, "overlong_filtered": sum(cut), "clip_fraction": (low + high) / max(1, tokens), "clip_fraction_low": low / max(1, tokens),
                   "clip_fraction_high": high / max(1, tokens), "loss": loss_sum / max(1, len(norms)),
                   "grad_norm": _mean_finite(norms), "updates_skipped": skipped,
                   "updated": updated, "lr": lr_at(step, cfg), "train_tokens": sum(seq_len),
                   "entropy": ent_sum / max(1, ent_tokens)}
        if self.reference is not None:
            metrics["ref_kl"] = kl_sum / max(1, tokens)
        return metrics, seqs, plens, roll, train_lps

    def _check_only(self, groups: list[ScoredGroup]) -> tuple[dict, list, list, list, list]:
        """No group survived dynamic sampling: no update, but the parity check still runs."""
        seqs = [g.prompt_ids + c.token_ids for g in groups for c in g.completions]
        plens = [len(g.prompt_ids) for g in groups for _ in g.completions]
        roll = [c.logprobs for g in groups for c in g.completions]
        lps, ents = [], []
        with torch.no_grad():
            for mb in self._micro_batches(list(range(len(seqs))), [len(s) for s in seqs]):
                lp_mb, ent_mb = self._logprobs(self.policy, seqs, plens, mb, entropy=True)
                lps += [x.detach().cpu() for x in lp_mb]
                ents += [x.cpu() for x in ent_mb]
        ent = torch.cat(ents)
        metrics = {**losses.mismatch_stats(torch.cat(lps), torch.cat(roll)), "overlong_filtered": 0,
                   "clip_fraction": 0.0, "clip_fraction_low": 0.0, "clip_fraction_high": 0.0, "loss": 0.0,
                   "grad_norm": 0.0, "updates_skipped": 0, "updated": False, "lr": lr_at(self.step_count, self.cfg),
                   "train_tokens": 0, "entropy": float(ent.mean()) if ent.numel() else 0.0}
        if self.reference is not None:
            metrics["ref_kl"] = None   # nothing trained: the same columns as a training step's record
        return metrics, seqs, plens, roll, lps

    def step(self) -> StepResult:
        """Run one training step; returns its metrics and the exact tokens and logprobs it used."""
        a = self.cfg.algorithm
        step = self.step_count
        t0 = time.perf_counter()
        kept, sampled, batches = self._rollout(step)
        t1 = time.perf_counter()
        freed = self.client.release_memory()
        if kept:
            metrics, seqs, plens, roll, train_lps = self._train(step, kept)
        else:
            metrics, seqs, plens, roll, train_lps = self._check_only(sampled)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if metrics["updated"]:
            self.client.sync_weights(self.policy)
            self.weight_version += 1
        self.client.resume_memory()
        t3 = time.perf_counter()
        self.step_count += 1
        all_comps = [c for g in sampled for c in g.completions]
        scores = [s for g in sampled for s in g.scores]
        lengths = [len(c.token_ids) for c in all_comps]
        gen_tokens = sum(lengths)
        record = {
            "step": self.step_count, "weight_version": self.weight_version,
            "reward_mean": float(np.mean(scores)), "reward_std": float(np.std(scores)),
            "reward_kept_mean": float(np.mean([r for g in kept for r in g.rewards])) if kept else None,
            "response_length_mean": float(np.mean(lengths)), "response_length_max": int(max(lengths)),
            "response_clip_ratio": float(np.mean([c.finish_reason == "length" for c in all_comps])),
            "overlong_penalty_mean": float(np.mean([r - s for g in sampled for r, s in zip(g.rewards, g.scores)])),
            **metrics,
            "groups_sampled": len(sampled), "groups_kept": len(kept), "gen_batches": batches,
            "dynamic_sampling": a.dynamic_sampling,
            "time_generate_s": t1 - t0, "time_train_s": t2 - t1, "time_sync_s": t3 - t2, "time_step_s": t3 - t0,
            "tokens_per_s": gen_tokens / max(t3 - t0, 1e-9), "kv_freed_gib": freed / 2**30,
            "data_consumed": self.sampler.consumed,
        }
        return StepResult(record, seqs, plens, roll, train_lps)

    def mismatch_error(self, record: dict) -> str | None:
        if self.cfg.model.numerics != "invariant" or not self.cfg.run.require_zero_mismatch:
            return None
        if record["logprob_diff_max"] == 0.0:
            return None
        return (f"step {record['step']}: in invariant mode the trainer's logprobs differ from the rollout's "
                f"(max |diff| {record['logprob_diff_max']:.3g}, mean {record['logprob_diff_mean']:.3g}); "
                "`vllm parity --numerics invariant` finds the first op that differs")

    # ---- evaluation ------------------------------------------------------------------------
    def evaluate(self) -> dict:
        """Greedy responses to the evaluation problems; mean reward. Changes no training state."""
        reqs = [RolloutRequest(ids, 1, 0) for ids in self.eval_prompt_ids]
        groups = self.client.generate(reqs, RolloutSettings(0.0, 1.0, self.cfg.algorithm.max_response_tokens))
        scores = [self._reward(g.completions[0].text, ex) for g, ex in zip(groups, self.eval_examples)]
        lengths = [len(g.completions[0].token_ids) for g in groups]
        return {"kind": "eval", "step": self.step_count, "eval_reward_mean": float(np.mean(scores)),
                "eval_problems": len(scores), "eval_response_length_mean": float(np.mean(lengths))}

    def _prepare_output_dir(self) -> None:
        """The output directory exists, takes files and is this run's alone, before any model
        is loaded (a path under a file or a read-only place fails now, in one line, not after
        the first step; a second `vllm train` into it is refused while this one's process holds its
        mark). The earlier run's checkpoints that --overwrite drops go only once the engine or
        the rollout servers are up (_start_checkpoints): a refusal found while building them
        loses nothing."""
        out = self.output_dir
        ckpts = os.path.join(out, "checkpoints")
        _writable_dir(out, out, "files", before=lambda: _claim_output_dir(out))
        if os.path.exists(ckpts) and not os.path.isdir(ckpts) and not self.cfg.run.overwrite:
            raise ValueError(f"--output-dir {out!r}: {ckpts!r} is not a directory")

    def _start_checkpoints(self) -> None:
        """--overwrite (without --resume) removes the earlier run's checkpoints (its `latest`
        left behind would make a later --resume continue the old run under the new config),
        its TensorBoard events (their curves would mix with the new run's) and its W&B run id
        (the new run gets its own W&B run)."""
        out = self.output_dir
        ckpts = os.path.join(out, "checkpoints")

        def drop_earlier_run():
            if not (self.cfg.run.overwrite and self.resume_from is None):
                return
            for path in (ckpts, os.path.join(out, "tensorboard"), os.path.join(out, WANDB_ID_FILE)):
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                elif os.path.lexists(path):
                    os.remove(path)
        _writable_dir(out, ckpts, "checkpoints", before=drop_earlier_run)

    # ---- checkpoints -------------------------------------------------------------------------
    def save(self) -> str:
        """Checkpoint this step: the state is copied to host memory now (what a resume
        restores) and written by the checkpoint writer, in the background unless
        `run.checkpoint_background` is off. Returns the checkpoint's path; `self.checkpoints.wait()`
        blocks until it is on disk."""
        cfg = self.cfg
        state = {
            "step": self.step_count, "weight_version": self.weight_version, "data": self.sampler.state_dict(),
            "seed": cfg.run.seed, "rollout_seed": "sha256('rollout:{seed}:{step}:{batch}:{index}')[:8] & (2**62 - 1)",
            "numerics": cfg.model.numerics, "derived_knobs": self.derived_knobs,
        }
        reference = self.reference.model.state_dict() if self.reference is not None else None
        snap = snapshot_checkpoint(trainer_state=state, policy=self.policy, optimizer=self.optimizer,
                                   master_weights=self.master, reference=reference,
                                   config_yaml=self.raw_config.to_yaml(),
                                   contract_json=self.client.execution_contract().to_json())
        return self.checkpoints.submit(snap, checkpoint_path(self.output_dir, self.step_count))

    def config_changes_since(self, ckpt: Checkpoint) -> list[str]:
        saved = _as_resolved_then(TrainConfig.from_dict(_yaml_load(ckpt.config_yaml))).flat()
        now = self.cfg.flat()
        return sorted(k for k in now if k not in RESUME_FREE_KNOBS and now[k] != saved.get(k))

    def _restore(self, ckpt: Checkpoint) -> None:
        from vllm.contract import ExecutionContract

        state = ckpt.trainer_state
        if state["seed"] != self.cfg.run.seed:
            raise ValueError(f"--resume: the checkpoint was made with seed {state['seed']}, this run has "
                             f"seed {self.cfg.run.seed}")
        self.sampler.load_state_dict(state["data"])
        contract = ExecutionContract.from_json(ckpt.contract_json)
        try:
            self.client.load_weights(ckpt.hf_weights(), contract)
        except ValueError as err:
            raise ValueError(f"--resume {ckpt.path}: {err}") from None
        ts = ckpt.training_state()
        if (ts["master_weights"] is None) != (self.master is None):
            raise ValueError("--resume: the checkpoint and this run disagree on master_weights")
        if self.master is not None:
            with torch.no_grad():
                for m, saved in zip(self.master, ts["master_weights"]):
                    m.copy_(saved)
        self.optimizer.load_state_dict(ts["optimizer"])
        if (ts["reference"] is None) != (self.reference is None):
            raise ValueError("--resume: the checkpoint and this run disagree on kl_coef > 0 (the frozen reference)")
        if self.reference is not None:
            self.reference.model.load_state_dict(ts["reference"])
        set_rng_state(ckpt.rng_state())
        self.step_count = int(state["step"])
        self.weight_version = int(state["weight_version"])

    # ---- the whole run --------------------------------------------------------------------------
    def run(self) -> list[dict]:
        cfg = self.cfg
        changes = self.config_changes_since(self.resume_from) if self.resume_from is not None else []
        log = MetricsLogger(self.output_dir, cfg.run.steps, self.step_count, cfg.run.tensorboard, cfg.run.progress,
                            stream=self.stream, wandb_project=cfg.run.wandb_project,
                            wandb_config=self.raw_config.to_dict())
        with open(os.path.join(self.output_dir, "config.yaml"), "w") as f:
            f.write(self.raw_config.to_yaml())
        records = []
        t_start = time.perf_counter()
        try:
            log.write(self._banner())
            if changes:
                log.write(f"warning: resuming with changed knobs {changes}: the run will not continue bit-exactly")
            if self.step_count >= cfg.run.steps:
                log.write(f"already at step {self.step_count} of {cfg.run.steps}: nothing to do (raise --steps)")
            if self.eval_note:
                log.write(self.eval_note)
            ignored = self._ignored_knobs()
            if ignored:
                log.write(f"note: {', '.join(ignored)} apply only with --rollout-url: ignored here")
            if self.eval_examples and self.step_count == 0:
                records.append(self.evaluate())
                log.log(records[-1])
            while self.step_count < cfg.run.steps:
                result = self.step()
                log.log(result.metrics)
                records.append(result.metrics)
                err = self.mismatch_error(result.metrics)
                if err is not None:
                    raise MismatchError(err)
                s = self.step_count
                if self.eval_examples and (s % cfg.run.eval_interval == 0 or s == cfg.run.steps):
                    records.append(self.evaluate())
                    log.log(records[-1])
                if (cfg.run.checkpoint_interval > 0 and s % cfg.run.checkpoint_interval == 0) or s == cfg.run.steps:
                    path = self.save()
                    log.write(f"checkpoint: {path}" + (" (being written)" if self.checkpoints.background else ""))
            self.checkpoints.wait()  # the last checkpoint is on disk before the run reports done
            done = summary_line(records, time.perf_counter() - t_start)
            if done is not None:
                log.write(done)
        finally:
            try:
                self.checkpoints.wait()  # never leave a write running behind an error
            except OSError as err:
                log.write(f"checkpoint write failed: {err}")
            plots = log.close(plots=cfg.run.plots)
            if hasattr(self.client, "close"):
                self.client.close()
        for p in plots:
            print(f"plot: {p}", file=self.stream or sys.stdout)
        return records

    def _banner(self) -> str:
        cfg = self.cfg
        a, m = cfg.algorithm, cfg.model
        src = cfg.data.data or f"task {cfg.data.task}"
        where = f"resumed at step {self.step_count}" if self.resume_from is not None else "from scratch"
        return (f"vllm train: {a.algorithm} on {src} ({len(self.train_examples)} problems), model {self.model_dir}, "
                f"{self.device} {str(self.policy.dtype).replace('torch.', '')}, numerics={m.numerics}, "
                f"{a.prompts_per_step} prompts x {a.group_size} responses/step, {cfg.run.steps} steps, {where}; "
                f"sleep mode {'on' if self.sleep else 'off'}; output {self.output_dir}"
                + (f"; rollouts on {m.rollout_url} (weights by {m.weight_sync})" if m.rollout_url else ""))


def _as_resolved_then(saved: TrainConfig) -> TrainConfig:
    """A checkpoint's config resolved as the run that wrote it resolved it. Configs saved
    before the knobs were pinned (_pin_resolved_knobs) leave them unset: lr_decay_steps was
    the run's steps, DAPO's overlong buffer max_response_tokens // 4."""
    a = saved.algorithm
    if a.overlong_buffer is None and a.algorithm == "dapo":
        a.overlong_buffer = a.max_response_tokens // 4
    if saved.optim.lr_decay_steps is None:
        saved.optim.lr_decay_steps = saved.run.steps
    return saved.resolved()


def _yaml_load(text: str) -> dict:
    import yaml
    return yaml.safe_load(text) or {}


def train(config: TrainConfig | dict, **kwargs) -> list[dict]:
    """Run a whole training job; returns the metrics records."""
    if isinstance(config, dict):
        config = TrainConfig.from_dict(config)
    return Trainer(config, **kwargs).run()


__all__ = ["Trainer", "StepResult", "MismatchError", "train", "lr_at", "rollout_seed", "SECTIONS"]
