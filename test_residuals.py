"""
The residual methods: their maths, init and invariants, on every backend the routing runs on
(`reference`: the classes as written; `torch`, `triton`: their fast twins in the kernels package).
"""
import json
import math
import re
import shutil
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import data
import kernels
import residuals
import train
from conftest import (BACKENDS, KNOB_VALUES, METHODS, ROOT, VARIANTS, on_backends, on_paths, README, REAL_TEXT, TINY_TRAIN,
                      fake_sublayers, randomize_routing, rel_rms, routing, tiny_model, unigram_entropy)
from model import GPTConfig, method_knobs
from residuals import RESIDUALS, DepthAttention


def read_weights(router):
    """Record every depth read of a residual module on its reference path: (reader, weights (S, B, T),
    number of detail sources), through a forward hook (as analyze.py does)."""
    reads = []

    def on_read(module, args, kwargs, output):
        details = kwargs.get('details', args[2] if len(args) > 2 else ())
        reads.append((args[0], module.weights(*args, **kwargs), len(details)))
    return reads, router.read.register_forward_hook(on_read, with_kwargs=True)


# ----------------------------------------------------------------------------- every method

@pytest.mark.parametrize('residual,knobs,backend', on_paths(VARIANTS))
def test_causality(residual, knobs, backend):
    """Changing tokens t+1.. leaves the logits at 0..t unchanged (with random routing parameters)."""
    model = tiny_model(residual, n_layer=4, **knobs)
    randomize_routing(model)
    model.eval().set_kernels(backend)
    gen = torch.Generator().manual_seed(0)
    B, T = (1, 16) if backend == 'triton' else (2, 32)  # the interpreter runs each token's program in Python
    idx = torch.randint(27, (B, T), generator=gen)
    t = T // 2 - 3
    changed = idx.clone()
    changed[:, t + 1:] = torch.randint(27, (B, T - t - 1), generator=gen)
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


@pytest.mark.parametrize('residual,knobs,backend', on_paths(VARIANTS))
def test_48_layers_give_finite_logits_and_gradients(residual, knobs, backend):
    """48 layers (through Triton's interpreter, which runs the same kernels some 100x slower, 12: at
    that depth every schedule still has several chunks or blocks, the last one short)."""
    n_layer, shape = (12, (1, 4)) if backend == 'triton' else (48, (2, 8))
    model = tiny_model(residual, n_layer=n_layer, n_embd=16, n_head=2, block_size=8, **knobs)
    model.set_kernels(backend)
    idx = torch.randint(27, shape)
    logits, loss = model(idx, idx)
    loss.backward()
    assert torch.isfinite(logits).all() and torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert all(p.grad is not None for p in model.residual.parameters() if p.requires_grad)


@pytest.mark.parametrize('residual,knobs', VARIANTS)
def test_routing_parameters_get_no_weight_decay(residual, knobs):
    model = tiny_model(residual, **knobs)
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    decayed = {id(p) for g in optimizer.param_groups if g['weight_decay'] > 0 for p in g['params']}
    assert not decayed & {id(p) for p in model.residual.parameters()}
    assert id(model.transformer.h[0].attn.c_attn.weight) in decayed
    assert sum(len(g['params']) for g in optimizer.param_groups) == len(list(model.parameters()))


@pytest.mark.parametrize('residual,knobs', VARIANTS)
def test_each_method_is_at_init_what_its_class_declares(residual, knobs):
    """A class's `equals_at_init` names the registered method whose logits it gives at init with the
    same shared weights (float64, within 1e-10 of their scale): a wrong init (a zero-init matrix drawn
    at random) or a dropped term fails here. None declares that no method does, and then it must differ
    from prenorm's, so that an unnoticed reduction to prenorm fails too. Where a knob decides it, the
    class declares a staticmethod equals_at_init(config) giving one or the other."""
    cls = RESIDUALS[residual]
    assert hasattr(cls, 'equals_at_init'), (f"{cls.__name__} declares no equals_at_init: name the registered "
                                            f"method it equals at init, or None (residuals.py's docstring)")
    models = {residual: tiny_model(residual, n_layer=4, **knobs)}
    declared = cls.equals_at_init(models[residual].config) if callable(cls.equals_at_init) else cls.equals_at_init
    assert declared is None or declared in RESIDUALS, f"{cls.__name__}.equals_at_init = {declared!r} is not registered"
    idx = torch.randint(27, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = {}
    for name in (residual, declared or 'prenorm'):
        model = models.get(name) or tiny_model(name, n_layer=4, **knobs)
        model.double()
        model.set_kernels('reference')
        logits[name] = model(idx, idx)[0]
    got, want = logits[residual], logits[declared or 'prenorm']
    scale = want.abs().max()
    if declared:
        assert (got - want).abs().max() <= 1e-10 * scale, f"{residual} at init is not {declared}"
    else:
        assert (got - want).abs().max() > 1e-6 * scale, f"{residual} at init is prenorm: declare it"


@pytest.mark.parametrize('residual,knobs', VARIANTS)
def test_every_routing_parameter_gets_a_gradient(residual, knobs):
    """On a step from random routing parameters, every parameter of the residual module gets a
    gradient with a non-zero entry (a term that a parameter never reaches, or a parameter that reaches
    the loss through nothing, fails here; `grad is not None` passes on zeros)."""
    model = tiny_model(residual, n_layer=4, **knobs)
    randomize_routing(model)
    model.set_kernels('reference')
    idx = torch.randint(27, (2, 16), generator=torch.Generator().manual_seed(0))
    model(idx, idx)[1].backward()
    silent = [name for name, p in model.residual.named_parameters() if p.grad is None or not p.grad.any()]
    assert not silent, f"{residual}: no gradient reaches {silent}"


def routing_that_stays_at_init(model, steps=3):
    """The routing parameters that a few AdamW steps (no weight decay) from the class's own init leave
    exactly where they were: a parameter stuck at a saddle of its init (a zero scale times a zero
    gate) never moves; a chain of zeros as in LoRA (B = 0 lets A move from the second step) does."""
    model.set_kernels('reference')
    start = {name: p.detach().clone() for name, p in model.residual.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(27, (2, 16), generator=gen)
        optimizer.zero_grad()
        model(idx, idx)[1].backward()
        optimizer.step()
    return [name for name, p in model.residual.named_parameters() if torch.equal(p.detach(), start[name])]


@pytest.mark.parametrize('residual,knobs', VARIANTS)
def test_every_routing_parameter_moves_from_its_own_init(residual, knobs):
    """The gradient check above starts from random routing; this one from the class's own init, where
    a parameter whose gradient is zero at init, and stays zero, would never train."""
    stuck = routing_that_stays_at_init(tiny_model(residual, n_layer=4, **knobs))
    assert not stuck, f"{residual}: {stuck} never move from their init"


def test_a_routing_product_of_two_zeros_is_found_stuck(monkeypatch):
    """A method whose update is scale * gate * f(x), both zero at init, has gradient zero for both,
    at init and forever: the check from the own init finds it (the one from random routing cannot)."""
    class DeadProduct(nn.Module):
        sublayer_norm, equals_at_init = True, None

        def __init__(self, config):
            super().__init__()
            self.scale, self.gate = nn.Parameter(torch.zeros(config.n_embd)), nn.Parameter(torch.zeros(1))

        def forward(self, x, sublayers):
            for f in sublayers:
                x = x + f(x) + self.scale * self.gate * f(x)
            return x
    monkeypatch.setitem(RESIDUALS, 'dead_product', DeadProduct)
    assert routing_that_stays_at_init(tiny_model('dead_product')) == ['scale', 'gate']
    model = tiny_model('dead_product')
    randomize_routing(model)
    assert routing_that_stays_at_init(model) == []


def test_no_document_counts_the_registered_methods():
    """"The seventeen registered methods" goes stale when a method is added, and nothing says so: no
    document gives a number of registered methods, or the registry's size before "methods", in words
    or digits ("the registered methods" stays true)."""
    words = ['zero', 'one', 'two', 'three', 'four', 'five', 'six', 'seven', 'eight', 'nine', 'ten', 'eleven',
             'twelve', 'thirteen', 'fourteen', 'fifteen', 'sixteen', 'seventeen', 'eighteen', 'nineteen', 'twenty']
    size = {str(len(RESIDUALS)), *words[len(RESIDUALS):len(RESIDUALS) + 1]}
    documents = [*ROOT.glob('*.md'), *(p for folder in ('docs', 'results', 'config')
                                       for p in (ROOT / folder).rglob('*.md'))]
    counts = [f"{path.relative_to(ROOT)}: {m.group(0)!r}" for path in documents
              for m in re.finditer(rf"\b({'|'.join(words)}|\d+)[- ](registered )?(?:residual )?methods\b",
                                   path.read_text(), re.I) if m.group(2) or m.group(1).lower() in size]
    assert not counts, f"counts of the registry, stale once a method is added: {counts}"


def test_every_knob_has_values_to_test():
    """Every knob of GPTConfig (the fields after `residual`) takes a value other than its default in
    KNOB_VALUES (conftest.py), so that the tests parametrised over VARIANTS run it."""
    knobs = method_knobs()
    tried = {k for variants in KNOB_VALUES.values() for given in variants for k, v in given.items() if v != knobs[k]}
    assert set(KNOB_VALUES) <= set(RESIDUALS)
    assert not set(knobs) - tried, f"knobs with no other value in conftest.KNOB_VALUES: {sorted(set(knobs) - tried)}"


def test_shared_weights_are_identical_across_methods():
    """Same seed, same attention/MLP/embedding weights whatever the residual (rezero drops the norms)."""
    ref = tiny_model('prenorm').state_dict()
    for residual in METHODS:
        state = tiny_model(residual).state_dict()
        for name, tensor in state.items():
            if name in ref and not name.startswith('residual.'):
                assert torch.equal(tensor, ref[name]), (residual, name)


def test_the_readme_example_method_trains_as_written(tmp_path, data_dir, monkeypatch):
    """The README's "Adding a residual method" code, copied verbatim into residuals.py's namespace,
    registers a method that trains and learns."""
    section = README.read_text().split('## Adding a residual method')[1]
    code = re.search(r'```python\n(.*?)```', section, re.S).group(1)
    namespace = dict(vars(residuals))
    monkeypatch.setattr(residuals, 'RESIDUALS', dict(RESIDUALS))
    namespace['RESIDUALS'] = residuals.RESIDUALS
    exec(code, namespace)
    name = next(k for k in residuals.RESIDUALS if k not in RESIDUALS)
    monkeypatch.setitem(RESIDUALS, name, residuals.RESIDUALS[name])
    metrics = train.main([f'--residual={name}', f'--dataset={REAL_TEXT}', f'--data_dir={data_dir}',
                          f'--out_dir={tmp_path}', '--max_iters=200', '--eval_interval=200', *TINY_TRAIN])
    assert metrics['val_loss'] < unigram_entropy(data.load(REAL_TEXT, data_dir).splits['train']) - 0.15


def test_a_method_added_as_the_readme_says_passes_the_suite(tmp_path):
    """The fork path, end to end: in a copy of the repository, the README's example class and its
    registry line appended to residuals.py and its section to docs/METHODS.md (what README and
    CONTRIBUTING ask, and nothing else), the tests that run every registered method pass for it,
    with the pins and the documents' checks (pytest in the copy, on the new method's cases)."""
    copy = tmp_path / 'repo'
    skip = {'.git', '.venv', '__pycache__', '.pytest_cache', 'data', 'runs', 'analysis'}  # what a run leaves at the top
    shutil.copytree(ROOT, copy, ignore=lambda folder, names: [n for n in names if folder == str(ROOT) and (
        n in skip or n.startswith('out')) or n == '__pycache__'])
    section = README.read_text().split('## Adding a residual method')[1]
    code = re.search(r'```python\n(.*?)```', section, re.S).group(1)
    with open(copy / 'residuals.py', 'a') as f:
        f.write('\n\n' + code)
    methods = (copy / 'docs' / 'METHODS.md').read_text().replace('---\n\n## Fast paths', '## `mine`: my residual\n\n'
                                                                   'Class `MyResidual`: x <- x + g_i f_i(x).\n\n---\n\n## Fast paths')
    (copy / 'docs' / 'METHODS.md').write_text(methods)
    readme = (copy / 'README.md').read_text()
    last_row = re.findall(r'^\| `\w+` \|.*\|$', readme.split('\n## Methods\n')[1].split('\n## ')[0], re.M)[-1]
    (copy / 'README.md').write_text(readme.replace(last_row, last_row + '\n| `mine` | `x <- x + g f(x)` | `MyResidual` | mine |'))
    tests = ['test_docs.py', 'test_residuals.py', 'test_decode.py', 'test_kernels.py',
             '-k', 'mine or test_docs or knob_has or (operators and pinned and torch)']
    result = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', *tests], cwd=copy,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    ran = re.search(r'(\d+) passed', result.stdout)
    assert ran and int(ran.group(1)) >= 20 and 'mine' in subprocess.run(
        [sys.executable, '-m', 'pytest', '--collect-only', '-q', '-p', 'no:cacheprovider', 'test_residuals.py'],
        cwd=copy, capture_output=True, text=True).stdout


# ----------------------------------------------------------------------------- baselines

def test_rezero_at_init_is_the_embedding_alone():
    model = tiny_model('rezero')
    idx = torch.randint(27, (2, 16))
    logits, _ = model(idx, idx)
    e = model.transformer.wte(idx) + model.transformer.wpe(torch.arange(16))
    assert torch.allclose(logits, model.lm_head(model.transformer.ln_f(e)), atol=1e-6)
    assert all(isinstance(b.attn.ln, nn.Identity) for b in model.transformer.h)  # no pre-norm


def test_layerscale_depth_rule_and_knob():
    for n_layer, eps in [(12, 0.1), (18, 0.1), (24, 1e-5), (48, 1e-6)]:
        model = tiny_model('layerscale', n_layer=n_layer)
        assert torch.all(model.residual.scale == torch.tensor(eps))
    assert torch.all(tiny_model('layerscale', layerscale_init=0.5).residual.scale == 0.5)


# ----------------------------------------------------------------------------- AttnRes family and WAV

def test_depth_attention_is_the_softmax_of_spec():
    """read(i, V) = sum_s softmax_s(w_i . RMSNorm(v_s) + b_s) v_s, written out here for 3 sources and
    one detail, with random queries; keys normalised, values raw."""
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randn(2, 3, 8, generator=gen) * (s + 1) for s in range(3)]
    detail, bias = torch.randn(2, 3, 8, generator=gen), torch.tensor([-0.7])
    read = DepthAttention(2, 8)
    torch.nn.init.normal_(read.queries)
    rms = lambda v: v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
    logits = [rms(v) @ read.queries[1] for v in sources] + [rms(detail) @ read.queries[1] + bias]
    alpha = torch.softmax(torch.stack(logits), dim=0)
    want = sum(a.unsqueeze(-1) * v for a, v in zip(alpha, sources + [detail]))
    assert torch.allclose(read(1, sources, [detail], bias), want, atol=1e-6)
    assert torch.allclose(read.weights(1, sources, [detail], bias), alpha, atol=1e-6)


@pytest.mark.parametrize('backend', BACKENDS)
def test_block_attnres_reads_the_sources_of_spec_at_init(backend):
    """2 layers, res_block_size=1: sublayers read e; e,PC; e,C_0; e,C_0,PC; the output e,C_0,C_1.
    With zero queries every read is the plain average of those sources."""
    gen = torch.Generator().manual_seed(0)
    e, *u = [torch.randn(2, 3, 16, generator=gen) for _ in range(5)]
    router, inputs = routing('block_attnres', 2, res_block_size=1), []
    reads, hook = read_weights(router)
    out = kernels.route(router, e, fake_sublayers(u, inputs), backend)
    expected = [e, (e + u[0]) / 2, (e + u[0] + u[1]) / 2, (e + (u[0] + u[1]) + u[2]) / 3]
    for got, want in zip(inputs, expected):
        assert torch.allclose(got, want, atol=1e-6)
    assert torch.allclose(out, (e + (u[0] + u[1]) + (u[2] + u[3])) / 3, atol=1e-6)
    if backend == 'reference':  # the hooks watch the reference path
        assert [w.shape[0] for _, w, _ in reads] == [1, 2, 2, 3, 3]
        assert [i for i, _, _ in reads] == [0, 1, 2, 3, 4]
        assert all(torch.allclose(w.sum(0), torch.ones(2, 3)) for _, w, _ in reads)
    hook.remove()


@pytest.mark.parametrize('backend', BACKENDS)
def test_block_attnres_auto_block_size_and_short_last_block(backend):
    assert routing('block_attnres', 48).block_len == 2 * 6 and routing('block_attnres', 4).block_len == 2
    gen = torch.Generator().manual_seed(0)
    e, *u = [torch.randn(1, 2, 16, generator=gen) for _ in range(7)]  # 3 layers, blocks of 2 layers + 1 layer
    router, inputs = routing('block_attnres', 3, res_block_size=2), []
    out = kernels.route(router, e, fake_sublayers(u, inputs), backend)
    assert torch.allclose(inputs[4], (e + sum(u[:4])) / 2, atol=1e-6)  # first sublayer of the last block
    assert torch.allclose(inputs[5], (e + sum(u[:4]) + u[4]) / 3, atol=1e-6)
    assert torch.allclose(out, (e + sum(u[:4]) + u[4] + u[5]) / 3, atol=1e-6)


@pytest.mark.parametrize('backend', BACKENDS)
def test_full_and_delta_attnres_at_init(backend):
    gen = torch.Generator().manual_seed(0)
    e, *u = [torch.randn(2, 3, 16, generator=gen) for _ in range(5)]
    inputs = []
    out = kernels.route(routing('attnres', 2), e, fake_sublayers(u, inputs), backend)
    for i, got in enumerate(inputs):
        assert torch.allclose(got, (e + sum(u[:i])) / (i + 1), atol=1e-6)
    assert torch.allclose(out, (e + sum(u)) / 5, atol=1e-6)
    inputs = []
    out = kernels.route(routing('delta_attnres', 2), e, fake_sublayers(u, inputs), backend)
    gate = torch.sigmoid(torch.tensor(-2.0))
    for i, got in enumerate(inputs):  # PreNorm stream plus the gated average of e and the deltas
        assert torch.allclose(got, e + sum(u[:i]) + gate * (e + sum(u[:i])) / (i + 1), atol=1e-6)
    assert torch.allclose(out, e + sum(u), atol=1e-6)


@pytest.mark.parametrize('backend', BACKENDS)
@pytest.mark.parametrize('residual', ['attnres', 'delta_attnres'])
@pytest.mark.parametrize('n_layer', [1, 2, 5, 13])
def test_full_and_delta_attnres_read_every_earlier_source_with_one_softmax(residual, n_layer, backend):
    """With random queries and gates, every sublayer's input is one plain softmax over all its
    sources, written out here: L = 2, 4, 10 and 26 (the fast twins read in chunks of 1, 2, 3 and 5
    sublayers, the last chunk short)."""
    gen = torch.Generator().manual_seed(n_layer)
    L = 2 * n_layer
    e, *u = [torch.randn(2, 3, 16, generator=gen) for _ in range(L + 1)]
    router = routing(residual, n_layer)
    randomize_routing(router)
    inputs = []
    out = kernels.route(router, e, fake_sublayers(u, inputs), backend)

    def softmax_read(i, sources):
        keys = torch.stack(sources) / torch.sqrt(torch.stack(sources).pow(2).mean(-1, keepdim=True) + 1e-6)
        alpha = torch.softmax(keys @ router.read.queries[i], dim=0)
        return (alpha.unsqueeze(-1) * torch.stack(sources)).sum(0)
    sources, x = [e], e
    with torch.no_grad():
        for i in range(L):
            if residual == 'attnres':
                want = softmax_read(i, sources)
            else:
                want = x + torch.sigmoid(router.gate_logit[i]) * softmax_read(i, sources)
                x = x + u[i]
            assert torch.allclose(inputs[i], want, atol=1e-5), i
            sources.append(u[i])
        want_out = softmax_read(L, sources) if residual == 'attnres' else x
    assert torch.allclose(out, want_out, atol=1e-5)


WAV_CASES = [(4, 1, {}), (5, 2, {}), (7, 4, {}), (6, 2, {'wav_levels': 2}), (6, 2, {'wav_learned_basis': True})]


@pytest.mark.parametrize('n_layer,block,knobs,backend', on_backends(WAV_CASES, through_triton=WAV_CASES[1::2]))
def test_wav_with_very_negative_detail_bias_equals_block_attnres(n_layer, block, knobs, backend):
    base = tiny_model('block_attnres', n_layer=n_layer, res_block_size=block)
    randomize_routing(base)
    wav = tiny_model('wav', n_layer=n_layer, res_block_size=block, wav_detail_bias=-30.0, **knobs)
    missing, unexpected = wav.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(k.startswith('residual.') and 'queries' not in k for k in missing)
    if 'wav_learned_basis' in knobs:
        torch.nn.init.normal_(wav.residual.basis_delta)
    base.set_kernels(backend)
    wav.set_kernels(backend)
    idx = torch.randint(27, (1, 16) if backend == 'triton' else (2, 32))  # (the interpreter: one program per token)
    with torch.no_grad():
        assert torch.allclose(wav(idx, idx)[0], base(idx, idx)[0], atol=1e-5, rtol=0)
        wav.residual.detail_bias.fill_(0.0)  # and the details do matter once they are let in
        assert not torch.allclose(wav(idx, idx)[0], base(idx, idx)[0], atol=1e-3)


def spec_phase(m):
    return [1 if k % 2 == 0 else -1 for k in range(m)]


def spec_split(m):
    return [1 if k < m // 2 else -1 for k in range(m)]


@pytest.mark.parametrize('backend', BACKENDS)
@pytest.mark.parametrize('n_layer,block', [(3, 2), (7, 4), (2, 1)])
def test_wav_detail_signs_for_full_and_partial_blocks(n_layer, block, backend):
    """Each update is a unit vector in its own channel, so RMS matching is the identity; with zero
    queries and zero detail bias every read is the average of METHODS.md's pool, built here by hand.
    (3, 2) and (7, 4) end with a block of an odd number of layers (1 and 3)."""
    L, C = 2 * n_layer, 16
    e = torch.linspace(-1, 1, C).expand(1, 2, C)
    u = [torch.eye(C)[j].expand(1, 2, C) for j in range(L)]
    router, inputs = routing('wav', n_layer, C=C, res_block_size=block, wav_detail_bias=0.0), []
    out = kernels.route(router, e, fake_sublayers(u, inputs), backend)
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


@pytest.mark.parametrize('backend', BACKENDS)
def test_wav_detail_readout_knob_adds_the_details_to_the_output_mixer(backend):
    """With wav_detail_readout the output reads e and C, phase, split of each block: at init the
    average of those 7 sources, here with updates that keep RMS matching the identity."""
    C = 16
    e = torch.linspace(-1, 1, C).expand(1, 2, C)
    u = [torch.eye(C)[j].expand(1, 2, C) for j in range(4)]
    router = routing('wav', 2, C=C, res_block_size=1, wav_detail_readout=True, wav_detail_bias=0.0)
    reads, hook = read_weights(router)
    out = kernels.route(router, e, fake_sublayers(u, []), backend)
    blocks = [(u[0], u[1]), (u[2], u[3])]
    pool = [e] + [a + b for a, b in blocks] + [d for a, b in blocks for d in (a - b, a - b)]  # m = 2: phase = split
    assert torch.allclose(out, sum(pool) / 7, atol=1e-5)
    if backend == 'reference':
        reader, weights, n_details = reads[-1]
        assert reader == 4 and weights.shape[0] == 7 and n_details == 4
    hook.remove()


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
        for p in router.coefficients.parameters():
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


def sinkhorn_by_hand(logits, iterations=20):
    """The mHC paper's Sinkhorn-Knopp written out: M = exp(logits), then alternately every column and
    every row divided by its sum."""
    M = logits.exp()
    for _ in range(iterations):
        M = M / M.sum(-2, keepdim=True)
        M = M / M.sum(-1, keepdim=True)
    return M


def test_mhc_h_res_is_twenty_sinkhorn_iterations_and_differentiates_through_them():
    """mHC's H_res is the paper's iteration (M <- T_r(T_c(M)) from exp(logits), 20 times), here in the
    log domain: equal to it written out in float64; its rows sum to 1, its columns nearly (for these
    logits, within 1e-2, where one iteration leaves them further); its
    gradient is the derivative of the 20 iterations (gradcheck)."""
    router = routing('mhc', 2)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 16, generator=gen, dtype=torch.float64) * 2
    H_res = router.coefficients.h_res(logits)
    assert rel_rms(H_res, sinkhorn_by_hand(logits.unflatten(-1, (4, 4)))) < 1e-12
    assert (H_res > 0).all() and torch.allclose(H_res.sum(-1), torch.ones(3, 5, 4, dtype=torch.float64), atol=1e-12)
    column_error = lambda M: (M.sum(-2) - 1).abs().max()  # the iterations' convergence: not exact (KromHC's point)
    assert 1e-6 < column_error(H_res) < 1e-2 < column_error(sinkhorn_by_hand(logits.unflatten(-1, (4, 4)), 1))
    assert torch.autograd.gradcheck(router.coefficients.h_res, logits[:1, :2].clone().requires_grad_())
    h_pre, h_post, h_res = router.coefficients(0, torch.randn(1, 2, 4, 16))  # at init: next to the identity
    off = 3 * math.exp(-8) / (1 + 3 * math.exp(-8))
    assert torch.allclose(h_res[0, 0], torch.eye(4) * (1 - off) + (1 - torch.eye(4)) * off / 3, atol=1e-6)
    assert torch.allclose(h_pre[0, 0], torch.sigmoid(torch.tensor([1.0, -1.0, -1.0, -1.0])))


@pytest.mark.parametrize('residual', ['mhc', 'mhc_lite', 'kromhc'])
def test_the_mhc_familys_h_res_stays_float32_under_bfloat16_autocast(residual):
    """Under bfloat16 autocast, H_res is computed in float32, by the class and by its PyTorch twin's
    step: mHC-lite's and KromHC's rows and columns sum to 1 within float32's rounding (in bfloat16 they
    were off by 6e-3 at n = 4), mHC's rows too (its columns: to the iterations' convergence)."""
    from kernels import FAST
    router = routing(residual, 2, hc_streams=4)
    randomize_routing(router)
    x = torch.randn(2, 5, 4, 16, generator=torch.Generator().manual_seed(0))
    step = FAST[type(router)].args[0](router)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        h_res = router.coefficients(1, x)[2]
        twins = step(x.flatten(0, 1), 1)[3][0]
    for H in (h_res, twins):
        assert H.dtype == torch.float32
        assert (H.sum(-1) - 1).abs().max() < 1e-6
        assert residual == 'mhc' or (H.sum(-2) - 1).abs().max() < 1e-6


@pytest.mark.parametrize('n', [1, 2, 4, 8])
def test_kromhc_h_res_is_a_kronecker_product_exactly_doubly_stochastic(n):
    """KromHC's H_res is U_1 (x) ... (x) U_K of 2 x 2 convex mixes of I and the swap (torch.kron of the
    factors built by hand), exactly doubly stochastic for any logits; a stream count that is not a
    power of 2 is refused."""
    router = routing('kromhc', 2, hc_streams=n)
    K = n.bit_length() - 1
    logits = torch.randn(3, 2 * K, generator=torch.Generator().manual_seed(n), dtype=torch.float64) * 3
    H_res = router.coefficients.h_res(logits)
    for token in range(3):
        want = torch.ones(1, 1, dtype=torch.float64)
        for k in range(K):
            p = torch.softmax(logits[token, 2 * k:2 * k + 2], 0)[0]
            want = torch.kron(want, torch.stack([torch.stack([p, 1 - p]), torch.stack([1 - p, p])]))
        assert torch.allclose(H_res[token], want, atol=1e-15)
    ones = torch.ones(3, n, dtype=torch.float64)
    assert torch.allclose(H_res.sum(-1), ones, atol=1e-14) and torch.allclose(H_res.sum(-2), ones, atol=1e-14)
    assert router.coefficients.bias.shape[1] == 2 * n + 2 * K  # 2 log2(n) residual logits, not n!
    with pytest.raises(ValueError, match='hc_streams=6 must be a power of 2'):
        GPTConfig(residual='kromhc', hc_streams=6)


def test_frac_writes_each_fraction_of_the_update_to_its_own_fraction():
    """Frac-Connections' equations written a second way, fraction by fraction: with random connections
    and fake sublayers, the sublayer reads y_j = sum_i Gamma_ij h_i joined, and fraction j becomes
    sum_i A_ij h_i + beta_j u_j, u_j the sublayer's output's j-th fraction."""
    router = routing('frac', 2, C=12, frac_parts=3)
    randomize_routing(router)
    gen = torch.Generator().manual_seed(0)
    e = torch.randn(2, 5, 12, generator=gen, dtype=torch.float64)
    updates = [torch.randn(2, 5, 12, generator=gen, dtype=torch.float64) for _ in range(4)]
    inputs = []
    router.double()
    out = router(e, fake_sublayers(updates, inputs))
    h = list(e.split(4, -1))
    with torch.no_grad():
        for i, u in enumerate(updates):
            width, beta = router.connections(i, torch.stack(h, -2))
            y = [sum(width[..., a, b, None] * h[a] for a in range(3)) for b in range(3)]
            assert torch.allclose(inputs[i], torch.cat(y, -1), atol=1e-12)
            h = [sum(width[..., a, 3 + b, None] * h[a] for a in range(3)) + beta[..., b, None] * u.split(4, -1)[b]
                 for b in range(3)]
    assert torch.allclose(out, torch.cat(h, -1), atol=1e-12)


def test_frac_with_one_fraction_is_hc_with_one_stream():
    """m = 1: Frac-Connections' [Gamma | A] and beta are HC's [A_m | A_r] and B of a single stream, so
    the two give the same logits for the same (random) connections."""
    frac, hc = tiny_model('frac', n_layer=3, frac_parts=1), tiny_model('hc', n_layer=3, hc_streams=1)
    randomize_routing(frac)
    hc.load_state_dict(frac.state_dict())
    idx = torch.randint(27, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(frac(idx, idx)[0], hc(idx, idx)[0], atol=1e-6)


def test_laurel_equations_written_out():
    """LAuReL-RW: x <- alpha f(x) + beta x; LAuReL-LR: x <- f(x) + x + B A x; with random parameters
    and fake sublayers, each step as written here."""
    gen = torch.Generator().manual_seed(0)
    e = torch.randn(2, 5, 16, generator=gen, dtype=torch.float64)
    updates = [torch.randn(2, 5, 16, generator=gen, dtype=torch.float64) for _ in range(4)]
    for name in ('laurel_rw', 'laurel_lr'):
        router = routing(name, 2, laurel_rank=3)
        randomize_routing(router)
        router.double()
        inputs = []
        out, x = router(e, fake_sublayers(updates, inputs)), e
        for i, u in enumerate(updates):
            assert torch.equal(inputs[i], x)
            if name == 'laurel_rw':
                x = router.alpha[i] * u + router.beta[i] * x
            else:
                x = u + x + x @ router.down[i].t() @ router.up[i].t()
        assert torch.allclose(out, x, atol=1e-12), name
    assert routing('laurel_lr', 2, laurel_rank=3).down.shape == (4, 3, 16)


def test_mhc_equals_the_hyper_connections_package_where_both_are_defined():
    """The peer: hyper-connections' ManifoldConstrainedHyperConnections (lucidrains; installed only
    where it is). With the dynamic projections at zero (its per-stream norms differ from the paper's
    flattened x', which ours follows) and random static biases, one sublayer's input and new streams
    equal ours (float32: the package computes in float32; its Sinkhorn normalises rows first, ours
    columns as the paper writes, and after 20 iterations the two agree to float32)."""
    package = pytest.importorskip('hyper_connections.manifold_constrained_hyper_connections')
    n, C, i = 4, 16, 1
    router = routing('mhc', 2, C=C)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.coefficients.bias.copy_(torch.randn(router.coefficients.bias.shape, generator=gen))
    peer = package.ManifoldConstrainedHyperConnections(n, dim=C, layer_index=i)
    b = router.coefficients.bias[i].detach()
    with torch.no_grad():
        peer.static_alpha.copy_(torch.cat([b[:n, None], b[2 * n:].view(n, n).t()], 1))  # [pre | H_res^T]
        peer.static_beta.copy_(b[n:2 * n])
    x = torch.randn(2, 5, n, C, generator=gen)
    f = lambda h: torch.tanh(h) * 3
    h, mixed, post = router.mix(i, x)
    ours = mixed + post.unsqueeze(-1) * f(h).unsqueeze(-2)
    branch_input, add_residual = peer(x.transpose(1, 2).reshape(2 * n, 5, C))
    theirs = add_residual(f(branch_input)).view(2, n, 5, C).transpose(1, 2)
    assert rel_rms(branch_input, h) < 1e-5 and rel_rms(theirs, ours) < 1e-5


def test_frac_reads_as_the_hyper_connections_package_reads_its_fractions():
    """The peer: hyper-connections' HyperConnections with num_fracs = m and one stream (installed only
    where it is). Its width connection, the sublayer's input and the carried fractions, equals ours for
    the same random connections, static and dynamic (to the two RMSNorms' epsilons). Its depth
    connection differs by design: it adds every fraction of the update to each fraction (static
    beta[f2] for every f1), where ours adds fraction j to fraction j (docs/METHODS.md)."""
    package = pytest.importorskip('hyper_connections.hyper_connections')
    m, C, i = 2, 16, 1
    router = routing('frac', 2, C=C, frac_parts=m)
    randomize_routing(router)
    c = router.connections
    peer = package.HyperConnections(1, dim=C, num_fracs=m, layer_index=0)
    interleave = torch.tensor([t * m + f2 for f2 in range(m) for t in range(2)])  # its columns (f2, t): ours (t, f2)
    with torch.no_grad():
        peer.static_alpha.copy_(c.width[i][:, interleave])
        peer.dynamic_alpha_fn.copy_(c.proj[i][:, interleave])
        peer.dynamic_alpha_scale.copy_(c.width_scale[i])
    x = torch.randn(2, 5, C, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    peer.double()
    router.double()
    with torch.no_grad():
        width, _ = c(i, x.unflatten(-1, (m, -1)))
        mixed = width.transpose(-1, -2) @ x.unflatten(-1, (m, -1))
        branch_input, residuals, _ = peer.width_connection(x)
    assert rel_rms(branch_input, mixed[..., :m, :].flatten(-2)) < 1e-5
    assert rel_rms(residuals, mixed[..., m:, :].flatten(-2)) < 1e-5


def watch_streams(router):
    """The streams (n, B, T, C) that MGR's AttnPool reads after every sublayer (forward hook)."""
    streams = []
    hook = router.pool.register_forward_hook(lambda module, args, out: streams.append(args[1]) if args[0] else None)
    return streams, hook


@pytest.mark.parametrize('backend', BACKENDS)
@pytest.mark.parametrize('gate', ['competitive', 'independent'])
def test_mgr_stream_norms_are_bounded_where_prenorm_grows(gate, backend):
    """METHODS.md's bound: every stream's per-token norm stays <= max(|e|, max_i |f_i(h_i)|); so do the
    sublayers' inputs and the output, pooled from the streams (the fast twins keep the streams
    inside their fused step: those two are what can be seen of them)."""
    gen = torch.Generator().manual_seed(0)
    e = torch.randn(2, 8, 16, generator=gen)
    updates = [torch.randn(2, 8, 16, generator=gen) * 1000 for _ in range(12)]
    bound = max(e.norm(dim=-1).max(), max(u.norm(dim=-1).max() for u in updates))
    router = routing('mgr', 6, mgr_gate=gate)
    randomize_routing(router)
    with torch.no_grad():
        router.gates.bias.add_(3.0)  # large gates: the streams move a lot
    streams, hook = watch_streams(router)
    inputs = []
    out = kernels.route(router, e, fake_sublayers(updates, inputs), backend)
    hook.remove()
    if backend == 'reference':
        assert len(streams) == 12 and max(s.norm(dim=-1).max() for s in streams) <= bound * (1 + 1e-6)
        assert streams[-1].norm(dim=-1).max() > 0.2 * bound  # the updates did get in
    assert max(h.norm(dim=-1).max() for h in inputs) <= bound * (1 + 1e-6)
    assert out.norm(dim=-1).max() <= bound * (1 + 1e-6) and out.norm(dim=-1).max() > 0.2 * bound
    prenorm_out = routing('prenorm', 6)(e, fake_sublayers(updates, []))
    assert prenorm_out.norm(dim=-1).max() > bound


@pytest.mark.parametrize('gate', ['competitive', 'independent'])
@pytest.mark.parametrize('L', [24, 48, 96])
def test_mgr_gate_bias_gives_the_depth_scaled_initial_gate(gate, L):
    for n in (3, 5):  # L gated sublayers after the n-1 that start the streams
        router = routing('mgr', (L + n - 1) // 2, mgr_streams=n, mgr_gate=gate)
        assert router.gates.queries.shape[0] == L
        target = torch.sigmoid(torch.tensor(-3.0)).item() * math.sqrt(21 / L)
        beta = router.gates(0, torch.randn(n, 2, 3, 16))
        assert torch.allclose(beta, torch.full_like(beta, target), rtol=1e-5)
        if gate == 'competitive':  # the paper's closed form
            assert router.gates.bias[0].item() == pytest.approx(math.log(math.sqrt(L / 21) * (math.exp(3) + 1) - n))


def test_mgr_accumulation_phase_starts_n_distinct_streams():
    router = routing('mgr', 3, mgr_streams=4)
    streams, hook = watch_streams(router)
    gen = torch.Generator().manual_seed(0)
    router(torch.randn(1, 2, 16, generator=gen), fake_sublayers([torch.randn(1, 2, 16, generator=gen)
                                                                 for _ in range(6)], []))
    hook.remove()
    assert [len(s) for s in streams] == [2, 3, 4, 4, 4, 4]
    assert all(not torch.allclose(streams[2][a], streams[2][b]) for a in range(4) for b in range(a))
    with pytest.raises(ValueError, match='needs more than 3 sublayers'):
        routing('mgr', 1, mgr_streams=4)


# ----------------------------------------------------------------------------- dense connections over layers

def random_layers(n_layer, C, seed=0):
    """Sublayers that depend on their input (a fixed random map each), so that routing changes what
    they see; attention takes one input, or three (query, key, value) as MUDD's multiway gives it."""
    gen = torch.Generator().manual_seed(seed)
    maps = [torch.randn(3, C, C, generator=gen) / C ** 0.5 for _ in range(2 * n_layer)]

    def attention(W):
        return lambda h, h_k=None, h_v=None: torch.tanh(h @ W[0] + (h if h_k is None else h_k) @ W[1]
                                                       + (h if h_v is None else h_v) @ W[2])
    return [attention(W) if i % 2 == 0 else (lambda h, W=W: torch.tanh(h @ W[0])) for i, W in enumerate(maps)]


@pytest.mark.parametrize('residual,knobs', [('denseformer', {}), ('denseformer', {'denseformer_dilation': 2}),
                                            ('denseformer', {'denseformer_period': 3, 'denseformer_dilation': 2}),
                                            ('mudd', {'mudd_multiway': False})])
def test_dense_connections_at_init_equal_prenorm_exactly(residual, knobs):
    """alpha_{r,r} = 1 (DenseFormer) and MUDD's one-hot "current only" bias with W2 = 0 make every
    average the newest state: the same logits as prenorm's, bit for bit (1.0 X + 0.0 Y is X)."""
    prenorm, model = tiny_model('prenorm', n_layer=6), tiny_model(residual, n_layer=6, **knobs)
    missing, unexpected = model.load_state_dict(prenorm.state_dict(), strict=False)
    assert not unexpected and all(k.startswith('residual.') for k in missing)
    idx = torch.randint(27, (2, 32))
    with torch.no_grad():
        assert torch.equal(model(idx, idx)[0], prenorm(idx, idx)[0])
        randomize_routing(model)
        assert not torch.allclose(model(idx, idx)[0], prenorm(idx, idx)[0], atol=1e-3)


def test_mudd_multiway_at_init_is_the_plain_transformer():
    """Multiway at init: every way is the newest state, so the query, key and value inputs are one
    tensor; with their norms at init the split projection gives prenorm's logits to rounding."""
    prenorm, model = tiny_model('prenorm', n_layer=4), tiny_model('mudd', n_layer=4)
    model.load_state_dict(prenorm.state_dict(), strict=False)
    idx = torch.randint(27, (2, 32))
    with torch.no_grad():
        assert torch.allclose(model(idx, idx)[0], prenorm(idx, idx)[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize('dilation,period', [(1, 1), (2, 1), (3, 2)])
def test_denseformer_averages_of_the_paper_and_unused_weights_get_no_gradient(dilation, period):
    """Against a direct reading of the paper (Y_r = sum_{j <= r, j = r mod k} alpha_{r,j} X_j over the
    stored group outputs, written with a masked matrix): the output, and alpha's gradient, which is
    exactly zero on every entry no average reads (above the diagonal, or of another residue)."""
    n_layer, C = 6, 16
    router = routing('denseformer', n_layer, C, denseformer_dilation=dilation, denseformer_period=period)
    randomize_routing(router)
    e = torch.randn(2, 5, C)
    out = router(e, random_layers(n_layer, C))
    R = n_layer // period
    r, j = torch.arange(1, R + 1)[:, None], torch.arange(R + 1)[None, :]
    read = (j <= r) & ((r - j) % dilation == 0)
    weights = router.dwa.alpha.detach() * read
    sublayers, states, x = random_layers(n_layer, C), [e], e
    for g in range(R):
        for f in sublayers[2 * g * period:2 * (g + 1) * period]:
            x = x + f(x)
        states.append(x)
        x = torch.einsum('j,jbtc->btc', weights[g, :g + 2], torch.stack(states))
    assert torch.allclose(out, x, atol=1e-5)
    out.pow(2).sum().backward()
    grad = router.dwa.alpha.grad
    assert (grad[~read] == 0).all() and (grad[read] != 0).all()


@pytest.mark.parametrize('multiway', [True, False])
def test_mudd_equals_its_equations_written_with_stacked_states(multiway):
    """MUDD against a direct reading of its equations (random routing): the weights of all ways in one
    matrix product, the mixes as one einsum over the stacked states, query/key/value/residual ways in
    that order; and the query, key and value inputs differ once the routing has moved."""
    n_layer, C = 4, 16
    router = routing('mudd', n_layer, C, mudd_multiway=multiway)
    randomize_routing(router)
    e = torch.randn(2, 5, C)
    seen = []
    sublayers = random_layers(n_layer, C)
    watched = [(lambda *h, f=f: seen.append(h) or f(*h)) if i % 2 == 0 else f for i, f in enumerate(sublayers)]
    out = router(e, watched)
    dense, states, ways = router.dense, [e], [e]
    for i in range(n_layer):
        attn, mlp = sublayers[2 * i], sublayers[2 * i + 1]
        y = ways[-1] + attn(*ways[:3])
        states.append(y + mlp(y))
        w1, w2 = dense.generators[i][0].weight, dense.generators[i][2].weight
        hidden = F.gelu(residuals.rms_norm(states[-1]) @ w1.T)
        n_ways = 1 if i == n_layer - 1 or not multiway else 4
        w = (hidden @ w2.T).view(2, 5, n_ways, i + 2) + dense.bias[i]
        ways = list(torch.einsum('btcj,jbtd->cbtd', w, torch.stack(states)))
    assert torch.allclose(out, ways[0], atol=1e-5)
    assert [len(h) for h in seen] == [1] + [3 if multiway else 1] * (n_layer - 1)
    if multiway:
        assert not torch.allclose(seen[1][0], seen[1][1]) and not torch.allclose(seen[1][1], seen[1][2])


def test_mudd_hidden_width_follows_the_official_rule_or_the_knob():
    """ways x (i+2), 4x at the last layer (one way), rounded up as (h // 64 + 1) * 64; mudd_hidden sets it."""
    widths = [g[0].out_features for g in routing('mudd', 20).dense.generators]
    assert widths == [64] * 14 + [128] * 5 + [128]  # 4 x (i+2) reaches 64 at i = 14; the last: 4 x 21 = 84
    assert [g[2].out_features for g in routing('mudd', 3).dense.generators] == [8, 12, 4]
    assert all(g[0].out_features == 32 for g in routing('mudd', 3, mudd_hidden=32).dense.generators)


def test_attention_takes_three_inputs_only_where_mudd_asks_and_one_input_is_unchanged():
    """Only MUDD's layers after the first get the key and value norms; the one-input attention is
    nanoGPT's, bit for bit (written out here), and three equal inputs give it to rounding."""
    for residual in METHODS:
        model = tiny_model(residual, n_layer=3)
        extra = sorted(k for k in model.state_dict() if '.ln_k.' in k or '.ln_v.' in k)
        assert extra == ([f'transformer.h.{i}.attn.{n}.weight' for i in (1, 2) for n in ('ln_k', 'ln_v')]
                         if residual == 'mudd' else []), residual
    model = tiny_model('mudd', n_layer=2)
    attn = model.transformer.h[1].attn
    with torch.no_grad():
        attn.c_attn.weight.mul_(30)  # scores far from uniform, so that the query's and key's inputs matter
    h = torch.randn(2, 9, 32)
    B, T, C = h.shape
    q, k, v = attn.c_attn(attn.ln(h)).split(C, dim=2)
    q, k, v = (t.view(B, T, attn.n_head, C // attn.n_head).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
    with torch.no_grad():
        assert torch.equal(attn(h), attn.c_proj(y))
        assert torch.allclose(attn(h, h, h), attn(h), atol=1e-6)
        for i in range(3):  # each of the query's, key's and value's inputs is used
            assert rel_rms(attn(*[h.flip(1) if j == i else h for j in range(3)]), attn(h)) > 0.05


def test_config_validates_each_knob_in_one_place():
    for bad, message in [({'residual': 'nope'}, 'choose one of'), ({'mgr_gate': 'soft'}, 'independent or competitive'),
                         ({'n_embd': 30, 'n_head': 4}, 'multiple of n_head'), ({'res_block_size': -1}, 'res_block_size'),
                         ({'residual': 'denseformer', 'n_layer': 4, 'denseformer_period': 3}, 'must divide n_layer=4'),
                         ({'denseformer_dilation': 0}, 'denseformer_dilation'), ({'mudd_hidden': -1}, 'mudd_hidden'),
                         ({'layerscale_init': -0.1}, 'layerscale_init'), ({'mgr_L_base': 0}, 'mgr_L_base'),
                         ({'residual': 'kromhc', 'hc_streams': 3}, 'hc_streams=3 must be a power of 2'),
                         ({'residual': 'frac', 'n_embd': 30, 'n_head': 2, 'frac_parts': 4}, 'must divide n_embd=30'),
                         ({'frac_parts': 0}, 'frac_parts must be at least 1'),
                         ({'residual': 'laurel_lr', 'n_embd': 16, 'n_head': 2, 'laurel_rank': 17},
                          'laurel_rank=17 must be at most n_embd=16'), ({'laurel_rank': 0}, 'laurel_rank'),
                         ({'wav_rho': 0.0}, 'wav_rho must be > 0'), ({'hc_streams': 0}, 'hc_streams must be at least 1'),
                         ({'mgr_streams': 0}, 'mgr_streams must be at least 1'), ({'wav_levels': 0}, 'wav_levels'),
                         ({'denseformer_period': 0}, 'denseformer_period must be at least 1'),
                         ({'dropout': 1.0}, 'dropout must be in'),
                         ({'residual': 'mhc_lite', 'hc_streams': 7}, 'would need 5040; use hc_streams <= 6'),
                         ({'residual': 'mgr', 'n_layer': 1, 'mgr_streams': 4}, 'needs more than 3 sublayers'),
                         ({'residual': 'mgr', 'mgr_gate': 'independent', 'mgr_b_base': 3.0, 'n_layer': 2},
                          r'initial gate .* must be below 1; use a lower mgr_b_base'),
                         ({'residual': 'mgr', 'mgr_streams': 8, 'n_layer': 4}, 'no keep weight for 8 competing streams')]:
        with pytest.raises(ValueError, match=message):
            GPTConfig(**bad)
    # GPTConfig is the one place: no class of residuals.py refuses a config
    assert 'raise ValueError' not in (ROOT / 'residuals.py').read_text()
