"""
The prepared run for a lent GPU, at most about 10 minutes: the kernels' tests on CUDA, then bench.py at
GPT-2 small's shape (bfloat16) with the Triton kernels: every method eager, Block AttnRes and WAV
compiled (default mode, and reduce-overhead: CUDA graphs), each with the profiler's GPU-busy time
beside the wall time; and decoding with the KV cache, every method (a new token's time). Writes
suite.json and suite.md (the table for docs/PERFORMANCE.md, with the hardware and the versions) into
out_dir.

    python gpu_suite.py --out_dir=$OUT              # on the GPU machine
    python gpu_suite.py --dry_run=True              # the same steps, tiny, on a CPU (a test runs it)

Each part is a child process with a time limit; a part that does not finish is written as such.
"""
import json
import os
import subprocess
import sys
import time

import torch

import configurator
import kernels

out_dir = 'out-gpu-suite'
budget_s = 570  # the suite's wall-time budget: what does not fit is reported as not run
dry_run = False  # the tiny config on this machine (Triton through its interpreter), few methods and tests, no compiling

# The suite's benchmarks: (label, bench arguments, methods (None: all), seconds at most): every method
# eager; Block AttnRes and WAV (the paper's pair) compiled, in torch.compile's default mode and with
# CUDA graphs (compiling a whole GPT-2-sized model takes tens of seconds per method).
RUNS = [('eager', [], None, 120),
        ('decode', ['--decode=True', '--steps=2'], None, 90),
        ('compiled', ['--compile=True', '--warmup=2'], 'block_attnres,wav', 160),
        ('reduce-overhead', ['--compile=True', '--compile_mode=reduce-overhead', '--warmup=3'], 'block_attnres,wav', 160)]
TESTS_S = 120  # the kernels' tests, seconds at most


def run_suite(cfg):
    """The kernels' tests, then each of RUNS, every part in a child process within the budget ->
    the suite's results, also written to out_dir as suite.json and suite.md."""
    dry, cuda = cfg['dry_run'], torch.cuda.is_available()
    if not cuda and not dry:
        sys.exit("error: gpu_suite.py needs a CUDA GPU; --dry_run=True runs the same steps, tiny, on this machine")
    os.makedirs(cfg['out_dir'], exist_ok=True)
    env = {**os.environ, **({} if cuda else {'TRITON_INTERPRET': '1'})}
    here = os.path.dirname(os.path.abspath(__file__))
    start = time.time()

    def child(args, limit):  # a dry run has no time limits: it checks that everything runs, on any machine
        limit = None if dry else min(limit, cfg['budget_s'] - (time.time() - start))
        if limit is not None and limit < 10:
            return None, 'not run: out of time'
        try:
            done = subprocess.run(args, cwd=here, env=env, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            return None, f'stopped after {limit:.0f} s'
        lines = (done.stdout + done.stderr).strip().splitlines()
        return done, lines[-1] if lines else ''

    suite = {'device': torch.cuda.get_device_name() if cuda else 'CPU (dry run)', 'torch': torch.__version__,
             'triton': getattr(kernels.triton, '__version__', None), 'date': time.strftime('%Y-%m-%d'),
             'config': 'tiny' if dry else 'gpt2', 'runs': {}}
    tests = sorted(name for name in os.listdir(here) if name.startswith('test_kernels') and name.endswith('.py'))
    tests += ['-k', 'float64 and block_attnres'] if dry else []
    print(f"suite: the kernels' tests{' (a few)' if dry else ''} on {'CUDA' if cuda else 'the CPU'}", file=sys.stderr)
    _, suite['tests'] = child([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', *tests], TESTS_S)
    for label, extra, methods, limit in RUNS:
        if dry and '--compile=True' in extra:
            suite['runs'][label] = {'status': 'not run: no compiling in a dry run'}
            continue
        methods = 'block_attnres,mgr' if dry else methods
        path = os.path.join(os.path.abspath(cfg['out_dir']), f'{label}.json')
        print(f"suite: bench {label}, {methods or 'every method'}", file=sys.stderr)
        done, status = child([sys.executable, os.path.join(here, 'bench.py'), f"--config={suite['config']}",
                              '--kernels=triton', '--profile=True', '--isolate=False', f'--json_path={path}', *extra]
                             + ([f'--methods={methods}'] if methods else []) + (['--steps=1', '--warmup=0'] if dry else []),
                             limit)
        if done is not None and done.returncode == 0:
            with open(path) as f:
                suite['runs'][label] = {'status': 'done', **json.load(f)}
        else:
            suite['runs'][label] = {'status': status if done is None else f'failed: {status}'}
    with open(os.path.join(cfg['out_dir'], 'suite.json'), 'w') as f:
        json.dump(suite, f, indent=1)
    table = suite_table(suite)
    with open(os.path.join(cfg['out_dir'], 'suite.md'), 'w') as f:
        f.write(table)
    print(table)
    return suite


def suite_table(suite):
    """The suite's markdown: every method's step and GPU-busy time x prenorm's, per run."""
    runs = suite['runs']
    head = (f"On {suite['device']}, torch {suite['torch']}, triton {suite['triton']}, {suite['date']}; "
            f"config {suite['config']}, Triton kernels. Kernel tests: {suite['tests']}.\n"
            + ''.join(f"{label}: {r['status']}.\n" for label, r in runs.items() if r['status'] != 'done') + '\n')
    done = {label: {r['method']: r for r in run['results']} for label, run in runs.items() if run['status'] == 'done'}
    if not done:
        return head
    cols = ''.join(f" | {label}: step ms | x prenorm | GPU busy x prenorm" for label in done)
    lines = [f"| method{cols} |", '|---' + '|---:' * 3 * len(done) + '|']
    methods = list(dict.fromkeys(m for rows in done.values() for m in rows))
    for m in methods:
        cells = ''
        for rows in done.values():
            r, base = rows.get(m), rows['prenorm']
            busy = (f"{r['gpu_busy_ms'] / base['gpu_busy_ms']:.2f}" if r and r.get('gpu_busy_ms') and base.get('gpu_busy_ms')
                    else '')
            cells += f" | {r['step_ms']:.1f} | {r['ratio']:.2f} | {busy}" if r else ' | | |'
        lines.append(f"| {m}{cells} |")
    return head + '\n'.join(lines) + '\n'


def main(argv):
    cfg, _ = configurator.parse(argv, configurator.keys_of(globals()), __doc__)
    return run_suite(cfg)


if __name__ == '__main__':
    main(sys.argv[1:])
