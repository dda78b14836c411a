"""Compile the fused kernels for an H100 (sm_90) on a machine without a GPU and print, per mode,
the shared memory each needs (JSON lines): the log-space modes (non-causal: rotated only), or
every mode with --all.  The interpreter runs constructs the compiler rejects
and knows no resource limits; triton's compiler and bundled ptxas need no device.  Run by
test_fused.py in a subprocess, since TRITON_INTERPRET must be off when the kernels are imported."""
import itertools
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton                                      # noqa: E402
import triton.language as tl                       # noqa: E402
from triton.backends.compiler import GPUTarget     # noqa: E402
from triton.compiler import ASTSource              # noqa: E402

from linattn.ops.linear_attention import fused     # noqa: E402

POINTER_TYPES = {"exact_ptr": "*i32", "turns_ptr": "*fp64"}


def compile_kernel(kernel, constants: dict, num_stages: int):
    signature = {name: (POINTER_TYPES.get(name, "*fp32") if name.endswith("_ptr") else "i32")
                 for name in kernel.arg_names if name not in constants}
    signature.update({name: "constexpr" for name in constants})
    constexprs = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    # As a launch with aligned pointers and M, Dv multiples of 16 specialises (offset and N are
    # do_not_specialize): those are the tiles that need the most shared memory.
    aligned = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in signature
               if signature[name] != "constexpr" and name not in ("offset", "N")}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "num_stages": num_stages})


def main(every_mode: bool):
    modes = [(causal, rotary, log, dot)
             for causal, rotary, log in itertools.product([True, False], [True, False], [True, False])
             for dot in ([tl.float32] if log else [tl.float32, tl.bfloat16])
             if every_mode or (log and (causal or rotary))]
    for causal, rotary, log, dot in modes:
        precision = "tf32x3" if dot == tl.float32 else "ieee"
        constants = dict(BT=fused.CHUNK, BK=fused.FEATURE_TILE, BV=fused.VALUE_TILE, CAUSAL=causal,
                         ROTARY=rotary, LOG=log, DOT=dot, PRECISION=precision)
        backward_stages = fused.LOG_BACKWARD_STAGES if log and causal else 3
        for kernel, extra, stages in [(fused._forward_kernel, {"STATE": True}, 3),
                                      (fused._backward_kernel, {}, backward_stages)]:
            compiled = compile_kernel(kernel, {**constants, **extra}, stages)
            print(json.dumps({"kernel": kernel.fn.__name__, "causal": causal, "rotary": rotary, "log": log,
                              "dot": str(dot), "shared": compiled.metadata.shared}), flush=True)


if __name__ == "__main__":
    main("--all" in sys.argv[1:])
