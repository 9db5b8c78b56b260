"""`vllm train --backend ray`: the trainer and the rollout engines as Ray actors in one
placement group, colocated or disaggregated (docs/ray.md).

Modules: placement (the bundles and actor slots, plain data: no Ray needed), messages (the
dataclasses that cross actor boundaries), actors (the engine and trainer actor classes),
rollout (RayRollout: the trainer's rollout client over engine actors), driver (RayTrainJob:
cluster, placement group, actors, run). Ray itself is imported only by the driver and
inside actor methods, so `pip install -e .[ray]` is needed on this path only.
"""
