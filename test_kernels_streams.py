"""
HC and the mHC family (kernels/streams.py, kernels/stream_kernels.py): the streams rebuilt in the
backward equal the saved ones, under bfloat16 autocast too; what they keep, and when it is freed.
"""
import pytest
import torch

import kernels
from conftest import (STREAM_VARIANTS, TRITON_MARKS, fake_sublayers, randomize_routing, rel_rms, routing, tiny_model,
                      two_backwards)
from kernels import streams
from kernels.streams import HCStep, ManifoldStep, StreamSegment


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


STREAM_COUNTS = [(residual, n) for residual in ('hc', 'mhc', 'mhc_lite', 'kromhc', 'frac') for n in (1, 2, 4, 8)
                 if (residual, n) != ('mhc_lite', 8)]  # (mHC-lite's 8! permutations: GPTConfig refuses n > 6)


@pytest.mark.parametrize('residual,n', STREAM_COUNTS)
@pytest.mark.parametrize('backend', ['torch', pytest.param('triton', marks=TRITON_MARKS)])
def test_every_stream_method_at_one_two_four_and_eight_streams(residual, n, backend):
    """Every stream method's fast path at n = 1, 2, 4 and 8 streams (Frac: fractions) equals its class in
    float64, output and every gradient: one stream too (KromHC with no factors has a constant H_res,
    whose backward once asked autograd for a gradient that did not exist)."""
    knobs = {'frac_parts': n} if residual == 'frac' else {'hc_streams': n}
    results = []
    for backend in ('reference', backend):
        gen = torch.Generator().manual_seed(n)
        router = routing(residual, 2, C=24, **knobs)
        randomize_routing(router)
        router.double()
        weights = [torch.randn(24, 24, generator=gen, dtype=torch.float64) * 24 ** -0.5 for _ in range(4)]
        e = torch.randn(1, 3, 24, generator=gen, dtype=torch.float64).requires_grad_()
        out = kernels.route(router, e, [lambda h, w=w: 3 * torch.tanh(h @ w) for w in weights], backend)
        probe = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        results.append([out, *torch.autograd.grad((out * probe).sum(), [e, *router.parameters()])])
    errors = [rel_rms(got, want) for got, want in zip(results[1], results[0])]
    assert max(errors) <= 1e-10, errors


@pytest.mark.parametrize('residual,knobs,backend', [(*variant, 'torch') for variant in STREAM_VARIANTS] + [
    pytest.param(*STREAM_VARIANTS[2], 'triton', marks=TRITON_MARKS), pytest.param(*STREAM_VARIANTS[4], 'triton', marks=TRITON_MARKS),
    pytest.param(*STREAM_VARIANTS[6], 'triton', marks=TRITON_MARKS)])  # (HC's replay is the same code as Frac's)
def test_recomputed_streams_under_bfloat16_autocast(residual, knobs, backend, monkeypatch):
    """Under CPU bfloat16 autocast: the streams the backward rebuilds are bit for bit the ones the
    forward mixed (the replay repeats the forward's ops at its precision), and a tiny model's loss
    and gradients are as close to float64 as the reference's (3 seeds of random routing; the twin
    rounds differently, so the two bfloat16 results differ from each other by about as much).
    Through Triton's interpreter at one seed and fewer tokens (it runs each program in Python)."""
    seen, rebuilt, streams_at = [], [], StreamSegment.streams_at

    def recorded(step, streams, replay):  # the streams of the forward's calls of a step (not the backward's replays)
        return lambda *args: (None if replay(args) else seen.append(streams(args))) or step(*args)
    for step in (HCStep, ManifoldStep):  # (self, H, i, saved): saved None in the forward
        monkeypatch.setattr(step, '__call__', recorded(step.__call__, lambda args: args[1].clone(),
                                                       lambda args: len(args) > 3 and args[3] is not None))
    # the kernels' streams (H, post, u): H itself, or the last H' and the update that the kernel adds
    monkeypatch.setattr(streams, '_triton_stream_mix', recorded(
        streams._triton_stream_mix, lambda args: [None if a is None else a.clone() for a in args[:3]],
        lambda args: args[-1]))
    monkeypatch.setattr(StreamSegment, 'streams_at',
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
    assert not [o for o in gc.get_objects() if type(o) is StreamSegment]


def test_recomputed_streams_keep_about_a_sublayer_update_per_sublayer():
    """Bytes saved for backward (6 layers, width 64, 4 streams): keeping every sublayer's streams
    costs hc 2.6x and mhc_lite 2.3x prenorm's; rebuilt from segments, both stay under 1.3x, and the
    excess over prenorm shrinks at least 4x (bench.py reports the full-size figures)."""
    from counters import saved_bytes
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
