"""
Run a grid of experiments over seeds, keep each run's result, and compare the methods pair by pair.

    python sweep.py cpu_methods --jobs=2      # run (skips runs with a result file, resumes interrupted ones)
    python sweep.py cpu_methods --report      # table and plot from results/cpu_methods/*.json, no training
    python sweep.py cpu_depth --report --references=prenorm,mudd   # paired with these: results.prenorm-mudd.md
    python sweep.py char --print              # the commands, one per line, for a cluster scheduler
    python sweep.py mine --configs=config/cpu_study.py --seeds=0,1,2 \
        --variants="--residual=prenorm; --residual=hc --hc_streams=8"   # a grid given here: results/mine/

A grid is a file config/GRID.grid.json: what it is for ("about"), the references its report pairs
every method with ("references"; prenorm and block_attnres where it names none), and its "parts",
each a product of "configs" x "variants" x "seeds" whose runs go config by config, variant by
variant, seed by seed ("seed_by_seed": true runs every config and variant at one seed before the
next seed, so that each finished seed is a paired comparison). A config or a variant is train.py
arguments separated by spaces; the variant --residual=* stands for every registered method, so that
a method registered later joins the grid. Each run is `python train.py CONFIG... VARIANT... --seed=S
--out_dir=RUNS/GRID/NAME` (RUNS = --runs_dir, default runs/). When a run has finished, its final
metrics, validation curve and wall time go to RESULTS/GRID/NAME.json (--results_dir, default
results/): small files to commit, from which --report rebuilds the table and the plot.

The report is RESULTS/GRID/results.md and results.png when it is the grid's own, the one committed:
at the grid's references, with a row for each of its configs and methods. Any other goes beside it,
named for what differs (results.prenorm-mudd.md for other references, results.unfinished.md where a
run has no result yet: a grid still running, or a method registered since), and the committed one
stays as it was.

The comparison is paired. Runs of different methods with the same seed share the initial weights
of the shared modules and the data order, so for each method and config the report takes, seed by
seed, the difference of its final validation loss to a reference method's, and gives their mean
with a 95% confidence interval (Student t over the per-seed differences). An interval that excludes
zero is a difference the seeds resolve.

Equal time: where RESULTS/GRID/bench.json holds `python bench.py --json_path=...` at the grid's shape
(each method's train-step time x prenorm's, measured isolated), or bench.CONFIG.json at one config's
(cpu_depth: one per depth, as `bench.py --config=cpu_depth --n_layer=48`), the report adds, per method, the
validation loss its own run had reached once it had used prenorm's total train time (its curve,
interpolated at prenorm's steps / its step-time ratio; paired with prenorm's final loss, seed by
seed) and the train time it needed to reach prenorm's final loss, x prenorm's.
"""
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields

import configurator
from residuals import RESIDUALS

ROOT = os.path.dirname(os.path.abspath(__file__))
REFERENCES = ('prenorm', 'block_attnres')  # the baselines a grid's methods are compared with, unless it names others
TARGET_HALF_WIDTH = 0.015  # nats: the 95% half-width a study aims at (the report names the comparisons over it)
EVERY_METHOD = '--residual=*'  # in a grid's variant: one run for each registered method, in the registry's order
TEXT = (lambda v: isinstance(v, str), 'a string')
STRINGS = (lambda v: isinstance(v, list) and v != [] and all(isinstance(x, str) for x in v), 'a list of strings')
GRID_KEYS = {'about': TEXT, 'references': STRINGS,
             'parts': (lambda v: isinstance(v, list) and v != [], 'a list of parts')}
PART_KEYS = {'about': TEXT, 'configs': STRINGS, 'variants': STRINGS,
             'seeds': (lambda v: isinstance(v, list) and v != [] and all(type(s) is int and s >= 0 for s in v),
                       'a list of integers from 0'),
             'seed_by_seed': (lambda v: type(v) is bool, 'true or false')}


def read_grid(path):
    """A grid file, checked: a misspelt key would change its runs silently."""
    with open(path) as f:
        try:
            grid = json.load(f)
        except json.JSONDecodeError as e:
            sys.exit(f"error: {path}: {e}")
    check_spec(path, grid, GRID_KEYS, ['parts'])
    for k, part in enumerate(grid['parts']):
        check_spec(f"{path}, part {k + 1}", part, PART_KEYS, ['configs', 'variants', 'seeds'])
    return grid


def check_spec(where, spec, keys, required):
    """Exit with one line unless spec is an object with the required keys and no others, each valid."""
    if not isinstance(spec, dict):
        sys.exit(f"error: {where}: expected an object with the keys {', '.join(keys)}")
    for key in [*spec, *required]:
        if key not in keys:
            sys.exit(f"error: {where}: unknown key {key!r}; the keys are {', '.join(keys)}")
        if key not in spec:
            sys.exit(f"error: {where}: {key!r} is missing")
        valid, wanted = keys[key]
        if not valid(spec[key]):
            sys.exit(f"error: {where}: {key} must be {wanted}, got {spec[key]!r}")


GRIDS = {name.removesuffix('.grid.json'): read_grid(os.path.join(ROOT, 'config', name))
         for name in sorted(os.listdir(os.path.join(ROOT, 'config'))) if name.endswith('.grid.json')}


def arg_name(arg):
    """A short, file-safe name for one argument: config/x.py -> x, --n_layer=4 -> n_layer4."""
    if not arg.startswith('--'):
        return os.path.splitext(os.path.basename(arg))[0]
    key, _, value = arg[2:].partition('=')
    return value if key == 'residual' else f'{key}{value}'


def every_method(variant):
    """A variant's runs: itself, or with --residual=* one for each registered method."""
    if EVERY_METHOD not in variant:
        return [variant]
    return [[f'--residual={name}' if arg == EVERY_METHOD else arg for arg in variant] for name in RESIDUALS]


def runs_of(grid, runs_dir):
    """A grid's runs in order, part by part (none for a grid GRIDS does not know: one given on the
    command line, reported from its files)."""
    for part in GRIDS.get(grid, {}).get('parts', []):
        yield from part_runs(grid, part, runs_dir)


def part_runs(grid, part, runs_dir):
    """A part's runs: config by config, variant by variant, seed by seed (with seed_by_seed, seed by
    seed first)."""
    configs = [config.split() for config in part['configs']]
    variants = [run for variant in part['variants'] for run in every_method(variant.split())]
    for seeds in [[seed] for seed in part['seeds']] if part.get('seed_by_seed') else [part['seeds']]:
        for config in configs:
            for variant in variants:
                for seed in seeds:
                    group, method = '-'.join(map(arg_name, config)), '-'.join(map(arg_name, variant))
                    out_dir = os.path.join(runs_dir, grid, f'{group}-{method}-seed{seed}')
                    yield dict(grid=grid, group=group, method=method, seed=seed, out_dir=out_dir,
                               args=[*config, *variant, f'--seed={seed}', f'--out_dir={out_dir}'])


def read_log(out_dir):
    path = os.path.join(out_dir, 'log.jsonl')
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def state(run, results_dir):
    """'done' (its result file exists, e.g. committed from another machine, or its log ends
    finished), 'interrupted' (a checkpoint to resume) or 'new'."""
    if os.path.exists(result_path(run, results_dir)):
        return 'done'
    log = read_log(run['out_dir'])
    events = [r.get('event') for r in log if 'event' in r]
    if events and events[-1] in ('done', 'diverged'):
        return 'done'
    return 'interrupted' if os.path.exists(os.path.join(run['out_dir'], 'ckpt.pt')) else 'new'


def command(run):
    resume = ['--init_from=resume'] if os.path.exists(os.path.join(run['out_dir'], 'ckpt.pt')) else []
    return [sys.executable, os.path.join(ROOT, 'train.py'), *run['args'], *resume]


def execute(runs, jobs, results_dir):
    """Run sequentially, or `jobs` at a time with the cores shared among them (at small widths
    two single-threaded runs do more work than one run on two threads); write each finished run's
    result file."""
    todo = [run for run in runs if state(run, results_dir) != 'done']
    print(f"{len(runs) - len(todo)} of {len(runs)} runs already done; {len(todo)} to run, {jobs} at a time", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // jobs)))
    start = time.time()

    def one(run):
        os.makedirs(run['out_dir'], exist_ok=True)
        t0 = time.time()
        with open(os.path.join(run['out_dir'], 'train.out'), 'a') as out:
            subprocess.run(command(run), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        kept = collect(run, results_dir, wall_s=time.time() - t0)  # a finished run, or one that diverged
        status = 'FAILED' if kept is None else 'diverged' if 'diverged_at' in kept else 'ok'
        print(f"{status:<8} {run['out_dir']} ({time.time() - t0:.0f}s)", flush=True)
        return kept is not None
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        failures = sum(not kept for kept in pool.map(one, todo))
    print(f"{len(todo)} runs in {(time.time() - start) / 60:.1f} minutes of wall time", flush=True)
    if failures:
        sys.exit(f"error: {failures} run(s) failed; see train.out in their folders")


# ----------------------------------------------------------------------------- results

def result_path(run, results_dir):
    return os.path.join(results_dir, run['grid'], os.path.basename(run['out_dir']) + '.json')


def collect(run, results_dir, wall_s=None):
    """Write a finished run's result file (final metrics, validation curve, wall time) from its log, or
    a diverged run's (its curve, and the iteration where its loss stopped being finite: final None)."""
    log = read_log(run['out_dir'])
    ends = [r for r in log if r.get('event') in ('done', 'diverged')]
    if not ends:
        return None
    path = result_path(run, results_dir)
    old = json.load(open(path)) if os.path.exists(path) else {}
    end = ends[-1]
    result = dict(grid=run['grid'], group=run['group'], method=run['method'], seed=run['seed'], args=run['args'][:-1],
                  final={k: v for k, v in end.items() if k != 'event'} if end['event'] == 'done' else None,
                  curve={r['iter']: r['val_loss'] for r in log if 'val_loss' in r and 'event' not in r},
                  wall_s=wall_s if wall_s is not None else old.get('wall_s'))
    if end['event'] == 'diverged':
        result['diverged_at'] = end['iter']
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w') as f:
        json.dump(result, f, indent=1)
    return result


def load_results(grid, results_dir):
    """Every result file of a grid, in the grid's order."""
    folder = os.path.join(results_dir, grid)
    order = {(r['group'], r['method'], r['seed']): k for k, r in enumerate(runs_of(grid, 'runs'))}
    results = [json.load(open(os.path.join(folder, name))) for name in sorted(os.listdir(folder))
               if name.endswith('.json') and not is_bench(name)] if os.path.isdir(folder) else []
    return sorted(results, key=lambda r: order.get((r['group'], r['method'], r['seed']), len(order)))


# two-sided 95% quantiles of Student's t, by degrees of freedom
T_975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t_975(df):
    if df <= len(T_975):
        return T_975[df - 1]
    z = 1.959964  # beyond the table, the Cornish-Fisher expansion (error below 1e-3)
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def paired(diffs):
    """Mean of per-seed differences and the half-width of its 95% confidence interval (None for one seed)."""
    mean = statistics.mean(diffs)
    if len(diffs) < 2:
        return mean, None
    return mean, t_975(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))


def comparisons(results, references=REFERENCES):
    """Per (config, method): the final losses by seed, and for each reference the paired difference
    (mean, 95% half-width, number of seeds) over the seeds both have; in the grid's order, or where
    every config is numbered (cpu_depth), method by method over its configs in number order."""
    losses = {}
    for r in results:
        losses.setdefault((r['group'], r['method']), {})[r['seed']] = r['final']['val_loss']
    rows = []
    for (group, method), by_seed in losses.items():
        row = dict(group=group, method=method, losses=by_seed, char_level='val_bpc' in next(
            r['final'] for r in results if (r['group'], r['method']) == (group, method)), versus={})
        for ref in references:
            ref_losses = losses.get((group, ref), {})
            seeds = sorted(set(by_seed) & set(ref_losses))
            if method != ref and seeds:
                row['versus'][ref] = (*paired([by_seed[s] - ref_losses[s] for s in seeds]), len(seeds))
        rows.append(row)
    if None not in {group_number(row['group']) for row in rows}:  # a trend (cpu_depth): a method's depths together
        order = list(dict.fromkeys(row['method'] for row in rows))
        rows.sort(key=lambda row: (order.index(row['method']), group_number(row['group'])))
    return rows


# ----------------------------------------------------------------------------- equal train time

def step_ratios(grid, results_dir):
    """Each method's train-step time x prenorm's, by config: {CONFIG: {method: ratio}} from
    RESULTS/GRID/bench.CONFIG.json, measured at that config's shape (cpu_depth: one per depth), and
    {None: ...} from bench.json, for every config without its own; {} without any."""
    folder = os.path.join(results_dir, grid)
    ratios = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if is_bench(name):
            with open(os.path.join(folder, name)) as f:
                ratios[name[len('bench.'):-len('.json')] or None] = {r['method']: r['ratio'] for r in json.load(f)['results']}
    return ratios


def is_bench(name):
    return name.startswith('bench.') and name.endswith('.json')


def ratios_of(ratios, group):
    """The step-time ratios that hold for a config: its own bench file's, else the grid's bench.json's."""
    return ratios.get(group, ratios.get(None, {}))


SCHEDULE = ('learning_rate', 'min_lr', 'warmup_iters', 'lr_decay_iters', 'weight_decay', 'beta1', 'beta2')


def timed_as(result):
    """The method whose step-time ratio a run takes: its own, less the optimizer schedule's arguments
    (a learning rate changes no step's work), so that mudd at another rate takes mudd's ratio."""
    method = result['method']
    for arg in result['args']:
        if arg.startswith('--') and arg[2:].partition('=')[0] in SCHEDULE:
            method = method.replace(f"-{arg_name(arg)}", '')
    return method


def loss_at(curve, step):
    """The validation loss of a curve {iter: loss} at a step, linear between evaluations; past the
    run's end, None."""
    points = sorted((int(i), v) for i, v in curve.items())
    for (s0, v0), (s1, v1) in zip(points, points[1:]):
        if s0 <= step <= s1:
            return v0 + (v1 - v0) * (step - s0) / (s1 - s0)
    return None


def step_reaching(curve, target):
    """The first step at which a curve {iter: loss} reaches target, linear between evaluations; None if never."""
    points = sorted((int(i), v) for i, v in curve.items())
    for (s0, v0), (s1, v1) in zip(points, points[1:]):
        if v1 <= target:
            return s0 + (s1 - s0) * (v0 - target) / (v0 - v1) if v0 > target else s0
    return None


def equal_time(results, ratios, reference='prenorm'):
    """Per (config, method), with the step-time ratios of its config (step_ratios): the paired
    difference to the reference's final loss of the loss reached at the reference's train time (mean, 95% half-width, seeds; None where a faster method's run
    ended first), and the train time to the reference's final loss, x the reference's (mean over
    seeds; None where a seed never got there)."""
    runs = {(r['group'], r['method'], r['seed']): r for r in results}
    out = {}
    for (group, method, seed), r in runs.items():
        ref, ratio, timed = runs.get((group, reference, seed)), ratios_of(ratios, group), timed_as(r)
        if ref is None or method == reference or timed not in ratio or reference not in ratio:
            continue
        total = max(int(i) for i in ref['curve'])
        at_time = loss_at(r['curve'], total / ratio[timed] * ratio[reference])
        reached = step_reaching(r['curve'], ref['final']['val_loss'])
        entry = out.setdefault((group, method), {'diffs': [], 'times': []})
        entry['diffs'].append(None if at_time is None else at_time - ref['final']['val_loss'])
        entry['times'].append(None if reached is None else reached * ratio[timed] / (total * ratio[reference]))
    return {key: (paired(e['diffs']) + (len(e['diffs']),) if None not in e['diffs'] else None,
                  statistics.mean(e['times']) if None not in e['times'] else None)
            for key, e in out.items()}


def seeds_for(half, n, target=TARGET_HALF_WIDTH):
    """The seeds a paired comparison would need for a 95% half-width of `target`, from the spread that
    n seeds gave (half-width `half`)."""
    sd, seeds = half * math.sqrt(n) / t_975(n - 1), max(n, 2)
    while t_975(seeds - 1) * sd / math.sqrt(seeds) > target:
        seeds += 1
    return seeds


def resolution(rows):
    """One line: how many of the distinct paired comparisons resolve, and those whose half-width is
    over the target, with the seeds they would need."""
    seen, resolved, wide = set(), 0, []
    for row in rows:
        for ref, (diff, half, n) in row['versus'].items():
            pair = (row['group'], frozenset((row['method'], ref)))
            if pair in seen or half is None:
                continue
            seen.add(pair)
            resolved += verdict(diff, half) != 'unresolved'
            if half > TARGET_HALF_WIDTH:
                wide.append(f"{row['method']} - {ref} +-{half:.3f} ({seeds_for(half, n)})")
    return (f"{resolved} of {len(seen)} distinct paired comparisons resolved. Half-widths over "
            f"{TARGET_HALF_WIDTH} nats (seeds that would bring them there, at the spread seen): "
            + ('; '.join(wide) if wide else 'none') + '.')


def verdict(mean, half):
    if half is None:
        return 'one seed'
    return 'unresolved' if abs(mean) <= half else ('lower' if mean < 0 else 'higher')


def report(grid, runs_dir, results_dir, references=None):
    """Collect the finished runs under runs_dir (if any), then write the report (report_name) from the
    result files, a table and a plot (with matplotlib), every method paired with each of the references
    (the grid's where none are given); return the markdown."""
    references = references or references_of(grid)
    for run in runs_of(grid, runs_dir):
        collect(run, results_dir)
    everything = load_results(grid, results_dir)
    if not everything:
        sys.exit(f"error: no results in {os.path.join(results_dir, grid)}; run `python sweep.py {grid}` first")
    results = [r for r in everything if r['final'] is not None]  # the diverged ones are listed, not compared
    missing = not_run(grid, everything)
    rows = comparisons(results, references)
    ratios = step_ratios(grid, results_dir)
    timed = equal_time(results, ratios) if ratios else {}
    timed_method = {(r['group'], r['method']): timed_as(r) for r in results}
    head = ' | '.join(f"vs {ref}: mean diff +- 95% CI" for ref in references)
    extra = " step time x prenorm | at prenorm's time: vs prenorm | time to prenorm's loss |" if ratios else ''
    lines = [f"| config | method | seeds | val loss (nats) | bpc | {head} |" + extra,
             '|---|---|---:|---:|---:|' + '---|' * len(references) + ('---:|---|---:|' if ratios else '')]
    for row in rows:
        values = list(row['losses'].values())
        mean, std = statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0
        bpc = f"{mean / math.log(2):.4f}" if row['char_level'] else '-'
        cells = []
        for ref in references:
            if ref not in row['versus']:
                cells.append('-')
                continue
            diff, half, n = row['versus'][ref]
            ci = f" +- {half:.4f}" if half is not None else ''
            fewer = f", {n} paired seeds" if n < len(values) else ''  # the seeds both have, where the reference has fewer
            cells.append(f"{diff:+.4f}{ci} ({verdict(diff, half)}{fewer})")
        if ratios:
            ratio = ratios_of(ratios, row['group']).get(timed_method[row['group'], row['method']])
            cells.append('-' if ratio is None else f"{ratio:.2f}")
            at_time, to_loss = timed.get((row['group'], row['method']), (None, None))
            cells.append('-' if at_time is None else f"{at_time[0]:+.4f}" + (
                f" +- {at_time[1]:.4f} ({verdict(*at_time[:2])})" if at_time[1] is not None else ''))
            cells.append('-' if to_loss is None else f"{to_loss:.2f}")
        lines.append(f"| {row['group']} | {row['method']} | {len(values)} | {mean:.4f} +- {std:.4f} | {bpc} | "
                     + ' | '.join(cells) + ' |')
    walls = [r['wall_s'] for r in everything if r.get('wall_s')]  # the diverged runs took time too
    note = ("\nFinal validation loss: mean +- sample standard deviation over seeds. Paired differences: the mean "
            "over seeds of (method - reference) with the half-width of its 95% confidence interval (Student t); "
            "'lower' or 'higher' where the interval excludes zero, 'unresolved' where it does not."
            + (f" {len(walls)} runs, {sum(walls) / 3600:.2f} hours of run time in all." if walls else '')
            + ' ' + resolution(rows) + unfinished(everything, missing)
            + (" Equal time (bench.json, or bench.CONFIG.json for one config): each method's train-step time x prenorm's, "
               "measured isolated at the config's shape (a variant of the learning-rate schedule alone takes its method's); "
               "the loss its run had reached at prenorm's total train time, paired with prenorm's final loss ('-' where its "
               "run ended first); the train time it took to reach prenorm's final loss, x prenorm's ('-' where a seed never did)."
               if ratios else '') + '\n')
    markdown = '\n'.join(lines) + '\n' + note
    path = os.path.join(results_dir, grid, report_name(grid, references, missing))
    with open(path + '.md', 'w') as f:
        f.write(markdown)
    print(f"wrote {path}.md", file=sys.stderr)
    plot(results, rows, path + '.png', references, timed)
    return markdown


def references_of(grid):
    return tuple(GRIDS.get(grid, {}).get('references', REFERENCES))


def report_name(grid, references, missing):
    """'results' for the grid's own report, the one committed: at its references, with a row for each
    of its (config, method) pairs. Any other is named for what differs (results.prenorm-mudd for other
    references, results.unfinished where a run has no result yet), so that it never overwrites it."""
    own = tuple(references) == references_of(grid)
    return 'results' + ('' if own else '.' + '-'.join(references)) + ('.unfinished' if missing else '')


def not_run(grid, results):
    """The grid's runs with no result file yet, as 'method (config, seeds 4, 5)' (none where a grid
    was given on the command line without its spec)."""
    have = {(r['group'], r['method'], r['seed']) for r in results}
    seeds = {}
    for run in runs_of(grid, 'runs'):
        if (run['group'], run['method'], run['seed']) not in have:
            seeds.setdefault((run['group'], run['method']), []).append(str(run['seed']))
    return [f"{method} ({group}, seed{'s' * (len(s) > 1)} {', '.join(s)})" for (group, method), s in seeds.items()]


def unfinished(results, missing):
    """The sentences on what the report leaves out: runs that diverged (a loss that was not finite),
    and the runs with no result file yet."""
    diverged = [f"{r['method']} ({r['group']}, seed {r['seed']}, at iter {r['diverged_at']})"
                for r in results if r['final'] is None]
    return ((f" Diverged, left out of the comparisons: {'; '.join(diverged)}." if diverged else '')
            + (f" Not run yet (no result file): {'; '.join(missing)}." if missing else ''))


def group_number(group):
    """The number a config's name ends in (cpu_depth-n_layer48 -> 48), or None."""
    digits = group[len(group.rstrip('0123456789')):]
    return int(digits) if digits else None


def configs_axis(ax, groups):
    """The x axis of the panels over configs: their number on a log2 scale where every config's name
    ends in one (cpu_depth: n_layer 12, 24, 48), else the configs in the grid's order. Returns each
    config's position."""
    numbers = [group_number(g) for g in groups]
    if None in numbers:
        ax.set_xticks(range(len(groups)), groups, rotation=15, fontsize=8)
        ax.set(xlabel='config')
        return list(range(len(groups)))
    ax.set_xscale('log', base=2)
    ax.set_xticks(sorted(numbers), [str(n) for n in sorted(numbers)])
    ax.set(xlabel=groups[0].rstrip('0123456789').split('-')[-1] or 'config')
    return numbers


def final_loss_by_group(ax, results, groups, methods, styles):
    """Final val loss (mean and sd over seeds) against the configs (configs_axis: the depth trend is
    val loss against n_layer), a line per method."""
    x_of = dict(zip(groups, configs_axis(ax, groups)))
    for method in methods:
        points = []
        for group in groups:
            losses = [r['final']['val_loss'] for r in results if (r['group'], r['method']) == (group, method)]
            if losses:
                points.append((x_of[group], statistics.mean(losses), statistics.stdev(losses) if len(losses) > 1 else 0))
        points.sort()
        if points:
            x, mean, sd = zip(*points)
            ax.errorbar(x, mean, yerr=sd, capsize=3, label=method, **styles[method])
    ax.set(title='final val loss, mean and sd over seeds', ylabel='val loss (nats)')


OFF_SCALE = 0.5  # nats: a difference beyond it is drawn at the panel's edge with its value beside it


def differences(ax, title, points, groups, methods, styles):
    """Paired differences {(config, method): (mean, 95% half-width or None, seeds)} with their
    intervals against the configs (configs_axis; over numbered configs a line per method), the methods
    side by side at each config; one beyond OFF_SCALE nats is drawn at the edge, its value written."""
    x_of = dict(zip(groups, configs_axis(ax, groups)))
    numbered = None not in map(group_number, groups)
    shown = [m for m in methods if any((g, m) in points for g in groups)]
    ends = [0.0]
    for k, method in enumerate(shown):
        shift = (k - (len(shown) - 1) / 2) / max(1, len(shown))  # from -0.5 to 0.5
        xs, ys, halves = [], [], []
        for group in groups:
            if (group, method) in points:
                diff, half, _ = points[(group, method)]
                xs.append(x_of[group] * 2 ** (0.3 * shift) if numbered else x_of[group] + 0.8 * shift)
                ys.append(diff)
                halves.append(half or 0)
        order = sorted(range(len(xs)), key=xs.__getitem__)
        xs, ys, halves = [xs[i] for i in order], [ys[i] for i in order], [halves[i] for i in order]
        inside = [abs(y) <= OFF_SCALE for y in ys]
        shown_y = [max(-OFF_SCALE, min(OFF_SCALE, y)) for y in ys]
        ends += [y + s * h if keep else at for y, h, keep, at in zip(ys, halves, inside, shown_y) for s in (-1, 1)]
        ax.errorbar(xs, shown_y, yerr=[h if keep else 0 for h, keep in zip(halves, inside)], capsize=3,
                    label=method, **dict(styles[method], ls=styles[method]['ls'] if numbered else ''))
        for x, y, keep, at in zip(xs, ys, inside, shown_y):
            if not keep:
                ax.annotate(f"{y:+.2f}", (x, at), fontsize=6, color=styles[method]['color'])
    ax.axhline(0, color='grey', lw=0.8)
    ax.set_ylim(max(-OFF_SCALE, min(ends)) - 0.03, min(OFF_SCALE, max(ends)) + 0.03)
    ax.set(title=title, ylabel='val loss difference (nats; below 0: lower)')


def styles_of(methods, tab20):
    """A hue per residual (a run's method up to its first '-': mudd-learning_rate2e-4-min_lr2e-5 is
    mudd's), ten dark then ten light, circles then squares (the eleventh residual is the first's hue,
    lighter, in squares); a variant of a residual (another rate, MGR's settings) is drawn in its hue,
    dashed, in open markers of its own shape."""
    residuals = list(dict.fromkeys(m.split('-')[0] for m in methods))
    styles, variants = {}, {}
    for method in methods:
        k = residuals.index(method.split('-')[0])
        style = dict(color=tab20(2 * k % 20 + k // 10 % 2), marker='os'[k // 10 % 2], ls='-')
        if '-' in method:
            j = variants[k] = variants.get(k, -1) + 1
            style.update(marker='D^v<>p'[j % 6], markerfacecolor='none', ls='--')
        styles[method] = style
    return styles


def plot(results, rows, path, references=REFERENCES, timed=None):
    """The validation curves of the first config (mean over seeds, min-max band); where the grid has
    several configs, the final val loss against them (cpu_depth: against depth); then per reference the
    paired differences with their 95% intervals, and with bench files (equal_time) the loss each method
    had at prenorm's train time minus prenorm's final loss; one legend for all."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: no plot; pip install matplotlib for results.png", file=sys.stderr)
        return
    groups = list(dict.fromkeys(r['group'] for r in results))
    methods = list(dict.fromkeys(r['method'] for r in results))
    styles = styles_of(methods, plt.cm.tab20)
    panels = [(f"paired difference to {ref}, 95% CI",
               {(row['group'], row['method']): row['versus'][ref] for row in rows if ref in row['versus']})
              for ref in references]
    panels.append(("at prenorm's train time, minus prenorm's final loss, 95% CI",
                   {key: at for key, (at, _) in (timed or {}).items() if at is not None}))
    panels = [(title, points) for title, points in panels if points]
    n = 1 + (len(groups) > 1) + len(panels) + 1  # the curves, the trend, the differences, the legend
    ncols = n if n <= 3 else math.ceil(n / 2)
    fig, axes = plt.subplots(math.ceil(n / ncols), ncols, figsize=(5.5 * ncols, 4.5 * math.ceil(n / ncols)),
                             layout='constrained', squeeze=False)
    axes = list(axes.flat)
    ax, group = axes.pop(0), groups[0]  # the curves of the first config (the deepest in cpu_depth)
    for method in methods:
        curves = [r['curve'] for r in results if (r['group'], r['method']) == (group, method)]
        if not curves:
            continue
        iters = sorted(set.intersection(*(set(c) for c in curves)), key=int)[1:]  # skip the untrained model
        values = [[c[i] for c in curves] for i in iters]
        x = [int(i) for i in iters]
        ax.plot(x, [statistics.mean(v) for v in values], color=styles[method]['color'], ls=styles[method]['ls'])
        ax.fill_between(x, [min(v) for v in values], [max(v) for v in values], color=styles[method]['color'], alpha=0.2)
    ax.set(title=f"{group}:\nval loss, mean and min-max over seeds", xlabel='iteration', ylabel='val loss (nats)')
    if len(groups) > 1:
        final_loss_by_group(axes.pop(0), results, groups, methods, styles)
    for title, points in panels:
        differences(axes.pop(0), title, points, groups, methods, styles)
    legend = axes.pop(0)
    legend.axis('off')
    legend.legend(handles=[matplotlib.lines.Line2D([], [], label=m, **styles[m]) for m in methods], loc='center',
                  ncol=2 if len(methods) > 14 else 1, fontsize=8)
    for ax in axes:
        ax.axis('off')
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)


def grid_from_command_line(opts):
    """A grid given as --configs, --variants (each a ';'-separated list of train.py arguments) and
    --seeds (comma-separated), every run's command line checked first (check_arguments)."""
    split = lambda text: [part.strip() for part in text.split(';') if part.strip()]
    configs, variants = split(opts['configs']), split(opts['variants'])
    try:
        seeds = [int(seed) for seed in opts['seeds'].split(',')]
    except ValueError:
        sys.exit(f"error: --seeds={opts['seeds']!r}: give integers separated by commas, e.g. --seeds=0,1,2")
    if not configs or not variants or any(seed < 0 for seed in seeds):
        sys.exit("error: a grid on the command line needs --configs and --variants (train.py arguments, ';' between "
                 "entries) and --seeds (e.g. 0,1,2)")
    for config in configs:
        for variant in [run for variant in variants for run in every_method(variant.split())]:
            try:
                check_arguments([*config.split(), *variant])
            except SystemExit as e:
                sys.exit(f"{e.code} (in the run {' '.join([config, *variant])!r})")
    return dict(parts=[dict(configs=configs, variants=variants, seeds=seeds)])


def train_defaults():
    """train.py's keys and defaults (its default_config()) without importing it: GPTConfig's fields but
    vocab_size, which comes from the dataset, then the script's own, read from its source."""
    from model import GPTConfig  # (only here: a report needs no model)
    return {**{f.name: f.default for f in fields(GPTConfig) if f.name != 'vocab_size'},
            **configurator.script_keys(os.path.join(ROOT, 'train.py'))}


def check_arguments(args):
    """Exit with train.py's one-line error where a run's arguments name an unknown key, give a value of
    the wrong type, or make a model that GPTConfig refuses; the ranges of
    train.py's own numbers are checked when the run starts."""
    from model import GPTConfig
    cfg, _ = configurator.parse(args, train_defaults(), 'python train.py')
    try:
        GPTConfig(**{f.name: cfg[f.name] for f in fields(GPTConfig) if f.name in cfg})  # every knob's check
    except ValueError as e:
        sys.exit(f"error: {e}")


def main(argv):
    usage = (f"usage: python sweep.py GRID [--jobs=N] [--print] [--report] [--runs_dir=DIR] [--results_dir=DIR] "
             f"[--references=prenorm,block_attnres,...]; "
             f"GRID: {', '.join(GRIDS)}, or a new name with --configs=... --variants=... [--seeds=0,1,2]")
    opts = dict(jobs='1', runs_dir='runs', results_dir=os.path.join(ROOT, 'results'), configs='', variants='', seeds='0',
                references='')
    flags, grids = set(), []
    for arg in argv:
        key, eq, value = arg.removeprefix('--').partition('=')
        if arg in ('-h', '--help'):
            print(__doc__.strip() + '\n\n' + usage)
            sys.exit(0)
        if arg in ('--print', '--report'):
            flags.add(key)
        elif arg.startswith('--') and eq and key in opts:
            opts[key] = value
        elif not arg.startswith('-') and arg.replace('_', '').isalnum():
            grids.append(arg)
        else:
            sys.exit(f"error: {arg!r} is not understood; {usage}")
    if len(grids) != 1 or not opts['jobs'].isdigit() or int(opts['jobs']) < 1:
        sys.exit(f"error: name one grid, and --jobs a positive integer; {usage}")
    grid = grids[0]
    if opts['variants'] or opts['configs']:
        if grid in GRIDS:
            sys.exit(f"error: config/{grid}.grid.json is a grid already; name the one you give on the command line "
                     f"otherwise")
        GRIDS[grid] = grid_from_command_line(opts)
    elif grid not in GRIDS and not ('report' in flags and os.path.isdir(os.path.join(opts['results_dir'], grid))):
        sys.exit(f"error: no grid {grid!r}: name one of {', '.join(GRIDS)}, or give a new one with --configs and "
                 f"--variants (with --report alone: the results in {os.path.join(opts['results_dir'], grid)})")
    runs, references = list(runs_of(grid, opts['runs_dir'])), tuple(filter(None, opts['references'].split(',')))
    if 'print' in flags:
        for run in runs:
            if state(run, opts['results_dir']) != 'done':
                print(' '.join(['python', *command(run)[1:]]).replace(ROOT + os.sep, ''))
    elif 'report' in flags:
        print(report(grid, opts['runs_dir'], opts['results_dir'], references))
    else:
        execute(runs, int(opts['jobs']), opts['results_dir'])
        print(report(grid, opts['runs_dir'], opts['results_dir'], references))


if __name__ == '__main__':
    main(sys.argv[1:])
