"""
analyze.py (the papers' diagnostics, each checked on a case whose answer is known by hand) and
sweep.py (grids of runs, resuming, and the results report).
"""
import ast
import importlib.util
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import analyze
import data
import sweep
import train
from conftest import TINY_TRAIN, exit_message, randomize_routing, run_cli, tiny_model
from model import load_checkpoint, save_checkpoint


def test_composite_gain_of_known_mixings():
    """Identity mixing has gain 1 at every depth; a diagonal (2, 1) mixing doubles the forward and
    backward gain per sublayer; one token's bad mixing is the worst token's gain."""
    eye = torch.eye(3).expand(2, 5, 3, 3)
    assert analyze.composite_gain([eye] * 4) == {'forward': [1.0] * 4, 'backward': [1.0] * 4}
    scale = torch.diag(torch.tensor([2.0, 1.0])).expand(1, 4, 2, 2).clone()
    gains = analyze.composite_gain([scale] * 3)
    assert gains['forward'] == [2.0, 4.0, 8.0] and gains['backward'] == [2.0, 4.0, 8.0]
    mixing = torch.eye(2).repeat(1, 3, 1, 1)
    mixing[0, 1] = torch.tensor([[1.0, -3.0], [0.5, 0.0]])  # row sums 4, 0.5; column sums 1.5, 3
    gains = analyze.composite_gain([mixing])
    assert gains['forward'] == [4.0] and gains['backward'] == [3.0]


def test_mhc_family_composite_gain_is_one_and_hc_and_frac_are_not():
    """mHC-lite's and KromHC's H_res are doubly stochastic, so every product of them has gain exactly 1
    (up to rounding), even with random routing parameters; mHC's rows sum to 1 exactly (forward gain 1)
    but its columns only to within 20 Sinkhorn iterations, so its backward gain drifts (here about
    1.09 after 8 sublayers); HC's free A_r and Frac's free A have no bound (Frac's rows are
    fractions, not copies of the stream: no angles)."""
    idx = torch.randint(27, (2, 16), generator=torch.Generator().manual_seed(0))
    for residual in ('mhc_lite', 'kromhc', 'mhc', 'hc', 'frac'):
        model = tiny_model(residual, n_layer=4)
        randomize_routing(model)
        rec = analyze.record(model, idx)
        gains = analyze.composite_gain(rec['mixing'])
        assert len(rec['mixing']) == 8 and len(rec['streams']) == (0 if residual == 'frac' else 8)
        if residual in ('mhc_lite', 'kromhc', 'mhc'):
            assert max(gains['forward']) == pytest.approx(1.0, abs=1e-5), residual
        if residual in ('mhc_lite', 'kromhc'):
            assert max(gains['backward']) == pytest.approx(1.0, abs=1e-5), residual
        elif residual == 'mhc':
            assert 1.01 < max(gains['backward']) < 1.5
        else:
            assert max(gains['forward']) > 1.1, residual


def test_diagnostics_are_picked_by_class_not_by_attribute_name(monkeypatch):
    """A method a fork adds, with a submodule that happens to be called `gates` (or `pool`,
    `connections`, `coefficients`) of its own kind, is analysed like any other: its activations are
    recorded and nothing is taken for MGR's gates or HC's connections."""
    import residuals

    class Forked(torch.nn.Module):
        sublayer_norm, equals_at_init = True, None

        def __init__(self, config):
            super().__init__()
            self.gates = torch.nn.Linear(config.n_embd, 1)
            self.pool = self.connections = self.coefficients = torch.nn.Identity()

        def forward(self, x, sublayers):
            for f in sublayers:
                x = x + torch.sigmoid(self.gates(self.pool(x))) * f(x)
            return x
    monkeypatch.setitem(residuals.RESIDUALS, 'forked', Forked)
    rec = analyze.record(tiny_model('forked', n_layer=2), torch.randint(27, (1, 8)))
    assert len(rec['inputs']) == 4 and not rec['gates'] and not rec['streams'] and not rec['mixing']


def test_a_new_routing_submodule_registered_in_watchers_is_reported(tmp_path, data_dir, monkeypatch):
    """A method's own kind of submodule (here a scalar gate per sublayer) gets its diagnostic with one
    line in analyze.WATCHERS, and analysis.json reports what it records under its own key."""
    import residuals

    class ScalarGate(torch.nn.Module):
        def __init__(self, n):
            super().__init__()
            self.logit = torch.nn.Parameter(torch.linspace(-1.0, 1.0, n))

        def forward(self, i):
            return torch.sigmoid(self.logit[i])

    class Gated(torch.nn.Module):
        sublayer_norm, equals_at_init = True, None

        def __init__(self, config):
            super().__init__()
            self.gate = ScalarGate(2 * config.n_layer)

        def forward(self, x, sublayers):
            for i, f in enumerate(sublayers):
                x = x + self.gate(i) * f(x)
            return x
    monkeypatch.setitem(residuals.RESIDUALS, 'gated', Gated)
    monkeypatch.setitem(analyze.WATCHERS, ScalarGate,
                        lambda rec, residual, module, args, g: rec['scalar_gates'].append(g.item()))
    model = tiny_model('gated', n_layer=2, vocab_size=data.load('pydoc', data_dir).vocab_size)
    run = {'dataset': 'pydoc', 'data_dir': data_dir, 'eval_tokens': 64, 'batch_size': 2}
    (tmp_path / 'run').mkdir()
    save_checkpoint({'model': model.state_dict(), 'model_args': vars(model.config).copy(), 'config': run,
                     'iter_num': 0}, str(tmp_path / 'run' / 'ckpt.pt'))
    analyze.main([f'--out_dir={tmp_path / "run"}', f'--report_dir={tmp_path / "report"}'])
    [result] = json.load(open(tmp_path / 'report' / 'analysis.json'))
    assert result['scalar_gates'] == pytest.approx(torch.sigmoid(torch.linspace(-1.0, 1.0, 4)).tolist())


def test_stream_angles_of_known_streams():
    """0 for identical directions, 1/2 for orthogonal, 1 for opposite; a single stream has no pairs."""
    e = torch.randn(1, 2, 3, 8)
    assert analyze.stream_angles([e.expand(3, 2, 3, 8), e[:1]]) == [0.0, 0.0]
    a, b = torch.zeros(1, 1, 4), torch.zeros(1, 1, 4)
    a[..., 0], b[..., 1] = 1.0, 1.0
    assert analyze.stream_angles([torch.stack([a, b])])[0] == pytest.approx(0.5)
    assert analyze.stream_angles([torch.stack([a, -a])])[0] == pytest.approx(1.0)


def test_mgr_gates_recorded_at_init_are_the_depth_scaled_gate():
    model = tiny_model('mgr', n_layer=4, mgr_streams=3)
    rec = analyze.record(model, torch.randint(27, (2, 8)))
    gated = 8 - 2
    target = torch.sigmoid(torch.tensor(-3.0)).item() * math.sqrt(21 / gated)
    assert len(rec['gates']) == gated and all(torch.allclose(b, torch.full_like(b, target)) for b in rec['gates'])
    assert [len(s) for s in rec['streams']] == [1, 2] + [3] * 6  # the streams each sublayer reads


def test_dense_connections_weights_are_the_routing_picture():
    """DenseFormer's reads are the rows of its DWA matrix alpha (the paper's picture: at init the
    identity, then what was learned); MUDD's are each layer's mean residual-way weights (one-hot on the
    newest state at init), with every way's means in `dense`."""
    idx = torch.randint(27, (2, 8), generator=torch.Generator().manual_seed(0))
    model = tiny_model('denseformer', n_layer=4, denseformer_dilation=2)
    assert [r['weights'] for r in analyze.record(model, idx)['reads']] == \
        [[0.0, 1.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0, 1.0]]
    randomize_routing(model)
    reads = analyze.record(model, idx)['reads']
    alpha = model.residual.dwa.alpha
    assert [r['reader'] for r in reads] == [0, 1, 2, 3]
    assert all(r['weights'] == alpha[i, :i + 2].tolist() for i, r in enumerate(reads))
    rec = analyze.record(tiny_model('mudd', n_layer=3), idx)
    assert [r['weights'] for r in rec['reads']] == [[0.0, 1.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]]
    assert [len(ways) for ways in rec['dense']] == [4, 4, 1]
    mudd = tiny_model('mudd', n_layer=3)
    randomize_routing(mudd)
    rec = analyze.record(mudd, idx)
    assert [r['weights'] for r in rec['reads']] == [ways[-1] for ways in rec['dense']]
    assert rec['dense'][0][0] != rec['dense'][0][3]  # the query's and the residual's mixes differ


def test_analyze_reports_the_diagnostics_and_pruning_a_silent_layer_changes_nothing(tmp_path, data_dir):
    folders = []
    for residual in ('prenorm', 'wav', 'mgr', 'hc'):
        folder = tmp_path / residual
        train.main([f'--residual={residual}', f'--out_dir={folder}', f'--data_dir={data_dir}', '--max_iters=10',
                    '--eval_interval=10', *TINY_TRAIN])
        folders.append(str(folder))
    ckpt = load_checkpoint(str(tmp_path / 'prenorm' / 'ckpt.pt'))
    for name in ('transformer.h.1.attn.c_proj.weight', 'transformer.h.1.mlp.c_proj.weight'):
        ckpt['model'][name].zero_()  # layer 1's updates are now exactly zero
    save_checkpoint(ckpt, str(tmp_path / 'prenorm' / 'ckpt.pt'))
    analyze.main([f'--out_dir={",".join(folders)}', f'--report_dir={tmp_path / "report"}', '--eval_tokens=2048'])
    prenorm, wav, mgr, hc = json.load(open(tmp_path / 'report' / 'analysis.json'))
    assert prenorm['pruning']['increase'][1] == 0.0 and prenorm['pruning']['increase'][0] != 0.0
    assert len(prenorm['activations']['rms']) == 4 and 'routing' not in prenorm and 'streams' not in prenorm
    assert prenorm['activations']['rms'][2] > 0 and all(m >= r for m, r in zip(prenorm['activations']['max_abs'],
                                                                                 prenorm['activations']['rms']))
    assert len(wav['routing']['mean_weights']) == 5  # 4 sublayers and the output mixer
    assert all(sum(w) == pytest.approx(1.0, abs=1e-5) for w in wav['routing']['mean_weights'])
    assert wav['routing']['detail_weight'][0] == 0.0 and 0 < wav['routing']['detail_weight'][1] < 1
    assert len(mgr['streams']['angular_distance']) == 4 and all(0 <= a <= 1 for a in mgr['streams']['angular_distance'])
    assert len(mgr['gates']) == 4 - 3 and len(mgr['gates'][0]) == 4
    assert len(hc['composite_gain']['forward']) == 4 and hc['composite_gain']['forward'][0] > 0
    plots = {p.name for p in (tmp_path / 'report').glob('*.png')}
    if importlib.util.find_spec('matplotlib'):  # optional: without it only the JSON is written
        assert plots == {'activations.png', 'routing.png', 'streams.png', 'pruning.png', 'composite_gain.png',
                         'gates.png'}
    else:
        assert not plots


def test_analyze_val_loss_is_the_one_train_logged_for_the_checkpoint(tmp_path, data_dir, capsys):
    """By default analyze.py evaluates the run's own eval_tokens in its batches, so its val loss is the
    one train.py logged for the same checkpoint, and it prints how many tokens that loss is over."""
    folder = tmp_path / 'run'
    train.main([f'--out_dir={folder}', f'--data_dir={data_dir}', '--max_iters=4', '--eval_interval=4', *TINY_TRAIN])
    logged = [json.loads(line) for line in open(folder / 'log.jsonl')]
    logged = [row['val_loss'] for row in logged if 'val_loss' in row][-1]
    capsys.readouterr()
    analyze.main([f'--out_dir={folder}', f'--report_dir={tmp_path / "report"}'])
    [result] = json.load(open(tmp_path / 'report' / 'analysis.json'))
    assert result['pruning']['val_loss'] == pytest.approx(logged, abs=1e-6)
    assert f"val loss {logged:.4f} on 4,096 tokens" in capsys.readouterr().out


def test_paired_interval_and_t_quantiles():
    mean, half = sweep.paired([0.1, 0.2, 0.3])
    assert mean == pytest.approx(0.2) and half == pytest.approx(4.303 * 0.1 / math.sqrt(3))
    assert sweep.paired([0.5]) == (0.5, None)
    assert sweep.t_975(2) == 4.303 and sweep.t_975(60) == pytest.approx(2.0003, abs=1e-3)
    assert sweep.t_975(120) == pytest.approx(1.9799, abs=1e-3)
    assert [sweep.verdict(-0.2, 0.1), sweep.verdict(0.2, 0.1), sweep.verdict(0.05, 0.1)] == ['lower', 'higher',
                                                                                             'unresolved']


def test_seeds_for_a_half_width_follow_student_t():
    """At the spread 5 seeds showed, the fewest seeds whose 95% half-width is at most the target."""
    sd = 0.02
    half5 = sweep.t_975(4) * sd / math.sqrt(5)
    need = sweep.seeds_for(half5, 5, target=0.015)
    assert sweep.t_975(need - 1) * sd / math.sqrt(need) <= 0.015 < sweep.t_975(need - 2) * sd / math.sqrt(need - 1)
    assert need == 10 and sweep.seeds_for(half5, 5, target=1.0) == 5  # never fewer than were run


def test_sweep_runs_a_grid_skips_finished_runs_resumes_interrupted_ones_and_reports(tmp_path, data_dir, monkeypatch):
    tiny = ['--dataset=pydoc', f'--data_dir={data_dir}', '--max_iters=4', '--eval_interval=2', '--n_layer=1',
            *TINY_TRAIN]
    monkeypatch.setitem(sweep.GRIDS, 'tiny', dict(parts=[dict(
        configs=[' '.join(tiny)], variants=['--residual=prenorm', '--residual=block_attnres'], seeds=[0, 1])]))
    runs_dir, results_dir = str(tmp_path / 'runs'), str(tmp_path / 'results')
    runs = list(sweep.runs_of('tiny', runs_dir))
    assert len(runs) == 4 and len({r['out_dir'] for r in runs}) == 4
    sweep.execute(runs[:3], 2, results_dir)
    assert [sweep.state(r, results_dir) for r in runs] == ['done', 'done', 'done', 'new']
    assert len(list((tmp_path / 'results' / 'tiny').glob('*.json'))) == 3
    # an interrupted run: a checkpoint at iter 2 and no 'done' event
    result = run_cli('train.py', *runs[3]['args'], '--max_iters=2', cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    log = (Path(runs[3]['out_dir']) / 'log.jsonl')
    log.write_text(''.join(line for line in log.read_text().splitlines(True) if '"done"' not in line))
    assert sweep.state(runs[3], results_dir) == 'interrupted' and '--init_from=resume' in sweep.command(runs[3])
    sweep.execute(runs, 1, results_dir)  # runs only the interrupted one
    assert all(sweep.state(r, results_dir) == 'done' for r in runs)
    finals = {(r['method'], r['seed']): sweep.read_log(r['out_dir'])[-1]['val_loss'] for r in runs}
    markdown = sweep.report('tiny', runs_dir, results_dir)
    prenorm = [finals[('prenorm', s)] for s in (0, 1)]
    assert f"{np.mean(prenorm):.4f} +- {np.std(prenorm, ddof=1):.4f}" in markdown
    diffs = [finals[('block_attnres', s)] - finals[('prenorm', s)] for s in (0, 1)]
    half = 12.706 * np.std(diffs, ddof=1) / math.sqrt(2)  # Student t with one degree of freedom
    row = next(line for line in markdown.splitlines() if '| block_attnres |' in line)
    assert f"{np.mean(diffs):+.4f} +- {half:.4f}" in row and row.endswith('| - |')  # not compared with itself
    resolved = int(abs(np.mean(diffs)) > half)  # one distinct comparison (prenorm - block_attnres is its mirror)
    assert f"{resolved} of 1 distinct paired comparisons resolved" in markdown
    assert (tmp_path / 'results' / 'tiny' / 'results.md').read_text() == markdown
    shutil.rmtree(runs_dir)  # a fresh clone: the committed result files alone rebuild the same table
    assert sweep.report('tiny', runs_dir, results_dir) == markdown
    sweep.execute(runs, 1, results_dir)  # and count as done: nothing runs again
    assert not Path(runs_dir).exists()



def test_the_depth_panel_plots_final_loss_against_the_number_in_each_config_name():
    """cpu_depth's configs are named ...-n_layer48, 24, 12 (deepest first, as they run): the panel puts
    each method's mean and sd over seeds at 12, 24, 48, in that order."""
    calls = []

    class Axes:  # records what is drawn
        def errorbar(self, x, y, yerr, label, **_):
            calls.append((label, list(x), [round(v, 6) for v in y], [round(v, 6) for v in yerr]))

        def __getattr__(self, name):
            return lambda *args, **kwargs: None
    groups = ['cpu_depth-n_layer48', 'cpu_depth-n_layer24', 'cpu_depth-n_layer12']
    losses = {('cpu_depth-n_layer48', 'wav'): [1.0, 1.2], ('cpu_depth-n_layer24', 'wav'): [2.0, 2.0],
              ('cpu_depth-n_layer12', 'wav'): [3.0, 3.4], ('cpu_depth-n_layer12', 'prenorm'): [4.0]}
    results = [dict(group=g, method=m, final=dict(val_loss=v)) for (g, m), vs in losses.items() for v in vs]
    sweep.final_loss_by_group(Axes(), results, groups, ['wav', 'prenorm'], {'wav': dict(color='r'), 'prenorm': {}})
    sd = [round(0.2 * math.sqrt(2), 6), 0.0, round(0.1 * math.sqrt(2), 6)]
    assert calls == [('wav', [12, 24, 48], [3.2, 2.0, 1.1], sd), ('prenorm', [12], [4.0], [0])]
    assert sweep.group_number('cpu_study') is None and sweep.group_number('text8_12l') is None


def test_sweep_report_at_equal_train_time(tmp_path, monkeypatch):
    """With the grid's bench.json, the report adds each method's loss at prenorm's train time and its
    time to prenorm's final loss, from the committed curves (values worked out by hand here)."""
    monkeypatch.setitem(sweep.GRIDS, 'fake', dict(parts=[dict(
        configs=['c.py'], variants=['--residual=prenorm', '--residual=wav', '--residual=hc'], seeds=[0, 1])]))
    folder = tmp_path / 'results' / 'fake'
    folder.mkdir(parents=True)
    curves = {('prenorm', 0): [3.0, 2.0, 1.0], ('prenorm', 1): [3.0, 2.0, 1.0], ('wav', 0): [3.0, 1.5, 0.8],
              ('wav', 1): [3.0, 1.7, 0.9], ('hc', 0): [3.0, 1.0, 0.5], ('hc', 1): [3.0, 1.0, 0.5]}
    for (method, seed), losses in curves.items():
        result = dict(grid='fake', group='c', method=method, seed=seed, args=[], wall_s=1.0,
                      final={'iter': 200, 'val_loss': losses[-1]}, curve={str(100 * k): v for k, v in enumerate(losses)})
        (folder / f'c-{method}-seed{seed}.json').write_text(json.dumps(result))
    bench = {'results': [{'method': 'prenorm', 'ratio': 1.0}, {'method': 'wav', 'ratio': 2.0},
                         {'method': 'hc', 'ratio': 0.5}]}
    (folder / 'bench.json').write_text(json.dumps(bench))
    markdown = sweep.report('fake', str(tmp_path / 'runs'), str(tmp_path / 'results'))
    wav = next(line for line in markdown.splitlines() if '| wav |' in line)
    # prenorm's 200 steps take wav's run to step 100: 1.5 and 1.7 against 1.0; 1.0 is reached at steps
    # 100 + 100 (0.5 / 0.7) and 100 + 100 (0.7 / 0.8), which take 2x prenorm's time per step
    half = 12.706 * np.std([0.5, 0.7], ddof=1) / math.sqrt(2)
    assert wav.endswith(f"| 2.00 | +0.6000 +- {half:.4f} (unresolved) | {(171.4286 + 187.5) / 200:.2f} |")
    hc = next(line for line in markdown.splitlines() if '| hc |' in line)
    assert hc.endswith('| 0.50 | - | 0.25 |')  # its run ended first; 1.0 at step 100, half prenorm's time a step
    assert sweep.loss_at({'0': 3.0, '100': 2.0}, 150) is None and sweep.step_reaching({'0': 3.0, '100': 2.0}, 1.0) is None


def test_a_learning_rate_variant_takes_its_methods_step_time_and_another_setting_does_not(tmp_path, monkeypatch):
    """A rate changes no step's work, so wav at another rate is timed as wav; a stream count changes
    it, so hc with 8 streams, absent from the bench file, has no equal-time figure."""
    variants = ['--residual=prenorm', '--residual=wav --learning_rate=1e-3 --min_lr=1e-4', '--residual=hc --hc_streams=8']
    monkeypatch.setitem(sweep.GRIDS, 'fake', dict(parts=[dict(configs=['c.py'], variants=variants, seeds=[0])]))
    folder = tmp_path / 'results' / 'fake'
    folder.mkdir(parents=True)
    for run in sweep.runs_of('fake', str(tmp_path / 'runs')):
        losses = [3.0, 2.0, 1.0] if run['method'] == 'prenorm' else [3.0, 1.5, 0.8]
        result = dict(grid='fake', group=run['group'], method=run['method'], seed=0, args=run['args'][:-1],
                      wall_s=1.0, final={'iter': 200, 'val_loss': losses[-1]},
                      curve={str(100 * k): v for k, v in enumerate(losses)})
        (folder / (Path(run['out_dir']).name + '.json')).write_text(json.dumps(result))
    bench = {'results': [{'method': 'prenorm', 'ratio': 1.0}, {'method': 'wav', 'ratio': 2.0}, {'method': 'hc', 'ratio': 1.5}]}
    (folder / 'bench.json').write_text(json.dumps(bench))
    lines = sweep.report('fake', str(tmp_path / 'runs'), str(tmp_path / 'results')).splitlines()
    wav = next(line for line in lines if '| wav-learning_rate1e-3-min_lr1e-4 |' in line)
    assert wav.endswith(f"| 2.00 | +0.5000 | {(100 + 100 * 0.5 / 0.7) * 2 / 200:.2f} |")  # step 100 of its curve at prenorm's time
    assert next(line for line in lines if '| hc-hc_streams8 |' in line).endswith('| - | - | - |')


def test_each_depth_takes_its_own_bench_file_and_a_methods_depths_are_listed_together(tmp_path, monkeypatch):
    """The depth study's step times differ by depth: bench.CONFIG.json holds for its config, the
    grid's bench.json for the others; the rows go method by method, each over its depths in order."""
    monkeypatch.setitem(sweep.GRIDS, 'deep', dict(parts=[dict(
        configs=['c.py --n_layer=24', 'c.py --n_layer=12'], variants=['--residual=prenorm', '--residual=wav'],
        seeds=[0, 1])]))
    folder = tmp_path / 'results' / 'deep'
    folder.mkdir(parents=True)
    for group in ('c-n_layer24', 'c-n_layer12'):
        for method, losses in (('prenorm', [3.0, 2.0, 1.0]), ('wav', [3.0, 1.5, 0.75])):
            for seed in (0, 1):
                curve = {str(100 * k): v + 0.1 * seed for k, v in enumerate(losses)}
                result = dict(grid='deep', group=group, method=method, seed=seed, args=[], wall_s=1.0,
                              final={'iter': 200, 'val_loss': curve['200']}, curve=curve)
                (folder / f'{group}-{method}-seed{seed}.json').write_text(json.dumps(result))
    bench = lambda ratio: json.dumps({'results': [{'method': 'prenorm', 'ratio': 1.0}, {'method': 'wav', 'ratio': ratio}]})
    (folder / 'bench.json').write_text(bench(1.0))
    (folder / 'bench.c-n_layer12.json').write_text(bench(2.0))
    markdown = sweep.report('deep', str(tmp_path / 'runs'), str(tmp_path / 'results'))
    rows = [line.split(' | ')[:2] for line in markdown.splitlines()[2:] if line.startswith('| c-')]
    assert rows == [['| c-n_layer12', 'prenorm'], ['| c-n_layer24', 'prenorm'], ['| c-n_layer12', 'wav'],
                    ['| c-n_layer24', 'wav']]
    wav = [line for line in markdown.splitlines() if '| wav |' in line]
    # at 12 layers wav's step takes 2x prenorm's: prenorm's 200 steps' time takes it to step 100 (1.5 against
    # 1.0; 1.0 at step 100 + 100 * 0.5 / 0.75, 2x the time a step); at 24 layers to its own end
    assert wav[0].endswith(f"| 2.00 | +0.5000 +- 0.0000 (higher) | {2 * (100 + 100 * 0.5 / 0.75) / 200:.2f} |")
    assert wav[1].endswith(f"| 1.00 | -0.2500 +- 0.0000 (lower) | {(100 + 100 * 0.5 / 0.75) / 200:.2f} |")
    assert len(sweep.load_results('deep', str(tmp_path / 'results'))) == 8  # the bench files are not results


def test_the_differences_panel_puts_each_depth_at_its_number_and_clips_what_is_off_scale():
    """Over numbered configs: a line per method at its depths (side by side: with two methods, the
    first 0.075 octave left of the depth, the other right), the off-scale point at the panel's edge
    with its value written, and the y range the in-scale intervals' with a margin."""
    drawn, notes, limits = [], [], []

    class Axes:
        def errorbar(self, x, y, yerr, label, ls, **_):
            drawn.append((label, [round(v, 4) for v in x], list(y), list(yerr), ls))

        def annotate(self, text, xy, **_):
            notes.append((text, xy[1]))

        def set_ylim(self, lo, hi):
            limits.append((round(lo, 4), round(hi, 4)))

        def __getattr__(self, name):
            return lambda *args, **kwargs: None
    points = {('d-n_layer48', 'wav'): (-0.1, 0.05, 3), ('d-n_layer12', 'wav'): (-0.2, 0.1, 3),
              ('d-n_layer48', 'mudd'): (0.9, 0.4, 3), ('d-n_layer12', 'mudd'): (0.1, None, 1)}
    styles = {'wav': dict(color='r', ls='-'), 'mudd': dict(color='b', ls='-'), 'hc': dict(color='g', ls='-')}
    sweep.differences(Axes(), 'title', points, ['d-n_layer48', 'd-n_layer12'], ['wav', 'hc', 'mudd'], styles)
    left, right = 2 ** -0.075, 2 ** 0.075  # two methods shown: shifts of -1/4 and +1/4 of 0.3 octave
    assert drawn == [('wav', [round(12 * left, 4), round(48 * left, 4)], [-0.2, -0.1], [0.1, 0.05], '-'),
                     ('mudd', [round(12 * right, 4), round(48 * right, 4)], [0.1, sweep.OFF_SCALE], [0, 0], '-')]
    assert notes == [('+0.90', sweep.OFF_SCALE)]
    assert limits == [(-0.33, sweep.OFF_SCALE + 0.03)]


def test_a_variant_is_drawn_in_its_residuals_hue_and_every_residual_in_its_own():
    """The picture's styles: sixteen residuals get sixteen (hue, marker) pairs, none repeated; a run at
    another rate or setting takes its residual's hue, dashed, with an open marker that no other variant
    of that residual has."""
    residuals = ['prenorm', 'block_attnres', 'wav', 'mudd', 'denseformer', 'mgr', 'attnres', 'mhc_lite', 'rezero',
                 'layerscale', 'hc', 'kromhc', 'frac', 'laurel_rw', 'delta_attnres', 'mhc']
    variants = ['mgr-mgr_streams8', 'mudd-learning_rate5e-4-min_lr5e-5', 'mudd-learning_rate2e-4-min_lr2e-5',
                'prenorm-learning_rate2e-4-min_lr2e-5']
    styles = sweep.styles_of(residuals[:6] + variants + residuals[6:], lambda k: k)  # a colour is its index
    assert len({(styles[m]['color'], styles[m]['marker']) for m in residuals}) == len(residuals)
    assert all(styles[m]['ls'] == '-' and 'markerfacecolor' not in styles[m] for m in residuals)
    for variant in variants:
        style, own = styles[variant], styles[variant.split('-')[0]]
        assert (style['color'], style['ls'], style['markerfacecolor']) == (own['color'], '--', 'none')
    mudd_rates = [styles[m]['marker'] for m in variants[1:3]]
    assert mudd_rates[0] != mudd_rates[1]


def test_activations_of_silent_sublayers_are_the_embedding_at_every_depth():
    """With every output projection at zero, every update is zero, so PreNorm's sublayers all read
    e itself: the recorded input RMS is RMS(e) at every depth, and max-abs likewise."""
    model = tiny_model('prenorm', n_layer=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith('c_proj.weight'):
                p.zero_()
    idx = torch.randint(27, (2, 16), generator=torch.Generator().manual_seed(0))
    stats = analyze.activation_stats(analyze.record(model.eval(), idx)['inputs'])
    e = model.transformer.wte(idx) + model.transformer.wpe(torch.arange(16))
    assert stats['rms'] == pytest.approx([e.pow(2).mean().sqrt().item()] * 6, rel=1e-6)
    assert stats['max_abs'] == pytest.approx([e.abs().max().item()] * 6, rel=1e-6)
    assert stats['growth'] == pytest.approx({'from_first': 1.0, 'past_layer_0': 1.0}, rel=1e-6)  # every input is e
    grown = analyze.activation_stats([torch.ones(2), torch.ones(2), torch.full((2,), 2.0), torch.full((2,), 7.0)])
    assert grown['growth'] == {'from_first': 7.0, 'past_layer_0': 3.5}
    assert analyze.activation_stats([torch.ones(2)] * 2)['growth']['past_layer_0'] is None


def test_a_grid_of_several_products_runs_in_their_order_and_pairs_over_the_seeds_both_have(tmp_path, monkeypatch):
    """A grid may extend some methods' seeds: its runs come part by part, and a method with more seeds
    than its reference is paired over the seeds both have, which the report says."""
    monkeypatch.setitem(sweep.GRIDS, 'fake', dict(parts=[
        dict(configs=['c.py'], variants=['--residual=prenorm', '--residual=wav'], seeds=[0, 1, 2]),
        dict(configs=['c.py'], variants=['--residual=wav'], seeds=[3, 4])]))
    runs = list(sweep.runs_of('fake', str(tmp_path / 'runs')))
    assert [(r['method'], r['seed']) for r in runs] == [('prenorm', s) for s in range(3)] + [('wav', s) for s in range(5)]
    folder = tmp_path / 'results' / 'fake'
    folder.mkdir(parents=True)
    finals = {('prenorm', s): 2.0 + 0.01 * s for s in range(3)} | {('wav', s): 1.9 + 0.02 * s for s in range(5)}
    for (method, seed), loss in finals.items():
        result = dict(grid='fake', group='c', method=method, seed=seed, args=[], wall_s=1.0,
                      final={'iter': 100, 'val_loss': loss}, curve={'0': 3.0, '100': loss})
        (folder / f'c-{method}-seed{seed}.json').write_text(json.dumps(result))
    markdown = sweep.report('fake', str(tmp_path / 'runs'), str(tmp_path / 'results'))
    wav = next(line for line in markdown.splitlines() if '| wav |' in line)
    diffs = [finals['wav', s] - finals['prenorm', s] for s in range(3)]  # -0.1, -0.09, -0.08
    half = 4.303 * np.std(diffs, ddof=1) / math.sqrt(3)
    assert f"| 5 | {np.mean([finals['wav', s] for s in range(5)]):.4f}" in wav
    assert f"{np.mean(diffs):+.4f} +- {half:.4f} (lower, 3 paired seeds)" in wav
    prenorm = next(line for line in markdown.splitlines() if '| prenorm |' in line)
    assert 'paired seeds' not in prenorm  # prenorm's 3 seeds are all paired


def test_a_grid_on_the_command_line_reports_its_diverged_runs_and_the_methods_not_run(tmp_path, data_dir,
                                                                                      monkeypatch):
    """sweep.py NAME --configs --variants --seeds runs a grid that GRIDS does not hold (its runs'
    command lines checked against train.py's keys first); a run whose loss stops being finite is kept
    as diverged and named in the report, not left out; a method with no result file yet is named too,
    in a report beside the grid's own."""
    monkeypatch.setattr(sweep, 'GRIDS', dict(sweep.GRIDS))  # what the command line adds stays in this test
    config = tmp_path / 'tiny.py'
    config.write_text(f"dataset = 'pydoc'\ndata_dir = {data_dir!r}\nmax_iters = 6\neval_interval = 2\nn_layer = 1\n"
                      + ''.join(f"{a[2:].split('=')[0]} = {a.split('=')[1]}\n" for a in TINY_TRAIN))
    dirs = [f'--runs_dir={tmp_path / "runs"}', f'--results_dir={tmp_path / "results"}']
    spec = [f'--configs={config}', '--seeds=0', '--variants=--residual=prenorm; --residual=hc --hc_streams=2 '
            '--learning_rate=1e12 --warmup_iters=0 --grad_clip=0.0']
    assert 'did you mean' in exit_message(sweep.main, ['mine', *dirs, *spec[:2], '--variants=--hc_stream=2'])
    sweep.main(['mine', *dirs, *spec])
    folder = tmp_path / 'results' / 'mine'
    kept = json.loads(next(folder.glob('*hc*.json')).read_text())
    assert kept['final'] is None and kept['diverged_at'] >= 1
    markdown = (folder / 'results.md').read_text()
    assert '| tiny | prenorm | 1 |' in markdown and '| hc' not in markdown
    assert 'Diverged, left out of the comparisons: hc-hc_streams2-learning_rate1e12' in markdown
    assert ' 2 runs, ' in markdown  # the run-time total counts the diverged run's time as well
    del sweep.GRIDS['mine']
    sweep.main(['mine', '--report', *dirs, *spec[:2], spec[2] + '; --residual=laurel_rw'])  # one more method
    assert 'Not run yet (no result file): laurel_rw (tiny, seed 0).' in (folder / 'results.unfinished.md').read_text()
    assert (folder / 'results.md').read_text() == markdown


def test_a_report_other_than_the_grids_own_goes_beside_it(tmp_path, monkeypatch):
    """results.md is the grid's own report, the one committed: at its references, with a row for each of
    its methods. A report with other references, or one made after a method was registered (it has no
    runs yet), goes beside it, named for what differs, and leaves results.md as it was."""
    monkeypatch.setitem(sweep.GRIDS, 'fake', dict(references=['prenorm', 'wav'], parts=[
        dict(configs=['c.py'], variants=['--residual=*'], seeds=[0, 1])]))
    folder = tmp_path / 'results' / 'fake'
    folder.mkdir(parents=True)
    for k, method in enumerate(sweep.RESIDUALS):
        for seed in (0, 1):
            loss = 2.0 + 0.01 * k + 0.001 * seed
            result = dict(grid='fake', group='c', method=method, seed=seed, args=[], wall_s=1.0,
                          final={'iter': 100, 'val_loss': loss}, curve={'0': 3.0, '100': loss})
            (folder / f'c-{method}-seed{seed}.json').write_text(json.dumps(result))
    plots = []
    monkeypatch.setattr(sweep, 'plot', lambda results, rows, path, references, timed: plots.append(Path(path).name))
    report = lambda *references: sweep.report('fake', str(tmp_path / 'runs'), str(tmp_path / 'results'), references)
    own = report()
    assert (folder / 'results.md').read_text() == own and '| vs wav:' in own and report('prenorm', 'wav') == own
    other = report('prenorm', 'mudd')
    assert (folder / 'results.prenorm-mudd.md').read_text() == other and '| vs mudd:' in other
    monkeypatch.setitem(sweep.RESIDUALS, 'newcomer', object)  # registered: it joins the grid, with no runs yet
    unfinished = report()
    assert 'Not run yet (no result file): newcomer (c, seeds 0, 1).' in unfinished
    assert (folder / 'results.unfinished.md').read_text() == unfinished
    assert (folder / 'results.md').read_text() == own
    assert plots == ['results.png', 'results.png', 'results.prenorm-mudd.png', 'results.unfinished.png']


def test_the_grids_that_take_every_registered_method_are_those_contributing_names(monkeypatch):
    """A variant --residual=* in a grid file is one run for each registered method, in the registry's
    order, so that a method registered later joins the grid; CONTRIBUTING.md names those grids."""
    every = [grid for grid, spec in sweep.GRIDS.items()
             if any(sweep.EVERY_METHOD in variant.split() for part in spec['parts'] for variant in part['variants'])]
    assert every
    contributing = ' '.join((Path(sweep.ROOT) / 'CONTRIBUTING.md').read_text().split())
    assert all(f'`{grid}`' in contributing for grid in every) and '--residual=*' in contributing
    monkeypatch.setitem(sweep.RESIDUALS, 'newcomer', object)
    methods = [run['method'] for run in sweep.runs_of('cpu_methods', 'runs') if run['seed'] == 0]
    assert methods == list(sweep.RESIDUALS)


def test_a_grid_file_is_checked_as_it_is_read(tmp_path):
    """A misspelt key, a missing one or a value of the wrong kind would change a grid's runs silently:
    each is refused with one line that names the file, the part and the key."""
    path = tmp_path / 'mine.grid.json'
    part = dict(configs=['c.py'], variants=['--residual=prenorm'], seeds=[0])
    path.write_text(json.dumps(dict(parts=[part])))
    assert sweep.read_grid(str(path)) == dict(parts=[part])
    for grid, expected in [(dict(parts=[dict(part, seeds_by_seed=True)]), "part 1: unknown key 'seeds_by_seed'"),
                           (dict(parts=[dict(configs=['c.py'], seeds=[0])]), "part 1: 'variants' is missing"),
                           (dict(parts=[dict(part, seeds=[-1])]), 'part 1: seeds must be a list of integers from 0'),
                           (dict(references='prenorm', parts=[part]), 'references must be a list of strings')]:
        path.write_text(json.dumps(grid))
        assert expected in exit_message(sweep.read_grid, str(path))


def test_sweep_checks_a_grids_command_lines_with_train_pys_keys_without_importing_it(tmp_path):
    """sweep.py reads train.py's keys from its source (configurator.script_keys): the same keys and
    defaults as train.py's own, the same one-line errors, and train.py is not imported; nor is it by
    any other script (only tests may)."""
    assert sweep.train_defaults() == train.default_config() and list(sweep.train_defaults()) == list(
        train.default_config())
    for args in (['--hc_stream=2'], ['--n_layer=x'], ['--residual=mgr', '--mgr_gate=x'], ['--residual=nope']):
        assert exit_message(sweep.check_arguments, args) == exit_message(train.parse_config, args)
    for script in Path(sweep.ROOT).glob('*.py'):
        if not script.name.startswith(('test_', 'conftest')):
            tree = ast.parse(script.read_text())
            imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
            imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
            assert 'train' not in imported, script.name
