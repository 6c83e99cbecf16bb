"""
kernels.py: every fast path against the maths it speeds up. DepthMix's hand-written backward
against autograd and finite differences; the Triton kernels (compiled on a GPU, interpreted on a
CPU) against DepthMix and the plain MGR in float64; MGR's inverting backward; HC's and mHC-lite's
recomputed streams; memory; compilation.
The equivalences of whole methods on every backend are in test_residuals.py.
"""
import contextlib
import os
from typing import List

import numpy as np
import pytest
import torch
from torch.func import functional_call

import data
import kernels
from conftest import (KERNEL_DEVICE, METHODS, VARIANTS, REAL_TEXT, on_paths, TRITON_MARKS, assert_clean_error, fake_sublayers,
                      needs_triton, randomize_routing, rel_rms, routing, run_cli, tiny_model)
from residuals import RESIDUALS, DepthAttention, rms_norm


def depth_mix(queries, bias, sources, backend, prior=None):
    """One read of the backend's Reads (no pool) -> mixed (m, B, T, C) and lse (m, B, T), its rows
    stacked."""
    mixed, lse = zip(*kernels.reads(backend).rows(queries, bias, sources, prior))
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
        return kernels.DepthMix.apply(q, b, None, None, False, *srcs)
    assert torch.autograd.gradcheck(mix, inputs)
    got_mixed, got_lse = kernels.DepthMix.apply(queries, bias, None, None, False, *sources)
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


def test_full_attnres_keeps_no_stacked_copies_for_backward():
    """With the fast twins (the default), saved activations grow linearly with depth, not as L^2:
    16-layer Full AttnRes keeps about what PreNorm keeps (each source once), not a stack of up to
    33 sources per sublayer (as the reference does)."""
    from bench import saved_bytes
    idx = torch.randint(27, (2, 32))
    saved = {r: saved_bytes(tiny_model(r, n_layer=16), idx, idx) for r in ('prenorm', 'attnres', 'wav')}
    assert saved['attnres'] < 1.5 * saved['prenorm'] and saved['wav'] < 2.0 * saved['prenorm']


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
    want = run(lambda q, b, srcs: kernels.DepthMix.apply(q, b, None, None, False, *srcs), torch.float64)
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
        more = lambda q, pm, pl, *srcs: kernels.DepthMix.apply(q, None, pm, pl, False, *srcs)
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
    read, low = kernels.readable(sources, torch.float64)
    if len(set(dtypes)) == 2:
        assert all(r is v for r, v in zip(read, sources)) and low.dtype == torch.float32
    mixed = depth_mix(queries, None, sources, 'triton')[0]
    assert mixed.dtype == torch.float64
    g = torch.randn(mixed.shape, generator=gen, dtype=torch.float64).to(KERNEL_DEVICE)
    grads = torch.autograd.grad(mixed, sources, g)
    exact = [v.detach().double().requires_grad_() for v in sources]
    expected = kernels.DepthMix.apply(queries, None, None, None, False, *exact)[0]
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
    from bench import saved_bytes
    for residual in ('attnres', 'block_attnres', 'wav'):
        saved = {}
        for backend in ('torch', 'triton'):
            model = tiny_model(residual, n_layer=4, n_embd=32).to(KERNEL_DEVICE)
            model.set_kernels(backend)
            with torch.autocast(device_type=KERNEL_DEVICE.type, dtype=torch.bfloat16):
                saved[backend] = saved_bytes(model, idx, idx)
        assert saved['triton'] <= saved['torch'], (residual, saved)

def two_backwards(residual, backend='torch', n_layer=3, **knobs):
    """The parameters' gradients of two backwards through one retained graph (random routing)."""
    model = tiny_model(residual, n_layer=n_layer, **knobs)
    randomize_routing(model)
    model.set_kernels(backend)
    idx = torch.randint(27, (2, 8) if backend != 'triton' else (1, 4), generator=torch.Generator().manual_seed(0))
    _, loss = model(idx, idx)
    grads = []
    for _ in range(2):
        loss.backward(retain_graph=True)
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad()
    return grads


def assert_compiled_matches_eager(model, idx, backend):
    """torch.compile(fullgraph=True) traces the model (a graph break fails) and gives eager's loss and gradients."""
    results = []
    for run in (model, torch.compile(model, fullgraph=True, backend=backend)):
        _, loss = run(idx, idx)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        model.zero_grad()
    assert torch.allclose(results[0][0], results[1][0], atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(results[0][1], results[1][1]))


def mgr_run(n, C, T, gate, backend, fallback_p, dtype, seed=0):
    """An MGR residual over 2n+2 random tanh sublayers with randomised routing: output and the
    gradients of e and of every routing parameter."""
    gen = torch.Generator().manual_seed(seed)
    router = routing('mgr', n + 1, C=C, n_head=1, mgr_streams=n, mgr_gate=gate)
    randomize_routing(router, seed)
    router.to(KERNEL_DEVICE, dtype)
    weights = [torch.randn(C, C, generator=gen).to(KERNEL_DEVICE, dtype) * C ** -0.5 for _ in range(2 * n + 2)]
    e = torch.randn(2, T, C, generator=gen).to(KERNEL_DEVICE, dtype).requires_grad_()
    router.fallback_p = fallback_p  # as GPT.set_kernels sets it
    out = kernels.route(router, e, [lambda h, w=w: 3 * torch.tanh(h @ w) for w in weights], backend)
    grads = torch.autograd.grad((out * torch.randn(out.shape, generator=gen).to(KERNEL_DEVICE, dtype)).sum(),
                                [e] + list(router.parameters()))
    return [out, *grads]


@needs_triton
@pytest.mark.parametrize('n,C,T,gate,p', [(1, 7, 3, 'competitive', 1), (3, 20, 7, 'independent', 0),
                                          (4, 33, 5, 'competitive', 1), (4, 48, 3, 'independent', 2),
                                          (5, 40, 3, 'competitive', 5)])
def test_mgr_step_kernel_and_inversion_equal_the_plain_backward(n, C, T, gate, p, few_programs):
    """MGR through the fused step, Triton and its PyTorch twin, with the inverting
    backward (the p largest gates kept) and without, against the plain-autograd MGR in float64:
    the output and every gradient within relative RMS 1e-5."""
    want = mgr_run(n, C, T, gate, 'reference', -1, torch.float64)
    for backend, fallback_p in [('torch', p), ('triton', p), ('triton', -1)]:
        got = mgr_run(n, C, T, gate, backend, fallback_p, torch.float32)
        errors = [rel_rms(a, b) for a, b in zip(got, want)]
        assert max(errors) <= 1e-5, (backend, fallback_p, errors)


@pytest.mark.filterwarnings('ignore::RuntimeWarning')  # p = 0 divides by 1 - beta = 0
@pytest.mark.parametrize('backend', ['torch', pytest.param('triton', marks=needs_triton)])
def test_mgr_fallback_keeps_the_streams_the_inversion_cannot_rebuild(backend, few_programs):
    """Competitive gates with no keep weight and one dominant stream per token: its beta is ~1, so
    s = (s' - beta u) / (1 - beta) loses it. Keeping that stream's original (p = 1), the gradients
    are as close to float64's as the plain float32 backward's are (gates this sharp cost float32
    itself ~3e-5 here); without it (p = 0) they are not even finite."""
    def run(fallback_p, dtype):
        gen = torch.Generator().manual_seed(0)
        router = routing('mgr', 4, C=24, mgr_streams=3)
        randomize_routing(router)
        with torch.no_grad():
            router.gates.bias.fill_(-30.0)  # the keep logit: gates sum to 1
            router.gates.queries.mul_(200.0)  # one stream wins the gate at every token
        router.to(KERNEL_DEVICE, dtype)
        e = torch.randn(2, 5, 24, generator=gen).to(KERNEL_DEVICE, dtype).requires_grad_()
        updates = [(torch.randn(2, 5, 24, generator=gen) * 3).to(KERNEL_DEVICE, dtype).requires_grad_()
                   for _ in range(8)]
        router.fallback_p = fallback_p
        out = kernels.route(router, e, fake_sublayers(updates, []), backend if fallback_p >= 0 else 'reference')
        gout = torch.randn(out.shape, generator=gen).to(KERNEL_DEVICE, dtype)
        return torch.autograd.grad((out * gout).sum(), [e] + updates)
    want = run(-1, torch.float64)
    error = lambda fallback_p: max(rel_rms(a, b) for a, b in zip(run(fallback_p, torch.float32), want))
    assert error(1) <= error(-1) + 1e-5
    assert not error(0) <= 1e-3


def test_mgr_inversion_keeps_at_least_3x_less_than_the_plain_backward():
    """Bytes saved for backward, 4 streams: the excess over prenorm with the inverting backward is
    under a third of the plain backward's (bench.py reports the full-size figures)."""
    from bench import saved_bytes
    idx = torch.randint(27, (2, 32))
    saved = {}
    for name, fallback_p in [('prenorm', 1), ('plain', -1), ('p=1', 1), ('p=0', 0)]:
        model = tiny_model('prenorm' if name == 'prenorm' else 'mgr', n_layer=6, n_embd=64)
        model.set_kernels('torch', fallback_p)
        saved[name] = saved_bytes(model, idx, idx)
    excess = {k: v - saved['prenorm'] for k, v in saved.items()}
    assert excess['plain'] > 3 * excess['p=1'] > 3 * excess['p=0'] > 0


def test_mgr_inverting_backward_runs_twice_and_refuses_to_start_at_an_inner_step():
    """Every backward through the model starts at the last step, which keeps its output, so a
    retained graph backpropagates again to the same gradients; a backward from an inner step's
    output has nothing to rebuild from and says so."""
    assert all(torch.equal(a, b) for a, b in zip(*two_backwards('mgr')))
    router, inputs = routing('mgr', 3, mgr_streams=4), []
    randomize_routing(router)
    gen = torch.Generator().manual_seed(0)
    kernels.route(router, torch.randn(1, 2, 16, generator=gen),
                  fake_sublayers([torch.randn(1, 2, 16, generator=gen)] * 6, inputs), 'torch')  # fallback_p 1: unset
    with pytest.raises(RuntimeError, match='mgr_fallback_p=-1'):
        inputs[4].sum().backward()  # the input of sublayer 4, made by the (inner) step of sublayer 3


STREAM_VARIANTS = [('hc', {}), ('hc', {'hc_dynamic': False}), ('mhc_lite', {}), ('mhc_lite', {'hc_streams': 3}),
                   ('mhc', {}), ('kromhc', {'hc_streams': 8})]  # (mhc, kromhc: the PyTorch twin on every backend)


@pytest.mark.parametrize('residual,knobs', STREAM_VARIANTS)
@pytest.mark.parametrize('n_layer,backend', [(1, 'torch'), (3, 'torch'), (5, 'torch'),  # segments of 1, 2 (+2+2)
                                             pytest.param(5, 'triton', marks=TRITON_MARKS)])  # and 3 (+3+3+1)
def test_recomputed_streams_equal_the_saved_ones(residual, knobs, n_layer, backend):
    """HC and mHC-lite with the streams rebuilt in the backward and the mixing's, the connections' and
    the projection's gradients written by hand (the PyTorch twin; the Triton kernels) against the
    classes' own forward through autograd: output and the gradients of e and of every routing
    parameter, on random routing and random sublayers, in float64."""
    results, batch = [], 1 if backend == 'triton' else 2  # (the interpreter runs one program per token)
    for backend in ('reference', backend):
        gen = torch.Generator().manual_seed(0)
        router = routing(residual, n_layer, C=24, **knobs)
        randomize_routing(router)
        router.double()
        weights = [torch.randn(24, 24, generator=gen, dtype=torch.float64) * 24 ** -0.5 for _ in range(2 * n_layer)]
        e = torch.randn(batch, 5, 24, generator=gen, dtype=torch.float64).requires_grad_()
        out = kernels.route(router, e, [lambda h, w=w: 3 * torch.tanh(h @ w) for w in weights], backend)
        probe = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        results.append([out, *torch.autograd.grad((out * probe).sum(), [e, *router.parameters()])])
    assert all(rel_rms(got, want) <= 1e-10 for got, want in zip(results[1], results[0]))


@pytest.mark.parametrize('residual,knobs,backend', [(*variant, 'torch') for variant in STREAM_VARIANTS] + [
    pytest.param(*STREAM_VARIANTS[2], 'triton', marks=TRITON_MARKS)])  # (HC's replay is the same code)
def test_recomputed_streams_under_bfloat16_autocast(residual, knobs, backend, monkeypatch):
    """Under CPU bfloat16 autocast: the streams the backward rebuilds are bit for bit the ones the
    forward mixed (the replay repeats the forward's ops at its precision), and a tiny model's loss
    and gradients are as close to float64 as the reference's (3 seeds of random routing; the twin
    rounds differently, so the two bfloat16 results differ from each other by about as much).
    Through Triton's interpreter at one seed and fewer tokens (it runs each program in Python)."""
    seen, rebuilt, streams_at = [], [], kernels.StreamSegment.streams_at

    def recorded(step, streams, replay):  # the streams of the forward's calls of a step (not the backward's replays)
        return lambda *args: (None if replay(args) else seen.append(streams(args))) or step(*args)
    for step in (kernels.HCStep, kernels.MHCStep):  # (self, H, i, saved): saved None in the forward
        monkeypatch.setattr(step, '__call__', recorded(step.__call__, lambda args: args[1].clone(),
                                                       lambda args: len(args) > 3 and args[3] is not None))
    # the kernels' streams (H, post, u): H itself, or the last H' and the update that the kernel adds
    monkeypatch.setattr(kernels, '_triton_stream_mix', recorded(
        kernels._triton_stream_mix, lambda args: [None if a is None else a.clone() for a in args[:3]],
        lambda args: args[-1]))
    monkeypatch.setattr(kernels.StreamSegment, 'streams_at',
                        lambda self, i, autocast: rebuilt.append(streams_at(self, i, autocast)) or rebuilt[-1])
    errors = {'reference': [], backend: []}
    for seed in range(3) if backend == 'torch' else [0]:
        idx = torch.randint(27, (4, 32) if backend == 'torch' else (2, 16), generator=torch.Generator().manual_seed(seed))
        results = {}
        for backend, precision in [('reference', 'float64'), ('reference', 'bfloat16'), (backend, 'bfloat16')]:
            model = tiny_model(residual, n_layer=3, n_embd=64, block_size=32, **knobs)
            randomize_routing(model, seed=seed + 1)
            model.to(torch.float64 if precision == 'float64' else torch.float32).set_kernels(backend)
            seen.clear()
            with torch.autocast('cpu', dtype=torch.bfloat16, enabled=precision == 'bfloat16'):
                _, loss = model(idx, idx)
            forward_streams, rebuilt[:] = seen[:6], []
            loss.backward()
            results[backend, precision] = loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])
        same = lambda a, b: a is b is None or torch.equal(a.flatten(0, -3), b.flatten(0, -3))  # (PyTorch's: (N, n, C))
        assert len(rebuilt) == 6 and all(same(a, b) if isinstance(a, torch.Tensor) else all(map(same, a, b))
                                         for a, b in zip(forward_streams, reversed(rebuilt)))
        (loss64, grads64) = results['reference', 'float64']
        for backend in errors:
            loss16, grads16 = results[backend, 'bfloat16']
            assert abs(loss16 - loss64) <= 2e-3 * loss64
            errors[backend].append(rel_rms(grads16, grads64))
    assert sum(errors[backend]) <= 1.5 * sum(errors['reference']), errors


@pytest.mark.parametrize('residual,backend', [('hc', 'torch'), ('mhc_lite', 'torch'),
                                              pytest.param('hc', 'triton', marks=TRITON_MARKS)])
def test_recomputed_streams_are_freed_after_the_step(residual, backend):
    """Once a step's graph is gone, no StreamSegment of it is left alive (a reference cycle through
    autograd's graph kept every step's segments, and training grew by 27 MB a step until killed)."""
    import gc
    model = tiny_model(residual, n_layer=3)
    model.set_kernels(backend)
    idx = torch.randint(27, (1, 4), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        logits, loss = model(idx, idx)
        loss.backward()
    del logits, loss
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is kernels.StreamSegment]


def test_recomputed_streams_keep_about_a_sublayer_update_per_sublayer():
    """Bytes saved for backward (6 layers, width 64, 4 streams): keeping every sublayer's streams
    costs hc 2.6x and mhc_lite 2.3x prenorm's; rebuilt from segments, both stay under 1.3x, and the
    excess over prenorm shrinks at least 4x (bench.py reports the full-size figures)."""
    from bench import saved_bytes
    idx = torch.randint(27, (2, 32), generator=torch.Generator().manual_seed(0))
    saved = {}
    for residual, backend in [('prenorm', 'torch'), ('hc', 'reference'), ('hc', 'torch'), ('mhc_lite', 'reference'),
                              ('mhc_lite', 'torch')]:
        model = tiny_model(residual, n_layer=6, n_embd=64)
        model.set_kernels(backend)
        saved[residual, backend] = saved_bytes(model, idx, idx)
    for residual in ('hc', 'mhc_lite'):
        kept, rebuilt = (saved[residual, b] - saved['prenorm', 'torch'] for b in ('reference', 'torch'))
        assert kept > 4 * rebuilt > 0
        assert saved[residual, 'torch'] < 1.3 * saved['prenorm', 'torch']


@pytest.mark.parametrize('backend', ['torch', pytest.param('triton', marks=TRITON_MARKS)])
def test_recomputed_streams_backpropagate_twice_and_from_an_inner_sublayer(backend):
    """Each backward rebuilds what it needs, so a retained graph backpropagates again to the same
    gradients, and a backward from an inner sublayer's input works and matches the reference."""
    assert all(torch.equal(a, b) for a, b in zip(*two_backwards('mhc_lite', backend)))
    inner = []
    for backend in ('reference', backend):
        router, inputs = routing('hc', 3), []
        randomize_routing(router)
        router.double()
        gen = torch.Generator().manual_seed(0)
        e = torch.randn(1, 2, 16, generator=gen, dtype=torch.float64).requires_grad_()
        updates = [torch.randn(1, 2, 16, generator=gen, dtype=torch.float64)] * 6
        kernels.route(router, e, fake_sublayers(updates, inputs), backend)
        inner.append(torch.autograd.grad(inputs[4].sum(), [e, *router.parameters()]))
    assert all(rel_rms(a, b) <= 1e-10 for a, b in zip(*inner))


# ----------------------------------------------------------------------------- DenseFormer and MUDD: the states in one buffer

DENSE_VARIANTS = [('denseformer', {}), ('denseformer', {'denseformer_dilation': 2}),
                  ('denseformer', {'denseformer_dilation': 3, 'denseformer_period': 2}),
                  ('mudd', {}), ('mudd', {'mudd_multiway': False})]


def dense_run(residual, knobs, n_layer, backend, dtype=torch.float64, inner=None):
    """Output and the gradients of e and of every routing parameter (or, with inner = k, of the input
    of sublayer k) on random routing and random sublayers that use every input they get."""
    torch.manual_seed(0)  # MUDD's W1 init draws from the global generator
    gen = torch.Generator().manual_seed(0)
    router = routing(residual, n_layer, C=24, **knobs)
    randomize_routing(router)
    router.to(dtype)
    weights = [torch.randn(3, 24, 24, generator=gen, dtype=dtype) * 24 ** -0.5 for _ in range(2 * n_layer)]
    inputs = []

    def sublayer(W):
        def f(h, h_k=None, h_v=None):
            inputs.append(h)
            return 3 * torch.tanh(h @ W[0] + (h if h_k is None else h_k) @ W[1] + (h if h_v is None else h_v) @ W[2])
        return f
    e = torch.randn(2, 5, 24, generator=gen, dtype=dtype).requires_grad_()
    out = kernels.route(router, e, [sublayer(W) for W in weights], backend)
    probe = torch.randn(out.shape, generator=gen, dtype=dtype)
    loss = (out * probe).sum() if inner is None else inputs[inner].pow(2).sum()
    return [out, *torch.autograd.grad(loss, [e, *router.parameters()], allow_unused=inner is not None)]


@pytest.mark.parametrize('backend', ['torch', pytest.param('triton', marks=TRITON_MARKS)])
@pytest.mark.parametrize('residual', ['attnres', 'block_attnres', 'delta_attnres', 'wav'])
def test_shared_source_gradients_equal_the_class_twice_and_from_an_inner_sublayer(residual, backend):
    """In eager mode a finished source's gradient is one tensor that every later read adds its share
    to, handed to autograd by the source's first reader (kernels.Reads; the PyTorch twin also
    computes each such source's 1/RMS once). In float64
    (blocks of one layer: each source read by up to five later reads): the output and every gradient
    equal the class's within 1e-10, from the output and from an inner sublayer's input (the later
    reads never run backward), and a retained graph backpropagates again to the same gradients."""
    knobs = {} if residual in ('attnres', 'delta_attnres') else dict(res_block_size=1)
    for inner in (None, 3):
        got, want = (dense_run(residual, knobs, 3, b, inner=inner) for b in (backend, 'reference'))
        assert all((a is None and b is None) or rel_rms(a, b) <= 1e-10 for a, b in zip(got, want)), (residual, inner)
    assert all(torch.equal(a, b) for a, b in zip(*two_backwards(residual, backend, n_layer=3, **knobs)))


@pytest.mark.parametrize('backend', ['torch', pytest.param('triton', marks=TRITON_MARKS)])
@pytest.mark.parametrize('residual,knobs', DENSE_VARIANTS)
@pytest.mark.parametrize('n_layer', [1, 4, 6])
def test_dense_states_in_one_buffer_equal_the_class(residual, knobs, n_layer, backend, few_programs):
    """The buffered twins (kernels=torch: one product per mix, forward and backward, gradients
    handed over by the first reader; kernels=triton: MUDD's mixes in one kernel each way, in tiles
    of 4 tokens) against the classes through autograd, in float64: output and the gradients of e
    and of every routing parameter within 1e-10."""
    if n_layer % knobs.get('denseformer_period', 1):
        pytest.skip('the period must divide n_layer')
    reference, fast = (dense_run(residual, knobs, n_layer, b) for b in ('reference', backend))
    assert all(rel_rms(got, want) <= 1e-10 for got, want in zip(fast, reference))


@pytest.mark.parametrize('residual,knobs,backend', [(*DENSE_VARIANTS[2], 'torch'), (*DENSE_VARIANTS[3], 'torch'),
                                                    pytest.param(*DENSE_VARIANTS[3], 'triton', marks=TRITON_MARKS)])
def test_dense_states_backpropagate_twice_from_an_inner_sublayer_and_under_autocast(residual, knobs, backend):
    """A retained graph backpropagates again to the same gradients; a backward from an inner
    sublayer's input matches the reference; under bfloat16 autocast the twin is as close to the
    float32 reference as the reference is (the products run in float32 in both: MUDD's kernel too)."""
    assert all(torch.equal(a, b) for a, b in zip(*two_backwards(residual, backend, n_layer=4, **knobs)))
    inner = [dense_run(residual, knobs, 6, b, inner=7) for b in ('reference', backend)]
    assert all((got is None and want is None) or rel_rms(got, want) <= 1e-10 for got, want in zip(*inner))
    twin, reference = bfloat16_errors(residual, backend, n_layer=6, **knobs)
    assert twin <= 1.5 * reference + 1e-3


def bfloat16_errors(residual, twin='torch', **overrides):
    """The gradients (all parameters together) under CPU bfloat16 autocast of the twin (the PyTorch one,
    or kernels=triton) and of the reference, each as relative RMS from the reference's in float32 (a
    batch of 2 x 16 tokens)."""
    idx = torch.randint(27, (2, 16), generator=torch.Generator().manual_seed(0))
    results = {}
    for backend, bf16 in [('reference', False), ('reference', True), (twin, True)]:
        model = tiny_model(residual, **overrides)
        randomize_routing(model)
        model.set_kernels(backend)
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=bf16):
            _, loss = model(idx, idx)
        loss.backward()
        results[backend, bf16] = torch.cat([p.grad.flatten() for p in model.parameters()])
    want = results['reference', False]
    return rel_rms(results[twin, True], want), rel_rms(results['reference', True], want)


@pytest.mark.parametrize('residual', ['attnres', 'block_attnres', 'delta_attnres', 'wav', 'mgr'])
def test_depth_mix_twins_under_bfloat16_autocast(residual):
    """Under CPU bfloat16 autocast, as in training (a float32 embedding beside bfloat16 updates), the
    PyTorch twins (the depth mix and its shared gradients, MGR's step) are as close to the float32
    reference as the reference itself is under autocast."""
    twin, reference = bfloat16_errors(residual, n_layer=4)
    assert twin <= 1.5 * reference + 1e-3


@needs_triton
@pytest.mark.parametrize('residual', ['block_attnres', 'wav', 'mgr'])
def test_training_with_kernels_on_and_off_gives_the_same_losses(residual, data_dir):
    """A few AdamW steps on real text with the Triton kernels and with plain PyTorch
    as written (the reference): the same losses within 1e-4."""
    ds = data.load(REAL_TEXT, data_dir)
    text = torch.from_numpy(ds.splits['train'][:8192].astype(np.int64)).to(KERNEL_DEVICE)
    starts = torch.randint(len(text) - 9, (4, 2), generator=torch.Generator().manual_seed(0))
    losses = {}
    for backend, fallback_p in [('reference', 1), ('triton', 1)]:
        model = tiny_model(residual, n_layer=3, n_embd=24, block_size=8, vocab_size=ds.vocab_size,
                           res_block_size=2).to(KERNEL_DEVICE)
        model.set_kernels(backend, fallback_p)
        optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.99), KERNEL_DEVICE.type)
        losses[backend] = []
        for batch in starts:
            x = torch.stack([text[s:s + 8] for s in batch])
            y = torch.stack([text[s + 1:s + 9] for s in batch])
            _, loss = model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[backend].append(loss.item())
    assert losses['reference'][-1] < losses['reference'][0]  # it learns, so the kernels' gradients matter
    assert max(abs(a - b) for a, b in zip(losses['reference'], losses['triton'])) <= 1e-4


@needs_triton
@pytest.mark.parametrize('residual', ['block_attnres', 'wav', 'mgr'])
def test_kernels_compile_without_graph_breaks(residual):
    """torch.compile(fullgraph=True) traces the models with the kernels as opaque custom ops
    (aot_eager: the same tracing as inductor, without generating code) and gives eager's loss
    and gradients."""
    model = tiny_model(residual, n_layer=2, n_embd=24, block_size=8)
    randomize_routing(model)
    model.to(KERNEL_DEVICE).set_kernels('triton')
    idx = torch.randint(27, (1, 7), generator=torch.Generator().manual_seed(0)).to(KERNEL_DEVICE)
    assert_compiled_matches_eager(model, idx, 'aot_eager')


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason='a host-GPU sync exists only on a GPU')
@pytest.mark.parametrize('residual', METHODS)
def test_a_training_step_never_waits_for_the_gpu(residual):
    """Forward and backward with the Triton kernels queue their work and return: no operator waits
    for the GPU (a copy of the kernels' address tables from pageable memory did, once per read).
    CUDA's sync debug mode turns any such wait into an error."""
    model = tiny_model(residual, n_layer=3, n_embd=64, block_size=32, res_block_size=2).to('cuda')
    model.set_kernels('triton')
    idx = torch.randint(27, (4, 32), generator=torch.Generator().manual_seed(0)).to('cuda')
    for check in (False, True):  # the first step loads and compiles the kernels
        torch.cuda.set_sync_debug_mode('error' if check else 'default')
        try:
            with torch.autocast(device_type='cuda', dtype=torch.bfloat16):
                _, loss = model(idx, idx)
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode('default')
        model.zero_grad(set_to_none=True)


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason='bfloat16 needs the compiled kernels on CUDA '
                    '(the interpreter has no bf16 arithmetic)')
@pytest.mark.parametrize('residual', ['block_attnres', 'wav', 'mgr', 'hc', 'mhc_lite', 'mudd'])
def test_kernels_under_bfloat16_autocast_match_torch(residual):
    """Under autocast the kernels see what training gives them: a float32 embedding beside
    bfloat16 updates, float32 queries. Loss within 1e-2 and gradients (all parameters together)
    within relative RMS 5e-2 of the PyTorch path on the same model and batch."""
    model = tiny_model(residual, n_layer=3, n_embd=64, block_size=32, res_block_size=2).to(KERNEL_DEVICE)
    randomize_routing(model)
    idx = torch.randint(27, (4, 32), generator=torch.Generator().manual_seed(0)).to(KERNEL_DEVICE)
    results = []
    for backend in ('torch', 'triton'):
        model.set_kernels(backend)
        with torch.autocast(device_type='cuda', dtype=torch.bfloat16):
            _, loss = model(idx, idx)
        loss.backward()
        results.append((loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])))
        model.zero_grad()
    (loss_torch, grads_torch), (loss_triton, grads_triton) = results
    assert abs(loss_triton - loss_torch) <= 1e-2 * abs(loss_torch)
    assert rel_rms(grads_triton, grads_torch) <= 5e-2


def test_kernels_knob_errors_are_clear(tmp_path):
    assert kernels.resolve('auto', 'cpu') == 'torch' and kernels.resolve('torch', 'cuda') == 'torch'
    assert kernels.resolve('reference', 'cuda') == 'reference'
    with pytest.raises(ValueError, match='choose one of: auto, reference, torch, triton'):
        kernels.resolve('cuda', 'cpu')
    result = run_cli('train.py', '--kernels=triton', '--device=cpu', '--max_iters=1', f'--out_dir={tmp_path / "o"}',
                     cwd=tmp_path, env={**os.environ, 'TRITON_INTERPRET': '0'})
    wanted = 'set TRITON_INTERPRET=1' if kernels.triton is not None else 'pip install triton'
    assert_clean_error(result, 'error: kernels=triton', wanted)
    assert not (tmp_path / 'o').exists() and not (tmp_path / 'data').exists()  # refused before the data is prepared


def test_every_fast_twin_is_found_by_its_class(monkeypatch):
    """FAST is keyed by the classes of residuals.py themselves (route looks up the exact class), so
    a renamed class keeps its twin: with each class's own forward made to fail, route runs every
    method with a twin on it (kernels=torch); a method without one (any method a fork adds) runs its
    class's forward on every backend."""
    assert set(kernels.FAST) <= set(RESIDUALS.values())
    for name, cls in RESIDUALS.items():
        if cls in kernels.FAST:
            with monkeypatch.context() as patch:
                patch.setattr(cls, 'forward', lambda *args, name=name: pytest.fail(f"{name} ran its class's forward"))
                out = kernels.route(routing(name, 2), torch.randn(1, 2, 16), [lambda h, *more: torch.tanh(h)] * 4,
                                    'torch')
            assert out.shape == (1, 2, 16), name


def test_mgr_fallback_p_reaches_mgrs_twin_alone(monkeypatch):
    """GPT.set_kernels' mgr_fallback_p is set on the MGR module, where MGR's twin alone reads it (route
    and the other twins take no such setting, and other methods' modules get none): p = -1 runs the
    class's plain forward, p >= 0 the inverting step; a p below -1 is refused."""
    import inspect
    assert list(inspect.signature(kernels.route).parameters) == ['residual', 'x', 'sublayers', 'backend']
    plain = []
    forward = kernels.residuals.MultiGateResiduals.forward
    monkeypatch.setattr(kernels.residuals.MultiGateResiduals, 'forward',
                        lambda *args: plain.append(True) or forward(*args))
    idx = torch.randint(27, (1, 4), generator=torch.Generator().manual_seed(0))
    model = tiny_model('mgr', n_layer=3, mgr_streams=2)
    for p, runs_plain in [(1, False), (-1, True), (0, False)]:
        plain.clear()
        assert model.set_kernels('torch', p) == 'torch' and model.residual.fallback_p == p
        model(idx, idx)
        assert bool(plain) == runs_plain, p
    other = tiny_model('attnres')
    other.set_kernels('torch', 0)
    assert not hasattr(other.residual, 'fallback_p')
    with pytest.raises(ValueError, match='mgr_fallback_p must be -1'):
        model.set_kernels('torch', -2)


def test_regional_compilation_compiles_one_attention_and_one_mlp_at_any_depth():
    """compile_sublayers (--compile_scope=sublayers): a 4-layer model compiles two graphs, one for
    every attention and one for every MLP, and gives eager's loss and gradients (backend 'eager')."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model('wav', n_layer=4, n_embd=24, block_size=8)
    randomize_routing(model)
    idx = torch.randint(27, (2, 7), generator=torch.Generator().manual_seed(0))
    results = []
    for compiled in (False, True):
        if compiled:
            model.compile_sublayers(backend='eager')
        _, loss = model(idx, idx)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        model.zero_grad()
    assert counters['stats']['unique_graphs'] == 2
    assert torch.allclose(results[0][0], results[1][0], atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(results[0][1], results[1][1]))


@pytest.mark.parametrize('residual,knobs', [(m, {}) for m in METHODS] + STREAM_VARIANTS[1::2])
def test_every_method_compiles_as_one_graph(residual, knobs):
    """torch.compile(fullgraph=True) traces every method on its default path (kernels=torch) without a
    graph break, and the compiled model gives eager's loss and gradients (backend 'eager': Dynamo's
    tracing alone, without generating code). In float64: compiled, HC and mHC-lite run their class's
    forward, which rounds differently from their eager twin."""
    torch._dynamo.reset()  # one model per test: no recompilation limit shared across them
    model = tiny_model(residual, n_layer=2, n_embd=24, block_size=8, **knobs)
    randomize_routing(model)
    model.double()
    idx = torch.randint(27, (2, 7), generator=torch.Generator().manual_seed(0))
    assert_compiled_matches_eager(model, idx, 'eager')


# Compiling every kernel for a GPU without one: Triton's code generator and the ptxas it ships run on
# any machine. Each launch of a forward and backward of every method (float32, float64, and bfloat16
# autocast) is captured instead of run, and compiled for sm_90 (H100/H200) with its actual argument
# types and constants. Run in a fresh process: the interpreter must be off for the JIT's path.
COMPILE_FOR_CUDA = """
import sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction, mangle_type
from model import GPT, GPTConfig
from residuals import RESIDUALS
launches = {}
def capture(self, *args, grid, warmup, **kwargs):
    bound = dict(zip([p.name for p in self.params], args), **kwargs)
    key = (self.fn.__name__,) + tuple(repr(bound[p.name]) if p.is_constexpr or bound[p.name] is None
                                      else mangle_type(bound[p.name]) for p in self.params)
    launches.setdefault(key, (self, bound))
JITFunction.run = capture  # nothing runs: the outputs stay uninitialised, and the launches are recorded
# every method in each dtype at width 16 (the kernels take tiles of several tokens), and the depth-mix
# reads with and without biases (block_attnres, wav), the stream, MGR and MUDD kernels at width 1024 too
# (one token per program, as at GPT-2's widths)
cases = [(name, 16, dtype, autocast) for name in RESIDUALS
         for dtype, autocast in [(torch.float32, False), (torch.float64, False), (torch.float32, True)]]
cases += [(name, 1024, torch.float32, False) for name in ('block_attnres', 'wav', 'hc', 'mhc_lite', 'mgr', 'mudd')]
for name, width, dtype, autocast in cases:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=width, n_head=2, block_size=8, vocab_size=32, residual=name)).to(dtype)
    model.kernels = 'triton'  # (set_kernels would refuse a CPU without the interpreter)
    idx = torch.randint(32, (1, 8))
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
        _, loss = model(idx, idx)
    loss.backward()
failed = []
for key, (fn, bound) in launches.items():
    constant = lambda p: p.is_constexpr or bound[p.name] is None
    signature = {p.name: 'constexpr' if constant(p) else mangle_type(bound[p.name]) for p in fn.params}
    try:
        triton.compile(ASTSource(fn=fn, signature=signature, constexprs={p.name: bound[p.name] for p in fn.params
                                                                          if constant(p)}), target=GPUTarget('cuda', 90, 32))
    except Exception as e:
        failed.append(f"{key}: {e!r}")
tiles = {}
for fn, bound in launches.values():
    tiles.setdefault(fn.fn.__name__, set()).add(bound.get('BT'))
print(len(launches), sorted(tiles), 'tiles', sorted(name for name, sizes in tiles.items() if len(sizes - {None}) >= 2))
sys.exit('\\n'.join(failed) or None)
"""


@needs_triton
def test_every_triton_kernel_compiles_for_a_cuda_gpu():
    """Every kernel launch of every method's forward and backward, with its argument types (float32,
    float64, bfloat16 under autocast), compiles to a CUDA binary for sm_90 (interpreted runs check
    the maths; this checks what only a GPU would otherwise: that the compiler takes the kernels)."""
    import subprocess
    import sys
    import triton
    if 'nvidia' not in triton.backends.backends:
        pytest.skip("this triton has no CUDA backend to compile with")
    env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}
    result = subprocess.run([sys.executable, '-c', COMPILE_FOR_CUDA], cwd=os.path.dirname(os.path.abspath(__file__)),
                            capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    count, names = result.stdout.split(' ', 1)
    tiled = ['_advance_bwd', '_depth_mix_bwd', '_depth_mix_fwd', '_mgr_step_bwd', '_mgr_step_fwd', '_mudd_mix_bwd',
             '_mudd_mix_fwd', '_stream_mix_bwd', '_stream_mix_fwd']
    assert names.endswith(f"tiles {tiled}\n"), result.stdout  # one token per program, and several
    assert int(count) >= 60 and all(k in names for k in ('_depth_mix_bwd', '_stream_mix_bwd',
                                                         '_advance_bwd', '_mgr_step_bwd')), result.stdout


# ----------------------------------------------------------------------------- every fast path in float64; launches

@pytest.mark.parametrize('residual,knobs,backend', [p for p in on_paths(VARIANTS) if p.values[2] != 'reference'])
def test_every_fast_path_equals_the_reference_in_float64(residual, knobs, backend, few_programs):
    """Every method's fast path (the twins of kernels.py, the Triton kernels) computes at its inputs'
    precision: in float64 its output and the gradients of e and of every routing parameter equal the
    class's own forward through autograd within 1e-10 (float32 inside would show as ~1e-7), on
    random routing and random sublayers that use every input they get. The kernels take tiles of 4
    tokens here, two programs reducing over three tiles (few_programs)."""
    def run(backend):
        torch.manual_seed(0)  # MUDD's init draws from the global generator
        gen = torch.Generator().manual_seed(0)
        router = routing(residual, 4, C=24, **knobs)
        randomize_routing(router)
        router.double()
        weights = [torch.randn(24, 24, generator=gen, dtype=torch.float64) * 24 ** -0.5 for _ in range(8)]
        e = torch.randn(2, 5, 24, generator=gen, dtype=torch.float64).requires_grad_()
        sublayers = [lambda h, *more, w=w: 3 * torch.tanh((h + sum(more)) @ w) for w in weights]
        out = kernels.route(router, e, sublayers, backend)
        probe = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        return [out, *torch.autograd.grad((out * probe).sum(), [e, *router.parameters()])]
    errors = [rel_rms(got, want) for got, want in zip(run(backend), run('reference'))]
    assert max(errors) <= 1e-10, errors


# The operators one training step dispatches (forward + backward; compute, views) at 4 layers, as
# `python bench.py --count_ops=True --config=ops` prints them: each compute operator is a kernel
# launch on a GPU, so a change that adds launches to a method's routing fails here. Lower counts
# fail too, so that these figures and docs/PERFORMANCE.md's stay the measured ones: update both
# (test_docs.py holds the two equal).
OPERATORS = {
    'torch': {'prenorm': (135, 245), 'rezero': (152, 239), 'layerscale': (168, 255), 'laurel_rw': (201, 249),
              'laurel_lr': (217, 377), 'attnres': (509, 652), 'block_attnres': (429, 570), 'delta_attnres': (482, 591),
              'wav': (751, 782), 'hc': (408, 760), 'mhc': (3656, 1389), 'mhc_lite': (472, 710),
              'kromhc': (608, 1117), 'frac': (610, 574), 'mgr': (500, 540), 'denseformer': (169, 322),
              'mudd': (291, 411)},
    'triton': {'prenorm': (135, 245), 'rezero': (152, 239), 'layerscale': (168, 255), 'laurel_rw': (201, 249),
               'laurel_lr': (217, 377), 'attnres': (159, 297), 'block_attnres': (159, 297), 'delta_attnres': (206, 315),
               'wav': (195, 302), 'hc': (159, 276), 'mhc': (3656, 1389), 'mhc_lite': (202, 316),
               'kromhc': (608, 1117), 'frac': (610, 574), 'mgr': (154, 265), 'denseformer': (169, 322),
               'mudd': (280, 417)},
}


@pytest.mark.parametrize('backend', ['torch', pytest.param('triton', marks=needs_triton)])
def test_operators_per_training_step_are_pinned(backend):
    """Counted exactly (a dispatch mode; no timing), on a 4-layer model at two tokens (the counts do
    not depend on width or tokens); within 2% for other PyTorch versions' decompositions."""
    import bench
    shape, cfg = dict(n_layer=4, n_embd=32, n_head=2, block_size=8), dict(seed=0, vocab_size=96, mgr_fallback_p=1)
    idx = torch.randint(96, (1, 2), generator=torch.Generator().manual_seed(0)).to(KERNEL_DEVICE)
    counted = {}
    for residual in METHODS:
        r = bench.operator_counts(residual, shape, 1, idx, idx, KERNEL_DEVICE, contextlib.nullcontext(), backend, cfg)
        counted[residual] = (r['compute'], r['views'])
    off = {m: (counted[m], want) for m, want in OPERATORS[backend].items()
           if any(abs(c - w) > max(2, 0.02 * w) for c, w in zip(counted[m], want))}
    assert not off, f"(counted, pinned) operators per training step changed: {off}"
    unpinned = sorted(m for m in METHODS if RESIDUALS[m] in kernels.FAST and m not in OPERATORS[backend])
    assert not unpinned, f"methods with a fast twin and no pinned operators: {unpinned} (counted: {counted})"


# The bytes one training step moves (bench.py --count_bytes), x prenorm's, in bfloat16 autocast at a
# small shape (4 layers of width 128, 2 x 64 tokens), as the operators are pinned above: a change that
# adds traffic to a method's routing fails here, and so does one that removes it until these figures
# and docs/PERFORMANCE.md's are updated.
BYTES = {
    'torch': {'prenorm': 1.0, 'rezero': 0.984, 'layerscale': 1.111, 'laurel_rw': 1.177, 'laurel_lr': 1.221,
              'attnres': 2.211, 'block_attnres': 1.775, 'delta_attnres': 2.116, 'wav': 2.879, 'hc': 3.343,
              'mhc': 4.606, 'mhc_lite': 3.225, 'kromhc': 3.075, 'frac': 1.684, 'mgr': 3.053, 'denseformer': 1.149,
              'mudd': 1.533},
    'triton': {'prenorm': 1.0, 'rezero': 0.984, 'layerscale': 1.111, 'laurel_rw': 1.177, 'laurel_lr': 1.221,
               'attnres': 1.125, 'block_attnres': 1.099, 'delta_attnres': 1.311, 'wav': 1.229, 'hc': 1.493,
               'mhc': 4.606, 'mhc_lite': 1.885, 'kromhc': 3.075, 'frac': 1.684, 'mgr': 1.232, 'denseformer': 1.149,
               'mudd': 1.428},
}


@pytest.mark.parametrize('backend', ['torch', pytest.param('triton', marks=needs_triton)])
def test_bytes_per_training_step_are_pinned(backend):
    """Counted exactly on fake tensors (shapes only: no data, no timing), within 0.005 of prenorm's."""
    import bench
    shape, cfg = dict(n_layer=4, n_embd=128, n_head=2, block_size=64), dict(seed=0, vocab_size=96, mgr_fallback_p=1)
    ctx = torch.autocast(KERNEL_DEVICE.type, dtype=torch.bfloat16)
    moved = {m: bench.bytes_moved(m, shape, 2, KERNEL_DEVICE, ctx, backend, cfg)['bytes'] for m in METHODS}
    off = {m: (round(moved[m] / moved['prenorm'], 3), want) for m, want in BYTES[backend].items()
           if abs(moved[m] / moved['prenorm'] - want) > 0.005}
    assert not off, f"(counted, pinned) bytes per training step x prenorm's changed: {off}"
    unpinned = sorted(m for m in METHODS if RESIDUALS[m] in kernels.FAST and m not in BYTES[backend])
    assert not unpinned, f"methods with a fast twin and no pinned bytes: {unpinned} (x prenorm's: " \
        f"{ {m: round(moved[m] / moved['prenorm'], 3) for m in unpinned} })"


@pytest.mark.parametrize('backend', ['torch', pytest.param('triton', marks=needs_triton)])
def test_bytes_counted_on_fake_tensors_are_those_of_a_real_step(backend):
    """The count on fake tensors (what lets bench.py count GPT-2's shape on a CPU at once) equals the
    count of a real step, operator by operator, for every method in float32 and, to the layer norm's
    saved statistics (the fakes keep them in bfloat16 where a real step keeps float32: 2 numbers a
    token, under 0.1%), in bfloat16 autocast."""
    import bench
    shape, cfg = dict(n_layer=4, n_embd=32, n_head=2, block_size=8), dict(seed=0, vocab_size=96, mgr_fallback_p=1)
    for name in [m for m in METHODS if backend == 'torch' or RESIDUALS[m] in kernels.FAST]:  # (no twin: as torch)
        for ctx in (contextlib.nullcontext(), torch.autocast(KERNEL_DEVICE.type, dtype=torch.bfloat16)):
            fake, real = (bench.bytes_moved(name, shape, 2, KERNEL_DEVICE, ctx, backend, cfg, fake=f) for f in (True, False))
            if isinstance(ctx, contextlib.nullcontext):
                assert fake['ops'] == real['ops'], name
            else:
                assert fake['ops'].keys() == real['ops'].keys() and abs(fake['bytes'] / real['bytes'] - 1) < 1e-3, name


def test_the_byte_counter_counts_reads_writes_and_in_place_writes():
    """add reads two tensors and writes one; add_ reads two and writes its first in place; views,
    allocations and a custom op's insides move nothing (the op moves its arguments and all its
    outputs, a list of them included)."""
    import bench

    @torch.library.custom_op('bytetest::halves', mutates_args=())
    def halves(x: torch.Tensor) -> List[torch.Tensor]:
        return [x[:5] * 2, x[5:] * 2]
    a, b = torch.ones(10), torch.ones(10)
    with bench.ByteCounter() as counter:
        a + b
        a.add_(b)
        a.view(2, 5).t().unsqueeze_(0)
        torch.empty(1000)
        halves(a)
    assert counter.moved == {'aten.add.Tensor': 120, 'aten.add_.Tensor': 120, 'bytetest.halves.default': 80}
