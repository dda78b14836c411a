"""The window's band (ops/window_decay/band.py): outputs and log-normalisers against explicit float64
masked softmax, with and without decay, over group sizes that split the blocks every way; gradients of
both outputs by gradcheck; no (N, N) tensor anywhere in forward or backward; `merge` as one softmax; RoPE
inside the pass and another attention merged into it, against the explicit float64 softmax and by gradcheck."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from linattn.ops.window_decay import band
from linattn.ops.window_decay.band import band_attention, merge
from linattn.rotary import rotate


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(autouse=True, params=["flash", "blocked"])
def kernel(request, monkeypatch):
    """Every test on both of the band's kernels: torch's CPU flash-attention kernel (what CPU runs) and
    the blocked torch products (what other devices run, and CPU where torch lacks that kernel)."""
    if request.param == "blocked":
        monkeypatch.setattr(band, "FLASH_BACKWARD", None)
    return request.param


def masked_scores(q, k, window: int, log_decay):
    n = q.shape[-2]
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    distance = torch.arange(n)[:, None] - torch.arange(n)
    if log_decay is not None:
        scores = scores + distance.clamp_min(0) * log_decay[:, None, None]
    return scores.masked_fill(~((distance >= 0) & (distance < window)), float("-inf"))


def inputs(n: int, dim: int = 3, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, n, dim, dtype=torch.float64, generator=generator, requires_grad=True)
            for _ in range(3)]


DECAYS = [None, torch.tensor([-0.05, -0.4], dtype=torch.float64)]


@pytest.mark.parametrize("n, window, group_scores", [
    (19, 3, 1 << 22), (23, 4, 1), (23, 4, 400), (13, 20, 1 << 22), (9, 1, 1 << 22), (64, 64, 1), (70, 33, 5000)])
@pytest.mark.parametrize("log_decay", DECAYS)
def test_band_matches_masked_softmax_in_float64(monkeypatch, n, window, group_scores, log_decay):
    monkeypatch.setattr(band, "GROUP_SCORES", group_scores)
    q, k, v = inputs(n, seed=n + window)
    out, lse = band_attention(q, k, v, window, log_decay)
    scores = masked_scores(q, k, window, log_decay)
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ v)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))


@pytest.mark.parametrize("n, window, group_scores", [(11, 3, 1), (11, 4, 1 << 22), (6, 9, 1 << 22)])
@pytest.mark.parametrize("log_decay", DECAYS)
@pytest.mark.parametrize("flash_rows", [1 << 14, 1])   # the flash backward's heads in one group, one by one
def test_band_gradients_of_output_and_log_normaliser(monkeypatch, n, window, group_scores, log_decay, flash_rows):
    monkeypatch.setattr(band, "MIN_BLOCK", 4)   # blocks of max(W, 4) rows: the window reaches the block before
    monkeypatch.setattr(band, "GROUP_SCORES", group_scores)
    monkeypatch.setattr(band, "FLASH_ROWS", flash_rows)
    q, k, v = inputs(n, dim=2)

    def both(q, k, v):
        out, lse = band_attention(q, k, v, window, log_decay)
        return out, lse.sin()   # a gradient into lse that is not constant across rows

    assert torch.autograd.gradcheck(both, (q, k, v))
    out, _ = band_attention(q, k, v, window, log_decay)
    out.sum().backward()   # the log-normaliser unused: its gradient is None
    assert all(t.grad is not None and t.grad.isfinite().all() for t in (q, k, v))


def test_values_of_another_width_match_masked_softmax():
    """Values wider than the keys (the flash kernel takes equal widths: the blocked products run)."""
    q, k, _ = inputs(40, dim=4)
    v = torch.randn(1, 2, 40, 6, dtype=torch.float64)
    out, lse = band_attention(q, k, v, 5, DECAYS[1])
    scores = masked_scores(q, k, 5, DECAYS[1])
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ v)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))


@pytest.mark.parametrize("log_decay", DECAYS)
def test_inputs_of_any_strides_give_the_same_outputs_and_gradients(monkeypatch, log_decay):
    """Rows that are not dense (a convolution's (B, C, N) output seen as (B, H, N, D)) are read as rows."""
    monkeypatch.setattr(band, "MIN_BLOCK", 4)   # four blocks of 5 rows
    dense = inputs(20, dim=4)
    strided = [t.detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_() for t in dense]
    weight = torch.randn(1, 2, 20, 4, dtype=torch.float64)
    results = []
    for q, k, v in (dense, strided):
        out, lse = band_attention(q, k, v, 5, log_decay)
        results.append((out, lse, *torch.autograd.grad((out * weight).sum() + lse.sum(), (q, k, v))))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)


class LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return result


def test_no_tensor_grows_with_n_squared(monkeypatch):
    monkeypatch.setattr(band, "GROUP_SCORES", 1 << 14)
    n, window = 2048, 8
    q, k, v = (t.detach().float().requires_grad_() for t in inputs(n, dim=4))
    with LargestTensor() as largest:
        out, lse = band_attention(q, k, v, window)
        (out.sum() + lse.sum()).backward()
    assert largest.numel < n * n // 64, "an (N, N)-sized tensor appeared"


class FlashCalls(LargestTensor):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in (band.FLASH_FORWARD.default, band.FLASH_BACKWARD.default)
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.mark.parametrize("log_decay", DECAYS)
def test_cpu_runs_the_flash_kernel_on_views_of_the_rows(kernel, log_decay):
    """On CPU: two kernel calls each way (own block, previous block), no band or scores made: no tensor
    beyond the inputs' size (a decay's masks, one (L, L) per block, are the queries' size at L = D; the
    lse's gradient takes one more column)."""
    if kernel == "blocked":
        pytest.skip("the flash kernel's layout")
    n, window, dim = 2048, 8, band.MIN_BLOCK   # blocks of L = 32 rows
    q, k, v = (t.detach().float().requires_grad_() for t in inputs(n, dim=dim))
    with FlashCalls() as mode:
        out, lse = band_attention(q, k, v, window, log_decay, rotary_offset=3)
        (out.sum() + lse.sum()).backward()
    assert mode.calls == 4
    assert mode.numel <= q.numel() * (dim + 1) // dim, "a band or scores tensor appeared"


def test_merge_is_one_softmax_over_both_sets_of_keys():
    q, k, v = (t.detach() for t in inputs(12))
    full = masked_scores(q, k, 12, None)
    near = full.masked_fill(torch.arange(12)[:, None] - torch.arange(12) >= 4, float("-inf"))
    far = full.masked_fill(torch.arange(12)[:, None] - torch.arange(12) < 4, float("-inf"))
    far_lse = torch.logsumexp(far, -1).nan_to_num(neginf=-1e30)   # rows without far keys
    far_out = torch.softmax(far, -1).nan_to_num() @ v
    out, lse = band_attention(q, k, v, 4)
    torch.testing.assert_close(merge(out, lse, far_out, far_lse), torch.softmax(full, -1) @ v)
    assert merge(out, lse, None, None) is out


def test_merge_from_a_start_row_matches_the_explicit_softmax_and_its_gradients():
    generator = torch.Generator().manual_seed(3)
    out, other = (torch.randn(2, 3, 10, 5, generator=generator, dtype=torch.float64) for _ in range(2))
    lse, other_lse = (3 * torch.randn(2, 3, 10, generator=generator, dtype=torch.float64) for _ in range(2))
    inputs = [out, lse, other[..., 4:, :], other_lse[..., 4:]]
    for t in inputs:
        t.requires_grad_()

    def explicit(out, lse, other, other_lse):
        logs = torch.stack((lse[..., 4:], other_lse), -1)
        weights = torch.softmax(logs, -1).unsqueeze(-2)
        tail = (torch.stack((out[..., 4:, :], other), -1) * weights).sum(-1)
        return torch.cat((out[..., :4, :], tail), -2)

    torch.testing.assert_close(merge(*inputs, start=4), explicit(*inputs))
    assert torch.autograd.gradcheck(lambda *t: merge(*t, start=4), inputs)


def with_other(n: int, window: int, dim: int = 3, seed: int = 5):
    """Another attention's output and log-normaliser for the rows W.., rows W..W+1 with no weight (-inf)."""
    generator = torch.Generator().manual_seed(seed)
    other = torch.randn(1, 2, n - window, dim, dtype=torch.float64, generator=generator)
    other_lse = 2 * torch.randn(1, 2, n - window, dtype=torch.float64, generator=generator)
    other_lse[..., :2] = float("-inf")
    return other.requires_grad_(), other_lse.requires_grad_()


def explicit_merged(q, k, v, window, log_decay, offset, other, other_lse):
    """float64 softmax over the window's keys and one extra key per row W.. (value other, log-weight
    other_lse), q and k rotated at positions offset..: (output, log-normaliser)."""
    scores = masked_scores(rotate(q, offset=offset), rotate(k, offset=offset), window, log_decay)
    extra = torch.cat((scores.new_full((*scores.shape[:-1][:-1], window), float("-inf")), other_lse), -1)
    extra_values = torch.cat((other.new_zeros(*other.shape[:-2], window, other.shape[-1]), other), -2)
    logs = torch.cat((scores, extra.unsqueeze(-1)), -1)
    weights = torch.softmax(logs, -1)
    out = weights[..., :-1] @ v + weights[..., -1:] * extra_values
    return out, torch.logsumexp(logs, -1)


@pytest.mark.parametrize("n, window, group_scores", [(19, 3, 1 << 22), (23, 4, 1), (70, 33, 5000), (9, 1, 400)])
@pytest.mark.parametrize("log_decay", DECAYS)
@pytest.mark.parametrize("offset", [0, 1000])
def test_rotation_and_merge_inside_the_pass_match_the_explicit_softmax(monkeypatch, n, window, group_scores,
                                                                       log_decay, offset):
    monkeypatch.setattr(band, "GROUP_SCORES", group_scores)
    q, k, v = inputs(n, dim=4, seed=n)
    other, other_lse = with_other(n, window, dim=4)
    out, lse = band_attention(q, k, v, window, log_decay, rotary_offset=offset, other=other, other_lse=other_lse)
    want_out, want_lse = explicit_merged(q, k, v, window, log_decay, offset, other, other_lse)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    # the same as rotating first and merging after, as the window path did before
    own, own_lse = band_attention(rotate(q, offset=offset), rotate(k, offset=offset), v, window, log_decay)
    torch.testing.assert_close(out, merge(own, own_lse, other, other_lse, start=window))
    alone, alone_lse = band_attention(q, k, v, window, log_decay, rotary_offset=offset)
    torch.testing.assert_close((alone, alone_lse), (own, own_lse))


@pytest.mark.parametrize("n, window, group_scores", [(11, 3, 1), (13, 4, 1 << 22), (10, 1, 1)])
@pytest.mark.parametrize("log_decay", DECAYS)
def test_rotation_and_merge_inside_the_pass_by_gradcheck(monkeypatch, n, window, group_scores, log_decay):
    monkeypatch.setattr(band, "MIN_BLOCK", 4)   # several blocks: the window reaches the block before
    monkeypatch.setattr(band, "GROUP_SCORES", group_scores)
    q, k, v = inputs(n, dim=4, seed=n + 1)
    other, other_lse = with_other(n, window, dim=4)

    def both(q, k, v, other, other_lse):
        out, lse = band_attention(q, k, v, window, log_decay, rotary_offset=7, other=other, other_lse=other_lse)
        return out, lse.sin()

    assert torch.autograd.gradcheck(both, (q, k, v, other, other_lse))
    # against the explicit softmax's gradients, the log-normaliser unused (its gradient None)
    weight = torch.randn(1, 2, n, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    leaves = (q, k, v, other, other_lse)
    got = torch.autograd.grad((both(*leaves)[0] * weight).sum(), leaves)
    want = torch.autograd.grad((explicit_merged(q, k, v, window, log_decay, 7, other, other_lse)[0] * weight).sum(),
                               leaves)
    for name, g, w in zip(("q", "k", "v", "other", "other_lse"), got, want):
        torch.testing.assert_close(g, w, msg=name)
