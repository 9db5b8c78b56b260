"""vllm-parity: a rollout engine whose logprobs match the trainer's bit for bit.

The offline API keeps upstream vLLM's names.
"""
from vllm.inputs import PromptType, TextPrompt, TokensPrompt
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "PromptType", "TextPrompt", "TokensPrompt", "__version__"]


def __getattr__(name):
    # LLM pulls in torch and the engine: import it lazily so `vllm --help` stays fast.
    if name == "LLM":
        from vllm.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)
