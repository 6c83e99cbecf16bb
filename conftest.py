"""
What the tests share: tiny models, fake sublayers, the backends to run the routing on, and the
real-text and script helpers. Run the suite with `python -m pytest -q -n auto` (a worker a core) from
the repository root.

Real-text tests read ../shared/data (the project's shared data slices); in a fresh clone without
it they train on the embedded corpus instead, and dataset-specific tests skip with the reason.
Every test that writes gets its own temporary folders (tmp_path): nothing is written into the
repository or the working directory.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

# The Triton kernels' tests run them compiled on CUDA tensors where there is a GPU; without one,
# on CPU tensors through Triton's interpreter, chosen before triton is imported (by the kernels package).
KERNEL_DEVICE = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
if KERNEL_DEVICE.type == 'cpu':
    os.environ.setdefault('TRITON_INTERPRET', '1')
# With -n auto (pytest-xdist) the workers share the cores: each takes its share of torch's threads.
if 'PYTEST_XDIST_WORKER_COUNT' in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ['PYTEST_XDIST_WORKER_COUNT'])))

import data  # noqa: E402  (after the interpreter switch above)
import kernels  # noqa: E402
from kernels import dense, depth_mix, mgr, stream_kernels  # noqa: E402
from kernels.common import next_pow2  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from residuals import RESIDUALS  # noqa: E402

ROOT = Path(__file__).resolve().parent
SHARED_DATA = ROOT.parent / 'shared' / 'data'
TEXT8 = SHARED_DATA / 'text8_head.txt'
README = ROOT / 'README.md'
REAL_TEXT = str(TEXT8) if TEXT8.is_file() else data.EMBEDDED  # fresh clone: the embedded corpus
METHODS = sorted(RESIDUALS)
# Every knob's values other than its default, by method (CONTRIBUTING: a new knob gets a line here, and
# test_every_knob_has_values_to_test holds it): the tests parametrised over VARIANTS run each method at
# its defaults and with these. The models they build have an even number of layers (denseformer_period).
KNOB_VALUES = {
    'layerscale': [dict(layerscale_init=0.5)],
    'laurel_lr': [dict(laurel_rank=2)],
    'block_attnres': [dict(res_block_size=2)],
    'wav': [dict(res_block_size=2, wav_detail_bias=-1.0, wav_rho=1.0, wav_detail_readout=True, wav_levels=2,
                 wav_learned_basis=True)],
    'hc': [dict(hc_streams=2, hc_dynamic=False)],
    'mhc': [dict(hc_streams=3)],
    'mhc_lite': [dict(hc_streams=3)],
    'kromhc': [dict(hc_streams=8)],
    'frac': [dict(frac_parts=4, hc_dynamic=False)],
    'mgr': [dict(mgr_streams=2, mgr_gate='independent', mgr_b_base=-2.0, mgr_L_base=10.0)],
    'denseformer': [dict(denseformer_dilation=2, denseformer_period=2)],
    'mudd': [dict(mudd_multiway=False, mudd_hidden=32)],
}
VARIANTS = [pytest.param(m, knobs, id='-'.join([m, *(f'{k}={v}' for k, v in knobs.items())]))
            for m in METHODS for knobs in [{}, *KNOB_VALUES.get(m, [])]]  # (method, knobs), as test parameters

TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=27)
TINY_TRAIN = ['--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=32', '--batch_size=32',
              '--learning_rate=5e-3', '--min_lr=1e-3', '--warmup_iters=5', '--eval_tokens=4096']

needs_triton = pytest.mark.skipif(kernels.triton is None, reason='triton is not installed (pip install triton; Linux)')
# every way to run the routing on CPU tensors: the classes as written, their PyTorch twins, and the
# Triton kernels through the interpreter (on a GPU machine the kernels' own tests run them compiled)
TRITON_MARKS = [needs_triton, pytest.mark.skipif(KERNEL_DEVICE.type == 'cuda',
                                                 reason="CPU tensors; with a GPU, test_kernels*.py run the kernels compiled")]
BACKENDS = ['reference', 'torch', pytest.param('triton', marks=TRITON_MARKS)]


def on_paths(variants):
    """(method, knobs, backend) for each variant on each backend that runs a path of its own: the class
    (reference), and where the class has a twin, the twin (torch) and its kernels (triton). A method
    without one runs its class on every backend: the reference's case tests it."""
    return [pytest.param(*variant.values, backend, id=f'{variant.id}-{backend}',
                         marks=TRITON_MARKS if backend == 'triton' else ())
            for variant in variants for backend in ('reference', 'torch', 'triton')
            if backend == 'reference' or RESIDUALS[variant.values[0]] in kernels.FAST]


def on_backends(cases, through_triton):
    """Parameters (*case, backend): every case on reference and torch, and the cases in through_triton
    on triton too (its interpreter runs the kernels some 100x slower than PyTorch)."""
    return [pytest.param(*case, backend, marks=TRITON_MARKS if backend == 'triton' else ())
            for case in cases for backend in ('reference', 'torch', 'triton')
            if backend != 'triton' or case in through_triton]


def tiny_model(residual, seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, 'residual': residual, **overrides}))


def randomize_routing(model, seed=1):
    """Give every routing parameter (of a GPT, or of a bare residual module) a random value, so no
    zero init can hide a mixing bug."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in getattr(model, 'residual', model).parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype).to(p.device) * 0.5)  # a model on any device


def routing(residual, n_layer, C=16, **knobs):
    """A bare residual module (no transformer around it)."""
    return RESIDUALS[residual](GPTConfig(**{**TINY, 'n_layer': n_layer, 'n_embd': C, 'residual': residual, **knobs}))


def fake_sublayers(updates, inputs):
    """Sublayers that record their input and return fixed updates, to read off what a method routes."""
    def make(u):
        def sublayer(h):
            inputs.append(h)
            return u
        return sublayer
    return [make(u) for u in updates]


def rel_rms(got, want):
    """RMS of the difference over the RMS of `want` (the plain RMS where `want` is all zero)."""
    diff, scale = (got.double() - want.double()).pow(2).mean().sqrt(), want.double().pow(2).mean().sqrt()
    return (diff / scale if scale > 0 else diff).item()


# the kernels' tests, family by family (test_kernels*.py)

STREAM_VARIANTS = [('hc', {}), ('hc', {'hc_dynamic': False}), ('mhc_lite', {}), ('mhc_lite', {'hc_streams': 3}),
                   ('mhc', {}), ('kromhc', {'hc_streams': 8}), ('frac', {}), ('frac', {'hc_dynamic': False, 'frac_parts': 4})]


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


def routing_run(residual, knobs, n_layer, backend, dtype=torch.float64, inner=None):
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


def unigram_entropy(tokens):
    counts = np.bincount(np.asarray(tokens), minlength=1).astype(np.float64)
    probs = counts[counts > 0] / counts.sum()
    return float(-(probs * np.log(probs)).sum())


def need_shared(path):
    if not path.is_file():
        pytest.skip(f"{path} is absent: the shared data slices live beside the repository in ../shared/data")
    return path


def run_cli(script, *args, cwd, env=None):
    """Run one of the scripts as a user would, in the given (temporary) working directory. No time
    limit: a slow or busy machine must not fail a test."""
    return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=cwd, capture_output=True, text=True,
                          env=env)


def assert_clean_error(result, *needles):
    """A bad input's answer: a non-zero exit and at most a few lines on stderr, the last one starting
    with 'error:', no traceback."""
    assert result.returncode != 0
    assert 'Traceback' not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith('error:') and len(lines) <= 5, result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


def exit_message(main, argv):
    """The message of the SystemExit that main(argv) stops with (in-process, for bad input)."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code not in (0, None)
    return str(stop.value.code)


def read_train_losses(log_path):
    losses = {}
    for line in open(log_path):
        record = __import__('json').loads(line)
        if 'loss' in record:
            losses[record['iter']] = record['loss']
    return losses


@pytest.fixture(scope='session')
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp('data'))


@pytest.fixture
def few_programs(monkeypatch):
    """Tiles of at most 4 tokens in every tiled kernel, so that a call on a few tokens spans several
    tiles, the last one part-filled, and at most 2 programs in the reducing backward kernels, so that
    each program loops over several tiles and writes a partial sum (on a GPU: up to 512 programs)."""
    few = {'reduction_programs': lambda n_tiles: min(n_tiles, 2),
           'token_tile': lambda m, C, N: min(4, next_pow2(N)),
           'stream_tile': lambda n, C, n_perm, N, hr: min(4, next_pow2(N))}
    for family in (depth_mix, stream_kernels, mgr, dense):  # the files whose launchers call them
        for name, tile in few.items():
            if hasattr(family, name):
                monkeypatch.setattr(family, name, tile)


@pytest.fixture(autouse=True)
def in_a_temporary_directory(tmp_path, monkeypatch):
    """Every test runs in its own temporary working directory, so that a default path (out/, data/)
    never lands in the repository or in a folder a user already has."""
    monkeypatch.chdir(tmp_path)


def repository_files():
    skip = {'.git', '.venv', '__pycache__', '.pytest_cache'}
    files = {}
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in skip]
        for name in names:
            path = os.path.join(folder, name)
            files[os.path.relpath(path, ROOT)] = os.stat(path).st_mtime_ns
    return files


@pytest.fixture(scope='session', autouse=True)
def the_repository_is_left_as_it_was():
    """After the whole suite, no file of the repository is new or rewritten."""
    before = repository_files()
    yield
    after = repository_files()
    changed = sorted(path for path in after if before.get(path) != after[path])
    assert not changed, f"the tests wrote into the repository: {changed[:10]}"


def pytest_collection_modifyitems(items):
    """The compile of every kernel for a GPU first (minutes of one core with an empty Triton cache):
    under -n auto one worker takes it at the start while the other runs the rest, not alone at the end."""
    items.sort(key=lambda item: item.originalname != 'test_every_triton_kernel_compiles_for_a_cuda_gpu')
