"""The log-space op's key offset and row log-normaliser (`linear_attention(..., key_offset=,
return_log_normalizer=True)`): outputs, log-normalisers and gradients against the float64 reference for every
log-space map and RoPE placement on both CPU backends, at scales where chunks are irregular, by gradcheck, through
torch.compile's custom op, and bad input."""
from functools import partial

import pytest
import torch

from linattn import LinearAttention, functional
from linattn.custom_ops import linear_attention_op
from linattn.ops.linear_attention.naive import logspace_attention_reference
from linattn.rotary import apply_rotary

MAPS = ("favor", "softmax", "hedgehog")   # the maps with log-features
PLACEMENTS = ("post", "pre", "none")
OFFSETS = [(0, None), (6, 2), (3, 9)]     # (queries' offset, key_offset): the same, keys behind, keys ahead


def log_features_of(fm: str, rope: str, projected: bool, offset: int, key_offset: int | None):
    """(q, k inputs) -> (b, a) as a block with this map and placement gives the op its log-features
    (`pre`: q and k rotated first, each at its own positions), as LogProjections where `projected`."""
    torch.manual_seed(0)
    feature_map = LinearAttention(16, 2, feature_map=fm, rope=rope,
                                  feature_map_options={"num_features": 8} if fm == "favor" else {}
                                  ).double().feature_map

    def features(q, k):
        if rope == "pre":
            q, k = apply_rotary(q, offset=offset), apply_rotary(k, offset=offset if key_offset is None else key_offset)
        if projected:
            return feature_map.log_projection(q, is_query=True), feature_map.log_projection(k, is_query=False)
        return feature_map.log_features(q, is_query=True), feature_map.log_features(k, is_query=False)
    return features


def materialized(x):
    return x.materialize() if hasattr(x, "materialize") else x


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("offset,key_offset", OFFSETS)
@pytest.mark.parametrize("rope", PLACEMENTS)
@pytest.mark.parametrize("fm,projected", [("favor", False), ("favor", True), ("softmax", False),
                                          ("hedgehog", False)])
def test_outputs_log_normalizers_and_gradients_match_the_reference(fm, projected, rope, offset, key_offset,
                                                                   backend):
    features = log_features_of(fm, rope, projected, offset, key_offset)
    generator = torch.Generator().manual_seed(1)
    leaves = [torch.randn(1, 2, 19, 8, generator=generator, dtype=torch.float64) for _ in range(3)]
    inputs = [t.clone().requires_grad_() for t in leaves]
    expected = [t.clone().requires_grad_() for t in leaves]
    out, lse = functional.linear_attention(*features(*inputs[:2]), inputs[2], causal=True, rotary=rope == "post",
                                           offset=offset, key_offset=key_offset, chunk_size=4, backend=backend,
                                           log_space=True, return_log_normalizer=True)
    b, a = (materialized(x) for x in features(*expected[:2]))
    ref, ref_lse = logspace_attention_reference(b, a, expected[2], causal=True, rotary=rope == "post", offset=offset,
                                                key_offset=key_offset, return_log_normalizer=True)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-9, atol=1e-11)
    check_gradients_match((out, lse), (ref, ref_lse), inputs, expected, generator)


def check_gradients_match(results, references, inputs, expected, generator):
    """The gradients of one random weighting of (output, log-normaliser) and of the reference's agree."""
    (out, lse), (ref, ref_lse) = results, references
    weights = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    lse_weights = torch.randn(lse.shape, generator=generator, dtype=torch.float64)
    grads = torch.autograd.grad((out * weights).sum() + (lse * lse_weights).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * weights).sum() + (ref_lse * lse_weights).sum(), expected)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("rotary", [True, False])
@pytest.mark.parametrize("scale", [3, 40])
def test_irregular_chunks_give_the_reference_log_normalizer_and_its_gradient(scale, rotary, backend):
    """scale 40: keys whose maxima jump past JUMP_LIMIT and wide pairs, the chunks the C++ kernel hands back.
    The queries' two coordinates of a pair stay close, so that Eq. 19's numerator stays below its cap."""
    generator = torch.Generator().manual_seed(2)
    leaves = [torch.randn(1, 2, 21, 6, generator=generator, dtype=torch.float64) * s for s in (scale, scale, 1)]
    pairs = leaves[0].unflatten(-1, (-1, 2))
    leaves[0] = (pairs.mean(-1, keepdim=True) + 0.005 * pairs).flatten(-2)
    inputs = [t.clone().requires_grad_() for t in leaves]
    expected = [t.clone().requires_grad_() for t in leaves]
    out, state, lse = functional.linear_attention(*inputs, causal=True, rotary=rotary, offset=5, key_offset=1,
                                                  chunk_size=4, backend=backend, log_space=True, return_state=True,
                                                  return_log_normalizer=True)
    ref, ref_lse = logspace_attention_reference(*expected, causal=True, rotary=rotary, offset=5, key_offset=1,
                                                return_log_normalizer=True)
    assert state.position == 1 + 21   # the keys' next position
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out, ref, rtol=1e-7, atol=1e-9)
    lse_weights = torch.randn(lse.shape, generator=generator, dtype=torch.float64)
    grads = torch.autograd.grad((lse * lse_weights).sum(), inputs, allow_unused=True)
    ref_grads = torch.autograd.grad((ref_lse * lse_weights).sum(), expected, allow_unused=True)
    for got, want in zip(grads[:2], ref_grads[:2]):   # the values take no part in the normaliser
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("causal,rotary", [(True, True), (True, False), (False, True)])
def test_gradcheck_of_the_output_and_the_log_normalizer(causal, rotary, backend):
    generator = torch.Generator().manual_seed(3)
    inputs = [(torch.randn(1, 2, 7, 4, generator=generator, dtype=torch.float64) * s).requires_grad_()
              for s in (3, 3, 1)]
    attend = partial(functional.linear_attention, causal=causal, rotary=rotary, chunk_size=3, offset=4,
                     key_offset=1, backend=backend, log_space=True, return_log_normalizer=True)
    assert torch.autograd.gradcheck(lambda b, a, v: attend(b, a, v), inputs)


@pytest.mark.parametrize("log_decay", [None, torch.tensor([-0.05, -0.7])])
def test_the_compiled_op_gives_eager_log_normalizers_and_gradients(log_decay):
    generator = torch.Generator().manual_seed(4)
    leaves = [torch.randn(1, 2, 9, 4, generator=generator) for _ in range(3)]
    attend = partial(functional.linear_attention, causal=True, rotary=True, chunk_size=4, offset=3, key_offset=0,
                     log_space=True, return_log_normalizer=True, log_decay=log_decay)
    check_compiled_matches_eager(attend, leaves)


def check_compiled_matches_eager(attend, leaves):
    """attend(q, k, v) -> (out, lse) compiled (fullgraph, aot_eager) gives eager's outputs and gradients."""
    results = []
    for run in (attend, torch.compile(attend, fullgraph=True, backend="aot_eager")):
        inputs = [t.clone().requires_grad_() for t in leaves]
        out, lse = run(*inputs)
        results.append((out, lse, torch.autograd.grad(out.sum() + lse.square().sum(), inputs)))
    (out, lse, grads), (c_out, c_lse, c_grads) = results
    torch.testing.assert_close(c_out, out)
    torch.testing.assert_close(c_lse, lse)
    for got, want in zip(c_grads, grads):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_custom_op_registration_with_a_key_offset_and_the_log_normalizer(backend):
    """torch.library.opcheck: the op's schema, fake and autograd with both options."""
    q, k, v = (torch.randn(2, 1, 6, size).requires_grad_() for size in (4, 4, 3))
    arguments = (q, None, None, 0.0, 0.0, k, None, None, 0.0, 0.0, v, True, True, 5, 4, 10000.0, True, backend, True,
                 True, 1, True)
    torch.library.opcheck(linear_attention_op, arguments)


def test_bad_key_offset_or_log_normalizer_flag():
    phi = torch.rand(1, 1, 4, 2)
    with pytest.raises(ValueError, match="offset"):
        functional.linear_attention(phi, phi, phi, causal=True, rotary=False, log_space=True, key_offset=-1)
    with pytest.raises(ValueError, match="return_log_normalizer"):
        functional.linear_attention(phi, phi, phi, causal=True, rotary=False, log_space=True,
                                    return_log_normalizer=1)
