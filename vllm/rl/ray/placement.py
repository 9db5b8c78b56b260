"""Where the trainer and the rollout engines run: one Ray placement group, planned as plain data.

A plan is a list of bundles ({"CPU": c} on CPU, {"GPU": 1, "CPU": c} on GPUs) and, for every
actor, the bundle it sits in and the share of that bundle's resources it asks for. Nothing
here imports Ray: the driver hands `plan.bundles` and `plan.strategy` to
`ray.util.placement_group` and each slot's `num_cpus` / `num_gpus` / bundle index to
`actor.options(...)`, and tests check plans for clusters that are not there (2 nodes x 8 GPUs).

- colocated: trainer rank r and engine e share bundle b (sleep mode frees the engine's KV
  cache while the trainer runs). Engine e spans bundles [e*tp, (e+1)*tp); the group has
  max(trainer ranks, engines x tp) bundles, and a bundle holding k actors gives each 1/k of
  it. An engine whose first bundle holds a trainer rank takes weights by IPC from it
  (CUDA IPC handles; shared memory on CPU); one in a bundle of its own, over the broadcast
  group.
- disaggregated: the trainer's bundles first, then every engine's (slime's order); every
  actor has its bundle to itself and every engine takes weights over the broadcast group.

Strategy PACK: Ray fills a node before the next, so with uniform bundles bundle i lands on
node i // bundles_per_node. The plan relies on that only to refuse layouts in which an
engine's tensor-parallel bundles would straddle two nodes.
"""
from __future__ import annotations

from dataclasses import dataclass

PLACEMENTS = ("colocated", "disaggregated")
DEVICES = ("cpu", "cuda")
ROLES = ("trainer", "engine")
WEIGHT_ROUTES = ("ipc", "broadcast")


@dataclass(frozen=True)
class ActorSlot:
    """One actor: its role and index (trainer rank or engine number), the bundles its work
    spans (the actor itself sits in `bundles[0]`; an engine's tensor-parallel workers
    would take the rest) and the resources it asks for in its bundle."""
    role: str
    index: int
    bundles: tuple[int, ...]
    num_cpus: float
    num_gpus: float
    weight_route: str | None = None   # engines: "ipc" (shares the trainer's bundle) | "broadcast"

    @property
    def bundle(self) -> int:
        return self.bundles[0]


@dataclass(frozen=True)
class PlacementPlan:
    placement: str
    device: str
    bundles: tuple[dict, ...]
    strategy: str
    trainer: tuple[ActorSlot, ...]
    engines: tuple[ActorSlot, ...]
    cpus_per_bundle: int
    bundles_per_node: int | None   # known for GPU plans of a given node size; None: one node or unknown

    @property
    def total_cpus(self) -> int:
        return sum(b.get("CPU", 0) for b in self.bundles)

    @property
    def total_gpus(self) -> int:
        return sum(b.get("GPU", 0) for b in self.bundles)

    def node_of(self, bundle: int) -> int:
        """The node PACK puts `bundle` on (0 when the plan fits one node)."""
        return bundle // self.bundles_per_node if self.bundles_per_node else 0

    def actors_in(self, bundle: int) -> list[ActorSlot]:
        return [s for s in (*self.trainer, *self.engines) if s.bundle == bundle]

    def describe(self) -> list[str]:
        """One line per bundle: its resources, its node, who sits in it (docs/ray.md shows these)."""
        lines = []
        for i, b in enumerate(self.bundles):
            res = ", ".join(f"{k} {v:g}" for k, v in b.items())
            who = [f"{s.role} {s.index}" + (f" ({s.weight_route})" if s.weight_route else "")
                   for s in (*self.trainer, *self.engines) if s.bundle == i]
            who += [f"engine {s.index} tp worker" for s in self.engines if i in s.bundles[1:]]
            lines.append(f"bundle {i:>2} node {self.node_of(i)}: {res}: {', '.join(who) or '-'}")
        return lines


def plan_placement(*, engines: int, placement: str = "colocated", device: str = "cuda", trainer_ranks: int = 1,
                   engine_gpus: int = 1, cpus_per_bundle: int = 1, nodes: int | None = None,
                   gpus_per_node: int | None = None) -> PlacementPlan:
    """The bundles and actor slots of one training job; ValueError names what does not fit.

    `engine_gpus`: GPUs (bundles) per engine, its tensor-parallel size (1 on CPU).
    `nodes` x `gpus_per_node`: the cluster the plan must fit (GPU plans; None: not checked)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    for name, v in (("engines", engines), ("trainer_ranks", trainer_ranks), ("engine_gpus", engine_gpus),
                    ("cpus_per_bundle", cpus_per_bundle)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if device == "cpu" and engine_gpus != 1:
        raise ValueError(f"engine_gpus={engine_gpus} needs device cuda: a CPU engine is one bundle")
    if (nodes is None) != (gpus_per_node is None):
        raise ValueError("give nodes and gpus_per_node together (or neither)")
    if nodes is not None and (nodes < 1 or gpus_per_node < 1):
        raise ValueError(f"nodes and gpus_per_node must be >= 1, got {nodes} x {gpus_per_node}")
    if nodes is not None and device == "cpu":
        raise ValueError("nodes x gpus_per_node describes a GPU cluster; a CPU plan does not use it")

    engine_bundles = engines * engine_gpus
    if placement == "colocated":
        n = max(trainer_ranks, engine_bundles)
        trainer_bundles = [(r,) for r in range(trainer_ranks)]
        engine_spans = [tuple(range(e * engine_gpus, (e + 1) * engine_gpus)) for e in range(engines)]
    else:
        n = trainer_ranks + engine_bundles
        trainer_bundles = [(r,) for r in range(trainer_ranks)]
        engine_spans = [tuple(range(trainer_ranks + e * engine_gpus, trainer_ranks + (e + 1) * engine_gpus))
                        for e in range(engines)]

    per_node = gpus_per_node if device == "cuda" else None
    if nodes is not None and n > nodes * gpus_per_node:
        raise ValueError(f"{placement} placement of {trainer_ranks} trainer rank(s) and {engines} engine(s) x "
                         f"{engine_gpus} GPU(s) needs {n} GPUs; the cluster has {nodes} x {gpus_per_node}")
    if per_node:
        for e, span in enumerate(engine_spans):
            if len({b // per_node for b in span}) > 1:
                raise ValueError(f"engine {e}'s {engine_gpus} tensor-parallel GPUs (bundles {span[0]}-{span[-1]}) "
                                 f"would straddle two nodes of {per_node} GPUs: choose engine_gpus dividing "
                                 f"{per_node} and a trainer that fills whole multiples of it")

    bundle = {"GPU": 1, "CPU": cpus_per_bundle} if device == "cuda" else {"CPU": cpus_per_bundle}
    # a bundle is split evenly among the actors (or an engine's tensor-parallel workers) in it
    occupants = [0] * n
    for span in (*trainer_bundles, *engine_spans):
        for b in span:
            occupants[b] += 1

    def slot(role: str, index: int, span: tuple[int, ...], route: str | None = None) -> ActorSlot:
        share = 1.0 / occupants[span[0]]
        return ActorSlot(role, index, span, num_cpus=cpus_per_bundle * share,
                         num_gpus=share if device == "cuda" else 0.0, weight_route=route)

    trainer_first = {span[0] for span in trainer_bundles}
    trainer = tuple(slot("trainer", r, span) for r, span in enumerate(trainer_bundles))
    engine_slots = tuple(slot("engine", e, span, "ipc" if span[0] in trainer_first else "broadcast")
                         for e, span in enumerate(engine_spans))
    return PlacementPlan(placement=placement, device=device, bundles=tuple(dict(bundle) for _ in range(n)),
                         strategy="PACK", trainer=trainer, engines=engine_slots, cpus_per_bundle=cpus_per_bundle,
                         bundles_per_node=per_node)
