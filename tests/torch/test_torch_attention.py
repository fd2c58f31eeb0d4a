"""The three attention kernels over a paged buffer (flex with a BlockMask from the page table, SDPA over the span,
the float32 reference with scores) against a float64 oracle, and the block lists themselves: every page holding a
visible entry is listed, full pages are wholly visible, empty and future pages are skipped."""

import numpy as np
import pytest
import torch
from torch_stream import DEVICE

from omnitide_mlx.torch.attention import (
    KERNELS,
    AttentionError,
    attend,
    block_lists,
    block_mask_visibility,
    plan_step,
    visibility,
)

P = 64


def _layout(rng, pages: int, retained: int, new: int, full_pages: int = 0):
    """A buffer of ``pages`` pages: ``full_pages`` completely filled first pages, the rest of the retained entries
    scattered, and ``new`` tokens (the step) in free slots; serials in a random physical order."""
    cap = pages * P
    key_seq = np.full(cap, -1, dtype=np.int64)
    filled = list(range(full_pages * P))
    rest = rng.choice(np.arange(full_pages * P, cap), retained + new - len(filled), replace=False)
    slots = np.concatenate([filled, rest]).astype(np.int64)
    old, fresh = slots[: retained], slots[retained:]
    key_seq[old] = np.sort(rng.permutation(retained)) if full_pages else rng.permutation(retained)
    key_seq[fresh] = retained + np.arange(new)
    return key_seq, retained + np.arange(new)


def _oracle(q, k, v, vis, scale):
    g = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(g, 1)
    vv = v.double().repeat_interleave(g, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    return p @ vv, p.sum(dim=(0, 1, 2))


@pytest.mark.parametrize("tokens", [1, 7, 200])
@pytest.mark.parametrize("seed", range(2))
def test_kernels_match_the_oracle(tokens, seed):
    rng = np.random.default_rng(seed)
    key_seq, q_seq = _layout(rng, pages=8, retained=150, new=tokens, full_pages=1)
    plan = plan_step(key_seq, q_seq, P, DEVICE)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=gen).to(DEVICE)
               for shape in ((1, 6, tokens, 32), (1, 2, key_seq.size, 32), (1, 2, key_seq.size, 32)))
    ref, ref_scores = _oracle(q, k, v, visibility(plan), 32 ** -0.5)
    for kernel in KERNELS:
        out = attend(kernel, q, k, v, plan, 32 ** -0.5)
        assert out.shape == q.shape and out.dtype == q.dtype
        np.testing.assert_allclose(out.double().cpu().numpy(), ref.cpu().numpy(), rtol=0, atol=2e-6, err_msg=kernel)
    _, scores = attend("reference", q, k, v, plan, 32 ** -0.5, return_scores=True)
    np.testing.assert_allclose(scores.cpu().numpy(), ref_scores.cpu().numpy(), rtol=1e-5, atol=1e-5)
    assert float(scores[torch.as_tensor(key_seq < 0, device=DEVICE)].abs().sum()) == 0.0


@pytest.mark.parametrize("seed", range(6))
def test_block_lists_cover_exactly_what_is_visible(seed):
    rng = np.random.default_rng(seed)
    key_seq, q_seq = _layout(rng, pages=10, retained=int(rng.integers(60, 400)), new=int(rng.integers(1, 260)),
                             full_pages=int(rng.integers(0, 3)))
    plan = plan_step(key_seq, q_seq, P, DEVICE)
    assert torch.equal(block_mask_visibility(plan), visibility(plan))
    occupied = (key_seq >= 0).reshape(-1, P).any(axis=1)
    page_min = np.where(key_seq >= 0, key_seq, 1 << 40).reshape(-1, P).min(axis=1)
    partial, whole = block_lists(plan)
    for b, (part, full) in enumerate(zip(partial, whole)):
        listed = np.union1d(part, full)
        assert np.intersect1d(part, full).size == 0
        assert occupied[listed].all()  # an empty page is never read
        block_max = q_seq[b * 128:(b + 1) * 128].max()
        assert (page_min[listed] <= block_max).all()  # nor a page entirely in the block's future
        assert np.array_equal(listed, np.flatnonzero(occupied & (page_min <= block_max)))


def test_a_skipped_tile_is_not_read():
    """NaN in the empty pages never reaches the output of the kernels that skip tiles (the reference gathers the
    active pages; compiled flex skips unlisted blocks; eager flex and SDPA read everything, so only on CUDA)."""
    rng = np.random.default_rng(3)
    key_seq = np.full(4 * P, -1, dtype=np.int64)
    key_seq[:40] = np.arange(40)
    key_seq[3 * P:3 * P + 10] = 40 + np.arange(10)
    plan = plan_step(key_seq, np.arange(45, 50), P, DEVICE)
    q, k, v = (torch.as_tensor(rng.standard_normal(s), dtype=torch.float32, device=DEVICE)
               for s in ((1, 4, 5, 16), (1, 2, 4 * P, 16), (1, 2, 4 * P, 16)))
    empty = np.repeat(~(key_seq >= 0).reshape(-1, P).any(axis=1), P)
    k[:, :, empty] = float("nan")
    v[:, :, empty] = float("nan")
    for kernel in ("reference", "flex") if torch.cuda.is_available() else ("reference",):
        assert torch.isfinite(attend(kernel, q, k, v, plan, 0.25)).all(), kernel
    assert list(plan.tiles) == [0, 3] and plan.span == 4 * P


def test_contract_errors():
    key_seq = np.full(2 * P, -1)
    key_seq[:5] = np.arange(5)
    plan = plan_step(key_seq, np.arange(3, 5), P, "cpu")
    q, k = torch.zeros(1, 4, 2, 16), torch.zeros(1, 2, 2 * P, 16)
    with pytest.raises(AttentionError, match="q must be"):
        attend("sdpa", torch.zeros(1, 4, 3, 16), k, k, plan, 1.0)
    with pytest.raises(AttentionError, match="multiple"):
        attend("sdpa", torch.zeros(1, 3, 2, 16), k, k, plan, 1.0)
    with pytest.raises(AttentionError, match="does not expose"):
        attend("flex", q, k, k, plan, 1.0, return_scores=True)
    with pytest.raises(AttentionError, match="unknown attention kernel"):
        attend("flash", q, k, k, plan, 1.0)
    with pytest.raises(AttentionError, match="whole pages"):
        plan_step(np.zeros(70), np.arange(2), P, "cpu")
    with pytest.raises(AttentionError, match="no slot is occupied"):
        plan_step(np.full(P, -1), np.arange(2), P, "cpu")
