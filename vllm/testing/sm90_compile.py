"""Compile the Triton kernels a piece of code launches for sm_90 (H100 / H200), without a GPU.

Why: the CPU tests run the kernels under TRITON_INTERPRET=1, and the interpreter does not
type-check. Errors only the compiler raises (a loop-carried variable whose shape changes in
the loop, mismatched shapes in a branch the test's data never takes, a dot or layout the
backend refuses, ptxas errors) pass every CPU test and fail on the GPU. Triton compiles for
a target without a device (ptxas ships with the NVIDIA backend), so a test can record the
launches it makes and compile each one as the GPU's first launch would.

How:

* `record_launches()` wraps the interpreter's launch (`InterpretedFunction.run`, which
  `kernel[grid](...)`, `kernel.run(...)` and wrappers such as triton.heuristics call). Each
  launch is bound by Triton's own launcher code for the sm_90 target, so the signature,
  the constexprs and the specialisations (ints equal to 1, 16-divisible ints, 16-byte
  aligned pointers, `do_not_specialize`) are those a GPU launch computes; tensor
  descriptors bind to their `tensordesc<...>` type. The launch then runs on the
  interpreter as usual, or not at all (`execute=False`: for GPU tile configs the
  interpreter would take too long on; the launch code still runs, the outputs are garbage).
* Constexprs that only the interpreter sets are given their GPU value before binding
  (`GPU_VALUES`: `EMULATE=False`, the kernels' switch between the interpreter's emulated
  dot and `tl.dot`), so the branch compiled is the one the GPU runs. Tile sizes an entry
  picks for the interpreter stay as recorded: pass the GPU's config where the entry takes one.
* `compile_launches()` compiles each distinct specialisation once (results are cached per
  process) in a child Python process without TRITON_INTERPRET: under the interpreter every
  `@triton.jit` function, `tl.sum` included, is an interpreter object the compiler cannot
  take. The child imports the kernels' modules (by name, or from their file for a module
  loaded from a path) and compiles their JITFunctions.
* A kernel whose shared memory exceeds what an sm_90 block can have compiles but fails at
  its first GPU launch (OutOfResources): reported as a failure too.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import subprocess
import sys
import tempfile
from typing import Any, Iterable, Iterator

# sm_90, 32 threads a warp: the H100 / H200 target
TARGET = ("cuda", 90, 32)
# Shared memory one block may opt into on sm_90 (cudaDevAttrMaxSharedMemoryPerBlockOptin, H100/H200)
SM90_MAX_SHARED = 232448
# Constexprs the launch code sets for the interpreter, and what a GPU launch passes instead
GPU_VALUES: dict[str, Any] = {"EMULATE": False}


@dataclasses.dataclass(frozen=True)
class KernelRef:
    """Where a @triton.jit function lives, for the compiling process to import it."""
    module: str
    qualname: str
    file: str

    @classmethod
    def of(cls, fn) -> "KernelRef":
        py = _python_function(fn)
        return cls(py.__module__, py.__qualname__, py.__code__.co_filename)

    def __str__(self) -> str:
        return f"{self.module.rsplit('.', 1)[-1]}.{self.qualname}"


@dataclasses.dataclass(frozen=True)
class Launch:
    """One specialisation of a kernel, as Triton's launcher binds it for sm_90: `signature`
    (name, type) in parameter order, `constexprs` and `attrs` keyed by argument path (a
    tuple: (index,) or deeper for tuple arguments), `options` the launch options
    (num_warps, num_stages, ...)."""
    kernel: KernelRef
    signature: tuple
    constexprs: tuple
    attrs: tuple
    options: tuple

    def constexpr_names(self) -> dict[str, Any]:
        names = [name for name, _ in self.signature]
        return {names[p[0]] + "".join(f"[{i}]" for i in p[1:]): _plain(v) for p, v in self.constexprs}

    def __str__(self) -> str:
        consts = ", ".join(f"{k}={v!r}" for k, v in self.constexpr_names().items())
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options)
        return f"{self.kernel}[{consts}; {opts}]"


@dataclasses.dataclass(frozen=True)
class Result:
    """`error` None: compiled, `shared` bytes of shared memory a block uses; with usage
    asked for, the registers a thread uses and its stack bytes (spills) as ptxas allotted them."""
    launch: Launch
    error: str | None
    shared: int | None = None
    registers: int | None = None
    stack: int | None = None
    asm: dict | None = None  # with asm asked for: the compiled stages' text ("ttgir", "ptx", ...)

    @property
    def ok(self) -> bool:
        return self.error is None


def unavailable_reason() -> str | None:
    """Why sm_90 kernels cannot be compiled on this machine, or None when they can."""
    try:
        from triton import knobs
        from triton.backends import backends
    except ImportError as err:  # pragma: no cover
        return f"triton is not installed ({err})"
    if "nvidia" not in backends:
        return "this triton has no NVIDIA backend"
    try:
        knobs.nvidia.ptxas.path
    except Exception as err:
        return f"triton's NVIDIA backend has no ptxas ({err})"
    return None


# ---- recording ----------------------------------------------------------------------------------

def _python_function(fn):
    """The Python function under a @triton.jit object, through autotune / heuristics wrappers."""
    while not hasattr(fn, "__code__"):
        fn = fn.fn
    return fn


def _portable(value):
    """A constexpr value the compiling process can unpickle: jit functions by reference."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if isinstance(value, (InterpretedFunction, JITFunction)):
        return KernelRef.of(value)
    if isinstance(value, tuple):
        return type(value)(*map(_portable, value)) if hasattr(value, "_fields") else tuple(map(_portable, value))
    return value


def _plain(value):
    import triton.language as tl
    return value.value if isinstance(value, tl.constexpr) else value


class _Binder:
    """Triton's launcher binding (signature, constexprs, attributes) of one kernel for sm_90.
    Uses the launcher's own functions (the same in triton 3.6 to 3.8), so every rule a GPU
    launch specialises by applies here unchanged."""

    def __init__(self, interp_fn):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        self.jit = JITFunction(_python_function(interp_fn), **getattr(interp_fn, "kwargs", {}))
        self.backend = make_backend(GPUTarget(*TARGET))
        self.bind = create_function_from_signature(self.jit.signature, self.jit.params, self.backend)
        self.ref = KernelRef.of(interp_fn)
        self.constexpr_names = {p.name for p in self.jit.params if p.is_constexpr}

    def __call__(self, args, kwargs, gpu_values) -> Launch:
        named = dict(zip(self.jit.arg_names, args))
        named.update(kwargs)
        for name, value in gpu_values.items():
            if name in named and name in self.constexpr_names:
                named[name] = value
        bound, specialization, options = self.bind(**named)
        _, signature, constexprs, attrs = self.jit._pack_args(self.backend, named, bound, specialization, options)
        return Launch(
            kernel=self.ref,
            signature=tuple(signature.items()),
            constexprs=tuple(sorted((path, _portable(v)) for path, v in constexprs.items())),
            attrs=tuple(sorted((path, _freeze(v)) for path, v in attrs.items())),
            options=tuple(sorted(options.items())))


def _freeze(value):
    return tuple(map(_freeze, value)) if isinstance(value, (list, tuple)) else value


class Recorder:
    """The distinct launches (`launches`, in first-seen order) made inside `record_launches()`."""

    def __init__(self):
        self.launches: list[Launch] = []
        self._seen: set = set()
        self._binders: dict = {}

    def add(self, interp_fn, args, kwargs, gpu_values) -> None:
        binder = self._binders.get(id(interp_fn))
        if binder is None:
            binder = self._binders[id(interp_fn)] = (_Binder(interp_fn), interp_fn)
        launch = binder[0](args, kwargs, gpu_values)
        key = _key(launch)
        if key not in self._seen:
            self._seen.add(key)
            self.launches.append(launch)

    def kernels(self) -> set[str]:
        return {str(launch.kernel) for launch in self.launches}


def _key(launch: Launch) -> str:
    return repr(launch)


@contextlib.contextmanager
def record_launches(execute: bool = True, gpu_values: dict | None = None) -> Iterator[Recorder]:
    """Record every Triton launch made inside the block (needs TRITON_INTERPRET=1, set
    before triton was imported). `execute=False` records without running the kernels.
    `gpu_values` replaces GPU_VALUES (constexprs given their GPU value)."""
    from triton.runtime.interpreter import InterpretedFunction

    import triton
    if not triton.knobs.runtime.interpret:
        raise RuntimeError("record_launches needs TRITON_INTERPRET=1 (set before triton is imported)")
    values = GPU_VALUES if gpu_values is None else gpu_values
    recorder = Recorder()
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        recorder.add(self, args, kwargs, values)
        if execute:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        return None

    InterpretedFunction.run = run
    try:
        yield recorder
    finally:
        InterpretedFunction.run = original


# ---- compiling ----------------------------------------------------------------------------------

_RESULTS: dict[tuple[str, bool, bool], Result] = {}  # per process, usage and asm flags: a specialisation compiles once


def compile_launches(launches: Iterable[Launch], jobs: int | None = None, usage: bool = False,
                     asm: bool = False) -> list[Result]:
    """Compile each launch for sm_90 in child processes (`jobs` of them, default one per CPU,
    at most 4), reusing this process's earlier results. Returns the results in order.
    `usage`: also read each kernel's registers and stack from its cubin (cuobjdump).
    `asm`: also keep the text stages of the compile (ttir, ttgir, llir, ptx) in `Result.asm`,
    e.g. to see whether a loop's loads were pipelined (async copies in its ttgir)."""
    launches = list(launches)
    todo = list({_key(la): la for la in launches if (_key(la), usage, asm) not in _RESULTS}.values())
    if todo:
        jobs = max(1, min(jobs or min(os.cpu_count() or 1, 4), len(todo)))
        parts = [todo[i::jobs] for i in range(jobs)]
        for result in _run_children(parts, usage, asm):
            _RESULTS[(_key(result.launch), usage, asm)] = result
    return [_RESULTS[(_key(la), usage, asm)] for la in launches]


def _run_children(parts: list[list[Launch]], usage: bool = False, asm: bool = False) -> list[Result]:
    # the child compiles, so Triton must not be its interpreter: it says so before anything
    # imports Triton (the environment is otherwise inherited as it is)
    boot = ("import os, sys; os.environ['TRITON_INTERPRET'] = '0'; "
            "from vllm.testing.sm90_compile import _main; _main(*sys.argv[1:3])")
    with tempfile.TemporaryDirectory(prefix="sm90_compile_") as tmp:
        procs = []
        for i, part in enumerate(parts):
            src, dst, log = (os.path.join(tmp, f"{what}{i}") for what in ("in", "out", "log"))
            with open(src, "wb") as f:
                pickle.dump({"sys_path": list(sys.path), "launches": part, "usage": usage, "asm": asm}, f)
            with open(log, "w") as out:
                proc = subprocess.Popen([sys.executable, "-c", boot, src, dst], stdout=out,
                                        stderr=subprocess.STDOUT)
            procs.append((proc, dst, log))
        results = []
        for proc, dst, log in procs:
            if proc.wait() != 0 or not os.path.exists(dst):
                with open(log) as f:
                    raise RuntimeError(f"the sm_90 compile process failed (exit {proc.returncode}):\n"
                                       f"{f.read()[-4000:]}")
            with open(dst, "rb") as f:
                results.extend(pickle.load(f))
    return results


def failures(results: Iterable[Result]) -> list[Result]:
    return [r for r in results if not r.ok]


def format_failures(results: Iterable[Result], limit: int = 1500) -> str:
    """One block per failed launch: the specialisation, then the error; a long one as its
    first line (where: line:column in the failing function) and its last `limit` characters
    (the source there and the message)."""
    blocks = []
    for r in failures(results):
        err = r.error.strip()
        if len(err) > limit:
            err = f"{err.splitlines()[0]}\n...\n{err[-limit:]}"
        blocks.append(f"{r.launch}\n{err}".replace("\n", "\n    "))
    return "\n".join(blocks)


# ---- the compiling process ----------------------------------------------------------------------

def _import_module(ref: KernelRef):
    """The kernel's module: imported by name when that finds the same file, else loaded from
    the file under the recorded name."""
    import importlib
    import importlib.util

    mod = sys.modules.get(ref.module)
    if mod is None:
        try:
            mod = importlib.import_module(ref.module)
        except ImportError:
            mod = None
    if mod is not None and os.path.realpath(getattr(mod, "__file__", "") or "") == os.path.realpath(ref.file):
        return mod
    spec = importlib.util.spec_from_file_location(ref.module, ref.file)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[ref.module] = mod
    spec.loader.exec_module(mod)
    return mod


def _resolve(ref: KernelRef):
    """The JITFunction of `ref` (through autotune / heuristics wrappers)."""
    from triton.runtime.jit import JITFunction

    if "<locals>" in ref.qualname:
        raise LookupError(f"{ref}: a kernel defined inside a function cannot be imported by name")
    obj = _import_module(ref)
    for part in ref.qualname.split("."):
        obj = getattr(obj, part)
    while not isinstance(obj, JITFunction):
        obj = obj.fn
    return obj


def _resolve_values(value):
    if isinstance(value, KernelRef):
        return _resolve(value)
    if isinstance(value, tuple):
        vals = map(_resolve_values, value)
        return type(value)(*vals) if hasattr(value, "_fields") else tuple(vals)
    return value


def _resource_usage(kernel) -> tuple[int | None, int | None]:
    """(registers, stack bytes) of a compiled kernel, from cuobjdump -res-usage on its cubin
    (the tool beside Triton's ptxas); (None, None) where it is not found."""
    import re

    import triton
    try:
        tool = os.path.join(os.path.dirname(triton.knobs.nvidia.ptxas.path), "cuobjdump")
    except AttributeError:
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        try:
            out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        except OSError:
            return None, None
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)


def _compile_one(launch: Launch, usage: bool = False, keep_asm: bool = False) -> Result:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        fn = _resolve(launch.kernel)
        src = ASTSource(fn=fn, signature=dict(launch.signature),
                        constexprs={p: _resolve_values(v) for p, v in launch.constexprs},
                        attrs={p: [list(a) for a in v] for p, v in launch.attrs})
        kernel = triton.compile(src, target=GPUTarget(*TARGET), options=dict(launch.options))
    except Exception as err:  # a compile error is the result
        return Result(launch, f"{type(err).__name__}: {err}")
    shared = kernel.metadata.shared
    registers, stack = _resource_usage(kernel) if usage else (None, None)
    text = {k: v for k, v in kernel.asm.items() if isinstance(v, str)} if keep_asm else None
    if shared > SM90_MAX_SHARED:
        return Result(launch, f"OutOfResources: shared memory {shared} B > {SM90_MAX_SHARED} B an sm_90 block "
                              "may use (fails at launch)", shared, registers, stack, text)
    return Result(launch, None, shared, registers, stack, text)


def _main(src: str, dst: str) -> None:
    with open(src, "rb") as f:
        job = pickle.load(f)
    sys.path[:] = job["sys_path"]
    results = [_compile_one(launch, job.get("usage", False), job.get("asm", False)) for launch in job["launches"]]
    with open(dst, "wb") as f:
        pickle.dump(results, f)
