"""
The depth mix (kernels/depth_mix.py): DepthMix's hand-written backward against autograd and finite
differences, the Triton kernel against it in float64, reads continued from a prior, sources of mixed
dtypes.
"""
import pytest
import torch
from torch.func import functional_call

from conftest import KERNEL_DEVICE, needs_triton, rel_rms, tiny_model
from kernels.depth_mix import DepthMix, readable, reads
from residuals import DepthAttention, rms_norm


def depth_mix(queries, bias, sources, backend, prior=None):
    """One read of the backend's Reads (no pool) -> mixed (m, B, T, C) and lse (m, B, T), its rows
    stacked."""
    mixed, lse = zip(*reads(backend).rows(queries, bias, sources, prior))
    return torch.stack(mixed), torch.stack(lse)


@pytest.mark.parametrize('S,C,m,with_bias', [(1, 7, 1, False), (4, 13, 3, True), (11, 16, 2, True)])
def test_depth_mix_hand_written_backward_matches_autograd(S, C, m, with_bias):
    """DepthMix (m queries, with the log-sum-exp for online merging) against the reference read of
    residuals.py (DepthAttention, plain autograd), in value and in every gradient, and by finite
    differences (gradcheck), in float64."""
    gen = torch.Generator().manual_seed(S)
    sources = [torch.randn(2, 3, C, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(S)]
    queries = torch.randn(m, C, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(m, S, dtype=torch.float64, generator=gen, requires_grad=True) if with_bias else None
    inputs = [queries] + ([bias] if with_bias else []) + sources

    def mix(q, *rest):
        b, srcs = (rest[0], rest[1:]) if with_bias else (None, rest)
        return DepthMix.apply(q, b, None, None, False, *srcs)
    assert torch.autograd.gradcheck(mix, inputs)
    got_mixed, got_lse = DepthMix.apply(queries, bias, None, None, False, *sources)
    grad_mixed = torch.randn(m, 2, 3, C, dtype=torch.float64, generator=gen)
    grad_lse = torch.randn(m, 2, 3, dtype=torch.float64, generator=gen)
    got = torch.autograd.grad((got_mixed * grad_mixed).sum() + (got_lse * grad_lse).sum(), inputs)
    read, want_total = DepthAttention(m, C).double(), 0
    for j in range(m):  # every source read as a biased one (a "detail"), to give each its bias
        b = bias[j] if with_bias else torch.zeros(S, dtype=torch.float64)
        want_mixed = functional_call(read, {'queries': queries}, (j, [], sources, b))
        assert torch.allclose(got_mixed[j], want_mixed)
        want_total = want_total + (want_mixed * grad_mixed[j]).sum()
    ref_logits = torch.einsum('sbtc,mc->msbt', rms_norm(torch.stack(sources)), queries)
    ref_logits = ref_logits + (0 if bias is None else bias[:, :, None, None])
    ref_lse = torch.logsumexp(ref_logits, dim=1)
    assert torch.allclose(got_lse, ref_lse)
    want = torch.autograd.grad(want_total + (ref_lse * grad_lse).sum(), inputs)
    assert all(torch.allclose(a, b) for a, b in zip(got, want))


@needs_triton
@pytest.mark.parametrize('S,m,C,T,with_bias', [(1, 1, 7, 3, False), (2, 1, 20, 5, True), (13, 3, 48, 7, True),
                                               (40, 2, 33, 5, False), (40, 6, 100, 3, True), (2, 2, 24, 1, True)])
def test_depth_mix_kernel_equals_its_reference(S, m, C, T, with_bias, few_programs):
    """The Triton depth_mix (float32; interpreted on CPU) against DepthMix, the PyTorch reference, run in
    float64 on the same inputs: mixed, lse and the gradients of the queries, the bias and the
    sources (all S as one tensor) within relative RMS 1e-5. (The float32 reference is itself up to
    ~1e-5 from float64 on single sources, so float64 is the oracle.)"""
    gen = torch.Generator().manual_seed(S * 100 + T)
    sources = [torch.randn(2, T, C, generator=gen) * (1 + s % 3) for s in range(S)]
    queries = torch.randn(m, C, generator=gen)
    bias = torch.randn(m, S, generator=gen) if with_bias else None
    grad_mixed, grad_lse = torch.randn(m, 2, T, C, generator=gen), torch.randn(m, 2, T, generator=gen)

    def run(mix, dtype):
        q, *srcs = [t.to(KERNEL_DEVICE, dtype).requires_grad_() for t in [queries] + sources]
        b = bias.to(KERNEL_DEVICE, dtype).requires_grad_() if with_bias else None
        mixed, lse = mix(q, b, srcs)[:2]
        grads = torch.autograd.grad((mixed * grad_mixed.to(KERNEL_DEVICE, dtype)).sum()
                                    + (lse * grad_lse.to(KERNEL_DEVICE, dtype)).sum(),
                                    [q] + ([b] if with_bias else []) + srcs)
        return [mixed, lse, grads[0]] + ([grads[1]] if with_bias else []) + [torch.stack(grads[-S:])]
    got = run(lambda q, b, srcs: depth_mix(q, b, srcs, 'triton'), torch.float32)
    want = run(lambda q, b, srcs: DepthMix.apply(q, b, None, None, False, *srcs), torch.float64)
    for name, a, b in zip(['mixed', 'lse', 'd queries'] + ['d bias'] * with_bias + ['d sources'], got, want):
        assert a.dtype == torch.float32 and rel_rms(a, b) <= 1e-5, name


@pytest.mark.parametrize('backend', ['torch', pytest.param('triton', marks=needs_triton)])
@pytest.mark.parametrize('S,split,m,with_bias', [(2, 1, 1, False), (5, 3, 2, True), (7, 1, 3, True)])
def test_depth_mix_with_a_prior_equals_one_read_of_every_source(S, split, m, with_bias, backend, few_programs):
    """Phase 2 in the kernel: the first `split` sources read as a prior (mixed, lse), the others read
    on top of it in one call, equal one read of all S sources at once, in float64 to 1e-12: mixed,
    lse and the gradients of the queries, the bias and every source (through the prior too); the
    PyTorch twin also by finite differences."""
    gen = torch.Generator().manual_seed(S)
    dev = KERNEL_DEVICE if backend == 'triton' else torch.device('cpu')
    leaf = lambda *shape: (torch.randn(*shape, generator=gen, dtype=torch.float64) * 2).to(dev).requires_grad_()
    sources, queries = [leaf(2, 3, 12) for _ in range(S)], leaf(m, 12)
    bias = leaf(m, S) if with_bias else None
    grad_mixed, grad_lse = torch.randn(m, 2, 3, 12, generator=gen, dtype=torch.float64).to(dev), torch.randn(
        m, 2, 3, generator=gen, dtype=torch.float64).to(dev)
    inputs = [queries] + ([bias] if with_bias else []) + sources

    def merged(q, b, *srcs):
        prior = depth_mix(q, None if b is None else b[:, :split], srcs[:split], backend)
        return depth_mix(q, None if b is None else b[:, split:], srcs[split:], backend, prior)

    def results(mix):
        mixed, lse = mix(queries, bias, *sources)
        grads = torch.autograd.grad((mixed * grad_mixed).sum() + (lse * grad_lse).sum(), inputs)
        return [mixed, lse, *grads]
    got, want = results(merged), results(lambda q, b, *srcs: depth_mix(q, b, srcs, 'torch'))
    assert all(rel_rms(a, b) <= 1e-12 for a, b in zip(got, want)), [rel_rms(a, b) for a, b in zip(got, want)]
    if backend == 'torch':
        prior = [t.detach().requires_grad_() for t in depth_mix(queries, None, sources[:split], backend)]
        more = lambda q, pm, pl, *srcs: DepthMix.apply(q, None, pm, pl, False, *srcs)
        assert torch.autograd.gradcheck(more, [queries, *prior, *sources[split:]])


@needs_triton
@pytest.mark.parametrize('dtypes', [(torch.float64, torch.float32, torch.float32),
                                    (torch.float32, torch.float64, torch.float16)])
def test_depth_mix_kernel_reads_sources_of_mixed_dtypes_as_they_are(dtypes):
    """Under autocast a pool mixes dtypes (e float32, updates bfloat16): the kernels read each source
    through its own pointer type and write its gradient in its dtype, copying nothing (a copy per
    source per read cost a GPU launch and its memory traffic); a third dtype is promoted. Values and
    gradients as DepthMix's in float64 (here float64 beside float32, and three dtypes)."""
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(1, 3, 10, generator=gen, dtype=torch.float64) for _ in range(3)]
    sources = [v.to(t).to(KERNEL_DEVICE).requires_grad_() for v, t in zip(values, dtypes)]
    queries = torch.randn(2, 10, generator=gen, dtype=torch.float64).to(KERNEL_DEVICE)
    read, low = readable(sources, torch.float64)
    if len(set(dtypes)) == 2:
        assert all(r is v for r, v in zip(read, sources)) and low.dtype == torch.float32
    mixed = depth_mix(queries, None, sources, 'triton')[0]
    assert mixed.dtype == torch.float64
    g = torch.randn(mixed.shape, generator=gen, dtype=torch.float64).to(KERNEL_DEVICE)
    grads = torch.autograd.grad(mixed, sources, g)
    exact = [v.detach().double().requires_grad_() for v in sources]
    expected = DepthMix.apply(queries, None, None, None, False, *exact)[0]
    assert rel_rms(mixed, expected) <= 1e-12
    for grad, want, v in zip(grads, torch.autograd.grad(expected, exact, g), sources):
        assert grad.dtype == v.dtype
        assert rel_rms(grad.double(), want) <= (1e-3 if v.dtype == torch.float16 else 1e-6)


@needs_triton
def test_triton_reads_keep_the_sources_not_their_promoted_copies():
    """Under bfloat16 autocast the sources of a depth read mix float32 (e) and bfloat16 (the updates);
    the Triton op promotes them inside itself, so autograd keeps the sources as the PyTorch path
    does, not a float32 copy of each per read (which cost Block AttnRes 1.88x prenorm's memory
    instead of 1.27x on a GPU)."""
    idx = torch.randint(27, (2, 16), generator=torch.Generator().manual_seed(0)).to(KERNEL_DEVICE)
    from counters import saved_bytes
    for residual in ('attnres', 'block_attnres', 'wav'):
        saved = {}
        for backend in ('torch', 'triton'):
            model = tiny_model(residual, n_layer=4, n_embd=32).to(KERNEL_DEVICE)
            model.set_kernels(backend)
            with torch.autocast(device_type=KERNEL_DEVICE.type, dtype=torch.bfloat16):
                saved[backend] = saved_bytes(model, idx, idx)
        assert saved['triton'] <= saved['torch'], (residual, saved)
