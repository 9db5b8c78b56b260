import os as _os

if _os.environ.get("TRITON_INTERPRET", "0") == "1":
    from vllm.kernels.interpreter_masks import install as _install_interpreter_masks

    _install_interpreter_masks()
