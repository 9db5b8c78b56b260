"""On-policy RL (GRPO / DAPO) on the engine and its training view: `vllm train`.

    from vllm.rl.config import TrainConfig
    from vllm.rl.trainer import Trainer
    Trainer(TrainConfig.from_yaml("training/arithmetic_grpo.yaml")).run()

See docs/training.md. Modules: config (the knobs), data, rewards, losses, rollout
(the engine seam), trainer (the loop), metrics, checkpoint.
"""
