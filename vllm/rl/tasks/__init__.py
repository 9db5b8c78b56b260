"""Built-in tasks: problems generated locally, each with a checkable answer.

A task is a module `vllm.rl.tasks.<name>` with
`generate_problems(n, seed, split) -> list[{"prompt": chat messages, "answer": str}]`
(deterministic; the "train" and "test" splits never share a problem). `vllm train
--task <name>` uses it instead of a data file (vllm/rl/data.py).
"""
