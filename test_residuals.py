"""
Tests: behaviour, not shapes. Run with `python -m pytest -q` from the repository root.

Real-text tests read ../shared/data (the project's shared data slices); in a fresh clone without
it they train on the embedded corpus instead, and dataset-specific tests skip with the reason.
"""
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

# The Triton kernels' tests run them compiled on CUDA tensors where there is a GPU; without one,
# on CPU tensors through Triton's interpreter, chosen before triton is imported (by kernels.py).
KERNEL_DEVICE = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
if KERNEL_DEVICE.type == 'cpu':
    os.environ.setdefault('TRITON_INTERPRET', '1')

import data
import kernels
import train
from model import GPT, GPTConfig
from residuals import RESIDUALS

ROOT = Path(__file__).resolve().parent
SHARED_DATA = ROOT.parent / 'shared' / 'data'
TEXT8 = SHARED_DATA / 'text8_head.txt'
REAL_TEXT = str(TEXT8) if TEXT8.is_file() else data.EMBEDDED  # fresh clone: the embedded corpus
METHODS = sorted(RESIDUALS)

TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=27)
TINY_TRAIN = ['--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=32', '--batch_size=32',
              '--learning_rate=1e-2', '--min_lr=1e-3', '--warmup_iters=5', '--eval_tokens=4096']


def tiny_model(residual, seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, 'residual': residual, **overrides}))


def randomize_routing(model, seed=1):
    """Give every routing parameter (of a GPT, or of a bare residual module) a random value, so no
    zero init can hide a mixing bug."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in getattr(model, 'residual', model).parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)


def unigram_entropy(tokens):
    counts = np.bincount(np.asarray(tokens), minlength=1).astype(np.float64)
    probs = counts[counts > 0] / counts.sum()
    return float(-(probs * np.log(probs)).sum())


def run_cli(script, *args, cwd=ROOT, timeout=120, env=None):
    return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture(scope='session')
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp('data'))


# ----------------------------------------------------------------------------- every method

@pytest.mark.parametrize('residual', METHODS)
def test_causality(residual):
    """Changing tokens t+1.. leaves the logits at 0..t unchanged (with random routing parameters)."""
    model = tiny_model(residual, n_layer=3)
    randomize_routing(model)
    model.eval()
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(27, (2, 32), generator=gen)
    t = 13
    changed = idx.clone()
    changed[:, t + 1:] = torch.randint(27, (2, 32 - t - 1), generator=gen)
    with torch.no_grad():
        logits_a, _ = model(idx, idx)
        logits_b, _ = model(changed, changed)
    assert torch.equal(logits_a[:, :t + 1], logits_b[:, :t + 1])
    assert not torch.allclose(logits_a[:, t + 1:], logits_b[:, t + 1:])  # the change is seen later


@pytest.mark.parametrize('residual', METHODS)
def test_training_lowers_val_loss_on_real_text(residual, tmp_path, data_dir):
    """A tiny model of each method beats the best context-free predictor (the unigram entropy)."""
    metrics = train.main([f'--residual={residual}', f'--dataset={REAL_TEXT}', f'--data_dir={data_dir}',
                          f'--out_dir={tmp_path}', '--max_iters=200', '--eval_interval=200', '--log_interval=50',
                          *TINY_TRAIN])
    log = [json.loads(line) for line in open(tmp_path / 'log.jsonl')]
    evals = [r['val_loss'] for r in log if 'val_loss' in r]
    ds = data.load(REAL_TEXT, data_dir)
    assert evals[0] > math.log(ds.vocab_size) - 0.3  # starts near uniform
    assert metrics['val_loss'] < unigram_entropy(ds.splits['train']) - 0.15
    assert metrics['val_bpc'] == pytest.approx(metrics['val_loss'] / math.log(2))


# ----------------------------------------------------------------------------- baselines

def test_rezero_at_init_is_the_embedding_alone():
    model = tiny_model('rezero')
    idx = torch.randint(27, (2, 16))
    logits, _ = model(idx, idx)
    e = model.transformer.wte(idx) + model.transformer.wpe(torch.arange(16))
    assert torch.allclose(logits, model.lm_head(model.transformer.ln_f(e)), atol=1e-6)
    assert all(isinstance(b.ln_1, torch.nn.Identity) for b in model.transformer.h)  # no pre-norm


def test_layerscale_depth_rule_and_knob():
    for n_layer, eps in [(12, 0.1), (18, 0.1), (24, 1e-5), (48, 1e-6)]:
        model = tiny_model('layerscale', n_layer=n_layer)
        assert torch.all(model.residual.scale == torch.tensor(eps))
    assert torch.all(tiny_model('layerscale', layerscale_init=0.5).residual.scale == 0.5)


@pytest.mark.parametrize('residual', METHODS)
def test_routing_parameters_get_no_weight_decay(residual):
    model = tiny_model(residual)
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    decayed = {id(p) for g in optimizer.param_groups if g['weight_decay'] > 0 for p in g['params']}
    assert not decayed & {id(p) for p in model.residual.parameters()}
    assert id(model.transformer.h[0].attn.c_attn.weight) in decayed
    assert sum(len(g['params']) for g in optimizer.param_groups) == len(list(model.parameters()))


def test_shared_weights_are_identical_across_methods():
    """Same seed, same attention/MLP/embedding weights whatever the residual (rezero drops the norms)."""
    ref = tiny_model('prenorm').state_dict()
    for residual in METHODS:
        state = tiny_model(residual).state_dict()
        for name, tensor in state.items():
            if name in ref and not name.startswith('residual.'):
                assert torch.equal(tensor, ref[name]), (residual, name)


# ----------------------------------------------------------------------------- AttnRes family and WAV

def fake_sublayers(updates, inputs):
    """Sublayers that record their input and return fixed updates, to read off what a method routes."""
    def make(u):
        def sublayer(h):
            inputs.append(h)
            return u
        return sublayer
    return [make(u) for u in updates]


def routing(residual, n_layer, C=16, **knobs):
    return RESIDUALS[residual](GPTConfig(**{**TINY, 'n_layer': n_layer, 'n_embd': C, 'residual': residual, **knobs}))


def test_block_attnres_reads_the_sources_of_spec_at_init():
    """2 layers, res_block_size=1: sublayers read e; e,PC; e,C_0; e,C_0,PC; the output e,C_0,C_1.
    With zero queries every read is the plain average of those sources."""
    gen = torch.Generator().manual_seed(0)
    e, *u = [torch.randn(2, 3, 16, generator=gen) for _ in range(5)]
    router, inputs = routing('block_attnres', 2, res_block_size=1), []
    router.recorded = []
    out = router(e, fake_sublayers(u, inputs))
    expected = [e, (e + u[0]) / 2, (e + u[0] + u[1]) / 2, (e + (u[0] + u[1]) + u[2]) / 3]
    for got, want in zip(inputs, expected):
        assert torch.allclose(got, want, atol=1e-6)
    assert torch.allclose(out, (e + (u[0] + u[1]) + (u[2] + u[3])) / 3, atol=1e-6)
    assert [r['weights'].shape[0] for r in router.recorded] == [1, 2, 2, 3, 3]
    assert [r['query'] for r in router.recorded] == [0, 1, 2, 3, 4]
    assert all(torch.allclose(r['weights'].sum(0), torch.ones(2, 3)) for r in router.recorded)


def test_block_attnres_auto_block_size_and_short_last_block():
    assert routing('block_attnres', 48).block_len == 2 * 6 and routing('block_attnres', 4).block_len == 2
    gen = torch.Generator().manual_seed(0)
    e, *u = [torch.randn(1, 2, 16, generator=gen) for _ in range(7)]  # 3 layers, blocks of 2 layers + 1 layer
    router, inputs = routing('block_attnres', 3, res_block_size=2), []
    out = router(e, fake_sublayers(u, inputs))
    assert torch.allclose(inputs[4], (e + sum(u[:4])) / 2, atol=1e-6)  # first sublayer of the last block
    assert torch.allclose(inputs[5], (e + sum(u[:4]) + u[4]) / 3, atol=1e-6)
    assert torch.allclose(out, (e + sum(u[:4]) + u[4] + u[5]) / 3, atol=1e-6)


def test_full_and_delta_attnres_at_init():
    gen = torch.Generator().manual_seed(0)
    e, *u = [torch.randn(2, 3, 16, generator=gen) for _ in range(5)]
    inputs = []
    out = routing('attnres', 2)(e, fake_sublayers(u, inputs))
    for i, got in enumerate(inputs):
        assert torch.allclose(got, (e + sum(u[:i])) / (i + 1), atol=1e-6)
    assert torch.allclose(out, (e + sum(u)) / 5, atol=1e-6)
    inputs = []
    out = routing('delta_attnres', 2)(e, fake_sublayers(u, inputs))
    gate = torch.sigmoid(torch.tensor(-2.0))
    for i, got in enumerate(inputs):  # PreNorm stream plus the gated average of e and the deltas
        assert torch.allclose(got, e + sum(u[:i]) + gate * (e + sum(u[:i])) / (i + 1), atol=1e-6)
    assert torch.allclose(out, e + sum(u), atol=1e-6)


@pytest.mark.parametrize('residual', ['attnres', 'delta_attnres'])
@pytest.mark.parametrize('n_layer', [1, 2, 5, 13])
def test_full_and_delta_attnres_chunked_reads_equal_one_softmax_over_all_sources(residual, n_layer):
    """Full and Delta AttnRes read in chunks of sqrt(L) sublayers with an online softmax merge;
    with random queries and gates that must equal one plain softmax per sublayer over all its
    sources (the depth_mix reference), L = 2, 4, 10 and 26 (chunks of 1, 2, 3 and 5, the last short)."""
    from residuals import depth_mix
    gen = torch.Generator().manual_seed(n_layer)
    L = 2 * n_layer
    e, *u = [torch.randn(2, 3, 16, generator=gen) for _ in range(L + 1)]
    router = routing(residual, n_layer)
    randomize_routing(router)
    inputs = []
    out = router(e, fake_sublayers(u, inputs))
    sources, x = [e], e
    for i in range(L):
        read = depth_mix(torch.stack(sources), router.queries[i])[0]
        if residual == 'attnres':
            want = read
        else:
            want = x + torch.sigmoid(router.gate_logit[i]) * read
            x = x + u[i]
        assert torch.allclose(inputs[i], want, atol=1e-5), i
        sources.append(u[i])
    want_out = depth_mix(torch.stack(sources), router.queries[L])[0] if residual == 'attnres' else x
    assert torch.allclose(out, want_out, atol=1e-5)


@pytest.mark.parametrize('n_layer,block,knobs', [(4, 1, {}), (5, 2, {}), (7, 4, {}),
                                                 (6, 2, {'wav_levels': 2}), (6, 2, {'wav_learned_basis': True})])
def test_wav_with_very_negative_detail_bias_equals_block_attnres(n_layer, block, knobs):
    base = tiny_model('block_attnres', n_layer=n_layer, res_block_size=block)
    randomize_routing(base)
    wav = tiny_model('wav', n_layer=n_layer, res_block_size=block, wav_detail_bias=-30.0, **knobs)
    missing, unexpected = wav.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(k.startswith('residual.') and 'queries' not in k for k in missing)
    if 'wav_learned_basis' in knobs:
        torch.nn.init.normal_(wav.residual.basis_delta)
    idx = torch.randint(27, (2, 32))
    with torch.no_grad():
        assert torch.allclose(wav(idx, idx)[0], base(idx, idx)[0], atol=1e-5, rtol=0)
        wav.residual.detail_bias.fill_(0.0)  # and the details do matter once they are let in
        assert not torch.allclose(wav(idx, idx)[0], base(idx, idx)[0], atol=1e-3)


def spec_phase(m):
    return [1 if k % 2 == 0 else -1 for k in range(m)]


def spec_split(m):
    return [1 if k < m // 2 else -1 for k in range(m)]


@pytest.mark.parametrize('n_layer,block', [(3, 2), (7, 4), (2, 1)])
def test_wav_detail_signs_for_full_and_partial_blocks(n_layer, block):
    """Each update is a unit vector in its own channel, so RMS matching is the identity; with zero
    queries and zero detail bias every read is the average of SPEC's pool, built here by hand.
    (3, 2) and (7, 4) end with a block of an odd number of layers (1 and 3)."""
    L, C = 2 * n_layer, 16
    e = torch.linspace(-1, 1, C).expand(1, 2, C)
    u = [torch.eye(C)[j].expand(1, 2, C) for j in range(L)]
    router, inputs = routing('wav', n_layer, C=C, res_block_size=block, wav_detail_bias=0.0), []
    out = router(e, fake_sublayers(u, inputs))
    combine = lambda signs, us: sum(s * v for s, v in zip(signs, us))
    finished, readout = [e], [e]
    for start in range(0, L, 2 * block):
        m = min(2 * block, L - start)
        block_u = u[start:start + m]
        for k in range(m):
            pool = finished + ([sum(block_u[:k]), combine(spec_phase(m)[:k], block_u[:k]),
                                combine(spec_split(m)[:k], block_u[:k])] if k else [])
            assert torch.allclose(inputs[start + k], sum(pool) / len(pool), atol=1e-5), (start, k)
        finished = finished + [sum(block_u), combine(spec_phase(m), block_u), combine(spec_split(m), block_u)]
        readout = readout + [sum(block_u)]
    assert torch.allclose(out, sum(readout) / len(readout), atol=1e-5)  # conservative readout


def test_wav_detail_readout_knob_adds_the_details_to_the_output_mixer():
    router = routing('wav', 2, res_block_size=1, wav_detail_readout=True)
    router.recorded = []
    router(torch.randn(1, 2, 16), [lambda h: torch.randn(1, 2, 16)] * 4)
    assert router.recorded[-1]['weights'].shape[0] == 1 + 2 * 3  # e, and C, phase, split of each block
    assert router.recorded[-1]['is_detail'] == [False] + [False, True, True] * 2


def test_rms_match_scale_is_detached_and_capped():
    from residuals import rms_match
    detail = torch.randn(2, 3, 8, requires_grad=True)
    state = (torch.randn(2, 3, 8) * 3).requires_grad_()
    matched = rms_match(detail, state, rho=100.0)
    rms = lambda v: v.pow(2).mean(-1).sqrt()
    assert torch.allclose(rms(matched), rms(state), rtol=1e-4)
    grad_detail, grad_state = torch.autograd.grad(matched.sum(), (detail, state), allow_unused=True)
    assert grad_state is None  # the state enters only through the detached scale
    scale = (rms(state) / (rms(detail) + 1e-6)).detach()
    assert torch.allclose(grad_detail, scale[..., None].expand_as(detail))  # linear in the detail
    capped = rms_match(detail * 1e-3, state, rho=2.0)
    assert torch.allclose(capped, detail * 2e-3)


def test_wav_haar_levels_and_learned_bases_are_zero_sum():
    from residuals import detail_signs
    assert detail_signs(4, 2) == ((1, -1, 1, -1), (1, 1, -1, -1), (1, -1, 0, 0), (0, 0, 1, -1))
    assert detail_signs(6, 2)[2:] == ((1, 0, -1, 0, 0, 0), (0, 0, 0, 1, 0, -1))
    for knobs in [{'wav_levels': 2}, {'wav_levels': 3}, {'wav_learned_basis': True}]:
        router = routing('wav', 5, res_block_size=4, **knobs)  # blocks of 8 and 2 sublayers
        if router.basis_delta is not None:
            assert torch.equal(router.basis(8), torch.tensor(detail_signs(8, 1)))  # learned bases start at the signs
            torch.nn.init.normal_(router.basis_delta)
        for m in (8, 2):
            assert torch.allclose(router.basis(m).sum(dim=1), torch.zeros(len(router.basis(m))), atol=1e-6)
    assert len(routing('wav', 5, res_block_size=4, wav_levels=9).basis(8)) == 1 + 1 + 2 + 4  # capped at 3


@pytest.mark.parametrize('residual', METHODS)
def test_48_layers_give_finite_logits_and_gradients(residual):
    model = tiny_model(residual, n_layer=48, n_embd=16, n_head=2, block_size=8)
    idx = torch.randint(27, (2, 8))
    logits, loss = model(idx, idx)
    loss.backward()
    assert torch.isfinite(logits).all() and torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert all(p.grad is not None for p in model.residual.parameters() if p.requires_grad)


@pytest.mark.parametrize('S,C,m,with_bias', [(1, 7, 1, False), (4, 13, 3, True), (11, 16, 2, True)])
def test_depth_mix_hand_written_backward_matches_autograd(S, C, m, with_bias):
    """DepthMix (m queries, with the log-sum-exp for online merging) against the plain reference,
    in value and in every gradient, and by finite differences (gradcheck) in float64."""
    from residuals import DepthMix, depth_mix
    gen = torch.Generator().manual_seed(S)
    sources = [torch.randn(2, 3, C, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(S)]
    queries = torch.randn(m, C, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(m, S, dtype=torch.float64, generator=gen, requires_grad=True) if with_bias else None
    inputs = [queries] + ([bias] if with_bias else []) + sources

    def mix(q, *rest):
        b, srcs = (rest[0], rest[1:]) if with_bias else (None, rest)
        mixed, lse, _ = DepthMix.apply(q, b, *srcs)
        return mixed, lse
    assert torch.autograd.gradcheck(mix, inputs)
    got_mixed, got_lse, got_weights = DepthMix.apply(queries, bias, *sources)
    grad_mixed = torch.randn(m, 2, 3, C, dtype=torch.float64, generator=gen)
    grad_lse = torch.randn(m, 2, 3, dtype=torch.float64, generator=gen)
    got = torch.autograd.grad((got_mixed * grad_mixed).sum() + (got_lse * grad_lse).sum(), inputs)
    want_total = 0
    for j in range(m):
        want_mixed, want_weights = depth_mix(torch.stack(sources), queries[j], None if bias is None else bias[j])
        assert torch.allclose(got_mixed[j], want_mixed) and torch.allclose(got_weights[j], want_weights)
        want_total = want_total + (want_mixed * grad_mixed[j]).sum()
    from residuals import rms_norm
    ref_logits = torch.einsum('sbtc,mc->msbt', rms_norm(torch.stack(sources)), queries)
    ref_logits = ref_logits + (0 if bias is None else bias[:, :, None, None])
    ref_lse = torch.logsumexp(ref_logits, dim=1)
    assert torch.allclose(got_lse, ref_lse)
    want = torch.autograd.grad(want_total + (ref_lse * grad_lse).sum(), inputs)
    assert all(torch.allclose(a, b) for a, b in zip(got, want))


def test_full_attnres_keeps_no_stacked_copies_for_backward():
    """Saved activations grow linearly with depth, not as L^2: 16-layer Full AttnRes keeps about
    what PreNorm keeps (each source once), not a stack of up to 33 sources per sublayer."""
    from bench import saved_bytes
    idx = torch.randint(27, (2, 32))
    saved = {r: saved_bytes(tiny_model(r, n_layer=16), idx, idx) for r in ('prenorm', 'attnres', 'wav')}
    assert saved['attnres'] < 1.5 * saved['prenorm'] and saved['wav'] < 2.0 * saved['prenorm']


# ----------------------------------------------------------------------------- multi-stream

@pytest.mark.parametrize('knobs', [{}, {'hc_dynamic': False}, {'hc_streams': 3}])
def test_hc_at_init_equals_prenorm(knobs):
    prenorm, hc = tiny_model('prenorm', n_layer=3), tiny_model('hc', n_layer=3, **knobs)
    missing, unexpected = hc.load_state_dict(prenorm.state_dict(), strict=False)
    assert not unexpected and all(k.startswith('residual.') for k in missing)
    idx = torch.randint(27, (2, 32))
    with torch.no_grad():
        assert torch.allclose(hc(idx, idx)[0], prenorm(idx, idx)[0], atol=1e-5, rtol=0)
        randomize_routing(hc)  # and the connections do matter once they move
        assert not torch.allclose(hc(idx, idx)[0], prenorm(idx, idx)[0], atol=1e-3)


@pytest.mark.parametrize('n', [2, 3, 4])
def test_mhc_lite_h_res_is_doubly_stochastic(n):
    router = routing('mhc_lite', 3, hc_streams=n)
    gen = torch.Generator().manual_seed(n)
    with torch.no_grad():  # random parameters far from the near-identity init
        for p in (router.proj, router.alpha, router.bias):
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(2, 5, n, 16) * 3
    for i in range(6):
        h_pre, h_post, h_res = router.coefficients(i, x)
        assert torch.allclose(h_res.sum(-1), torch.ones(2, 5, n), atol=1e-6)
        assert torch.allclose(h_res.sum(-2), torch.ones(2, 5, n), atol=1e-6)
        assert (h_res >= 0).all() and not torch.allclose(h_res, torch.eye(n).expand_as(h_res), atol=1e-3)
        assert ((h_pre >= 0) & (h_pre <= 1)).all() and ((h_post >= 0) & (h_post <= 2)).all()


def test_mhc_lite_init_and_too_many_streams():
    router = routing('mhc_lite', 2)
    h_pre, h_post, h_res = router.coefficients(1, torch.randn(1, 2, 4, 16))
    assert torch.allclose(h_pre[0, 0], torch.sigmoid(torch.tensor([-1.0, 1.0, -1.0, -1.0])))
    assert torch.allclose(h_post[0, 0], 2 * torch.sigmoid(torch.tensor([-1.0, 1.0, -1.0, -1.0])))
    # a diagonal entry: the identity (logit 0) and the 3! - 1 other permutations fixing that point (-8)
    diagonal = (1 + 5 * math.exp(-8)) / (1 + 23 * math.exp(-8))
    assert torch.allclose(torch.diagonal(h_res[0, 0]), torch.full((4,), diagonal), atol=1e-6)
    with pytest.raises(ValueError, match='hc_streams <= 6'):
        routing('mhc_lite', 2, hc_streams=7)
    assert_clean_error(run_cli('train.py', '--residual=mhc_lite', '--hc_streams=7'), 'hc_streams <= 6', '5040')


def stream_norms(recorded):
    return torch.stack([s.norm(dim=-1).max() for s in recorded])


@pytest.mark.parametrize('gate', ['competitive', 'independent'])
def test_mgr_stream_norms_are_bounded_where_prenorm_grows(gate):
    """SPEC's bound: every stream's per-token norm stays <= max(|e|, max_i |f_i(h_i)|)."""
    gen = torch.Generator().manual_seed(0)
    e = torch.randn(2, 8, 16, generator=gen)
    updates = [torch.randn(2, 8, 16, generator=gen) * 1000 for _ in range(12)]
    bound = max(e.norm(dim=-1).max(), max(u.norm(dim=-1).max() for u in updates))
    router = routing('mgr', 6, mgr_gate=gate)
    randomize_routing(router)
    with torch.no_grad():
        router.gate_bias.add_(3.0)  # large gates: the streams move a lot
    router.recorded = []
    out = router(e, fake_sublayers(updates, []))
    assert stream_norms(router.recorded).max() <= bound * (1 + 1e-6)
    assert out.norm(dim=-1).max() <= bound * (1 + 1e-6)
    assert stream_norms(router.recorded[-1:]) > 0.2 * bound  # the updates did get in
    prenorm_out = routing('prenorm', 6)(e, fake_sublayers(updates, []))
    assert prenorm_out.norm(dim=-1).max() > bound


@pytest.mark.parametrize('gate', ['competitive', 'independent'])
@pytest.mark.parametrize('L', [24, 48, 96])
def test_mgr_gate_bias_gives_the_depth_scaled_initial_gate(gate, L):
    for n in (3, 5):  # L gated sublayers after the n-1 that start the streams
        router = routing('mgr', (L + n - 1) // 2, mgr_streams=n, mgr_gate=gate)
        assert router.gate_queries.shape[0] == L
        target = torch.sigmoid(torch.tensor(-3.0)).item() * math.sqrt(21 / L)
        beta = router.gates(0, torch.randn(n, 2, 3, 16))
        assert torch.allclose(beta, torch.full_like(beta, target), rtol=1e-5)
        if gate == 'competitive':  # the paper's closed form
            assert router.gate_bias[0].item() == pytest.approx(math.log(math.sqrt(L / 21) * (math.exp(3) + 1) - n))


def test_mgr_accumulation_phase_starts_n_distinct_streams():
    router = routing('mgr', 3, mgr_streams=4)
    router.recorded = []
    gen = torch.Generator().manual_seed(0)
    router(torch.randn(1, 2, 16, generator=gen), fake_sublayers([torch.randn(1, 2, 16, generator=gen)
                                                                 for _ in range(6)], []))
    assert [len(s) for s in router.recorded] == [2, 3, 4, 4, 4, 4]
    streams = router.recorded[2]
    assert all(not torch.allclose(streams[a], streams[b]) for a in range(4) for b in range(a))
    with pytest.raises(ValueError, match='needs more than 3 sublayers'):
        routing('mgr', 1, mgr_streams=4)


# ----------------------------------------------------------------------------- kernels

needs_triton = pytest.mark.skipif(kernels.triton is None, reason='triton is not installed (pip install triton; Linux)')


def rel_rms(got, want):
    """RMS of the difference over the RMS of `want` (the plain RMS where `want` is all zero)."""
    diff, scale = (got.double() - want.double()).pow(2).mean().sqrt(), want.double().pow(2).mean().sqrt()
    return (diff / scale if scale > 0 else diff).item()


@pytest.fixture
def few_programs(monkeypatch):
    """At most 5 programs in the reducing backward kernels, so that on a few tokens each program
    already loops over several of them and writes a partial sum (on a GPU: up to 512)."""
    monkeypatch.setattr(kernels, 'reduction_programs', lambda n_tokens: min(n_tokens, 5))


@needs_triton
@pytest.mark.parametrize('S,m,C,T,with_bias', [(1, 1, 7, 3, False), (2, 1, 20, 5, True), (13, 3, 48, 7, True),
                                               (40, 2, 33, 5, False), (40, 6, 100, 3, True), (2, 2, 24, 1, True)])
def test_depth_mix_kernel_equals_its_reference(S, m, C, T, with_bias, few_programs):
    """The Triton depth_mix (float32; interpreted on CPU) against DepthMix, the PyTorch reference, run in
    float64 on the same inputs: mixed, lse and the gradients of the queries, the bias and the
    sources (all S as one tensor) within relative RMS 1e-5. (The float32 reference is itself up to
    ~1e-5 from float64 on single sources, so float64 is the oracle.)"""
    from residuals import DepthMix
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
    got = run(kernels.triton_depth_mix, torch.float32)
    want = run(lambda q, b, srcs: DepthMix.apply(q, b, *srcs), torch.float64)
    for name, a, b in zip(['mixed', 'lse', 'd queries'] + ['d bias'] * with_bias + ['d sources'], got, want):
        assert a.dtype == torch.float32 and rel_rms(a, b) <= 1e-5, name


@needs_triton
def test_depth_mix_kernel_promotes_sources_of_mixed_dtypes():
    """Under autocast a pool mixes dtypes (e float32, updates bfloat16); the kernel reads one
    pointer type, so it must promote as DepthMix's stack does (here: float32 and float64)."""
    from residuals import DepthMix
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randn(1, 3, 10, generator=gen).to(KERNEL_DEVICE) for _ in range(3)]
    queries = torch.randn(2, 10, generator=gen).to(KERNEL_DEVICE)
    mixed = kernels.triton_depth_mix(queries, None, [sources[0].double()] + sources[1:])[0]
    assert mixed.dtype == torch.float64
    assert rel_rms(mixed, DepthMix.apply(queries.double(), None, *[v.double() for v in sources])[0]) <= 1e-6


def mgr_run(n, C, T, gate, backend, fallback_p, dtype, seed=0):
    """An MGR residual over 2n+2 random tanh sublayers with randomised routing: output and the
    gradients of e and of every routing parameter."""
    gen = torch.Generator().manual_seed(seed)
    router = routing('mgr', n + 1, C=C, n_head=1, mgr_streams=n, mgr_gate=gate)
    randomize_routing(router, seed)
    router.to(KERNEL_DEVICE, dtype).kernels, router.fallback_p = backend, fallback_p
    weights = [torch.randn(C, C, generator=gen).to(KERNEL_DEVICE, dtype) * C ** -0.5 for _ in range(2 * n + 2)]
    e = torch.randn(2, T, C, generator=gen).to(KERNEL_DEVICE, dtype).requires_grad_()
    out = router(e, [lambda h, w=w: 3 * torch.tanh(h @ w) for w in weights])
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
    want = mgr_run(n, C, T, gate, 'torch', -1, torch.float64)
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
            router.gate_bias.fill_(-30.0)  # the keep logit: gates sum to 1
            router.gate_queries.mul_(200.0)  # one stream wins the gate at every token
        router.to(KERNEL_DEVICE, dtype).kernels = backend if fallback_p >= 0 else 'torch'
        router.fallback_p = fallback_p
        e = torch.randn(2, 5, 24, generator=gen).to(KERNEL_DEVICE, dtype).requires_grad_()
        updates = [(torch.randn(2, 5, 24, generator=gen) * 3).to(KERNEL_DEVICE, dtype).requires_grad_()
                   for _ in range(8)]
        out = router(e, fake_sublayers(updates, []))
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
    model = tiny_model('mgr', n_layer=3)
    randomize_routing(model)
    idx = torch.randint(27, (2, 8))
    _, loss = model(idx, idx)
    grads = []
    for _ in range(2):
        loss.backward(retain_graph=True)
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    router, inputs = routing('mgr', 3, mgr_streams=4), []
    randomize_routing(router)
    gen = torch.Generator().manual_seed(0)
    router(torch.randn(1, 2, 16, generator=gen), fake_sublayers([torch.randn(1, 2, 16, generator=gen)] * 6, inputs))
    with pytest.raises(RuntimeError, match='mgr_fallback_p=-1'):
        inputs[4].sum().backward()  # the input of sublayer 4, made by the (inner) step of sublayer 3


@needs_triton
@pytest.mark.parametrize('residual', ['block_attnres', 'wav', 'mgr'])
def test_training_with_kernels_on_and_off_gives_the_same_losses(residual, data_dir):
    """A few AdamW steps on real text with the Triton kernels and with plain PyTorch
    (for mgr: the plain backward, no inversion): the same losses within 1e-4."""
    ds = data.load(REAL_TEXT, data_dir)
    text = torch.from_numpy(ds.splits['train'][:8192].astype(np.int64)).to(KERNEL_DEVICE)
    starts = torch.randint(len(text) - 9, (4, 2), generator=torch.Generator().manual_seed(0))
    losses = {}
    for backend, fallback_p in [('torch', -1), ('triton', 1)]:
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
    assert losses['torch'][-1] < losses['torch'][0]  # it learns, so the kernels' gradients matter
    assert max(abs(a - b) for a, b in zip(losses['torch'], losses['triton'])) <= 1e-4


@needs_triton
@pytest.mark.parametrize('residual', ['block_attnres', 'wav', 'mgr'])
def test_kernels_compile_without_graph_breaks(residual):
    """torch.compile(fullgraph=True) traces the models with the kernels as opaque custom ops
    (aot_eager: the same tracing as inductor, without generating code) and gives eager's loss
    and gradients."""
    model = tiny_model(residual, n_layer=2, n_embd=24, block_size=8)
    randomize_routing(model)
    model.to(KERNEL_DEVICE).set_kernels('triton')
    idx = torch.randint(27, (2, 7), generator=torch.Generator().manual_seed(0)).to(KERNEL_DEVICE)
    grads = []
    for run in (model, torch.compile(model, fullgraph=True, backend='aot_eager')):
        _, loss = run(idx, idx)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        model.zero_grad()
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads[0][1], grads[1][1]))


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason='bfloat16 needs the compiled kernels on CUDA '
                    '(the interpreter has no bf16 arithmetic)')
@pytest.mark.parametrize('residual', ['block_attnres', 'wav', 'mgr'])
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


def test_kernels_knob_errors_are_clear():
    assert kernels.resolve('auto', 'cpu') == 'torch' and kernels.resolve('torch', 'cuda') == 'torch'
    with pytest.raises(ValueError, match='choose one of: auto, torch, triton'):
        kernels.resolve('cuda', 'cpu')
    result = run_cli('train.py', '--kernels=triton', '--device=cpu', '--max_iters=1',
                     env={**os.environ, 'TRITON_INTERPRET': '0'})
    assert result.returncode != 0 and 'Traceback' not in result.stderr
    wanted = 'set TRITON_INTERPRET=1' if kernels.triton is not None else 'pip install triton'
    assert 'error: kernels=triton' in result.stderr and wanted in result.stderr


# ----------------------------------------------------------------------------- data

def test_embedded_corpus_is_real_text_with_a_fixed_split(data_dir):
    ds = data.load(data.EMBEDDED, data_dir)
    text = ds.decode(ds.splits['val'][:2000].tolist())
    assert text.count(' the ') > 5  # English prose, not noise
    assert len(ds.splits['train']) > 300_000
    again = data.Dataset(data.prepare(data.EMBEDDED, data_dir))
    assert np.array_equal(again.splits['val'], ds.splits['val'])
    assert len(ds.splits['val']) == int((len(ds.splits['train']) + len(ds.splits['val'])) * data.VAL_FRACTION)


def test_local_text_file_round_trips_and_is_reprepared_when_edited(tmp_path):
    src = tmp_path / 'mine.txt'
    src.write_text('héllo wörld, ' * 100, encoding='utf-8')
    ds = data.load(str(src), str(tmp_path / 'd'))
    both = np.concatenate([ds.splits['train'], ds.splits['val']])
    assert ds.decode(both.tolist()) == src.read_text(encoding='utf-8')
    src.write_text('something else entirely. ' * 100, encoding='utf-8')
    assert 'y' in data.load(str(src), str(tmp_path / 'd')).stoi
    assert 'ö' not in data.load(str(src), str(tmp_path / 'd')).stoi


def test_fixed_validation_is_identical_across_methods_and_runs(tmp_path, data_dir):
    """Two methods evaluated at init on the fixed val windows see exactly the same tokens."""
    ds = data.load(data.EMBEDDED, data_dir)
    cfg = dict(block_size=32, eval_tokens=1000, batch_size=7)
    seen = []

    class Spy(torch.nn.Module):
        def forward(self, x, y):
            seen.append(x.clone())
            return None, torch.tensor(1.0)
    train.evaluate(Spy(), ds.splits['val'], cfg, torch.device('cpu'), torch.no_grad())
    first = torch.cat(seen)
    seen.clear()
    train.evaluate(Spy(), ds.splits['val'], cfg, torch.device('cpu'), torch.no_grad())
    assert torch.equal(first, torch.cat(seen))
    assert first.shape == (1000 // 32, 32)
    assert first[1, 0].item() == ds.splits['val'][32]


def need_shared(path):
    if not path.is_file():
        pytest.skip(f"{path} is absent: the shared data slices live beside the repository in ../shared/data")
    return path


def test_text8_from_a_zip_splits_90_5_5_and_reports_bpc(tmp_path, capsys):
    import zipfile
    head = need_shared(TEXT8)
    archive = tmp_path / 'text8.zip'
    with zipfile.ZipFile(archive, 'w') as z:
        z.write(head, 'text8')
    data.prepare('text8', str(tmp_path / 'd'), source=str(archive))
    assert 'not the full text8' in capsys.readouterr().err
    ds = data.load('text8', str(tmp_path / 'd'))
    n = head.stat().st_size
    assert {k: len(v) for k, v in ds.splits.items()} == {'train': n * 90 // 100, 'val': n * 5 // 100,
                                                          'test': n - n * 90 // 100 - n * 5 // 100}
    assert ds.vocab_size == 27 and ds.decode(ds.splits['train'][:26].tolist()) == head.read_text()[:26]
    metrics = train.main(['--dataset=text8', f'--data_dir={tmp_path / "d"}', f'--out_dir={tmp_path / "o"}',
                          '--max_iters=5', '--eval_interval=5', *TINY_TRAIN])
    assert metrics['val_bpc'] == pytest.approx(metrics['val_loss'] / math.log(2))


def test_tinystories_keeps_story_boundaries(tmp_path):
    source = need_shared(SHARED_DATA / 'tinystories_train_head_2MiB.txt')
    data.prepare('tinystories', str(tmp_path), source=str(source))
    ds = data.load('tinystories', str(tmp_path))
    raw = source.read_text(encoding='utf-8')
    sep = ds.stoi[data.STORY_SEPARATOR]
    train_tokens, val_tokens = ds.splits['train'], ds.splits['val']
    assert train_tokens[-1] == sep  # validation starts at the beginning of a story
    assert (train_tokens == sep).sum() + (val_tokens == sep).sum() == raw.count(data.STORY_SEPARATOR)
    stories = ds.decode(np.concatenate([train_tokens, val_tokens]).tolist()).split(data.STORY_SEPARATOR)
    source_stories = raw.split(data.STORY_SEPARATOR + '\n')
    assert len(stories) == len(source_stories)
    for got, want in zip(stories, source_stories):  # rare characters become the one UNKNOWN symbol
        assert len(got) == len(want)
        assert all(a == b or a == data.UNKNOWN for a, b in zip(got, want))
    assert data.UNKNOWN in ds.stoi and 0.05 < len(val_tokens) / len(train_tokens) < 0.15


def test_fineweb_shards_read_back_exactly_and_bad_ones_fail_clearly(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 50257, 5000).astype(np.uint16)
    data.write_shard(tmp_path / 'good.bin', tokens)
    assert np.array_equal(data.read_shard(tmp_path / 'good.bin'), tokens)
    raw = (tmp_path / 'good.bin').read_bytes()
    header = np.frombuffer(raw[:1024], dtype=np.int32).copy()
    for name, mutate, message in [('magic', lambda h: h.__setitem__(0, 1234), 'bad magic 1234'),
                                  ('version', lambda h: h.__setitem__(1, 7), 'version 7, expected 1')]:
        bad = header.copy()
        mutate(bad)
        (tmp_path / f'{name}.bin').write_bytes(bad.tobytes() + raw[1024:])
        with pytest.raises(data.DataError, match=message):
            data.read_shard(tmp_path / f'{name}.bin')
    (tmp_path / 'short.bin').write_bytes(raw[:-100])
    with pytest.raises(data.DataError, match='truncated'):
        data.read_shard(tmp_path / 'short.bin')


def test_fineweb_prepared_from_local_shards_trains_on_sequences_across_shards(tmp_path):
    rng = np.random.default_rng(1)
    src = tmp_path / 'src'
    src.mkdir()
    shards = {name: rng.integers(0, 50257, 3000).astype(np.uint16)
              for name in ['fineweb_val_000000.bin', 'fineweb_train_000001.bin', 'fineweb_train_000002.bin']}
    for name, tokens in shards.items():
        data.write_shard(src / name, tokens)
    data.prepare('fineweb', str(tmp_path / 'd'), source=str(src), shards=2)
    ds = data.load('fineweb', str(tmp_path / 'd'))
    both = np.concatenate([shards['fineweb_train_000001.bin'], shards['fineweb_train_000002.bin']])
    assert len(ds.splits['train']) == 6000 and ds.vocab_size == 50304 and not ds.char_level
    assert np.array_equal(ds.splits['train'][2990:3010], both[2990:3010])  # across the boundary
    metrics = train.main(['--dataset=fineweb', f'--data_dir={tmp_path / "d"}', f'--out_dir={tmp_path / "o"}',
                          '--max_iters=3', '--eval_interval=3', *TINY_TRAIN])
    assert 'val_bpc' not in metrics and math.isfinite(metrics['val_ppl'])


class RangeHandler(__import__('http.server').server.SimpleHTTPRequestHandler):
    """Serves one payload, honouring Range requests, and can cut the connection half-way."""
    payload, cut_after, requests = b'', None, []

    def do_GET(self):
        start = int(self.headers['Range'].split('=')[1].rstrip('-')) if self.headers['Range'] else 0
        RangeHandler.requests.append(start)
        body = self.payload[start:]
        self.send_response(206 if start else 200)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body[:self.cut_after] if self.cut_after else body)

    def log_message(self, *args):
        pass


def test_download_resumes_an_interrupted_file_and_renames_when_complete(tmp_path):
    import http.server
    import threading
    RangeHandler.payload = bytes(range(256)) * 4000
    RangeHandler.cut_after, RangeHandler.requests = 300_000, []
    server = http.server.HTTPServer(('127.0.0.1', 0), RangeHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url, dest = f'http://127.0.0.1:{server.server_port}/file.bin', str(tmp_path / 'file.bin')
    try:
        with pytest.raises(data.DataError, match='expected'):  # the connection died half-way
            data.download(url, dest, size=len(RangeHandler.payload))
        assert not os.path.exists(dest)
        (tmp_path / 'file.bin.part').write_bytes(RangeHandler.payload[:300_000])  # as left by a killed run
        RangeHandler.cut_after = None
        data.download(url, dest, size=len(RangeHandler.payload))
        assert RangeHandler.requests[-1] == 300_000  # it asked only for the rest
        assert (tmp_path / 'file.bin').read_bytes() == RangeHandler.payload
        assert not (tmp_path / 'file.bin.part').exists()
    finally:
        server.shutdown()


def test_offline_download_names_the_url_and_where_to_put_the_file(tmp_path):
    with pytest.raises(data.DataError) as error:
        data.download('http://127.0.0.1:9/text8.zip', str(tmp_path / 'downloads' / 'text8.zip'))
    assert 'http://127.0.0.1:9/text8.zip' in str(error.value) and str(tmp_path / 'downloads' / 'text8.zip') in str(error.value)
    assert '--source' in str(error.value)


def test_torchrun_two_cpu_processes_give_the_single_process_losses(tmp_path, data_dir):
    """DDP with gloo: 2 processes x 1 micro-step each equal 1 process x 2 micro-steps, step for step."""
    args = ['--dataset=pydoc', f'--data_dir={data_dir}', '--max_iters=6', '--eval_interval=6', '--log_interval=1',
            '--gradient_accumulation_steps=2', '--device=cpu', *TINY_TRAIN]
    single = run_cli('train.py', f'--out_dir={tmp_path / "single"}', *args)
    assert single.returncode == 0, single.stderr
    ddp = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                          str(ROOT / 'train.py'), f'--out_dir={tmp_path / "ddp"}', *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert ddp.returncode == 0, ddp.stderr
    expected, got = read_train_losses(tmp_path / 'single' / 'log.jsonl'), read_train_losses(tmp_path / 'ddp' / 'log.jsonl')
    assert set(got) == set(expected) == set(range(1, 7))
    for it in expected:
        assert got[it] == pytest.approx(expected[it], abs=1e-5), it


def test_ddp_ranks_draw_different_batches_that_together_make_one_process_batch():
    gen = lambda: torch.Generator().manual_seed(0)
    single = train.draw_offsets(gen(), 10_000, 32, 4, 3, rank=0, world=1)
    ranks = [train.draw_offsets(gen(), 10_000, 32, 4, 3, rank=r, world=2) for r in (0, 1)]
    assert not torch.equal(ranks[0], ranks[1])
    assert torch.equal(ranks[0], single[0::2]) and torch.equal(ranks[1], single[1::2])


# ----------------------------------------------------------------------------- CLI and bad input

def assert_clean_error(result, *needles):
    assert result.returncode != 0
    assert 'Traceback' not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith('error:'), result.stderr  # one last clear line
    for needle in needles:
        assert needle in result.stderr, result.stderr


def test_unknown_residual_lists_the_registered_names(tmp_path):
    result = run_cli('train.py', '--residual=nope', f'--out_dir={tmp_path / "o"}')
    assert_clean_error(result, 'nope', *METHODS)
    assert not (tmp_path / 'o').exists()


def test_unknown_key_suggests_the_right_one(tmp_path):
    assert_clean_error(run_cli('train.py', '--n_layr=4'), "'n_layr'", "did you mean 'n_layer'")


def test_wrong_type_is_named():
    assert_clean_error(run_cli('train.py', '--n_layer=abc'), 'n_layer expects int', "'abc'")
    assert_clean_error(run_cli('train.py', '--compile=1'), 'compile expects bool')


def test_missing_config_file():
    assert_clean_error(run_cli('train.py', 'config/no_such_config.py'), 'no_such_config.py', 'not found')


def test_missing_dataset(tmp_path):
    result = run_cli('train.py', '--dataset=no/such/file.txt', f'--out_dir={tmp_path / "o"}',
                     f'--data_dir={tmp_path / "d"}')
    assert_clean_error(result, 'no/such/file.txt', 'pydoc')
    assert not (tmp_path / 'o' / 'ckpt.pt').exists()


def test_missing_checkpoint_on_resume(tmp_path):
    result = run_cli('train.py', '--init_from=resume', f'--out_dir={tmp_path}')
    assert_clean_error(result, 'no checkpoint', str(tmp_path))


def test_corrupt_checkpoint_on_resume_is_reported_and_left_untouched(tmp_path):
    ckpt = tmp_path / 'ckpt.pt'
    ckpt.write_bytes(b'PK\x03\x04 this is not a checkpoint')
    result = run_cli('train.py', '--init_from=resume', f'--out_dir={tmp_path}')
    assert_clean_error(result, 'unreadable', str(ckpt))
    assert ckpt.read_bytes() == b'PK\x03\x04 this is not a checkpoint'
    assert not (tmp_path / 'log.jsonl').exists()


def test_scratch_run_never_overwrites_an_existing_checkpoint(tmp_path):
    (tmp_path / 'ckpt.pt').write_bytes(b'precious')
    assert_clean_error(run_cli('train.py', f'--out_dir={tmp_path}'), 'already exists', '--init_from=resume')
    assert (tmp_path / 'ckpt.pt').read_bytes() == b'precious'


def test_config_file_and_overrides_are_type_checked(tmp_path):
    config = tmp_path / 'cfg.py'
    config.write_text('import math\nn_layer = 3\nlearning_rate = 1\ndataset = "text8"\n')
    cfg, given = train.parse_config([str(config), '--n_layer=5', '--out_dir=123'])
    assert cfg['n_layer'] == 5 and cfg['learning_rate'] == 1.0 and isinstance(cfg['learning_rate'], float)
    assert cfg['dataset'] == 'text8' and cfg['out_dir'] == '123'
    assert given == {'n_layer', 'learning_rate', 'dataset', 'out_dir'}


# ----------------------------------------------------------------------------- analysis

def test_analyze_reports_the_diagnostics_and_pruning_a_silent_layer_changes_nothing(tmp_path, data_dir):
    import analyze
    folders = []
    for residual in ('prenorm', 'wav', 'mgr'):
        folder = tmp_path / residual
        train.main([f'--residual={residual}', f'--out_dir={folder}', f'--data_dir={data_dir}', '--max_iters=10',
                    '--eval_interval=10', *TINY_TRAIN])
        folders.append(str(folder))
    ckpt = train.load_checkpoint(str(tmp_path / 'prenorm' / 'ckpt.pt'))
    for name in ('transformer.h.1.attn.c_proj.weight', 'transformer.h.1.mlp.c_proj.weight'):
        ckpt['model'][name].zero_()  # layer 1's updates are now exactly zero
    train.save_checkpoint(ckpt, str(tmp_path / 'prenorm' / 'ckpt.pt'))
    analyze.main([f'--out_dir={",".join(folders)}', f'--report_dir={tmp_path / "report"}', '--eval_tokens=2048'])
    prenorm, wav, mgr = json.load(open(tmp_path / 'report' / 'analysis.json'))
    assert prenorm['pruning']['increase'][1] == 0.0 and prenorm['pruning']['increase'][0] != 0.0
    assert len(prenorm['activations']['rms']) == 4 and 'routing' not in prenorm and 'streams' not in prenorm
    assert prenorm['activations']['rms'][2] > 0 and all(m >= r for m, r in zip(prenorm['activations']['max_abs'],
                                                                                 prenorm['activations']['rms']))
    assert len(wav['routing']['mean_weights']) == 5  # 4 sublayers and the output mixer
    assert all(sum(w) == pytest.approx(1.0, abs=1e-5) for w in wav['routing']['mean_weights'])
    assert wav['routing']['detail_weight'][0] == 0.0 and 0 < wav['routing']['detail_weight'][1] < 1
    assert len(mgr['streams']['angular_distance']) == 4 and all(0 <= a <= 1 for a in mgr['streams']['angular_distance'])
    plots = {p.name for p in (tmp_path / 'report').glob('*.png')}
    if importlib.util.find_spec('matplotlib'):  # optional: without it only the JSON is written
        assert plots == {'activations.png', 'routing.png', 'streams.png', 'pruning.png'}
    else:
        assert not plots


def test_sweep_runs_a_grid_skips_finished_runs_resumes_interrupted_ones_and_reports(tmp_path, data_dir, monkeypatch):
    import sweep
    tiny = ['--dataset=pydoc', f'--data_dir={data_dir}', '--max_iters=4', '--eval_interval=2', '--n_layer=1',
            *TINY_TRAIN]
    monkeypatch.setitem(sweep.GRIDS, 'tiny', dict(configs=[tiny], variants=[['--residual=prenorm'],
                                                                            ['--residual=block_attnres']],
                                                  seeds=[0, 1]))
    runs = list(sweep.runs_of('tiny', str(tmp_path)))
    assert len(runs) == 4 and len({r['out_dir'] for r in runs}) == 4
    sweep.execute(runs[:3], jobs=2)
    assert [sweep.state(r) for r in runs] == ['done', 'done', 'done', 'new']
    # an interrupted run: a checkpoint at iter 2 and no 'done' event
    result = run_cli('train.py', *runs[3]['args'], '--max_iters=2')
    assert result.returncode == 0, result.stderr
    log = (Path(runs[3]['out_dir']) / 'log.jsonl')
    log.write_text(''.join(line for line in log.read_text().splitlines(True) if '"done"' not in line))
    assert sweep.state(runs[3]) == 'interrupted' and '--init_from=resume' in sweep.command(runs[3])
    sweep.execute(runs, jobs=1)  # runs only the interrupted one
    assert all(sweep.state(r) == 'done' for r in runs)
    finals = {(r['method'], r['seed']): sweep.read_log(r['out_dir'])[-1]['val_loss'] for r in runs}
    markdown = sweep.report('tiny', str(tmp_path))
    prenorm = [finals[('prenorm', s)] for s in (0, 1)]
    assert f"{np.mean(prenorm):.4f} +- {np.std(prenorm, ddof=1):.4f}" in markdown
    ppl_change = 100 * (math.exp(np.mean(prenorm) - np.mean([finals[('block_attnres', s)] for s in (0, 1)])) - 1)
    assert f"{ppl_change:+.2f}%" in markdown and 'the spread' in markdown
    assert (tmp_path / 'tiny' / 'results.md').read_text() == markdown


# ----------------------------------------------------------------------------- checkpoints

def test_crash_during_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    path = str(tmp_path / 'ckpt.pt')
    train.save_checkpoint({'iter_num': 1, 'w': torch.ones(3)}, path)
    real_save = torch.save

    def dying_save(obj, f):
        real_save(obj, f)
        f.seek(f.tell() // 2)
        f.truncate()  # half a file written ...
        raise KeyboardInterrupt  # ... and then the process is interrupted
    monkeypatch.setattr(torch, 'save', dying_save)
    with pytest.raises(KeyboardInterrupt):
        train.save_checkpoint({'iter_num': 2, 'w': torch.zeros(3)}, path)
    ckpt = train.load_checkpoint(path)
    assert ckpt['iter_num'] == 1 and torch.equal(ckpt['w'], torch.ones(3))


def read_train_losses(log_path):
    losses = {}
    for line in open(log_path):
        record = json.loads(line)
        if 'loss' in record:
            losses[record['iter']] = record['loss']
    return losses


def test_killed_run_resumes_with_the_uninterrupted_losses(tmp_path, data_dir):
    """SIGKILL a run mid-way, resume it, and get the losses of a run that was never interrupted."""
    args = ['--dataset=pydoc', f'--data_dir={data_dir}', '--max_iters=300', '--eval_interval=40',
            '--log_interval=1', '--dropout=0.1', *TINY_TRAIN]
    whole = run_cli('train.py', f'--out_dir={tmp_path / "whole"}', *args)
    assert whole.returncode == 0, whole.stderr
    expected = read_train_losses(tmp_path / 'whole' / 'log.jsonl')

    out = tmp_path / 'killed'
    proc = subprocess.Popen([sys.executable, str(ROOT / 'train.py'), f'--out_dir={out}', *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and max(read_train_losses(out / 'log.jsonl') if (out / 'log.jsonl').exists()
                                         else {}, default=0) < 130:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, 'the run ended before it could be killed'
    resumed_from = train.load_checkpoint(str(out / 'ckpt.pt'))['iter_num']
    assert 0 < resumed_from < 300

    resumed = run_cli('train.py', f'--out_dir={out}', '--init_from=resume')  # config comes from ckpt
    assert resumed.returncode == 0, resumed.stderr
    got = read_train_losses(out / 'log.jsonl')  # later lines (the resumed run) win
    assert set(got) == set(expected)
    for it in expected:
        assert got[it] == pytest.approx(expected[it], rel=1e-6, abs=1e-7), it


def test_resume_refuses_to_change_the_model(tmp_path, data_dir):
    result = run_cli('train.py', f'--out_dir={tmp_path}', f'--data_dir={data_dir}', '--max_iters=2',
                     '--eval_interval=2', *TINY_TRAIN)
    assert result.returncode == 0, result.stderr
    assert_clean_error(run_cli('train.py', f'--out_dir={tmp_path}', '--init_from=resume', '--n_layer=3'),
                       'n_layer=2', 'cannot change')


def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, data_dir):
    result = run_cli('train.py', f'--out_dir={tmp_path}', f'--data_dir={data_dir}', '--max_iters=60',
                     '--eval_interval=5', *TINY_TRAIN, '--learning_rate=1e12', '--warmup_iters=0', '--grad_clip=0.0')
    assert_clean_error(result, 'loss is', 'nan', 'last good checkpoint')
    ckpt = train.load_checkpoint(str(tmp_path / 'ckpt.pt'))
    assert math.isfinite(ckpt['val_loss'])


def test_sample_prints_text_from_a_trained_checkpoint(tmp_path, data_dir):
    result = run_cli('train.py', f'--out_dir={tmp_path}', f'--data_dir={data_dir}', '--max_iters=20',
                     '--eval_interval=20', *TINY_TRAIN)
    assert result.returncode == 0, result.stderr
    result = run_cli('sample.py', f'--out_dir={tmp_path}', '--start=The ', '--num_samples=2',
                     '--max_new_tokens=50', '--seed=3')
    assert result.returncode == 0, result.stderr
    samples = result.stdout.split('---------------\n')
    assert len(samples) == 3 and all(s.startswith('The ') and len(s) >= 54 for s in samples[:2])
    again = run_cli('sample.py', f'--out_dir={tmp_path}', '--start=The ', '--num_samples=2',
                    '--max_new_tokens=50', '--seed=3')
    assert again.stdout == result.stdout  # the seed makes it reproducible
    assert_clean_error(run_cli('sample.py', f'--out_dir={tmp_path / "nothing"}'), 'no checkpoint')
