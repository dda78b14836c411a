"""Compile linattn's Triton kernels for a GPU on a machine without one and print, per kernel and mode,
the shared memory each needs (JSON lines).  --chunk-parallel compiles those of chunk_parallel.py (plain
features), --log-chunk-parallel those of log_chunk_parallel.py (log-features); targets are ARCH:LEVEL
(default 90:0, an H100 with the first of the module's TILE_LEVELS), every kernel causal or not,
rotated or not, in float32 and bf16 (--float32: float32 only, which needs the most shared memory).
The interpreter runs constructs the compiler rejects and knows no resource limits; triton's compiler
and bundled ptxas need no device.  Run by the modules' tests in a subprocess, since TRITON_INTERPRET
must be off when the kernels are imported."""
import itertools
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton                                      # noqa: E402
import triton.language as tl                       # noqa: E402
from triton.backends.compiler import GPUTarget     # noqa: E402
from triton.compiler import ASTSource              # noqa: E402


def compile_kernel(kernel, constants: dict, num_stages: int, arch: int, pointer_types: dict):
    signature = {name: (pointer_types.get(name, "*fp32") if name.endswith("_ptr") else "i32")
                 for name in kernel.arg_names if name not in constants}
    signature.update({name: "constexpr" for name in constants})
    constexprs = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    # As a launch with aligned pointers and M, Dv multiples of 16 specialises: those are the tiles that
    # need the most shared memory.
    aligned = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in signature
               if signature[name] != "constexpr" and name != "N"}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": 4, "num_stages": num_stages})


CHUNK_PARALLEL_KERNELS = ("_states_kernel", "_output_kernel", "_dstate_kernel", "_dqk_kernel", "_dv_kernel")


def chunk_parallel_pointer_types(dot) -> dict:
    """Inputs, outputs and their gradients in the input dtype; per-chunk states in the dots' dtype;
    denominators, key sums and the float32 output gradients G, gd in float32."""
    half = "*bf16" if dot == tl.bfloat16 else "*fp32"
    inputs = {name: half for name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "dq_ptr", "dk_ptr", "dv_ptr",
                                       "h_ptr", "dh_ptr")}
    return {**inputs, "turns_ptr": "*fp64"}


def main_chunk_parallel(arch: int, level: int, dots: list):
    from linattn.ops.linear_attention import chunk_parallel
    feature_tile, value_tile = chunk_parallel.TILE_LEVELS[level]
    for dot, causal, rotary, name in itertools.product(dots, [True, False], [True, False], CHUNK_PARALLEL_KERNELS):
        kernel = getattr(chunk_parallel, name)
        precision = "tf32x3" if dot == tl.float32 else "ieee"
        constants = dict(BT=chunk_parallel.CHUNK, BK=feature_tile, BV=value_tile, ROTARY=rotary, DOT=dot,
                         PRECISION=precision)
        constants.update(dict(CHUNKS=causal, STATE=True) if name == "_states_kernel" else dict(CAUSAL=causal))
        compiled = compile_kernel(kernel, constants, 3, arch, chunk_parallel_pointer_types(dot))
        print(json.dumps({"arch": arch, "level": level, "kernel": name, "causal": causal, "rotary": rotary,
                          "dot": str(dot), "shared": compiled.metadata.shared}), flush=True)


LOG_CHUNK_PARALLEL_KERNELS = ("_states_kernel", "_output_kernel", "_dstate_kernel", "_dq_kernel", "_dk_kernel",
                              "_dv_kernel")


def log_chunk_parallel_pointer_types(dot) -> dict:
    """Values, outputs and dv in the input dtype; per-chunk states in the dots' dtype; log-features,
    scales, denominators, their gradients and G, gd in float32."""
    half = "*bf16" if dot == tl.bfloat16 else "*fp32"
    return {**{name: half for name in ("v_ptr", "out_ptr", "dv_ptr", "h_ptr", "dh_ptr")}, "turns_ptr": "*fp64"}


def main_log_chunk_parallel(arch: int, level: int, dots: list):
    from linattn.ops.linear_attention import log_chunk_parallel as module
    feature_tile, value_tile = module.TILE_LEVELS[level]
    for dot, causal, rotary, name in itertools.product(dots, [True, False], [True, False],
                                                       LOG_CHUNK_PARALLEL_KERNELS):
        precision = "tf32x3" if dot == tl.float32 else "ieee"
        constants = dict(BT=module.CHUNK, BK=feature_tile, BV=value_tile, ROTARY=rotary, DOT=dot,
                         PRECISION=precision)
        if name == "_states_kernel":
            constants.update(CHUNKS=causal, STATE=True)
        else:
            constants.update(CAUSAL=causal)
        if name not in ("_states_kernel", "_dstate_kernel"):
            constants.update(BC=module.SUB_CHUNK)
        compiled = compile_kernel(getattr(module, name), constants, 3, arch, log_chunk_parallel_pointer_types(dot))
        print(json.dumps({"arch": arch, "level": level, "kernel": name, "causal": causal, "rotary": rotary,
                          "dot": str(dot), "shared": compiled.metadata.shared}), flush=True)


def main(args: list[str]):
    targets = [tuple(map(int, arg.split(":"))) for arg in args if not arg.startswith("--")] or [(90, 0)]
    dots = [tl.float32] if "--float32" in args else [tl.float32, tl.bfloat16]
    for flag, compile_at in (("--chunk-parallel", main_chunk_parallel),
                             ("--log-chunk-parallel", main_log_chunk_parallel)):
        if flag in args:
            for arch, level in targets:
                compile_at(arch, level, dots)
            return
    raise SystemExit("name the kernels: --chunk-parallel or --log-chunk-parallel")


if __name__ == "__main__":
    main(sys.argv[1:])
