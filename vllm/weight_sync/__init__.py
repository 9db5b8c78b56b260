"""Weight sync: a running engine takes new weights in place, from a trainer.

- `session`: one update (begin -> load(bucket)... -> finish), validation, the load-rule
  cast, undo of a failed update; `update_weights` is the one-bucket case;
- `bucket`: flat buffers of many tensors and their layout (what every transport moves);
- transports: `ipc` (another process on this node: CUDA IPC handles, or shared memory on
  CPU), `group` (another GPU or node: a stateless process group the trainer broadcasts
  over), a checkpoint path (`staging`: read, cast and validated on a thread while the
  engine serves, then copied in during a short pause; EngineCore.utility_update_weights_from_path);
- `client`: the trainer's side of a server's HTTP weight endpoints;
- `transfer`: upstream vLLM's four-phase transfer (init, start, update x N, finish) and
  TRL's per-tensor protocol, as sessions of one engine over a `group`.

docs/serving.md ("Weight sync") describes the API, the transports and the checks.
"""
from vllm.weight_sync.bucket import FlatBucket, pack, plan_buckets
from vllm.weight_sync.session import WeightUpdate, WeightUpdateError, plan_update, update_weights

__all__ = ["FlatBucket", "WeightUpdate", "WeightUpdateError", "pack", "plan_buckets", "plan_update", "update_weights"]
