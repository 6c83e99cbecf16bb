"""
Run a grid of experiments with several seeds, and aggregate their results.

    python sweep.py cpu_trend --jobs=2          # run (skips finished runs, resumes interrupted ones)
    python sweep.py char --print                # the commands, one per line, for a cluster scheduler
    python sweep.py cpu_trend --report          # runs/cpu_trend/results.md and results.png

A grid is base configs x variants x seeds; each run is `train.py CONFIG... VARIANT... --seed=S
--out_dir=runs/GRID/NAME`. The report reads every run's log.jsonl: final val loss mean +- std
over seeds, bpc, perplexity change against block_attnres on the same base config, and whether
each difference exceeds the seed-to-seed spread; plus validation-loss curves (matplotlib,
optional).
"""
import json
import math
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from residuals import RESIDUALS

ROOT = os.path.dirname(os.path.abspath(__file__))
CHAR_METHODS = ['prenorm', 'rezero', 'layerscale', 'block_attnres', 'wav']
FINEWEB_VARIANTS = [['--residual=prenorm'], ['--residual=mhc_lite'], ['--residual=block_attnres'],
                    ['--residual=attnres']] + [['--residual=mgr', f'--mgr_gate={gate}', f'--mgr_streams={n}']
                                               for n in (4, 8) for gate in ('independent', 'competitive')]
GRIDS = {
    # the CPU-scale depth trend: 4/8/16 layers, width 64, 1.5M characters of text8 per run; about
    # 50 minutes with --jobs=2 on 2 cores (add '--residual=mgr' to the variants for 25 more).
    # Deepest first: the long runs start early and the short ones fill in, so both jobs end together.
    'cpu_trend': dict(configs=[['config/cpu_text8.py', f'--n_layer={n}'] for n in (16, 8, 4)],
                      variants=[[f'--residual={r}'] for r in ('prenorm', 'block_attnres', 'wav')],
                      seeds=[0, 1, 2]),
    # the learning rate of cpu_methods: prenorm and block_attnres at four rates, one seed
    'cpu_lr': dict(configs=[['config/cpu_methods.py']],
                   variants=[[f'--residual={r}', f'--learning_rate={lr}', f'--min_lr={lr / 10:g}']
                             for lr in (3e-3, 6e-3, 1e-2, 2e-2) for r in ('prenorm', 'block_attnres')],
                   seeds=[0]),
    # every registered method at one CPU config, three seeds (about 2 hours with --jobs=2 on 2 cores)
    'cpu_methods': dict(configs=[['config/cpu_methods.py']],
                        variants=[[f'--residual={r}'] for r in RESIDUALS], seeds=[0, 1, 2]),
    # the WAV paper's character-level grid
    'char': dict(configs=[[f'config/{ds}_{n}l.py'] for ds in ('text8', 'tinystories') for n in (12, 24, 48)],
                 variants=[[f'--residual={r}'] for r in CHAR_METHODS], seeds=[0, 1, 2]),
    # the MGR paper's small FineWeb grid
    'fineweb': dict(configs=[[f'config/fineweb_{size}.py'] for size in 'SML'], variants=FINEWEB_VARIANTS,
                    seeds=[0]),
}
REFERENCE = 'block_attnres'  # the papers report changes against it


def arg_name(arg):
    """A short, file-safe name for one argument: config/x.py -> x, --n_layer=4 -> n_layer4."""
    if not arg.startswith('--'):
        return os.path.splitext(os.path.basename(arg))[0]
    key, _, value = arg[2:].partition('=')
    return value if key == 'residual' else f'{key}{value}'


def runs_of(grid, runs_dir):
    spec = GRIDS[grid]
    for config in spec['configs']:
        for variant in spec['variants']:
            for seed in spec['seeds']:
                group, method = '-'.join(map(arg_name, config)), '-'.join(map(arg_name, variant))
                out_dir = os.path.join(runs_dir, grid, f'{group}-{method}-seed{seed}')
                yield dict(group=group, method=method, seed=seed, out_dir=out_dir,
                           args=[*config, *variant, f'--seed={seed}', f'--out_dir={out_dir}'])


def read_log(out_dir):
    path = os.path.join(out_dir, 'log.jsonl')
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def state(run):
    """'done', 'interrupted' (a checkpoint to resume) or 'new'."""
    log = read_log(run['out_dir'])
    events = [r.get('event') for r in log if 'event' in r]
    if events and events[-1] == 'done':
        return 'done'
    return 'interrupted' if os.path.exists(os.path.join(run['out_dir'], 'ckpt.pt')) else 'new'


def command(run):
    resume = ['--init_from=resume'] if state(run) == 'interrupted' else []
    return [sys.executable, os.path.join(ROOT, 'train.py'), *run['args'], *resume]


def execute(runs, jobs):
    """Run sequentially, or `jobs` at a time with the cores shared among them (at small widths
    two single-threaded runs do more work than one run on two threads)."""
    todo = [run for run in runs if state(run) != 'done']
    print(f"{len(runs) - len(todo)} of {len(runs)} runs already done; {len(todo)} to run, {jobs} at a time")
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // jobs)))

    def one(run):
        os.makedirs(run['out_dir'], exist_ok=True)
        with open(os.path.join(run['out_dir'], 'train.out'), 'a') as out:
            result = subprocess.run(command(run), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        print(f"{'ok ' if result.returncode == 0 else 'FAILED'} {run['out_dir']}", flush=True)
        return result.returncode
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        failures = sum(code != 0 for code in pool.map(one, todo))
    if failures:
        sys.exit(f"error: {failures} run(s) failed; see train.out in their folders")


def summarise(values):
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def report(grid, runs_dir):
    """Write runs_dir/GRID/results.md (and results.png with matplotlib); return the markdown."""
    table = {}  # (group, method) -> list of (seed, final record, eval curve)
    for run in runs_of(grid, runs_dir):
        log = read_log(run['out_dir'])
        done = [r for r in log if r.get('event') == 'done']
        if done:
            curve = {r['iter']: r['val_loss'] for r in log if 'val_loss' in r and 'event' not in r}
            table.setdefault((run['group'], run['method']), []).append((run['seed'], done[-1], curve))
    if not table:
        sys.exit(f"error: no finished runs under {os.path.join(runs_dir, grid)}; run `python sweep.py {grid}` first")
    lines = [f"| config | method | seeds | val loss (nats) | bpc | ppl vs {REFERENCE} | difference vs {REFERENCE} |",
             '|---|---|---:|---:|---:|---:|---|']
    groups = list(dict.fromkeys(group for group, _ in table))
    for group in groups:
        ref = table.get((group, REFERENCE))
        ref_mean, ref_std = summarise([r['val_loss'] for _, r, _ in ref]) if ref else (None, None)
        for (g, method), runs in table.items():
            if g != group:
                continue
            mean, std = summarise([r['val_loss'] for _, r, _ in runs])
            bpc = f"{mean / math.log(2):.4f}" if 'val_bpc' in runs[0][1] else '-'
            if ref and method != REFERENCE:
                change = f"{100 * (math.exp(mean - ref_mean) - 1):+.2f}%"
                delta = mean - ref_mean
                verdict = 'exceeds the spread' if abs(delta) > std + ref_std else 'within the spread'
                difference = f"{delta:+.4f} ({verdict})"
            else:
                change = difference = '-'
            lines.append(f"| {group} | {method} | {len(runs)} | {mean:.4f} +- {std:.4f} | {bpc} | {change} | {difference} |")
    note = (f"\nMean +- sample standard deviation over seeds of the final validation loss. A difference "
            f"'exceeds the spread' when |mean - {REFERENCE} mean| > std + {REFERENCE} std.\n")
    markdown = '\n'.join(lines) + '\n' + note
    out = os.path.join(runs_dir, grid)
    with open(os.path.join(out, 'results.md'), 'w') as f:
        f.write(markdown)
    plot_curves(table, groups, os.path.join(out, 'results.png'))
    return markdown


def plot_curves(table, groups, path):
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: no plot; pip install matplotlib for results.png", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, group in zip(axes[0], groups):
        for (g, method), runs in table.items():
            if g == group:
                iters = sorted(set.intersection(*(set(curve) for _, _, curve in runs)))
                means = [statistics.mean(curve[i] for _, _, curve in runs) for i in iters]
                ax.plot(iters[1:], means[1:], marker='o', label=method)  # skip iter 0: the untrained model
        ax.set_title(group)
        ax.set_xlabel('iteration')
        ax.set_ylabel('val loss (nats), mean over seeds')
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}", file=sys.stderr)


def main(argv):
    usage = (f"usage: python sweep.py GRID [--jobs=N] [--print] [--report] [--runs_dir=DIR]; "
             f"GRID: {', '.join(GRIDS)}")
    opts = dict(jobs='1', runs_dir='runs')
    flags, grids = set(), []
    for arg in argv:
        key, eq, value = arg.removeprefix('--').partition('=')
        if arg in ('--print', '--report'):
            flags.add(key)
        elif arg.startswith('--') and eq and key in opts:
            opts[key] = value
        elif arg in GRIDS:
            grids.append(arg)
        else:
            sys.exit(f"error: {arg!r} is not understood; {usage}")
    if len(grids) != 1 or not opts['jobs'].isdigit() or int(opts['jobs']) < 1:
        sys.exit(usage)
    grid, runs = grids[0], list(runs_of(grids[0], opts['runs_dir']))
    if 'print' in flags:
        for run in runs:
            if state(run) != 'done':
                print(' '.join(command(run)[1:]).replace(ROOT + os.sep, ''))
    elif 'report' in flags:
        print(report(grid, opts['runs_dir']))
    else:
        execute(runs, int(opts['jobs']))
        print(report(grid, opts['runs_dir']))


if __name__ == '__main__':
    main(sys.argv[1:])
