"""upstream vLLM's older home of `Logprob` (`from vllm.sequence import Logprob`, as older RL
frameworks import it); the class is vllm.logprobs.Logprob."""
from vllm.logprobs import Logprob

__all__ = ["Logprob"]
