"""The output side of a request: token-id deltas -> RequestOutputs, for offline and served
requests alike.

The engine turns each step's progress into per-sample deltas (`LLMEngine.deltas`: new token
ids, raw logprobs, the finish). A RequestState detokenizes each sample incrementally,
applies stop strings, gives logprob entries their decoded text and sums cumulative_logprob
in token order. The offline engine feeds its own RequestStates in its process; a served
engine sends the same deltas to its API server process (vllm/engine/core.py), whose
RequestStates do the same work there. One pipeline, so a served request's text, token ids
and finish reason equal the offline engine's.

A stop string found here ends the sample: its token ids stop at the token that completed
the string. Offline the engine finishes the sample at once; a served engine hears of it by
StopChild, and tokens it sampled before that message arrived are dropped here.
"""
from __future__ import annotations

from vllm.engine.core_messages import RequestDelta
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.tokenizer import IncrementalDetokenizer, find_stop_string


class TokenTextCache:
    """Decoded text of single tokens (logprob entries), shared by all requests."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text


class RequestState:
    """All samples of one request as the client sees them."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "params", "token_ids", "detoks", "logprobs",
                 "cumulative", "finish", "stop_reason", "weight_versions", "num_cached_tokens", "_decode",
                 "prompt_logprobs", "_stop_buffer")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer, decode_one: TokenTextCache):
        n = params.n
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.token_ids: list[list[int]] = [[] for _ in range(n)]
        self.detoks = [IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
                       if params.detokenize else None for _ in range(n)]
        self.logprobs: list[list[dict[int, Logprob]]] | None = [[] for _ in range(n)] if params.logprobs is not None else None
        self.cumulative = [0.0] * n
        self.finish: list[str | None] = [None] * n
        self.stop_reason: list[int | str | None] = [None] * n
        self.weight_versions: list[list[int]] = [[] for _ in range(n)]
        self.num_cached_tokens = 0
        # detokenize=False: no text anywhere, the logprobs' decoded_token included (None, as upstream)
        self._decode = decode_one if params.detokenize else _no_text
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self._stop_buffer = max((len(s) for s in params.stop_strings), default=1) - 1

    @property
    def finished(self) -> bool:
        return all(f is not None for f in self.finish)

    def apply(self, d: RequestDelta) -> str | None:
        """Add one delta. Returns the stop string that just ended the sample, if any (the
        caller must tell the engine to stop it)."""
        i = d.index
        if self.finish[i] is not None:
            return None  # sampled after a stop string, before the engine heard of it
        self.weight_versions[i] = d.weight_versions
        if i == 0:
            # the request's count is its first sample's: that one computes the prompt, and its
            # n > 1 siblings wait for its blocks (their hits would count the same prompt again)
            self.num_cached_tokens = d.num_cached_tokens
        if d.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] + [None if e is None else self._entry(tok, *e)
                                             for tok, e in zip(self.prompt_token_ids[1:], d.prompt_logprobs)]
        ids = self.token_ids[i]
        detok = self.detoks[i]
        stops = self.params.stop_strings
        last = len(d.new_token_ids) - 1
        # eos or a stop token ended the sample: its text stays out (as upstream), unless asked for
        token_stop = d.finish_reason == "stop"
        for k, tok in enumerate(d.new_token_ids):
            ids.append(tok)
            if self.logprobs is not None and d.new_logprobs is not None:
                lp, rank, top = d.new_logprobs[k]
                self.logprobs[i].append(self._entry(tok, lp, rank, top))
                self.cumulative[i] += lp
            if detok is None or (k == last and token_stop and not self.params.include_stop_str_in_output):
                continue
            before = len(detok.text)
            detok.append(tok)
            if not stops:
                continue
            if len(ids) <= self.params.min_tokens:
                # stop strings wait for min_tokens; the first token after may complete one
                # that started before (as upstream)
                continue
            hit = find_stop_string(detok.text, before, stops)
            if hit is None:
                continue
            pos, s = hit
            detok.text = detok.text[:pos + len(s)] if self.params.include_stop_str_in_output else detok.text[:pos]
            # the string is the stop reason, also where eos / a stop token ended the sample in the
            # same step (as upstream); then the engine has stopped it already
            self.finish[i] = "stop"
            self.stop_reason[i] = s
            return None if k == last and token_stop else s
        if d.finish_reason is not None:
            self.finish[i] = d.finish_reason
            self.stop_reason[i] = d.stop_reason
        return None

    def _entry(self, tok: int, lp: float, rank: int, top: list) -> dict[int, Logprob]:
        """One token's logprob entry: the token itself (its true rank), then the top-k
        alternatives (rank = position, best first) not already in it."""
        entry = {tok: Logprob(lp, rank, self._decode(tok))}
        for r, (tid, tlp) in enumerate(top, start=1):
            if tid not in entry:
                entry[tid] = Logprob(tlp, r, self._decode(tid))
        return entry

    def fail(self) -> None:
        self.finish = [f or "abort" for f in self.finish]

    def _text(self, i: int) -> str:
        """Sample i's text as a reader may see it: while it runs, without the last characters
        a stop string may be completing (they are cut if it completes), so text read while
        streaming only ever grows (upstream's stop buffer)."""
        detok = self.detoks[i]
        if detok is None:
            return ""
        hold = 0 if self.finish[i] is not None or self.params.include_stop_str_in_output else self._stop_buffer
        return detok.text[:max(0, len(detok.text) - hold)] if hold else detok.text

    def output_tail(self, marks: list[list[int]]) -> RequestOutput:
        """output() with each sample's text, token ids and logprobs only past marks[i] =
        [characters, tokens] already handed out, then advances the marks: the cost of a call is
        what is new, not the sample's length (a streamed response's chunks). The text holds
        back what _text holds back; the prompt fields are output()'s (not copied)."""
        lps = self.logprobs
        outs = []
        for i in range(len(self.finish)):
            t0, n0 = marks[i]
            detok = self.detoks[i]
            text = ""
            if detok is not None:
                hold = 0 if self.finish[i] is not None or self.params.include_stop_str_in_output else self._stop_buffer
                end = len(detok.text) - hold
                if end > t0:
                    text = detok.text[t0:end]
                    marks[i][0] = end
            ids = self.token_ids[i]
            marks[i][1] = len(ids)
            outs.append(CompletionOutput(index=i, text=text, token_ids=ids[n0:],
                                         cumulative_logprob=self.cumulative[i] if lps is not None else None,
                                         logprobs=lps[i][n0:] if lps is not None else None,
                                         finish_reason=self.finish[i], stop_reason=self.stop_reason[i],
                                         weight_versions=list(self.weight_versions[i])))
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, self.prompt_logprobs, outs,
                             self.finished, num_cached_tokens=self.num_cached_tokens)

    def output(self) -> RequestOutput:
        lps = self.logprobs
        outs = [CompletionOutput(index=i, text=self._text(i),
                                 token_ids=list(self.token_ids[i]),
                                 cumulative_logprob=self.cumulative[i] if lps is not None else None,
                                 logprobs=list(lps[i]) if lps is not None else None,
                                 finish_reason=self.finish[i], stop_reason=self.stop_reason[i],
                                 weight_versions=list(self.weight_versions[i]))
                for i in range(len(self.finish))]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, self.prompt_logprobs, outs,
                             self.finished, num_cached_tokens=self.num_cached_tokens)


def _no_text(token_id: int) -> None:
    return None
