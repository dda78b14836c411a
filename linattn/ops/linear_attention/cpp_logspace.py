"""The "cpp" backend: torch_logspace.py's causal log-space pass with each (head, chunk) fused in C++.

torch_logspace.py computes runs of chunks op by op over (B, H, G, L, M) tensors, so on a CPU every op
streams them through memory.  `stable_cpu.cpp` does the same maths (stable.py's numerics) for one
head and one chunk at a time, in cache, with the BLAS that torch links (MKL's sgemm_) on one thread
per head, and hands the rare irregular chunks (exact rows, wide pairs) back to torch_logspace.py
(`irregular_chunk_forward`, `irregular_chunk_backward`).  `logspace_attention` is the entry that
dispatch.py's table holds for causal log-space calls on CPU.  Outputs, states
and gradients are those of the torch backend up to float rounding (tests/linattn/ops/linear_attention/test_cpp_logspace.py).

It is built on first use with the system's C++ compiler and OpenMP (a few seconds), into a cache
(`LINATTN_CACHE_DIR`, else `$XDG_CACHE_HOME/linattn` or `~/.cache/linattn`) under a name that holds
the source, compiler, flags and CPU, and loaded with ctypes.  Where it cannot be built (no compiler,
not Linux, a torch without sgemm_), `unavailable()` says why, and backend="auto" uses "torch".
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from . import torch_logspace
from .common import LogProjection, first_derivatives_only, source_from_parts, source_parts, without_autocast
from .stable import JUMP_LIMIT, PAIR_SPREAD

SOURCE = Path(__file__).with_name("stable_cpu.cpp")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fopenmp", "-shared", "-fPIC")
_lock = threading.Lock()
_loaded: dict[str, object] = {}   # "library" or "error"


class CppUnavailable(RuntimeError):
    """The C++ kernel cannot be built or loaded here; the message says why."""


def cache_dir() -> Path:
    if os.environ.get("LINATTN_CACHE_DIR"):
        return Path(os.environ["LINATTN_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "linattn"


def compiler() -> list[str]:
    """The C++ compiler's command ($CXX may hold arguments, such as "ccache g++")."""
    return shlex.split(os.environ.get("CXX", "")) or [shutil.which("c++") or shutil.which("g++") or "c++"]


def unavailable() -> str | None:
    """Why the kernel cannot run here, or None (building it on the first call)."""
    try:
        library()
    except CppUnavailable as error:
        return str(error)
    return None


def library() -> ctypes.CDLL:
    """The kernel, built and loaded once per process (a failure is remembered too)."""
    if "library" in _loaded:
        return _loaded["library"]
    with _lock:
        if "library" not in _loaded and "error" not in _loaded:
            try:
                _loaded["library"] = _load(_build())
            except CppUnavailable as error:
                _loaded["error"] = error
        if "error" in _loaded:
            raise _loaded["error"]
        return _loaded["library"]


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's feature flags (a cache shared by machines stays right)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler_error(output: str) -> str:
    """The compiler's first error line (or its last line), short: messages here are one line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    first = next((line for line in lines if re.search(r"\berror:", line)), lines[-1] if lines else "no output")
    return first[:300]


def _build() -> Path:
    if not sys.platform.startswith("linux"):
        raise CppUnavailable(f"the cpp backend is built on Linux only (this is {sys.platform}); use backend='torch'")
    cxx = compiler()
    try:
        version = subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise CppUnavailable(f"no C++ compiler to build the cpp backend ({shlex.join(cxx)}: {error}); install "
                             f"one (g++) or set CXX, or use backend='torch'") from None
    command = shlex.join([*cxx, *FLAGS])
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), version.encode(), command.encode(),
                                     _cpu_signature().encode()])).hexdigest()[:20]
    try:
        target = cache_dir() / f"stable_cpu-{key}.so"
    except RuntimeError as error:   # Path.home() without a home directory
        raise CppUnavailable(f"no directory for the cpp backend's build ({error}); set LINATTN_CACHE_DIR, "
                             "or use backend='torch'") from None
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(prefix=target.stem, suffix=".so.partial", dir=target.parent)
        os.close(handle)
    except OSError as error:
        raise CppUnavailable(f"cannot write the cpp backend's build to {target.parent} ({error}); set "
                             "LINATTN_CACHE_DIR to a writable directory, or use backend='torch'") from None
    try:
        built = subprocess.run([*cxx, *FLAGS, str(SOURCE), "-o", partial], capture_output=True, text=True,
                               timeout=600)
        if built.returncode:
            raise CppUnavailable(f"building the cpp backend failed ({command}: {_compiler_error(built.stderr)}); "
                                 "use backend='torch'")
        try:   # only a library that loads goes into the cache
            ctypes.CDLL(partial).linattn_forward
        except (OSError, AttributeError) as error:
            raise CppUnavailable(f"building the cpp backend ({command}) gave no loadable library ({error}); "
                                 "use backend='torch'") from None
        os.replace(partial, target)   # whole or not at all: another process may be loading it
    except (OSError, subprocess.SubprocessError) as error:
        raise CppUnavailable(f"building the cpp backend failed ({error}); use backend='torch'") from None
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return target


def _load(path: Path) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as error:
        raise CppUnavailable(f"cannot load the cpp backend ({error}); delete {path} to rebuild it, "
                             "or use backend='torch'") from None
    blas = _torch_blas()
    lib.linattn_set_blas(blas["sgemm_"], blas["dgemm_"], ctypes.c_double(JUMP_LIMIT),
                         ctypes.c_double(PAIR_SPREAD))
    i64, ptr, call = ctypes.c_int64, ctypes.c_void_p, ctypes.POINTER(_Call)
    grads = ctypes.POINTER(_SourceGrad)
    signatures = {   # stable_cpu.cpp's extern "C" entry points: (result, arguments)
        "forward": (i64, [ctypes.c_int, call, i64, i64, *[ptr] * 7, i64, ptr]),
        "states": (i64, [ctypes.c_int, call, i64, i64, *[ptr] * 5]),
        "backward": (i64, [ctypes.c_int, call, i64, i64, ptr, ptr, ptr, i64, i64, *[ptr] * 7, grads, grads, ptr]),
    }
    for name, (result, arguments) in signatures.items():
        function = getattr(lib, f"linattn_{name}")
        function.restype, function.argtypes = result, arguments
    return lib


def _torch_blas() -> dict[str, ctypes.c_void_p]:
    """The BLAS products torch links (MKL's on x86 builds): the kernel's products run where torch's do."""
    libraries = sorted((Path(torch.__file__).parent / "lib").glob("libtorch_cpu.*"))
    try:
        torch_cpu = ctypes.CDLL(str(libraries[0]))
        return {name: ctypes.cast(getattr(torch_cpu, name), ctypes.c_void_p) for name in ("sgemm_", "dgemm_")}
    except (IndexError, OSError, AttributeError):
        raise CppUnavailable("this torch build exports no BLAS sgemm_/dgemm_ for the cpp backend; "
                             "use backend='torch'") from None


# The C structs of stable_cpu.cpp, field for field.
class _Source(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("stride_b", ctypes.c_int64), ("stride_h", ctypes.c_int64),
                ("stride_n", ctypes.c_int64), ("dim", ctypes.c_int64), ("weight", ctypes.c_void_p),
                ("shift", ctypes.c_void_p), ("shift_b", ctypes.c_int64), ("shift_h", ctypes.c_int64),
                ("shift_n", ctypes.c_int64), ("shift_value", ctypes.c_double), ("square_scale", ctypes.c_double)]


class _SourceGrad(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("shift", ctypes.c_void_p), ("weight", ctypes.c_void_p)]


class _Call(ctypes.Structure):
    _fields_ = [("batch", ctypes.c_int64), ("heads", ctypes.c_int64), ("n", ctypes.c_int64), ("m", ctypes.c_int64),
                ("dv", ctypes.c_int64), ("length", ctypes.c_int64), ("q", _Source), ("k", _Source),
                ("v", ctypes.c_void_p), ("v_b", ctypes.c_int64), ("v_h", ctypes.c_int64), ("v_n", ctypes.c_int64),
                ("phases", ctypes.c_void_p), ("q_phases", ctypes.c_void_p), ("feat", ctypes.c_void_p),
                ("threads", ctypes.c_int64), ("log_decay", ctypes.c_void_p), ("lead", ctypes.c_int64)]


_OUT_OF_MEMORY = -2   # stable_cpu.cpp's error results


def _pointer(t: torch.Tensor | None):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _rows_layout(t: torch.Tensor) -> torch.Tensor:
    """t as the kernel reads it: each (N, last) matrix in rows that BLAS takes, i.e. a contiguous last
    dimension and a row stride of at least its length (batch and head strides are free, 0 too).
    An expanded N or a single row with a small stride is copied (.contiguous() keeps those strides)."""
    if t.stride(-1) == 1 and t.stride(-2) >= t.shape[-1]:
        return t
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


def _source(x) -> tuple[_Source, list[torch.Tensor]]:
    """The C view of a log-feature tensor or a projection, and the tensors it points into."""
    if not isinstance(x, LogProjection):
        x = _rows_layout(x)
        return _Source(_pointer(x), *x.stride()[:3], x.shape[-1], None, None, 0, 0, 0, 0.0, 0.0), [x]
    inputs = _rows_layout(x.inputs)
    shift = x.shift if isinstance(x.shift, torch.Tensor) else None
    shift_strides = shift.stride()[:3] if shift is not None else (0, 0, 0)
    return (_Source(_pointer(inputs), *inputs.stride()[:3], inputs.shape[-1], _pointer(x.weight), _pointer(shift),
                    *shift_strides, 0.0 if shift is not None else float(x.shift), float(x.square_scale)),
            [inputs, x.weight] + ([shift] if shift is not None else []))


class _Kernel:
    """One call's arguments for the C entry points, holding every tensor they point into."""

    def __init__(self, queries, keys, v: torch.Tensor, phases, feat: torch.Tensor, length: int, decay=None):
        self.lib = library()
        self.dtype = 1 if v.dtype == torch.float64 else 0
        v = _rows_layout(v)
        (q, q_keep), (k, k_keep) = _source(queries), _source(keys)
        # phases: the queries' and keys' rotations (common.query_key_phases), each as (N, M/2, 2) reals
        q_phases, k_phases = (None, None) if phases is None else \
            (torch.view_as_real(p).contiguous() for p in (phases[0], phases[1]))
        batch, heads, n, dv = v.shape
        # decay: torch_logspace.chunk_decay's (log gamma (H,), the queries' lead) or None
        log_decay, lead = (None, 0) if decay is None else (decay[0].contiguous(), decay[1])
        self.keep = [v, q_phases, k_phases, feat, log_decay, *q_keep, *k_keep]
        self.call = _Call(batch, heads, n, feat.shape[-1], dv, length, q, k, _pointer(v), *v.stride()[:3],
                          _pointer(k_phases), _pointer(q_phases), _pointer(feat), torch.get_num_threads(),
                          _pointer(log_decay), lead)

    def run(self, name: str, *args) -> int:
        """lib.linattn_<name>(dtype, call, *args), tensors passed as pointers; its result, or the error
        that a result below -1 stands for."""
        function = getattr(self.lib, f"linattn_{name}")
        result = function(self.dtype, ctypes.byref(self.call),
                          *(_pointer(a) if isinstance(a, torch.Tensor) else a for a in args))
        call = self.call
        return _checked(result, name, f"per thread about {call.length}^2 + 8 x {call.length} x {call.m} values at "
                                      f"chunk_size {call.length}", "use a smaller chunk_size")


def _checked(result: int, name: str, buffers: str, remedy: str) -> int:
    """An entry point's result, or the error that a result below -1 stands for (`buffers`: what they
    hold; `remedy`: how to need less)."""
    if result == _OUT_OF_MEMORY:
        raise MemoryError(f"the cpp backend's buffers do not fit in memory ({buffers}); {remedy}")
    if result < -1:
        raise RuntimeError(f"the cpp backend's {name} failed (code {result}); use backend='torch'")
    return result


def logspace_attention(b, a, v, **call):
    """torch_logspace.logspace_attention (dispatch.py's call shape) with its causal pass in the C++ kernel."""
    return torch_logspace.logspace_attention(b, a, v, causal_pass=causal, **call)


def causal(b, a, v, phases, length: int, base: float, decay=None):
    """Causal Eq. 19 from log-features (tensors or `LogProjection`s) on CPU: (out, state, key sum, F
    after the last token, log-normaliser), as torch_logspace.causal_log_attention gives them (with its decay)."""
    out, kv, k_sum, last, lse = _FusedCausalLogAttention.apply(*source_parts(b), *source_parts(a), v, phases, length,
                                                               base, decay)
    return first_derivatives_only(out), kv, k_sum, last, first_derivatives_only(lse)


class _FusedCausalLogAttention(torch.autograd.Function):
    """torch_logspace.causal_log_attention's autograd function with its regular chunks in stable_cpu.cpp."""

    @staticmethod
    def forward(ctx, q_inputs, q_weight, q_shift, q_square, k_inputs, k_weight, k_shift, k_square, v, phases,
                length, base, decay):
        queries = source_from_parts(q_inputs, q_weight, q_shift, q_square)
        keys = source_from_parts(k_inputs, k_weight, k_shift, k_square)
        batch, heads, n, dv = v.shape
        m = k_inputs.shape[-1] if k_weight is None else k_weight.shape[0]
        chunks, groups = -(-n // length), -(-n // (length * torch_logspace.STATE_GROUP))
        feat = v.new_empty(batch, heads, chunks + 1, m)
        kernel = _Kernel(queries, keys, v, phases, feat, length, decay)
        out, den = v.new_empty(batch, heads, n, dv), v.new_empty(batch, heads, n)
        query_scale = torch.empty_like(den)
        state, key_sum = v.new_zeros(batch, heads, m, dv), v.new_zeros(batch, heads, m)
        saved_states, saved_sums = v.new_empty(groups, batch, heads, m, dv), v.new_empty(groups, batch, heads, m)
        flags = torch.zeros(chunks, dtype=torch.int32)
        start = 0
        while start < chunks:
            start = kernel.run("forward", start, chunks, state, key_sum, out, den, query_scale, saved_states,
                               saved_sums, torch_logspace.STATE_GROUP, flags)
            if start < chunks:   # an irregular chunk: torch_logspace.py's own, from the state before it
                torch_logspace.irregular_chunk_forward(start, queries, keys, v, phases, feat, length, base, state,
                                                       key_sum, out, den, query_scale, decay)
                start += 1
        parts = (q_inputs, q_weight, q_shift, q_square, k_inputs, k_weight, k_shift, k_square)
        return torch_logspace.finish_forward(ctx, parts, length, base, decay, v, out, den, query_scale, feat, phases,
                                             state, key_sum, saved_states, saved_sums, flags)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx, grad, _state_grad, _key_sum_grad, _last_grad, lse_grad):
        queries, keys, (v, out, den, query_scale, feat, phases), (saved_states, saved_sums, flags) = \
            torch_logspace.saved_sources(ctx)
        needs = ctx.needs_input_grad
        kernel = _Kernel(queries, keys, v, phases, feat, ctx.length, ctx.decay)
        grad = torch.zeros_like(out) if grad is None else grad.contiguous()
        lse_grad = None if lse_grad is None else lse_grad.contiguous()
        q_grads, k_grads = _FusedGradients(queries, needs[0:3]), _FusedGradients(keys, needs[4:7])
        dv = torch.empty(v.shape, dtype=v.dtype)
        later, later_sum = torch.zeros_like(saved_states[0]), torch.zeros_like(saved_sums[0])
        chunks, length = feat.shape[2] - 1, ctx.length
        for group in reversed(range(saved_states.shape[0])):
            lo, hi = group * torch_logspace.STATE_GROUP, min((group + 1) * torch_logspace.STATE_GROUP, chunks)
            states = v.new_empty(*v.shape[:2], hi - lo, feat.shape[-1], v.shape[-1])
            sums = v.new_empty(*v.shape[:2], hi - lo, feat.shape[-1])
            kernel.run("states", lo, hi, flags, saved_states[group], saved_sums[group], states, sums)
            top = hi - 1
            while top >= lo:
                top = kernel.run("backward", top, lo, flags, states, sums, lo, hi - lo, grad, lse_grad, out, den,
                                 query_scale, later, later_sum, ctypes.byref(q_grads.c), ctypes.byref(k_grads.c), dv)
                if top >= lo:   # an irregular chunk: torch_logspace.py's backward of it
                    torch_logspace.irregular_chunk_backward(
                        top, queries, keys, v, phases, feat, length, ctx.base, states[:, :, top - lo],
                        sums[:, :, top - lo], grad, out, den, query_scale, later, later_sum, q_grads.eager,
                        k_grads.eager, dv, capped=bool(flags[top] & 1), lse_grad=lse_grad, decay=ctx.decay)
                    top -= 1
        return (*q_grads.result(), None, *k_grads.result(), None, dv, None, None, None, None)


class _FusedGradients:
    """A source's gradients, written by the kernel (C view `c`) and, for irregular chunks, by
    torch_logspace.SourceGradients (`eager`): contiguous buffers, and the weight's as per-head partial
    sums."""

    def __init__(self, source, needs):
        projection = isinstance(source, LogProjection)
        inputs = source.inputs if projection else source
        self.inputs = torch.empty(inputs.shape, dtype=inputs.dtype) if needs[0] else None
        self.shift = torch.empty(inputs.shape[:-1], dtype=inputs.dtype) if projection and needs[2] else None
        self.weight_parts = None
        weight = None
        if projection and needs[1]:
            self.weight_parts = inputs.new_zeros(inputs.shape[0] * inputs.shape[1], *source.weight.shape)
            weight = torch.zeros_like(source.weight)
        self.eager = torch_logspace.SourceGradients(self.inputs, weight,
                                                    None if self.shift is None else self.shift.unsqueeze(-1))
        self.c = _SourceGrad(_pointer(self.inputs), _pointer(self.shift), _pointer(self.weight_parts))

    def result(self):
        weight = None if self.weight_parts is None else self.eager.weight + self.weight_parts.sum(0)
        return self.inputs, weight, None if self.shift is None else self.shift.unsqueeze(-1)

