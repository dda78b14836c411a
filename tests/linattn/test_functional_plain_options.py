"""The plain op's key offset, row log-normaliser and decay (`linear_attention(..., key_offset=,
return_log_normalizer=True, log_decay=)` of plain features): outputs, log-normalisers, states and gradients
against the float64 reference for every plain map and RoPE placement, decay on and off; gradcheck; the decay
exact far along a sequence in float32; through torch.compile's custom op; bad input."""
from functools import partial

import pytest
import torch

from linattn import LinearAttention, functional
from linattn.custom_ops import linear_attention_op
from linattn.ops.linear_attention.naive import reference_attention
from linattn.rotary import apply_rotary
from tests.linattn.test_functional_log_normalizer import check_compiled_matches_eager, check_gradients_match

PLAIN_MAPS = ("elu", "taylor")
OPTIONS = {"taylor": {"dim": 4}}   # head dim 8; taylor's M = 1 + 4 + 10, padded to 16
PLACEMENTS = ("post", "pre", "none")
OFFSETS = [(0, None), (6, 2), (3, 9)]     # (queries' offset, key_offset): the same, keys behind, keys ahead
LOG_DECAY = torch.tensor([-0.3, -2.0 ** -5], dtype=torch.float64)   # a strong decay and RetNet's first


def plain_features_of(fm: str, rope: str, offset: int, key_offset: int | None):
    """(q, k inputs) -> (phi_q, phi_k) as a block with this map and placement gives the op its features
    (`pre`: q and k rotated first, each at its own positions)."""
    torch.manual_seed(0)
    feature_map = LinearAttention(16, 2, feature_map=fm, rope=rope,
                                  feature_map_options=OPTIONS.get(fm, {})).double().feature_map

    def features(q, k):
        if rope == "pre":
            q, k = apply_rotary(q, offset=offset), apply_rotary(k, offset=offset if key_offset is None else key_offset)
        return feature_map(q, is_query=True), feature_map(k, is_query=False)
    return features, feature_map.nonnegative_features


def expected_state(phi_k, v, *, rotary: bool, key_offset: int, log_decay):
    """sum_n gamma^(N-1-n) (R_n phi_k_n) v_n^T and sum_n gamma^(N-1-n) phi_k_n, explicitly."""
    n = v.shape[-2]
    weights = torch.ones(phi_k.shape[1], n, dtype=torch.float64)
    if log_decay is not None:
        weights = torch.exp(torch.arange(n - 1, -1, -1, dtype=torch.float64) * log_decay[:, None])
    k_num = apply_rotary(phi_k, offset=key_offset) if rotary else phi_k
    weighted = weights[:, :, None] * k_num
    return weighted.transpose(-1, -2) @ v, (weights[:, :, None] * phi_k).sum(-2)


@pytest.mark.parametrize("decay", [False, True], ids=["no-decay", "decay"])
@pytest.mark.parametrize("offset,key_offset", OFFSETS)
@pytest.mark.parametrize("rope", PLACEMENTS)
@pytest.mark.parametrize("fm", PLAIN_MAPS)
def test_outputs_log_normalizers_states_and_gradients_match_the_reference(fm, rope, offset, key_offset, decay):
    features, nonnegative = plain_features_of(fm, rope, offset, key_offset)
    log_decay = LOG_DECAY if decay else None
    generator = torch.Generator().manual_seed(1)
    leaves = [torch.randn(1, 2, 19, 8, generator=generator, dtype=torch.float64) for _ in range(3)]
    inputs = [t.clone().requires_grad_() for t in leaves]
    expected = [t.clone().requires_grad_() for t in leaves]
    options = dict(causal=True, rotary=rope == "post", offset=offset, key_offset=key_offset,
                   nonnegative_features=nonnegative, log_decay=log_decay)
    out, state, lse = functional.linear_attention(*features(*inputs[:2]), inputs[2], chunk_size=4, backend="torch",
                                                  return_state=True, return_log_normalizer=True, **options)
    phi_q, phi_k = features(*expected[:2])
    ref, ref_lse = reference_attention(phi_q, phi_k, expected[2], return_log_normalizer=True, **options)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-9, atol=1e-11)
    keys_at = offset if key_offset is None else key_offset
    kv, k_sum = expected_state(phi_k.detach(), leaves[2], rotary=rope == "post", key_offset=keys_at,
                               log_decay=log_decay)
    assert state.position == keys_at + 19
    torch.testing.assert_close(state.kv, kv, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(state.k_sum, k_sum, rtol=1e-9, atol=1e-11)
    check_gradients_match((out, lse), (ref, ref_lse), inputs, expected, generator)


@pytest.mark.parametrize("causal,rotary,decay", [(True, True, False), (True, False, False), (False, True, False),
                                                 (True, True, True), (True, False, True)])
def test_gradcheck_of_the_output_and_the_log_normalizer(causal, rotary, decay):
    generator = torch.Generator().manual_seed(3)
    inputs = [(torch.rand(1, 2, 7, 4, generator=generator, dtype=torch.float64) + 0.1).requires_grad_()
              for _ in range(2)] + [torch.randn(1, 2, 7, 4, generator=generator, dtype=torch.float64).requires_grad_()]
    attend = partial(functional.linear_attention, causal=causal, rotary=rotary, chunk_size=3, offset=4, key_offset=1,
                     backend="torch", return_log_normalizer=True, log_decay=LOG_DECAY if decay else None)
    assert torch.autograd.gradcheck(lambda q, k, v: attend(q, k, v), inputs)


def test_a_zero_denominator_has_no_weight():
    """A row whose features meet no key's: log-normaliser -inf (a merge gives it no weight), no NaN gradient."""
    q = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]], dtype=torch.float64, requires_grad=True)
    k = torch.tensor([[[[0.0, 1.0], [0.0, 1.0]]]], dtype=torch.float64, requires_grad=True)
    v = torch.ones(1, 1, 2, 2, dtype=torch.float64)
    _, lse = functional.linear_attention(q, k, v, causal=True, rotary=False, return_log_normalizer=True)
    assert lse[0, 0, 0] == float("-inf") and lse[0, 0, 1].isfinite()
    grads = torch.autograd.grad(lse[..., 1].sum(), (q, k))
    assert all(g.isfinite().all() for g in grads)


def test_decay_is_exact_far_along_the_sequence_in_float32():
    """4,096 tokens at RetNet's slowest rates: float32 within 1e-5 of float64 at every position (a decay
    folded into the features as gamma^(+-n) loses digits with n; the chunk factors stay bounded)."""
    generator = torch.Generator().manual_seed(5)
    q, k = (torch.rand(1, 2, 4096, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 2, 4096, 8, generator=generator, dtype=torch.float64)
    log_decay = torch.tensor([1 - 2.0 ** -12, 1 - 2.0 ** -5], dtype=torch.float64).log()
    options = dict(causal=True, rotary=True, offset=10 ** 5, key_offset=10 ** 5 - 64, backend="torch",
                   return_log_normalizer=True)
    want, want_lse = functional.linear_attention(q, k, v, log_decay=log_decay, **options)
    got, got_lse = functional.linear_attention(q.float(), k.float(), v.float(), log_decay=log_decay.float(), **options)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse.double(), want_lse, rtol=1e-6, atol=1e-5)


def test_the_compiled_op_gives_eager_outputs_log_normalizers_and_gradients():
    generator = torch.Generator().manual_seed(4)
    leaves = [torch.rand(1, 2, 9, 4, generator=generator) for _ in range(3)]
    attend = partial(functional.linear_attention, causal=True, rotary=True, chunk_size=4, offset=3, key_offset=0,
                     return_log_normalizer=True, log_decay=LOG_DECAY.float())
    check_compiled_matches_eager(attend, leaves)


def test_custom_op_registration_with_plain_features_and_a_decay():
    """torch.library.opcheck: the op's schema, fake and autograd with the plain pass's options."""
    q, k = (torch.rand(2, 2, 6, 4).requires_grad_() for _ in range(2))
    v = torch.randn(2, 2, 6, 3).requires_grad_()
    arguments = (q, None, None, 0.0, 0.0, k, None, None, 0.0, 0.0, v, True, True, 5, 4, 10000.0, True, "torch",
                 False, True, 1, True, LOG_DECAY.float())
    torch.library.opcheck(linear_attention_op, arguments)


@pytest.mark.parametrize("change,word", [
    (dict(causal=False), "causal=True"),
    (dict(log_decay=torch.zeros(3)), "shape"),
    (dict(log_decay=torch.zeros(2, dtype=torch.int64)), "floating"),
    (dict(log_decay=[0.0, 0.0]), "floating"),
])
def test_bad_decay(change, word):
    phi = torch.rand(1, 2, 4, 2)
    options = dict(causal=True, rotary=False, log_decay=torch.zeros(2)) | change
    with pytest.raises(ValueError, match=word):
        functional.linear_attention(phi, phi, phi, **options)


def test_a_decay_above_one_is_refused_on_cpu():
    phi = torch.rand(1, 2, 4, 2)
    with pytest.raises(ValueError, match="<= 0"):
        functional.linear_attention(phi, phi, phi, causal=True, rotary=False, log_decay=torch.tensor([0.5, -0.1]))
