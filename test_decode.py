"""
Decoding with a KV cache (GPT.generate, sample.py, bench.py --decode): for every method and backend
the cache changes the cost of generation, never its tokens or its logits.
"""
import contextlib

import pytest
import torch

import bench
import counters
import kernels
import sample
import train
from conftest import BACKENDS, KERNEL_DEVICE, METHODS, TINY_TRAIN, VARIANTS, on_paths, exit_message, randomize_routing, tiny_model
from model import KVCache
from residuals import RESIDUALS


def decoding_model(residual, backend, dtype=torch.float64, **overrides):
    """A tiny model with random routing (no zero init hides a term), in eval mode on backend."""
    model = tiny_model(residual, n_layer=4, **{'block_size': 16, **overrides})
    randomize_routing(model)
    model.to(dtype).eval().set_kernels(backend)
    return model


def tokens_run(model):
    """A list that a forward pre-hook fills with the number of positions of each forward."""
    counts = []
    model.transformer.wte.register_forward_pre_hook(lambda module, args: counts.append(args[0].size(1)))
    return counts


# the Triton kernels through the interpreter, which runs every program in Python: each method at its
# defaults (its knobs' values: on the other backends, and the kernels' own tests), in a window of 8
GREEDY_CASES = [p for p in on_paths(VARIANTS) if p.values[2] != 'triton' or not p.values[1]]


@pytest.mark.parametrize('residual,knobs,backend', GREEDY_CASES)
def test_cached_greedy_decoding_gives_the_uncached_tokens(residual, knobs, backend):
    """Greedy decoding of two prompts, in float64, well past block_size (the window jumps twice): the
    same tokens with the cache as without, and the cached path runs each new token alone (the prompt
    once, then one position a forward, and the kept half of the window again at each jump)."""
    window, prompt_length, new = (8, 3, 12) if backend == 'triton' else (16, 5, 30)
    model = decoding_model(residual, backend, block_size=window, **knobs)
    prompt = torch.randint(27, (2, prompt_length), generator=torch.Generator().manual_seed(0))
    counts = tokens_run(model)
    cached = model.generate(prompt, new, top_k=1, kv_cache=True)
    ran_cached, counts[:] = list(counts), []
    uncached = model.generate(prompt, new, top_k=1, kv_cache=False)
    assert torch.equal(cached, uncached)
    # by the tokens in hand at each step: one more than the window makes it jump to the last half (a
    # prefill of window / 2), which fills it again window / 2 tokens later: jumps every window / 2 + 1
    lengths = range(prompt_length + 1, prompt_length + new)
    jump = lambda n: n > window and (n - window - 1) % (window // 2 + 1) == 0
    assert ran_cached == [prompt_length] + [window // 2 if jump(n) else 1 for n in lengths]
    assert sum(map(jump, lengths)) == 2
    assert max(counts) == window and sum(counts) > 2 * sum(ran_cached)  # uncached: the whole window each time


@pytest.mark.parametrize('residual,knobs,backend', on_paths(VARIANTS[:len(METHODS)]))  # (their defaults)
def test_cached_logits_equal_the_full_forward(residual, knobs, backend):
    """In float32, a batch of two: a prompt of 5 positions, a chunk of 3 (the queries see the cached
    positions and the chunk's own earlier ones), then one position a forward to block_size: the last
    position's logits equal those of the whole sequence so far run without a cache, within float32's
    own rounding of that forward (both against the same model in float64: the cache's error is at
    most 4x the uncached forward's, the worst step of each, and far from an error of substance)."""
    model = decoding_model(residual, backend, dtype=torch.float32)
    exact = decoding_model(residual, backend, dtype=torch.float64)  # the same weights (the same seeds)
    seq = torch.randint(27, (2, 16), generator=torch.Generator().manual_seed(1))
    cache, ends = KVCache(model.config), [5, 8, *range(9, 17 if backend != 'triton' else 11)]
    cached_error = uncached_error = 0.0
    with torch.no_grad():
        for begin, end in zip([0, *ends], ends):
            got, _ = model(seq[:, begin:end], cache=cache)
            uncached, _ = model(seq[:, :end])
            truth, _ = exact(seq[:, :end])
            scale = truth.abs().max().item()
            cached_error = max(cached_error, (got.double() - truth).abs().max().item() / scale)
            uncached_error = max(uncached_error, (uncached.double() - truth).abs().max().item() / scale)
    assert cache.length == ends[-1]
    assert cached_error <= 4 * uncached_error and cached_error < 1e-4, (cached_error, uncached_error)


def test_a_cache_with_the_wrong_positions_would_be_seen():
    """The equality above depends on the cached positions: a cache one position behind (the new
    token takes the last prompt token's place) gives other logits (the test can fail)."""
    model = decoding_model('prenorm', 'reference', dtype=torch.float32)
    seq = torch.randint(27, (1, 8), generator=torch.Generator().manual_seed(2))
    cache = KVCache(model.config)
    with torch.no_grad():
        model(seq[:, :5], cache=cache)
        cache.length -= 1
        got, _ = model(seq[:, 5:6], cache=cache)
        want, _ = model(seq[:, :6])
    assert (got - want).abs().max() > 1e-3


def test_generate_refuses_what_it_cannot_decode():
    model = decoding_model('prenorm', 'torch', dtype=torch.float32)
    with pytest.raises(ValueError, match='the prompt has 17 tokens; it must have 1 to block_size=16'):
        model.generate(torch.zeros(1, 17, dtype=torch.long), 4)
    with pytest.raises(ValueError, match='max_new_tokens=0; generate at least 1 token'):
        model.generate(torch.zeros(1, 4, dtype=torch.long), 0)
    cache = KVCache(model.config)
    with torch.no_grad():
        model(torch.zeros(2, 4, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match=r'one KVCache serves one batch of one model'):
            model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match='sequence of length 17 is longer than block_size=16'):
            model(torch.zeros(2, 13, dtype=torch.long), cache=cache)


def test_sample_decodes_with_the_cache_and_prints_the_uncached_text(tmp_path, data_dir, capsys):
    """sample.py decodes with the cache by default; --kv_cache=False prints the same samples (past
    block_size = 32 too); bad input is one line."""
    train.main([f'--out_dir={tmp_path}', f'--data_dir={data_dir}', '--max_iters=20', '--eval_interval=20', *TINY_TRAIN])
    capsys.readouterr()
    args = [f'--out_dir={tmp_path}', '--start=The ', '--num_samples=2', '--max_new_tokens=80', '--seed=5']
    sample.main(args)
    cached = capsys.readouterr().out
    sample.main([*args, '--kv_cache=False'])
    assert capsys.readouterr().out == cached and len(cached) > 160
    assert 'max_new_tokens=0 is out of range' in exit_message(sample.main, [*args, '--max_new_tokens=0'])
    message = exit_message(sample.main, [*args, '--start=' + 'The ' * 9])
    assert 'the prompt is 36 tokens long and the model reads at most block_size=32' in message


def test_a_checkpoint_of_a_method_this_version_lacks_is_one_line(tmp_path, data_dir):
    """A checkpoint of a method (or a knob) that this checkout does not have, e.g. from a fork."""
    train.main([f'--out_dir={tmp_path}', f'--data_dir={data_dir}', '--max_iters=2', '--eval_interval=2', *TINY_TRAIN])
    ckpt = torch.load(tmp_path / 'ckpt.pt', weights_only=True)
    for change in ({'residual': 'forked_method'}, {'forked_knob': 3}):
        torch.save({**ckpt, 'model_args': {**ckpt['model_args'], **change}}, tmp_path / 'other.pt')
        message = exit_message(sample.main, [f'--out_dir={tmp_path}', '--ckpt_name=other.pt'])
        assert 'other.pt holds a model this version of model.py cannot build' in message
        assert next(iter(change)) in message and '\n' not in message


# The operators one decode step dispatches (one new token, forward only; compute, views) at 4 layers,
# as `python bench.py --decode=True --count_ops=True --config=ops` prints them: on a GPU each compute
# operator is a kernel launch, and a decode step of a small batch is its launches. Pinned as the
# training step's are (test_kernels.OPERATORS): a change that adds launches fails, and so does one
# that removes them until these and docs/PERFORMANCE.md's decode table (test_docs.py) are updated.
DECODE_OPERATORS = {
    'torch': {'prenorm': (72, 96), 'rezero': (72, 97), 'layerscale': (80, 97), 'laurel_rw': (88, 98),
              'laurel_lr': (112, 130), 'attnres': (212, 209), 'block_attnres': (188, 193), 'delta_attnres': (201, 189),
              'wav': (345, 252), 'hc': (157, 298), 'mhc': (491, 277), 'mhc_lite': (179, 262), 'kromhc': (182, 266),
              'frac': (155, 298), 'mgr': (201, 202), 'denseformer': (87, 133), 'mudd': (141, 146)},
    'triton': {'prenorm': (72, 96), 'rezero': (72, 97), 'layerscale': (80, 97), 'laurel_rw': (88, 98),
               'laurel_lr': (112, 130), 'attnres': (77, 97), 'block_attnres': (81, 97), 'delta_attnres': (93, 98),
               'wav': (87, 100), 'hc': (74, 114), 'mhc': (93, 133), 'mhc_lite': (95, 133), 'kromhc': (96, 137),
               'frac': (73, 114), 'mgr': (76, 99), 'denseformer': (87, 133), 'mudd': (141, 151)},
}


@pytest.mark.parametrize('backend', ['torch', pytest.param('triton', marks=BACKENDS[2].marks)])
def test_operators_per_decode_step_are_pinned(backend):
    """Counted exactly (no timing) on a 4-layer model decoding its 8th position; within 2% for other
    PyTorch versions' decompositions."""
    shape = dict(n_layer=4, n_embd=32, n_head=2, block_size=8)
    cfg = dict(seed=0, vocab_size=96, mgr_fallback_p=1)
    results = counters.decode_counts(METHODS, shape, 1, KERNEL_DEVICE, contextlib.nullcontext(), backend, cfg)
    counted = {r['method']: (r['compute'], r['views']) for r in results}
    off = {m: (counted[m], want) for m, want in DECODE_OPERATORS[backend].items()
           if any(abs(c - w) > max(2, 0.02 * w) for c, w in zip(counted[m], want))}
    assert not off, f"(counted, pinned) operators per decode step changed: {off}"
    unpinned = sorted(m for m in METHODS if RESIDUALS[m] in kernels.FAST and m not in DECODE_OPERATORS[backend])
    assert not unpinned, f"methods with a fast twin and no pinned decode operators: {unpinned} (counted: {counted})"


@pytest.mark.parametrize('backend', ['torch', pytest.param('triton', marks=BACKENDS[2].marks)])
def test_bench_decode_measures_every_method(backend):
    """bench.py --decode at a tiny shape: every figure is there, the cache is the same for every
    method, and the decode step's working memory and operators are counted."""
    shape = dict(n_layer=2, n_embd=32, n_head=2, block_size=8)
    cfg = dict(seed=0, vocab_size=27, mgr_fallback_p=1, steps=1, warmup=0)
    results = bench.decode_costs(METHODS, shape, 2, KERNEL_DEVICE, contextlib.nullcontext(), backend, cfg)
    assert [r['method'] for r in results] == METHODS
    for r in results:
        assert r['prefill_ms'] > 0 and r['step_ms'] > 0 and r['uncached_ms'] > 0 and r['compute'] > 0
        assert r['cache_bytes_per_token'] == 2 * 2 * 32 * 4  # keys and values of 2 layers, float32
        assert 32 * 4 <= r['step_bytes'] < 1e5  # at least the token's vector, and no batch-sized copy of anything


def test_peak_memory_counts_what_is_alive_at_once():
    """Two new tensors alive together count together; a freed one is counted out; views, in-place
    writes and what existed before count nothing."""
    before = torch.ones(1000)
    with counters.PeakMemory() as memory:
        a = before * 2  # 4000 bytes
        b = a + 1  # 8000 alive
        del a, b
        c = before.view(10, 100).t()  # a view: nothing
        c.add_(1)  # in place: nothing
        d = before[:500] * 3  # 2000
    assert memory.peak == 8000 and memory.now == 2000 and d.numel() == 500
