// The Python extension module vllm._C: importing it registers the ops in
// cache_kernels.cu under torch.ops.vllm_parity.
#include <Python.h>

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "vllm-parity CUDA ops", -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module_def); }
