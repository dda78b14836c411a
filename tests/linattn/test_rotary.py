"""Rotary phases: standard angles, exact at any position, O(dim) memory per position."""
import mpmath
import pytest
import torch

from linattn import LinearAttention
from linattn.rotary import apply_rotary, rotary_frequencies, rotary_phases, rotate_pairs


def test_rope_pairs_adjacent_coordinates_with_standard_angles():
    theta = 10000 ** (-torch.arange(0, 6, 2, dtype=torch.float64) / 6)
    torch.testing.assert_close(rotary_phases(3, 6, dtype=torch.float64)[2].angle(), 2 * theta)
    x = torch.randn(5, 6, dtype=torch.float64)
    rotated = apply_rotary(x, offset=7)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    pair = rotated[1, 2:4]                   # position 8, pair i = 1
    c, s = torch.cos(8 * theta[1]), torch.sin(8 * theta[1])
    torch.testing.assert_close(pair, torch.stack([c * x[1, 2] - s * x[1, 3], s * x[1, 2] + c * x[1, 3]]))


@pytest.mark.parametrize("position", [0, 7, 65535, 65536, 10 ** 5, 10 ** 9, 2 ** 40 + 3, 2 ** 63 - 1])
def test_phases_match_the_exact_angle_at_any_position(position):
    """Against p * theta evaluated by mpmath at 50 digits: float64's p * theta alone is off by
    ~5e-9 at p = 1e9 and by O(1) at 2^62."""
    phases = rotary_phases(1, 16, offset=position, dtype=torch.float64)[0]
    with mpmath.workdps(50):
        exact = [mpmath.expj(mpmath.mpf(position) * theta) for theta in rotary_frequencies(16)]
    expected = torch.tensor([complex(z) for z in exact], dtype=torch.complex128)
    assert (phases - expected).abs().max() < 1e-9


def test_a_range_of_positions_equals_one_position_at_a_time():
    """Prefill (a range) and decoding (one token) must rotate a position identically, across the
    16-bit digit boundary of the angle reduction too."""
    start = 2 ** 16 - 3
    ranged = rotary_phases(6, 8, offset=start)
    single = torch.cat([rotary_phases(1, 8, offset=start + i) for i in range(6)])
    assert torch.equal(ranged, single)


def test_huge_offset_needs_no_table_and_keeps_relative_positions():
    """offset=10**9 used to allocate a 10^9-row phase table; outputs depend on relative positions."""
    torch.manual_seed(0)
    block = LinearAttention(32, 4, feature_map="elu", rope="post", chunk_size=8).double().eval()
    x = torch.randn(1, 12, 32, dtype=torch.float64)
    torch.testing.assert_close(block(x, offset=10 ** 9), block(x), rtol=1e-7, atol=1e-8)
    assert rotary_phases(1, 256, offset=10 ** 12).shape == (1, 128)


@pytest.mark.parametrize("offset", [-1, 2.5, True, 2 ** 63])
def test_bad_offsets_are_refused(offset):
    with pytest.raises(ValueError, match="offset"):
        apply_rotary(torch.randn(2, 4), offset=offset)


@pytest.mark.parametrize("x, message", [
    (torch.arange(16).reshape(1, 1, 4, 4), "integer inputs would give truncated outputs"),
    (torch.randn(1, 4, 4, dtype=torch.complex64), "real floating-point tensor, got torch.complex64"),
    (torch.randn(4), r"takes x of shape \(..., N, dim\).*got shape \(4,\)"),
    ([[1.0, 2.0]], r"takes a tensor of shape \(..., N, dim\), got list"),
    (torch.randn(1, 4, 4, device="meta"), r"on a device that computes, not meta"),
])
def test_inputs_that_are_not_real_floating_tensors_of_positions_are_refused(x, message):
    """An int64 tensor came back rotated and truncated, with no error."""
    with pytest.raises(ValueError, match=message):
        apply_rotary(x)


@pytest.mark.parametrize("base", ["1e4", True, 10 ** 400], ids=["string", "bool", "int-past-float"])
def test_a_base_that_is_not_a_finite_number_is_refused_before_any_conversion(base):
    """'1e4' and True passed float() and were accepted; 10**400 overflowed inside the check."""
    with pytest.raises(ValueError, match=r"rope_base must be a finite number > 0"):
        apply_rotary(torch.randn(3, 4), base=base)


def test_phases_first_made_under_inference_mode_serve_a_training_call():
    """The phase cache kept inference tensors, which autograd refuses to save: an evaluation under
    inference_mode broke the next training step of the same length."""
    x = torch.randn(2, 7, 6)
    with torch.inference_mode():
        apply_rotary(x, offset=3)
    y = apply_rotary(x.clone().requires_grad_(), offset=3)
    y.sum().backward()


def test_a_new_offset_copies_nothing_from_the_host(monkeypatch):
    """Decoding asks for a new offset each step: after the first call the angles are built on the device
    alone (a copy from host memory would make the host wait for a GPU at every step)."""
    from linattn import rotary
    rotary.rotary_angles(4, 8, offset=3, device="meta")
    built = []
    monkeypatch.setattr(torch, "tensor", lambda *args, **kwargs: built.append(kwargs) or torch.as_tensor(*args))
    for offset in (4, 2 ** 40):
        assert rotary.rotary_angles(4, 8, offset=offset, device="meta").device.type == "meta"
    assert built == []


def test_rotating_into_dense_rows_gives_the_same_pairs_from_a_view_of_heads():
    """rotate_pairs(..., dense=True) (the window's band): one pass into contiguous rows, from (B, H, N, D)
    heads viewed in a (B, N, H D) projection, the same values as the plain rotation."""
    projection = torch.randn(2, 7, 3 * 8, dtype=torch.float64)
    heads = projection.unflatten(-1, (3, 8)).transpose(1, 2)   # (2, 3, 7, 8), not contiguous
    phases = rotary_phases(7, 8, offset=5, dtype=torch.float64)
    dense = rotate_pairs(heads, phases, dense=True)
    assert dense.is_contiguous() and not heads.is_contiguous()
    torch.testing.assert_close(dense, rotate_pairs(heads, phases), rtol=0, atol=0)
    odd = torch.randn(2, 3, 7, 9, dtype=torch.float64)[..., :8]   # rows 9 apart: no view as pairs
    torch.testing.assert_close(rotate_pairs(odd, phases, dense=True), rotate_pairs(odd.contiguous(), phases),
                               rtol=0, atol=0)
