"""The RL protocols other tools already speak, on `vllm serve` (docs/serving.md):

upstream vLLM's RL routes: POST /init_weight_transfer_engine, /start_weight_update,
/update_weights, /finish_weight_update, /update_weight_version, /abort_weight_update
(extension), /reset_prefix_cache; GET /weight_info, /server_info. The installed TRL's
`VLLMClient` drives exactly these (with /v1/completions for generation).

TRL's own server protocol (`trl vllm-serve`, routes with trailing slashes): GET /health/,
/get_world_size/; POST /generate/, /chat/, /init_communicator/, /update_named_param/,
/reset_prefix_cache/, /close_communicator/, /get_sequence_logprobs/ (the engine's prompt
logprobs, with the trainer's bits). As TRL's server does, /init_communicator/ and /update_named_param/ answer
before the collective they start (the trainer joins or broadcasts after the answer); each
announced tensor is checked against the model first, so a bad one is a 400 before any
byte moves. The tensors go into one update that the next generation, prefix-cache reset
or close commits (vllm/weight_sync/transfer.py): no request runs on a mix.

Both sides of the wire are ours: the trainer's collectives are vllm.distributed's adapter
of the names TRL imports, on vllm/weight_sync/group.py.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Optional

from fastapi import FastAPI, Request

from vllm.entrypoints.openai.errors import (
    await_or_error, exception_response, health_response, require_scored_prompts,
)
from vllm.entrypoints.openai.protocol import (
    MAX_CHOICES_PER_REQUEST, FinishWeightUpdateRequest, MessageResponse, StartWeightUpdateRequest, TrlChatRequest,
    TrlGenerateRequest,
    TrlGenerateResponse, TrlInitCommunicatorRequest, TrlSequenceLogprobsBinaryResponse, TrlSequenceLogprobsRequest,
    TrlSequenceLogprobsResponse, TrlUpdateNamedParamRequest, UpdateWeightVersionRequest, WeightTransferInitRequest,
    WeightTransferUpdateRequest, json_logprob,
)
from vllm.sampling_params import SamplingParams
from vllm.entrypoints.openai.serving import OpenAIServing, _final_outputs, _json, _unless_disconnected, \
    trl_logprobs

logger = logging.getLogger(__name__)


class TrlSession:
    """The API process's view of TRL's per-tensor protocol: whether an implicit update may be
    open (so generation settles it first), and the background collectives in flight."""

    def __init__(self, serving: OpenAIServing):
        self.serving = serving
        self.llm = serving.llm
        self.open = False
        self.tasks: list[asyncio.Future] = []

    def background(self, coro) -> None:
        """Start a collective the trainer completes after our answer; failures are logged
        here and reported by the engine on the next call."""
        task = asyncio.ensure_future(coro)
        self.tasks = [t for t in self.tasks if not t.done()] + [task]
        task.add_done_callback(_log_failure)

    async def settle(self) -> None:
        """Commit the implicit update (or report its refusal) before anything generates."""
        if self.open:
            self.open = False
            await self.llm.weight_transfer("settle")

    def init_error(self) -> str | None:
        for t in self.tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                return str(t.exception())
        return None


def _sequence_logprobs_binary(ranked: list, sequences: list, prompt_lengths: list,
                              top_k: int) -> TrlSequenceLogprobsBinaryResponse:
    """TRL's binary layout of /get_sequence_logprobs/ (float32 values keep their bits)."""
    import base64

    import numpy as np
    lengths = [len(seq) - pl for seq, pl in zip(sequences, prompt_lengths)]
    shape = (len(sequences), max(lengths, default=0), top_k)
    values = np.full(shape, -np.inf, dtype=np.float32)
    ids = np.zeros(shape, dtype=np.int32)
    actual = np.full(shape[:2] + (1,), -np.inf, dtype=np.float32)
    actual_ids = np.zeros(shape[:2] + (1,), dtype=np.int32)
    for b, (seq_ranked, seq, pl) in enumerate(zip(ranked, sequences, prompt_lengths)):
        for t, pos in enumerate(seq_ranked):
            tok = seq[pl + t]
            actual_ids[b, t, 0] = tok
            for j, (tid, lp) in enumerate(pos):
                if tid == tok:
                    actual[b, t, 0] = lp.logprob
                if j < top_k:
                    values[b, t, j], ids[b, t, j] = lp.logprob, tid
    enc = lambda a: base64.b64encode(a.astype(a.dtype.newbyteorder("<")).tobytes()).decode("ascii")  # noqa: E731
    return TrlSequenceLogprobsBinaryResponse(logprobs_b64=enc(values), token_ids_b64=enc(ids),
                                             actual_logprobs_b64=enc(actual), actual_token_ids_b64=enc(actual_ids),
                                             shape=list(shape), completion_lengths=lengths)


def _log_failure(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("weight transfer collective failed: %s", task.exception())


async def _with_message(message: str, coro) -> dict:
    """upstream's {"message": ...} next to the engine's fields."""
    return {"message": message, **await coro}


def register_rl_routes(app: FastAPI, serving: OpenAIServing) -> TrlSession:
    llm = serving.llm
    trl = TrlSession(serving)
    serving.before_generate = trl.settle

    # ---- upstream vLLM ------------------------------------------------------------------
    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(req: WeightTransferInitRequest):
        return await await_or_error(_with_message("Weight transfer initialized",
                                                  llm.init_weight_transfer_engine(req.init_info)))

    @app.post("/start_weight_update")
    async def start_weight_update(req: Optional[StartWeightUpdateRequest] = None):
        async def go():
            if req is not None and not req.is_checkpoint_format:
                raise ValueError("only checkpoint-format (HF) weight names are accepted: is_checkpoint_format must be true")
            await trl.settle()
            res = await llm.start_weight_update()
            return MessageResponse(message="Weight update started", weight_version=res["weight_version"])
        return await await_or_error(go())

    @app.post("/update_weights")
    async def update_weights(req: WeightTransferUpdateRequest):
        return await await_or_error(_with_message("Weights updated", llm.update_weights(req.update_info)))

    @app.post("/finish_weight_update")
    async def finish_weight_update(req: Optional[FinishWeightUpdateRequest] = None):
        return await await_or_error(_with_message(
            "Weight update finished", llm.finish_weight_update(req.weight_version if req is not None else None)))

    @app.post("/abort_weight_update")
    async def abort_weight_update():
        return await await_or_error(llm.weight_transfer("abort"))

    @app.post("/update_weight_version")
    async def update_weight_version(req: UpdateWeightVersionRequest):
        async def go():
            await llm.update_weight_version(req.new_version)
            return {"success": True, "new_version": req.new_version}
        return await await_or_error(go())

    @app.get("/weight_info")
    async def weight_info():
        async def go():
            return {"weight_version": await llm.get_weight_version()}
        return await await_or_error(go())

    @app.get("/server_info")
    async def server_info(config_format: str = "json"):
        async def go():
            info = await llm.weight_transfer("info")
            return {"vllm_config": {
                "model": llm.info.model_path, "served_model_name": serving.names[0],
                "max_model_len": llm.max_model_len,
                "parallel_config": {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1,
                                    "world_size": 1},
                "weight_transfer_config": {"backend": info["backend"]},
                "device": info["device"],
            }}
        return await await_or_error(go())

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        async def go():
            await trl.settle()
            return {"success": bool(await llm.utility("reset_prefix_cache"))}
        return await await_or_error(go())

    # ---- TRL's server protocol ----------------------------------------------------------
    @app.get("/health/")
    async def trl_health():
        return health_response(llm)

    @app.get("/get_world_size/")
    async def trl_world_size():
        return {"world_size": 1}

    @app.post("/generate/")
    async def trl_generate(req: TrlGenerateRequest, raw: Request):
        try:
            if req.images and any(i is not None for i in req.images):
                raise ValueError("images are not supported")
            if not req.prompts:
                raise ValueError("prompts is empty")
            prompts = [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in req.prompts]
            return await _trl_run(prompts, req, raw)
        except Exception as err:  # noqa: BLE001
            return exception_response(err)

    @app.post("/chat/")
    async def trl_chat(req: TrlChatRequest, raw: Request):
        try:
            if not req.messages:
                raise ValueError("messages is empty")
            kwargs = dict(req.chat_template_kwargs)
            if req.tools:
                kwargs["tools"] = req.tools
            convs = [[m.to_template_dict() for m in conv] for conv in req.messages]
            # rendered and tokenized off the event loop (a batch of long conversations takes seconds)
            prompts = await serving.llm.on_prompt_thread(lambda tok: [
                {"prompt_token_ids": serving.chat_prompt_ids(conv, kwargs, req.chat_template, tokenizer=tok)}
                for conv in convs])
            return await _trl_run(prompts, req, raw)
        except Exception as err:  # noqa: BLE001
            return exception_response(err)

    async def _trl_run(prompts, req, raw: Request):
        extra = req.ignored_fields()
        if extra:   # a field of another TRL version this server does not know: said, not silent
            logger.warning("TRL %s: ignoring unknown request fields: %s", raw.url.path, ", ".join(extra))
        params = req.to_sampling_params(serving.max_logprobs)
        if len(prompts) * params.n > MAX_CHOICES_PER_REQUEST:
            raise ValueError(f"a request may ask for at most {MAX_CHOICES_PER_REQUEST} completions (prompts x n), "
                             f"got {len(prompts)} x {params.n}")
        await trl.settle()
        rid = f"trl-{uuid.uuid4().hex}"
        streams = await llm.add_requests([(f"{rid}-{i}", p, params) for i, p in enumerate(prompts)])

        async def collect():
            try:
                finals = await _final_outputs(streams)
            except Exception as err:  # noqa: BLE001
                return exception_response(err)
            values, ids = trl_logprobs(finals, params.logprobs)
            version = max(v for out in finals for c in out.outputs for v in (c.weight_versions or [0]))
            return _json(TrlGenerateResponse(
                prompt_ids=[list(out.prompt_token_ids) for out in finals],
                completion_ids=[list(c.token_ids) for out in finals for c in out.outputs],
                logprobs=values, logprob_token_ids=ids, weight_version=version))
        return await _unless_disconnected(raw, collect(), streams)

    @app.post("/get_sequence_logprobs/")
    async def trl_sequence_logprobs(req: TrlSequenceLogprobsRequest, raw: Request):
        try:
            req.validate_sequences(serving.max_logprobs)
            # one sampled token per sequence is the engine's minimum; it is not reported
            params = SamplingParams(max_tokens=1, temperature=req.temperature, prompt_logprobs=req.top_logprobs)
            await trl.settle()
            rid = f"trl-logprobs-{uuid.uuid4().hex}"
            streams = await llm.add_requests([(f"{rid}-{i}", {"prompt_token_ids": list(seq)}, params)
                                              for i, seq in enumerate(req.sequences)])
        except Exception as err:  # noqa: BLE001
            return exception_response(err)

        async def collect():
            try:
                finals = await _final_outputs(streams)
                require_scored_prompts(finals)
            except Exception as err:  # noqa: BLE001
                return exception_response(err)
            ranked = [[sorted(entry.items(), key=lambda kv: kv[1].rank) if entry is not None else []
                       for entry in out.prompt_logprobs[pl:]]
                      for out, pl in zip(finals, req.prompt_lengths)]
            if req.response_format == "binary":
                return _json(_sequence_logprobs_binary(ranked, req.sequences, req.prompt_lengths, req.top_logprobs))
            return _json(TrlSequenceLogprobsResponse(
                logprobs=[[[json_logprob(lp.logprob) for _, lp in pos] for pos in seq] for seq in ranked],
                logprob_token_ids=[[[tid for tid, _ in pos] for pos in seq] for seq in ranked]))
        return await _unless_disconnected(raw, collect(), streams)

    @app.post("/init_communicator/")
    async def trl_init_communicator(req: TrlInitCommunicatorRequest):
        async def go():
            if req.world_size != 2:
                raise ValueError(f"this server is one engine (get_world_size/ is 1): world_size must be 2, "
                                 f"got {req.world_size}")
            if req.contract is not None:
                from vllm.contract import ExecutionContract
                ours = ExecutionContract.from_dict(await llm.utility("execution_contract"))
                try:
                    theirs = ExecutionContract.from_dict(req.contract)
                except Exception as err:  # noqa: BLE001
                    raise ValueError(f"malformed contract: {type(err).__name__}: {err}") from None
                ours.check_compatible(theirs)
            await trl.settle()
            trl.tasks = []
            # the trainer connects after this answer: the engine waits for it in the background
            trl.background(llm.weight_transfer("init_trl", req.host, req.port, req.world_size,
                                               req.client_device_uuid, req.contract))
            return {"message": "Request received, initializing communicator"}
        return await await_or_error(go())

    @app.post("/update_named_param/")
    async def trl_update_named_param(req: TrlUpdateNamedParamRequest):
        async def go():
            try:
                await llm.weight_transfer("check_trl", req.name, req.dtype, list(req.shape))
            except ValueError as err:
                failed = trl.init_error()
                if failed is not None and "no weight transfer group" in str(err):
                    raise ValueError(f"the communicator could not be made: {failed}") from None
                raise
            trl.open = True
            # the trainer broadcasts after this answer: the engine receives it in the background
            trl.background(llm.weight_transfer("receive_trl", req.name, req.dtype, list(req.shape)))
            return {"message": "Request received, updating named parameter"}
        return await await_or_error(go())

    @app.post("/reset_prefix_cache/")
    async def trl_reset_prefix_cache():
        async def go():
            await trl.settle()
            ok = bool(await llm.utility("reset_prefix_cache"))
            return {"message": f"Request received, resetting prefix cache status: {ok}"}
        return await await_or_error(go())

    @app.post("/close_communicator/")
    async def trl_close_communicator():
        async def go():
            try:
                await trl.settle()
            finally:
                await llm.weight_transfer("close")
            return {"message": "Request received, closing communicator"}
        return await await_or_error(go())

    return trl
