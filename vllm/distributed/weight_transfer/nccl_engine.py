"""upstream vLLM's trainer-side NCCL weight transfer names (the ones TRL's `VLLMClient`
calls), sending this project's flat buckets with its handshake and outcome flags
(vllm/weight_sync/group.py) to a server's /update_weights."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
from vllm.distributed.utils import StatelessProcessGroup
from vllm.weight_sync.bucket import DEFAULT_BUCKET_BYTES


@dataclass
class NCCLTrainerSendWeightsArgs:
    group: Any                                   # the PyNcclCommunicator of trainer_init
    src: int = 0                                 # the trainer's rank
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor] | None = None
    packed: bool = False                         # always bucketed here; kept for upstream's callers
    stream: Any = None
    packed_buffer_size_bytes: int = DEFAULT_BUCKET_BYTES   # must equal the update_info's (same default)
    packed_num_buffers: int = 2


class NCCLWeightTransferEngine:
    """The trainer's side: `trainer_init` makes the group (the trainer is rank 0 and hosts
    its store), `trainer_send_weights` broadcasts one update_weights call's tensors."""

    @staticmethod
    def trainer_init(init_info: dict | Any) -> PyNcclCommunicator:
        get = init_info.get if isinstance(init_info, dict) else lambda k, d=None: getattr(init_info, k, d)
        pg = StatelessProcessGroup.create(get("master_address"), int(get("master_port")), 0, int(get("world_size")))
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        comm = PyNcclCommunicator(pg, device)
        comm.engine_rank = int(get("rank_offset", 1))
        return comm

    @staticmethod
    def trainer_send_weights(iterator: Iterator[tuple[str, torch.Tensor]],
                             trainer_args: dict | NCCLTrainerSendWeightsArgs) -> bool:
        """Broadcast the (name, tensor) pairs, in the order of the update_info the server got.
        Returns False when the server refused or failed the update: its HTTP answer says why
        (TRL raises it), and its previous weights keep serving."""
        from vllm.weight_sync.group import send_update

        args = NCCLTrainerSendWeightsArgs(**trainer_args) if isinstance(trainer_args, dict) else trainer_args
        tensor_of = args.post_iter_func or (lambda item: item[1])
        named = [(item[0], tensor_of(item).detach()) for item in iterator]
        comm: PyNcclCommunicator = args.group
        return send_update(comm.weight_group, named, args.packed_buffer_size_bytes, engine_rank=comm.engine_rank)
