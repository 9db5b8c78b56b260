"""upstream vLLM's trainer-side names that TRL's clients import, implemented on this
project's weight broadcast group (vllm/weight_sync/group.py: a TCPStore the trainer or
the engine hosts, ProcessGroupNCCL on GPUs, ProcessGroupGloo on CPU).

    utils.StatelessProcessGroup                      a rank's view of the group's store
    device_communicators.pynccl.PyNcclCommunicator   broadcasts over it
    weight_transfer.nccl_engine.NCCLWeightTransferEngine.trainer_init / trainer_send_weights
                                                     the trainer's side of /init_weight_transfer_engine
                                                     and /update_weights (flat buckets)

Only this project's server is on the other end: upstream vLLM's own rendezvous and packing
are not reproduced (docs/serving.md, "TRL").
"""
