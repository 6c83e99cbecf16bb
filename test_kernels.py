"""
The kernels package as a whole: the knob and its errors, FAST, every fast path against its class in
float64, compilation (one graph, regional, for a CUDA GPU without one), training with the kernels on
and off, and the operators and bytes of a training step, pinned. Each family's own tests are in
test_kernels_<family>.py; the equivalences of whole methods on every backend in test_residuals.py.
"""
import contextlib
import os
from typing import List

import numpy as np
import pytest
import torch

import data
import kernels
from conftest import (KERNEL_DEVICE, METHODS, STREAM_VARIANTS, VARIANTS, REAL_TEXT, on_paths, assert_clean_error,
                      assert_compiled_matches_eager, needs_triton, randomize_routing, rel_rms, routing, run_cli,
                      tiny_model)
from residuals import RESIDUALS



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
cases += [(name, 1024, torch.float32, False) for name in ('block_attnres', 'wav', 'hc', 'mhc_lite', 'mhc', 'frac', 'mgr', 'mudd')]
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
    """Every method's fast path (the twins of the kernels package, the Triton kernels) computes at its inputs'
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
              'wav': (751, 782), 'hc': (408, 768), 'mhc': (1416, 781), 'mhc_lite': (472, 718),
              'kromhc': (477, 726), 'frac': (403, 767), 'mgr': (500, 540), 'denseformer': (169, 322),
              'mudd': (291, 411)},
    'triton': {'prenorm': (135, 245), 'rezero': (152, 239), 'layerscale': (168, 255), 'laurel_rw': (201, 249),
               'laurel_lr': (217, 377), 'attnres': (159, 297), 'block_attnres': (159, 297), 'delta_attnres': (206, 315),
               'wav': (195, 302), 'hc': (159, 276), 'mhc': (200, 316), 'mhc_lite': (202, 316),
               'kromhc': (205, 324), 'frac': (156, 275), 'mgr': (154, 265), 'denseformer': (169, 322),
               'mudd': (280, 417)},
}


@pytest.mark.parametrize('backend', ['torch', pytest.param('triton', marks=needs_triton)])
def test_operators_per_training_step_are_pinned(backend):
    """Counted exactly (a dispatch mode; no timing), on a 4-layer model at two tokens (the counts do
    not depend on width or tokens); within 2% for other PyTorch versions' decompositions."""
    import counters
    shape, cfg = dict(n_layer=4, n_embd=32, n_head=2, block_size=8), dict(seed=0, vocab_size=96, mgr_fallback_p=1)
    idx = torch.randint(96, (1, 2), generator=torch.Generator().manual_seed(0)).to(KERNEL_DEVICE)
    counted = {}
    for residual in METHODS:
        r = counters.operator_counts(residual, shape, 1, idx, idx, KERNEL_DEVICE, contextlib.nullcontext(), backend, cfg)
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
              'mhc': 3.666, 'mhc_lite': 3.23, 'kromhc': 3.067, 'frac': 1.541, 'mgr': 3.053, 'denseformer': 1.149,
              'mudd': 1.533},
    'triton': {'prenorm': 1.0, 'rezero': 0.984, 'layerscale': 1.111, 'laurel_rw': 1.177, 'laurel_lr': 1.221,
               'attnres': 1.125, 'block_attnres': 1.099, 'delta_attnres': 1.311, 'wav': 1.229, 'hc': 1.493,
               'mhc': 1.825, 'mhc_lite': 1.885, 'kromhc': 1.75, 'frac': 1.07, 'mgr': 1.232, 'denseformer': 1.149,
               'mudd': 1.428},
}


@pytest.mark.parametrize('backend', ['torch', pytest.param('triton', marks=needs_triton)])
def test_bytes_per_training_step_are_pinned(backend):
    """Counted exactly on fake tensors (shapes only: no data, no timing), within 0.005 of prenorm's."""
    import counters
    shape, cfg = dict(n_layer=4, n_embd=128, n_head=2, block_size=64), dict(seed=0, vocab_size=96, mgr_fallback_p=1)
    ctx = torch.autocast(KERNEL_DEVICE.type, dtype=torch.bfloat16)
    moved = {m: counters.bytes_moved(m, shape, 2, KERNEL_DEVICE, ctx, backend, cfg)['bytes'] for m in METHODS}
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
    token, under 0.1%), in bfloat16 autocast. (Two layers: a deeper step dispatches no other operator.)"""
    import counters
    shape, cfg = dict(n_layer=2, n_embd=32, n_head=2, block_size=8), dict(seed=0, vocab_size=96, mgr_fallback_p=1)
    for name in [m for m in METHODS if backend == 'torch' or RESIDUALS[m] in kernels.FAST]:  # (no twin: as torch)
        for ctx in (contextlib.nullcontext(), torch.autocast(KERNEL_DEVICE.type, dtype=torch.bfloat16)):
            fake, real = (counters.bytes_moved(name, shape, 2, KERNEL_DEVICE, ctx, backend, cfg, fake=f) for f in (True, False))
            if isinstance(ctx, contextlib.nullcontext):
                assert fake['ops'] == real['ops'], name
            else:
                assert fake['ops'].keys() == real['ops'].keys() and abs(fake['bytes'] / real['bytes'] - 1) < 1e-3, name


def test_the_byte_counter_counts_reads_writes_and_in_place_writes():
    """add reads two tensors and writes one; add_ reads two and writes its first in place; views,
    allocations and a custom op's insides move nothing (the op moves its arguments and all its
    outputs, a list of them included)."""
    import counters

    @torch.library.custom_op('bytetest::halves', mutates_args=())
    def halves(x: torch.Tensor) -> List[torch.Tensor]:
        return [x[:5] * 2, x[5:] * 2]
    a, b = torch.ones(10), torch.ones(10)
    with counters.ByteCounter() as counter:
        a + b
        a.add_(b)
        a.view(2, 5).t().unsqueeze_(0)
        torch.empty(1000)
        halves(a)
    assert counter.moved == {'aten.add.Tensor': 120, 'aten.add_.Tensor': 120, 'bytetest.halves.default': 80}
