"""
MGR's fused step (kernels/mgr.py): the Triton kernel and the inverting backward against the plain
backward in float64, the fallback, what the inversion keeps, and the one setting route hands it.
"""
import pytest
import torch

import kernels
import residuals
from conftest import (KERNEL_DEVICE, fake_sublayers, needs_triton, randomize_routing, rel_rms, routing, tiny_model,
                      two_backwards)
from kernels import mgr


def mgr_run(n, C, T, gate, backend, fallback_p, dtype, seed=0):
    """An MGR residual over 2n+2 random tanh sublayers with randomised routing: output and the
    gradients of e and of every routing parameter."""
    gen = torch.Generator().manual_seed(seed)
    router = routing('mgr', n + 1, C=C, n_head=1, mgr_streams=n, mgr_gate=gate)
    randomize_routing(router, seed)
    router.to(KERNEL_DEVICE, dtype)
    weights = [torch.randn(C, C, generator=gen).to(KERNEL_DEVICE, dtype) * C ** -0.5 for _ in range(2 * n + 2)]
    e = torch.randn(2, T, C, generator=gen).to(KERNEL_DEVICE, dtype).requires_grad_()
    out = kernels.route(router, e, [lambda h, w=w: 3 * torch.tanh(h @ w) for w in weights], backend, fallback_p)
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
        out = kernels.route(router, e, fake_sublayers(updates, []), backend if fallback_p >= 0 else 'reference',
                            fallback_p)
        gout = torch.randn(out.shape, generator=gen).to(KERNEL_DEVICE, dtype)
        return torch.autograd.grad((out * gout).sum(), [e] + updates)
    want = run(-1, torch.float64)
    error = lambda fallback_p: max(rel_rms(a, b) for a, b in zip(run(fallback_p, torch.float32), want))
    assert error(1) <= error(-1) + 1e-5
    assert not error(0) <= 1e-3


def test_mgr_inversion_keeps_at_least_3x_less_than_the_plain_backward():
    """Bytes saved for backward, 4 streams: the excess over prenorm with the inverting backward is
    under a third of the plain backward's (bench.py reports the full-size figures)."""
    from counters import saved_bytes
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


def test_mgr_fallback_p_reaches_mgrs_twin_alone(monkeypatch):
    """GPT.set_kernels' mgr_fallback_p goes through route to MGR's twin, the one twin that takes a
    setting (the others take the backend alone, and no module gets an attribute set): p = -1 runs the
    class's plain forward, p >= 0 the inverting step; a p below -1 is refused by the rule that
    train.py and bench.py check the knob with."""
    import inspect
    assert list(inspect.signature(kernels.route).parameters) == ['residual', 'x', 'sublayers', 'backend',
                                                                 'mgr_fallback_p']
    for cls, twin in kernels.FAST.items():
        takes = list(inspect.signature(twin).parameters)
        assert takes == ['module', 'x', 'sublayers', 'backend'] + (['fallback_p'] if twin is mgr.mgr else []), cls
    plain = []
    forward = residuals.MultiGateResiduals.forward
    monkeypatch.setattr(residuals.MultiGateResiduals, 'forward', lambda *args: plain.append(True) or forward(*args))
    idx = torch.randint(27, (1, 4), generator=torch.Generator().manual_seed(0))
    model = tiny_model('mgr', n_layer=3, mgr_streams=2)
    for p, runs_plain in [(1, False), (-1, True), (0, False)]:
        plain.clear()
        assert model.set_kernels('torch', p) == 'torch' and model.mgr_fallback_p == p
        model(idx, idx)
        assert bool(plain) == runs_plain, p
    assert not [m for m in model.modules() if hasattr(m, 'fallback_p')]
    with pytest.raises(ValueError, match='mgr_fallback_p must be -1'):
        model.set_kernels('torch', -2)
    assert not kernels.MGR_FALLBACK_P_RULE[0](-2) and kernels.MGR_FALLBACK_P_RULE[0](kernels.MGR_FALLBACK_P)
