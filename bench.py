"""
Cost of every residual method against prenorm: the time of a training step, or of decoding.

    python bench.py                                  # default config, every registered method
    python bench.py --config=deep --methods=prenorm,block_attnres,wav --steps=5
    python bench.py --compile=True --json_path=bench.json
    python bench.py --config=deep --compile=True --compile_scope=sublayers   # regional: seconds to compile
    python bench.py --methods=mgr --mgr_fallback_p=-1   # MGR without the inverting backward
    python bench.py --methods=mgr,hc --mgr_streams=8 --hc_streams=8   # any method's knob (GPTConfig's fields)
    python bench.py --config=gpt2 --kernels=triton      # on a GPU: GPT-2 small's shape, bf16
    python bench.py --count_ops=True                    # operators per training step, exact, no timing
    TRITON_INTERPRET=1 python bench.py --count_ops=True --kernels=triton --config=ops_deep  # on a CPU
    TRITON_INTERPRET=1 python bench.py --count_bytes=True --kernels=triton --config=gpt2    # bytes moved per step

Each method runs in a process of its own beside its own prenorm (--isolate=False: all in one
process): models that share a process slow each other down through the memory allocator, on a
CPU by up to 1.2x, and by how much depends on which methods share it. Within a process the steps
are interleaved (step 1 of every model, then step 2, ...) so that machine noise hits them alike.
Reports the median train-step time (forward + backward + AdamW step), tokens/s,
the ratio to prenorm, parameters, the bytes that autograd saves for backward (activation memory,
counted once per storage, parameters excluded; device-independent) and, on CUDA, peak memory.
With --compile=True, the first step of each method (compilation included) is timed apart.

--count_ops=True and --count_bytes=True time nothing: they count, exactly and on any device, the
operators that one training step's forward and backward dispatch, or the bytes those move
(counters.py says what counts). --count_ops reports each method's extra compute operators per
sublayer over prenorm's and its views as a multiple of prenorm's; --count_bytes its bytes per step,
x prenorm's, the routing's extra per sublayer and the operators that add the most over prenorm's, in
bfloat16 autocast as on a GPU unless --dtype says otherwise. With the Triton kernels on a CPU, set
TRITON_INTERPRET=1 (the counts are the same as on a GPU; the 16-token shapes 'ops' and 'ops_deep'
keep the interpreter quick).

--decode=True times generation with the KV cache instead of training (GPT.generate's path): a prompt
of half the config's block_size, then the other half one token at a time, the same tokens for every
method. Per method: the prompt's prefill, the median new token's step, and the same token without the
cache (the whole context run again, at a few positions), each x prenorm's; the cache's bytes per token
(the same for every method: only attention looks across positions); the decode step's working memory
(the most bytes of new tensors alive at once, beside the cache and the weights: what the routing keeps
per token while it runs, as every method routes each token alone) and its operators.
--count_ops=True with --decode=True counts one decode step's operators only (exact, no timing).

gpu_suite.py is the prepared run of these benchmarks on a lent GPU.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import configurator
from counters import bytes_moved, decode_counts, model_config, operator_counts, report_bytes, report_ops, saved_bytes
import kernels as kernels_module
from kernels import resolve as resolve_kernels
from model import COMPILE_MODES, COMPILE_SCOPES, GPT, KVCache, method_knobs
from residuals import RESIDUALS

CONFIGS = {
    'default': dict(n_layer=12, n_embd=384, n_head=6, block_size=256, batch_size=4),
    'deep': dict(n_layer=48, n_embd=128, n_head=2, block_size=256, batch_size=4),
    # the papers' GPU shapes: GPT-2 small (12 x 768, context 1024), and 48 layers of it
    'gpt2': dict(n_layer=12, n_embd=768, n_head=12, block_size=1024, batch_size=8),
    'gpt2_deep': dict(n_layer=48, n_embd=768, n_head=12, block_size=1024, batch_size=4),
    'tiny': dict(n_layer=2, n_embd=32, n_head=2, block_size=16, batch_size=1),  # does it all run? (16 tokens)
    # the CPU study's shape (config/cpu_methods.py), for sweep.py's equal-time columns:
    #   python bench.py --config=cpu_methods --json_path=results/cpu_methods/bench.json
    'cpu_methods': dict(n_layer=6, n_embd=96, n_head=4, block_size=128, batch_size=16),
    # the depth study's shape (config/cpu_depth.py), one file per depth:
    #   python bench.py --config=cpu_depth --n_layer=48 --json_path=results/cpu_depth/bench.cpu_depth-n_layer48.json
    'cpu_depth': dict(n_layer=12, n_embd=64, n_head=4, block_size=128, batch_size=16),
    # for --count_ops (the counts do not depend on the token count): 4 and 12 layers of width 64
    'ops': dict(n_layer=4, n_embd=64, n_head=2, block_size=16, batch_size=1),
    'ops_deep': dict(n_layer=12, n_embd=64, n_head=2, block_size=16, batch_size=1),
}

config = 'default'  # a key of CONFIGS
n_layer = 0  # the config's depth where 0, else this many layers (--config=cpu_depth --n_layer=48)
methods = ','.join(RESIDUALS)  # comma-separated; prenorm is always measured, as the reference
vocab_size = 96  # a character vocabulary
steps = 4  # timed steps per method (the median is reported)
warmup = 1  # untimed steps per method first (compilation happens here: raise it with --compile)
device = 'auto'
dtype = 'auto'
compile = False
compile_scope = 'model'  # model: one graph, the routing included; sublayers: each attention and MLP compiled once
compile_mode = 'default'  # torch.compile's mode: default, reduce-overhead (CUDA graphs) or max-autotune
kernels = 'auto'  # how the routing runs (kernels/): reference, torch, triton; auto = triton on CUDA, else torch
mgr_fallback_p = kernels_module.MGR_FALLBACK_P  # MGR's fast backward keeps p originals per token; -1 = no inversion
seed = 0
json_path = ''  # write the results here too
isolate = True  # each method in its own process beside its own prenorm
count_ops = False  # count the operators of one training step instead of timing (exact; see above)
count_bytes = False  # count the bytes one training step moves instead of timing (exact; see above)
decode = False  # time generation with the KV cache instead of training steps (see above)
profile = False  # on CUDA, also the GPU's busy time per step (kernel time from the profiler, 2 more steps)


def main(argv):
    cfg, _ = configurator.parse(argv, {**configurator.keys_of(globals()), **method_knobs()}, __doc__)
    configurator.check(cfg, {'steps': (lambda v: v >= 1, 'at least 1'), 'warmup': (lambda v: v >= 0, 'at least 0'),
                             'vocab_size': (lambda v: v >= 2, 'at least 2'),
                             'n_layer': (lambda v: v >= 0, "at least 1, or 0 for the config's depth"),
                             'compile_scope': (lambda v: v in COMPILE_SCOPES, ' or '.join(COMPILE_SCOPES)),
                             'compile_mode': (lambda v: v in COMPILE_MODES, ' or '.join(COMPILE_MODES)),
                             'mgr_fallback_p': kernels_module.MGR_FALLBACK_P_RULE})
    names = ['prenorm'] + [m for m in cfg['methods'].split(',') if m and m != 'prenorm']
    unknown = [m for m in names if m not in RESIDUALS]
    if unknown:
        sys.exit(f"error: unknown methods {unknown}; choose from: {', '.join(RESIDUALS)}")
    if cfg['config'] not in CONFIGS:
        sys.exit(f"error: config={cfg['config']!r}; choose one of: {', '.join(CONFIGS)}")
    shape = dict(CONFIGS[cfg['config']], **({'n_layer': cfg['n_layer']} if cfg['n_layer'] else {}))
    B, T = shape.pop('batch_size'), shape['block_size']
    try:
        for name in names:  # every method's knobs checked (GPTConfig) before anything runs
            model_config(name, shape, cfg)
        dev = configurator.resolve_device(cfg['device'])
        dtype = 'bfloat16' if cfg['count_bytes'] and cfg['dtype'] == 'auto' else cfg['dtype']  # as on a GPU
        dtype_name, ctx = configurator.precision(dev, dtype)
        backend = resolve_kernels(cfg['kernels'], dev.type)
    except ValueError as e:
        sys.exit(f"error: {e}")
    gen = torch.Generator().manual_seed(cfg['seed'])
    x = torch.randint(cfg['vocab_size'], (B, T), generator=gen).to(dev)
    y = torch.randint(cfg['vocab_size'], (B, T), generator=gen).to(dev)
    knobs = ''.join(f" --{k}={cfg[k]}" for k, v in method_knobs().items() if cfg[k] != v)
    print(f"bench: {cfg['config']} {shape}{knobs}, batch {B}, on {dev} {dtype_name}, compile={cfg['compile']} "
          f"({cfg['compile_scope']}, {cfg['compile_mode']}), "
          f"kernels={backend}, mgr_fallback_p={cfg['mgr_fallback_p']}, "
          + ("counting operators" if cfg['count_ops'] else "counting bytes" if cfg['count_bytes'] else
             f"{cfg['warmup']} warm-up + {cfg['steps']} timed steps each, {torch.get_num_threads()} threads"))

    if cfg['decode']:
        results = (decode_counts if cfg['count_ops'] else decode_costs)(names, shape, B, dev, ctx, backend, cfg)
        report_decode(results, cfg, shape, B, dev, dtype_name, backend)
        return results
    if cfg['count_ops']:
        results = [operator_counts(name, shape, B, x, y, dev, ctx, backend, cfg) for name in names]
        report_ops(results, cfg, shape, backend)
        return results
    if cfg['count_bytes']:
        results = [bytes_moved(name, shape, B, dev, ctx, backend, cfg) for name in names]
        report_bytes(results, cfg, shape, B, backend, dtype_name)
        return results
    if cfg['isolate'] and len(names) > 2:
        results = isolated(argv, names[1:])
    else:
        results = measure(cfg, names, shape, B, x, y, dev, ctx, backend)
    report(results, cfg, shape, B, dev, dtype_name)
    return results


# ----------------------------------------------------------------------------- decoding

def decode_costs(names, shape, B, dev, ctx, backend, cfg):
    """Per method: the prompt's prefill, a new token's step with the cache and without it, in ms
    (medians; see time_decoding), and the cache's bytes, beside one decode step's working memory and
    operators (counters.decode_counts)."""
    counts = decode_counts(names, shape, B, dev, ctx, backend, cfg)
    T, gen = shape['block_size'], torch.Generator().manual_seed(cfg['seed'])
    tokens = torch.randint(cfg['vocab_size'], (B, T), generator=gen).to(dev)  # prompt, then teacher-forced tokens
    runs = {}
    for name in names:
        torch.manual_seed(cfg['seed'])
        model = GPT(model_config(name, shape, cfg)).to(dev).eval()
        model.set_kernels(backend, cfg['mgr_fallback_p'])
        runs[name] = dict(model=model, prefill=[], step=[], uncached=[])
    with torch.no_grad(), ctx:
        time_decoding(runs, tokens, dev, cfg)
    base = statistics.median(runs[names[0]]['step'])
    return [dict(r, prefill_ms=statistics.median(run['prefill']), step_ms=statistics.median(run['step']),
                 uncached_ms=statistics.median(run['uncached']), cache_bytes_per_token=run['cache_bytes'] / (B * T),
                 ratio=statistics.median(run['step']) / base)  # as gpu_suite.py's table reads it
            for r, run in zip(counts, runs.values())]


def time_decoding(runs, tokens, dev, cfg, positions=8):
    """--warmup and --steps rounds of: every method's prefill of the first half of tokens, then its
    steps over the second half with the cache, then (at `positions` of them) without it, in ms into
    each run's lists; the methods take turns at every call, so that machine noise hits them alike."""
    T = tokens.size(1)
    P, sync = T // 2, torch.cuda.synchronize if dev.type == 'cuda' else (lambda: None)

    def timed(fn):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return (time.perf_counter() - t0) * 1e3
    for k in range(cfg['warmup'] + cfg['steps']):
        keep = k >= cfg['warmup']
        caches = {name: KVCache(run['model'].config) for name, run in runs.items()}
        for name, run in runs.items():
            run['prefill'] += [timed(lambda: run['model'](tokens[:, :P], cache=caches[name]))] * keep
        for t in range(P, T):
            for name, run in runs.items():
                run['step'] += [timed(lambda: run['model'](tokens[:, t:t + 1], cache=caches[name]))] * keep
        for t in sorted(set(range(P, T, max(1, (T - P) // positions)))):
            for run in runs.values():
                run['uncached'] += [timed(lambda: run['model'](tokens[:, :t + 1]))] * keep
        for name, run in runs.items():
            run['cache_bytes'] = caches[name].nbytes()
        print(f"  round {k + 1}/{cfg['warmup'] + cfg['steps']} done", file=sys.stderr)


def report_decode(results, cfg, shape, B, dev, dtype_name, backend):
    """The decode table: each figure and its ratio to prenorm's (the first row)."""
    base, T = results[0], shape['block_size']
    timed = 'step_ms' in base
    print(f"\ndecoding, kernels={backend}, {dtype_name}, batch {B}: a prompt of {T // 2} tokens, then "
          f"{T - T // 2} tokens one at a time with the KV cache")
    head = (f"{'prefill ms':>11} {'x':>5} {'token ms':>9} {'x':>5} {'no cache':>9} {'speedup':>8} {'cache KB/tok':>13} "
            if timed else '')
    print(f"{'method':<14} {head}{'step KB/seq':>12} {'x':>5} {'ops/token':>10} {'x':>5}")
    for r in results:
        cells = (f"{r['prefill_ms']:>11.2f} {r['prefill_ms'] / base['prefill_ms']:>5.2f} {r['step_ms']:>9.3f} "
                 f"{r['step_ms'] / base['step_ms']:>5.2f} {r['uncached_ms']:>9.3f} {r['uncached_ms'] / r['step_ms']:>8.1f} "
                 f"{r['cache_bytes_per_token'] / 1024:>13.2f} " if timed else '')
        print(f"{r['method']:<14} {cells}{r['step_bytes'] / 1024:>12.1f} {r['step_bytes'] / base['step_bytes']:>5.2f} "
              f"{r['compute']:>10} {r['compute'] / base['compute']:>5.2f}")
    if timed:
        print("prefill: the prompt in one forward; token: one new token with the cache (median); no cache: the same "
              "token with its whole context run again; step KB/seq: the decode step's working memory per sequence")
    if cfg['json_path']:
        with open(cfg['json_path'], 'w') as f:
            json.dump({'config': cfg, 'shape': shape, 'batch_size': B, 'device': str(dev), 'dtype': dtype_name,
                       'kernels': backend, 'torch': torch.__version__, 'results': results}, f, indent=1)


def isolated(argv, methods):
    """Each method beside its own prenorm in a fresh process; the prenorm row is the median of theirs."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, name in enumerate(methods):
            print(f"  {name} ({k + 1}/{len(methods)}) in a process of its own", file=sys.stderr)
            path = os.path.join(tmp, f'{name}.json')
            subprocess.run([sys.executable, os.path.abspath(__file__), *argv, f'--methods={name}', '--isolate=False',
                            f'--json_path={path}'], check=True, stdout=subprocess.DEVNULL)
            with open(path) as f:
                base, result = json.load(f)['results']
            results.append((base, result))
    bases = [base for base, _ in results]
    middle = sorted(bases, key=lambda r: r['step_ms'])[len(bases) // 2]
    return [{**middle, 'step_ms_each': [r['step_ms'] for r in bases]}] + [r for _, r in results]


def measure(cfg, names, shape, B, x, y, dev, ctx, backend):
    """The models of `names` in this process, their steps interleaved."""
    T = shape['block_size']
    runs = {}
    for name in names:
        torch.manual_seed(cfg['seed'])
        model = GPT(model_config(name, shape, cfg)).to(dev)
        model.set_kernels(backend, cfg['mgr_fallback_p'])
        with ctx:
            saved = saved_bytes(model, x, y)
        optimizer = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), dev.type)
        step_model = model.compiled(cfg['compile_scope'], cfg['compile_mode']) if cfg['compile'] else model
        runs[name] = dict(model=model, step=step_model, optimizer=optimizer, times=[], saved=saved, first=None)

    def train_step(run):
        if dev.type == 'cuda':
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with ctx:
            _, loss = run['step'](x, y)
        loss.backward()
        run['optimizer'].step()
        run['optimizer'].zero_grad(set_to_none=True)
        if dev.type == 'cuda':
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for i in range(cfg['warmup'] + cfg['steps']):
        for name, run in runs.items():  # interleaved
            if dev.type == 'cuda' and i == cfg['warmup']:
                torch.cuda.reset_peak_memory_stats()
            dt = train_step(run)
            if i == 0:
                run['first'] = dt  # with --compile: compilation and the first step
            if i >= cfg['warmup']:
                run['times'].append(dt)
        print(f"  round {i + 1}/{cfg['warmup'] + cfg['steps']} done", file=sys.stderr)

    for run in runs.values():  # the GPU's own time per step: kernel time, without the host's launch gaps
        run['busy'] = gpu_busy_ms(lambda: train_step(run)) if cfg['profile'] and dev.type == 'cuda' else None

    results = []
    base = statistics.median(runs['prenorm']['times'])
    base_saved = runs['prenorm']['saved']
    for name, run in runs.items():
        median = statistics.median(run['times'])
        results.append(dict(method=name, step_ms=median * 1e3, tokens_per_s=B * T / median,
                            ratio=median / base, params=run['model'].get_num_params(),
                            saved_mb=run['saved'] / 2**20, saved_ratio=run['saved'] / base_saved,
                            first_step_s=run['first'], gpu_busy_ms=run['busy'],
                            peak_gib=torch.cuda.max_memory_allocated() / 2**30 if dev.type == 'cuda' else 0.0))
    return results


def gpu_busy_ms(step, steps=2):
    """The time the GPU spends in kernels per step, from the profiler (ms)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
    return sum(e.self_device_time_total for e in prof.key_averages()) / steps / 1e3


def report(results, cfg, shape, B, dev, dtype_name):
    first = f" {'compile s':>10}" if cfg['compile'] else ''
    print(f"\n{'method':<14} {'step ms':>9} {'tokens/s':>10} {'x prenorm':>10} {'params':>11} "
          f"{'saved MB':>9} {'x prenorm':>10}" + first)
    for r in results:
        print(f"{r['method']:<14} {r['step_ms']:>9.1f} {r['tokens_per_s']:>10,.0f} {r['ratio']:>10.2f} "
              f"{r['params']:>11,} {r['saved_mb']:>9.1f} {r['saved_ratio']:>10.2f}" +
              (f" {r['first_step_s']:>10.1f}" if cfg['compile'] else ''))
    if cfg['compile']:
        print(f"compile s: the first step, compilation included; {sum(r['first_step_s'] for r in results):.0f} s in all")
    if results[0].get('gpu_busy_ms') is not None:
        base = results[0]['gpu_busy_ms']
        print('GPU busy ms per step (x prenorm): ' + ', '.join(f"{r['method']} {r['gpu_busy_ms']:.1f} "
                                                             f"({r['gpu_busy_ms'] / base:.2f})" for r in results))
    if 'step_ms_each' in results[0]:
        print(f"prenorm beside each method: {min(results[0]['step_ms_each']):.1f} to "
              f"{max(results[0]['step_ms_each']):.1f} ms a step (its row: the median)")
    if dev.type == 'cuda':
        print(f"peak CUDA memory of a process: {max(r['peak_gib'] for r in results):.2f} GiB")
    if cfg['json_path']:
        with open(cfg['json_path'], 'w') as f:
            json.dump({'config': cfg, 'shape': shape, 'batch_size': B, 'device': str(dev), 'dtype': dtype_name,
                       'results': results}, f, indent=1)


if __name__ == '__main__':
    main(sys.argv[1:])
