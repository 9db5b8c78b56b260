"""/metrics: a Prometheus registry read from the AsyncLLM's counters at scrape time."""
from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.core.request import RequestStatus

if TYPE_CHECKING:
    from vllm.entrypoints.openai.serving import OpenAIServing

# the finish reasons a sequence ends with
FINISH_REASONS = tuple(s.value for s in RequestStatus if s.finished)


def metrics_registry(serving: OpenAIServing):
    """A Prometheus registry whose collector reads the AsyncLLM's counters at scrape time
    (nothing is counted on the hot path beyond plain integer additions)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    llm = serving.llm
    model = serving.names[0]

    class _Collector:
        def collect(self):
            st = llm.stats
            labels = ["model_name"]

            def gauge(name, doc, value):
                g = GaugeMetricFamily(name, doc, labels=labels)
                g.add_metric([model], value)
                return g

            def counter(name, doc, value):
                c = CounterMetricFamily(name, doc, labels=labels)
                c.add_metric([model], value)
                return c
            yield gauge("vllm:num_requests_running", "Sequences running in the engine (last step).", st.num_running)
            yield gauge("vllm:num_requests_waiting", "Sequences waiting to be scheduled (last step).", st.num_waiting)
            yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (0-1).", st.kv_usage)
            yield gauge("vllm:kv_cache_free_blocks", "KV-cache blocks free to allocate.", st.num_free_blocks)
            yield gauge("vllm:weight_version", "Weight version the engine is serving.", llm.weight_version)
            yield gauge("vllm:engine_paused", "1 while generation is paused (POST /v1/pause).", int(st.paused))
            yield gauge("vllm:engine_alive", "1 while the engine process runs.", int(llm.is_running))
            yield counter("vllm:request_received", "Requests (prompts) accepted.", llm.num_requests_received)
            yield counter("vllm:prompt_tokens", "Prompt tokens of accepted requests.", llm.num_prompt_tokens)
            yield counter("vllm:generation_tokens", "Tokens generated.", llm.num_generation_tokens)
            yield counter("vllm:num_preemptions", "Sequences preempted (KV cache full).", st.num_preemptions)
            yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                          st.prefix_cache_queries)
            yield counter("vllm:prefix_cache_hits", "Prompt tokens the prefix cache held.", st.prefix_cache_hits)
            # upstream's older names of the same values, which dashboards and routers still read
            # (the Kubernetes production-stack router: these three)
            yield gauge("vllm:gpu_cache_usage_perc", "Fraction of KV-cache blocks held by requests (0-1); "
                        "the older name of vllm:kv_cache_usage_perc.", st.kv_usage)
            yield counter("vllm:gpu_prefix_cache_queries", "The older name of vllm:prefix_cache_queries.",
                          st.prefix_cache_queries)
            yield counter("vllm:gpu_prefix_cache_hits", "The older name of vllm:prefix_cache_hits.",
                          st.prefix_cache_hits)
            c = CounterMetricFamily("vllm:request_success", "Finished sequences by finish reason.",
                                    labels=["model_name", "finished_reason"])
            # every reason from the start, at 0 until it occurs (as upstream): rate() and alerts
            # on a reason see its first increment
            finished = {reason: 0 for reason in FINISH_REASONS}
            finished.update(llm.finished_by_reason)
            for reason, n in sorted(finished.items()):
                c.add_metric([model, reason], n)
            yield c
            info = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's configuration (labels), value 1.",
                                     labels=["block_size", "num_gpu_blocks"])
            info.add_metric([str(llm.info.block_size), str(llm.info.num_kv_blocks)], 1)
            yield info
            lat, size = llm.latency, llm.sizes
            for name, doc, hist in (
                    ("vllm:time_to_first_token_seconds", "Time from acceptance to a request's first token.", lat.ttft),
                    ("vllm:inter_token_latency_seconds", "Time between a sample's consecutive tokens.", lat.itl),
                    # upstream's older name of the same histogram, which dashboards still read
                    ("vllm:time_per_output_token_seconds", "The older name of vllm:inter_token_latency_seconds.",
                     lat.itl),
                    ("vllm:e2e_request_latency_seconds", "Time from acceptance to a request's end.", lat.e2e),
                    ("vllm:request_queue_time_seconds", "Time from acceptance to the engine first scheduling a "
                     "finished request.", lat.queue),
                    ("vllm:request_prefill_time_seconds", "Time from the engine first scheduling a finished request "
                     "to its first token.", lat.prefill),
                    ("vllm:request_decode_time_seconds", "Time from a finished request's first token to its end.",
                     lat.decode),
                    ("vllm:request_inference_time_seconds", "Time from the engine first scheduling a finished "
                     "request to its end.", lat.inference),
                    ("vllm:request_time_per_output_token_seconds", "A finished request's decode time per token after "
                     "the first, of its longest sample (two tokens or more).", lat.tpot),
                    ("vllm:request_prompt_tokens", "Prompt tokens of each finished sample.", size.prompt),
                    ("vllm:request_generation_tokens", "Tokens generated by each finished sample.", size.generation),
                    ("vllm:request_max_num_generation_tokens", "A finished request's longest sample, in tokens.",
                     size.max_generation),
                    ("vllm:request_params_n", "A finished request's n.", size.n),
                    ("vllm:request_params_max_tokens", "A finished request's max_tokens, when given.",
                     size.max_tokens)):
                with llm._lock:   # one consistent snapshot of the counts
                    buckets, total = hist.cumulative(), hist.sum
                h = HistogramMetricFamily(name, doc, labels=labels)
                h.add_metric([model], buckets, sum_value=total)
                yield h

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return registry
