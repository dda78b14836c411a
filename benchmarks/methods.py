"""What is measured: the attention methods, as data, and the calls that time them.

Every method maps q, k, v of shape (B, H, N, D) to (B, H, N, D); linattn methods include their
feature map, as `LinearAttention` does.  A method is listed only where it can run: one whose
package, device or dtype is missing is skipped with a one-line note naming what it needs.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
from dataclasses import dataclass
from typing import Callable

import torch

import linattn
from linattn_lm.flags import preset_settings
from linattn_lm.variants import block_option_from_name

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MASKS = {"causal": True, "full": False}
LINATTN_ROPES = ("post", "none")

# The block and kernels sections' names (settings.py checks --block-methods and --kernel-methods against them).
SOFTMAX_BLOCKS = {"softmax": "sdpa", "softmax-xformers": "xformers"}   # name -> SoftmaxAttention backend
ROPES = linattn.ROPE_PLACEMENTS
LINEAR_BACKENDS = tuple(b for b in linattn.functional.BACKENDS if b != "auto")   # named as a suffix
OURS = {"linattn-log": "fla-gla", "linattn-plain": "fla-linear",           # ours -> its fla peer (auto backend)
        "linattn-fla-log": "fla-gla", "linattn-fla-plain": "fla-linear"}   # backend="fla"
FLA_METHODS = ("fla-gla", "fla-linear")
KERNEL_METHODS = tuple(OURS) + FLA_METHODS


@dataclass(frozen=True)
class Shape:
    """Attention inputs q, k, v of shape (batch, heads, N, head_dim); M random features."""
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    num_features: int = 256


@dataclass(frozen=True)
class Method:
    """One attention implementation, selected by `name` (--methods).

    family: softmax (linattn's SoftmaxAttention call), linattn, performer or fla.  `backend` is the
    SoftmaxAttention backend or the linattn one; the other fields say where the method can run."""
    name: str
    family: str
    backend: str = ""
    feature_map: str = ""
    rope: str = "none"
    packages: tuple[str, ...] = ()
    cuda_only: bool = False
    causal_only: bool = False
    dtypes: tuple[str, ...] = tuple(DTYPES)
    flash: bool = False

    @property
    def is_linear(self) -> bool:
        return self.family in ("linattn", "fla")


def method_table(linattn_backends: tuple[str, ...]) -> list[Method]:
    """Every method this package knows.  linattn methods are `<map>-<rope>`, suffixed with the
    backend unless it is "auto" (what a user gets by default)."""
    methods = [
        Method("sdpa", "softmax", backend="sdpa"),
        Method("sdpa-flash", "softmax", backend="sdpa", cuda_only=True, dtypes=("bf16",), flash=True),
        Method("xformers", "softmax", backend="xformers", packages=("xformers",), cuda_only=True),
    ]
    for backend in linattn_backends:
        suffix = "" if backend == "auto" else f"-{backend}"
        methods += [Method(f"{fm}-{rope}{suffix}", "linattn", backend=backend, feature_map=fm, rope=rope)
                    for fm in linattn.available_feature_maps() for rope in LINATTN_ROPES]
    methods += [
        Method("performer", "performer", packages=("performer_pytorch",)),
        Method("fla-chunk", "fla", feature_map="favor", rope="post", packages=("fla",),
               cuda_only=True, causal_only=True),
    ]
    return methods


def unavailable(method: Method, device: torch.device) -> str | None:
    """Why `method` cannot run on `device` at all, or None."""
    missing = [p for p in method.packages if importlib.util.find_spec(p) is None]
    if missing:
        return f"needs the {', '.join(missing)} package"
    if method.cuda_only and device.type != "cuda":
        return "runs on CUDA only"
    if method.family == "linattn":
        try:
            linattn.resolve_backend(method.backend, device)
        except ValueError as error:
            return str(error)
    return None


def runs_with(method: Method, causal: bool, dtype: str) -> bool:
    return dtype in method.dtypes and (causal or not method.causal_only)


def make_feature_map(name: str, shape: Shape) -> linattn.FeatureMap:
    """A registered map with M = shape.num_features where the map has that option (and the shape's
    heads, for maps with weights per head)."""
    options = {"num_features": shape.num_features} if "num_features" in linattn.feature_map_options(name) else {}
    return linattn.make_feature_map(name, shape.head_dim, heads=shape.heads, options=options).eval()


def build_attention(method: Method, shape: Shape, device: torch.device, causal: bool,
                    chunk_size: int) -> Attend:
    """attend(q, k, v) -> (B, H, N, D) for `method`."""
    builders = {"softmax": _softmax, "linattn": _linattn, "performer": _performer, "fla": _fla}
    return builders[method.family](method, shape, device, causal, chunk_size)


def _softmax(method: Method, shape: Shape, device: torch.device, causal: bool, chunk_size: int) -> Attend:
    block = linattn.SoftmaxAttention(shape.heads * shape.head_dim, shape.heads, rope=False,
                                     causal=causal, backend=method.backend)
    if not method.flash:
        return block.attend
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attend_flash(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return block.attend(q, k, v)
    return attend_flash


def _linattn(method: Method, shape: Shape, device: torch.device, causal: bool, chunk_size: int) -> Attend:
    """What LinearAttention runs between its projections (the same map, placement, backend and
    choice of plain or log-space features as a user's block)."""
    block = linattn.LinearAttention(shape.heads * shape.head_dim, shape.heads,
                                    feature_map=make_feature_map(method.feature_map, shape), rope=method.rope,
                                    causal=causal, chunk_size=chunk_size, backend=method.backend)
    return block.to(device).eval().attend


def _performer(method: Method, shape: Shape, device: torch.device, causal: bool, chunk_size: int) -> Attend:
    from performer_pytorch import FastAttention

    # Its causal path prints a warning about missing CUDA code at construction; the CPU fallback
    # it announces is exactly what is measured, so the message is noise here.
    with contextlib.redirect_stdout(io.StringIO()):
        return FastAttention(dim_heads=shape.head_dim, nb_features=shape.num_features,
                             causal=causal).to(device)


def _fla(method: Method, shape: Shape, device: torch.device, causal: bool, chunk_size: int) -> Attend:
    """flash-linear-attention's chunk kernel as the peer of causal favor-post: the same FAVOR+
    features, rotated by linattn.apply_rotary, go through `chunk_linear_attn(normalize=False,
    scale=1.0)` for the numerator only; the unrotated denominator phi_q . cumsum(phi_k) is computed
    separately with a torch cumsum, since fla's own normalisation would use the rotated features.
    Uses fla's current API: (B, T, H, K) tensors, returning (output, final_state)."""
    from fla.ops.linear_attn import chunk_linear_attn

    fm = make_feature_map("favor", shape).to(device)

    def attend(q, k, v):
        phi_q, phi_k = fm(q, is_query=True), fm(k, is_query=False)
        rotated = [linattn.apply_rotary(phi).to(v.dtype).transpose(1, 2) for phi in (phi_q, phi_k)]
        numerator, _ = chunk_linear_attn(*rotated, v.transpose(1, 2), scale=1.0, normalize=False)
        denominator = (phi_q * phi_k.cumsum(dim=-2)).sum(dim=-1, keepdim=True)
        return (numerator.transpose(1, 2) / denominator).to(v.dtype)
    return attend


def make_inputs(shape: Shape, n: int, device: torch.device, dtype: torch.dtype = torch.float32,
                seed: int = 0):
    """q, k, v (B, H, N, D) requiring grad, and a fixed output gradient for backward."""
    generator = torch.Generator().manual_seed(seed)
    size = (shape.batch, shape.heads, n, shape.head_dim)
    q, k, v, grad = (torch.randn(size, generator=generator).to(device, dtype) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad


def forward_call(attend: Attend, q, k, v) -> Callable[[], None]:
    """Inference forward: no autograd graph is kept."""
    def run() -> None:
        with torch.no_grad():
            attend(q, k, v)
    return run


def drop_grads(*tensors: torch.Tensor) -> None:
    for t in tensors:
        t.grad = None


def train_call(attend: Attend, q, k, v, grad) -> Callable[[], None]:
    """Forward + backward to q, k, v; gradients are dropped first so they never accumulate."""
    def run() -> None:
        drop_grads(q, k, v)
        attend(q, k, v).backward(grad)
    return run


def block_names() -> tuple[str, ...]:
    """Every block this section can build, without options (`block_parts`): the softmax ones,
    `<map>-<rope>` for each registered map (backend auto), and `<map>-<rope>-<backend>` for the others
    (e.g. favor-post-fla)."""
    linear = tuple(f"{name}-{rope}{suffix}" for name in linattn.available_feature_maps() for rope in ROPES
                   for suffix in ("", *(f"-{backend}" for backend in LINEAR_BACKENDS)))
    return tuple(SOFTMAX_BLOCKS) + linear


def linear_parts(name: str) -> tuple[str, str, str]:
    """(feature map, rope, backend) of a linear block's or LM's name `<map>-<rope>[-<backend>]`."""
    head, last = name.rsplit("-", 1)
    if last in LINEAR_BACKENDS:
        feature_map, rope = head.rsplit("-", 1)
        return feature_map, rope, last
    return head, last, "auto"


SMALL_MODEL = {"n_layer": 4, "d_model": 256, "n_head": 4}


def model_size(size: str) -> dict:
    """Layers, width and heads of the small LM or of a training preset."""
    if size == "small":
        return SMALL_MODEL
    preset = preset_settings(size)
    return {key: preset[key] for key in ("n_layer", "d_model", "n_head", "mlp_ratio", "dropout")}


def block_parts(name: str) -> tuple[str, dict[str, int | str | tuple[float, ...]]]:
    """(name without options, block options) of `<name>[+window=W][+decay=retnet|g1_g2_...][+short_conv=K]`,
    the options the block takes (`linattn.BLOCK_OPTIONS`) as the training harness names them:
    favor-pre+window=64, softmax+window=64 (the window-only control), elu-post+decay=retnet."""
    base, *texts = name.split("+")
    options: dict[str, int | str | tuple[float, ...]] = {}
    for text in texts:
        key, _, value = text.partition("=")
        allowed = linattn.BLOCK_OPTIONS["softmax" if base in SOFTMAX_BLOCKS else "linear"]
        if key not in allowed or key in options:
            raise ValueError(f"{name}: after its name a block takes {' and '.join(f'+{k}=...' for k in allowed)}, "
                             f"each once, got +{text}")
        options[key] = block_option_from_name(key, value)
    if options.get("decay", "retnet") != "retnet":   # one factor per head, joined with '_' in a name
        try:
            options["decay"] = tuple(float(item) for item in str(options["decay"]).split(","))
        except ValueError:
            raise ValueError(f"{name}: decay is retnet or one factor per head joined with '_' (0.9_0.99)") from None
    return base, options


def is_softmax(name: str) -> bool:
    """Whether a block's or LM's name is softmax attention (the window-only control included)."""
    return block_parts(name)[0] in SOFTMAX_BLOCKS


def build_block(name: str, dim: int, heads: int, num_features: int) -> torch.nn.Module:
    """A block as a user builds it: softmax attention with RoPE, or LinearAttention with the map's
    M = num_features where the map has that option, on the backend its name gives, with its window
    and decay (`block_parts`)."""
    base, options = block_parts(name)
    if base in SOFTMAX_BLOCKS:
        return linattn.SoftmaxAttention(dim, heads, rope=True, causal=True, backend=SOFTMAX_BLOCKS[base], **options)
    feature_map, rope, backend = linear_parts(base)
    map_options = {"num_features": num_features} if "num_features" in linattn.feature_map_options(feature_map) else {}
    return linattn.LinearAttention(dim, heads, feature_map=feature_map, feature_map_options=map_options,
                                   rope=rope, causal=True, backend=backend, **options)
