// The Python extension module vllm._C, built from csrc/ by CMakeLists.txt where nvcc and a
// CUDA build of torch exist (setup.py; a failed build leaves the install working).
//
// csrc/ is the home of compiled ops. An op lives here when a measurement (benchmarks/NOTES.md)
// shows it beats its Triton form, or when it does what Triton cannot, e.g. choosing a
// cuBLASLt algorithm beyond torch's first heuristic. No op qualifies today (the paged KV
// write runs in Triton, vllm/kernels/cache_write.py, and no measurement shows a compiled
// form faster), so the module registers nothing, and setup.py does not build it until
// csrc/ holds an op (a .cu source). To add an op:
//   * implement it in csrc/<op>.cu and register it with TORCH_LIBRARY(vllm_parity, m) /
//     TORCH_LIBRARY_IMPL(vllm_parity, CUDA, m) (importing vllm._C then registers
//     torch.ops.vllm_parity.<op>);
//   * expose it in vllm/_custom_ops.py next to its torch reference, and name it in the
//     numerics table (vllm/kernels/numerics_table.py) if it is the production kernel;
//   * test it against the reference in tests/test_custom_ops.py (bit patterns) and put the
//     measurement that justifies it in benchmarks/NOTES.md.
#include <Python.h>

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "vllm-parity compiled ops", -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module_def); }
