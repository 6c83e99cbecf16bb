"""
The papers' diagnostics for trained checkpoints, as PNG plots and one JSON of the numbers.

    python analyze.py --out_dir=out-prenorm,out-wav,out-mgr --report_dir=analysis

For each checkpoint, on a fixed batch of its validation split (the model runs its reference path,
--kernels=reference, watched by PyTorch forward hooks; nothing in the model is replaced):
- activations: RMS and max-abs of every sublayer's input (before its own pre-norm), per sublayer:
  the hidden state that grows with depth under PreNorm (the AttnRes papers' motivation, and MGR's
  claim); and its growth, the last sublayer's input RMS over the first's and over layer 1's first
  (two numbers per run);
- routing (AttnRes family, WAV): the mean softmax weight of each reader on each source, and for
  WAV the total weight on detail sources per reader; DenseFormer: its DWA weights alpha (the
  paper's matrix: a row per average, a column per stored state); MUDDFormer: the mean dynamic
  weight of each layer's residual way on each state (every way's in the JSON, `dense_weights`);
- streams (hc, the mHC family, mgr): the mean pairwise angular distance between the streams each
  sublayer reads (0 = identical directions, 1 = opposite);
- composite gain (hc, the mHC family: mhc, mhc_lite, kromhc; frac, over its fractions): the product of
  the mixing matrices of sublayers 0..l, per token; its largest absolute row sum (forward gain) and column
  sum (backward gain), the worst token, for every depth l (the mHC paper's measure: 1 for doubly
  stochastic mixing);
- gates (mgr): the mean gate beta of every stream at every gated sublayer;
- pruning: the validation-loss increase when one transformer layer's updates are skipped (both of
  its sublayers return zero), for every layer; on the run's own validation tokens (the eval_tokens
  of its config, unless --eval_tokens says otherwise), so the full model's loss is train.py's.
Plots need matplotlib (optional); without it only analysis.json is written.

How it watches: each routing computation of residuals.py is a call of a small submodule (a
DepthAttention read, HC's and Frac's connections, the mHC family's coefficients, MGR's AttnPool and
gates), picked by its class, so a forward hook sees its inputs and outputs; a depth read's weights are recomputed from its inputs
with DepthAttention.weights. DenseFormer's DWA and MUDD's weight generator are submodules too.
WATCHERS maps each kind of routing submodule to what is recorded of it: a new method's own kind of
submodule gets its diagnostic there, and it appears in analysis.json under its own key.
"""
import collections
import functools
import json
import math
import os
import sys

import torch

import configurator
import data
from model import GPT, CheckpointError, load_checkpoint
from residuals import (DepthAttention, DepthWeightedAverage, DynamicDenseWeights, HCConnections, HyperConnections,
                       ManifoldCoefficients, MultiGateResiduals, StreamGates)

out_dir = 'out'  # one run folder, or several separated by commas
ckpt_name = 'ckpt.pt'
report_dir = 'analysis'
batch_size = 8  # sequences in the fixed batch for activations, routing and streams
eval_tokens = 0  # validation tokens per pruning evaluation (the first ones of the val split); 0 = the run's own


def record(model, idx):
    """One forward of idx through the reference path, watched by forward hooks. Returns every
    sublayer's input and, per routing submodule call in order: the depth reads (reader index, mean
    weights per source, number of detail sources), the streams each sublayer reads (n, B, T, C),
    the stream-mixing matrices (hc: A_r^T, mhc_lite: H_res; (B, T, n, n)), MGR's gates (n, B, T) and
    MUDD's mean weights per way and state. DenseFormer's averages and MUDD's residual way count as reads.
    A watcher added to WATCHERS records under keys of its own."""
    rec = collections.defaultdict(list)  # the keys of RECORDED, and those of new watchers
    hooks = watch(model, rec)
    backend = model.kernels
    model.set_kernels('reference')
    try:
        with torch.no_grad():
            model(idx)
    finally:
        model.set_kernels(backend)
        for hook in hooks:
            hook.remove()
    return rec


def on_connections(rec, residual, module, args, output):
    # hc: [A_m | A_r], B, of the streams H (B, T, n, C); frac: [Gamma | A]
    i, H = args
    if isinstance(residual, HyperConnections):  # (a frac's rows are fractions, not streams)
        rec['streams'].append(H.detach().movedim(-2, 0))
    n = H.shape[-2]  # the mixing of the rows: A_r (hc), A (frac), the last n columns
    rec['mixing'].append(output[0][..., -n:].transpose(-1, -2).detach().expand(*H.shape[:-2], -1, -1))


def on_coefficients(rec, residual, module, args, output):  # the mHC family: H_pre, H_post, H_res of the streams x
    i, x = args
    rec['streams'].append(x.detach().movedim(-2, 0))
    rec['mixing'].append(output[2].detach())


def on_average(rec, residual, module, args, output):  # DenseFormer: row r of alpha over the states X_0..X_r
    r, states = args
    rec['reads'].append({'reader': r - 1, 'weights': module.alpha[r - 1, :r + 1].tolist(), 'details': 0})


def on_dense(rec, residual, module, args, w):  # MUDD: w (ways, B, T, i+2); the residual way is the last
    i, newest = args
    means = w.float().mean(dim=(1, 2)).tolist()
    rec['dense'].append(means)
    rec['reads'].append({'reader': i, 'weights': means[-1], 'details': 0})


def on_gates(rec, residual, module, args, beta):  # MGR: the gates (n, B, T)
    rec['gates'].append(beta.detach())


# A routing submodule's diagnostic, by its class (subclasses too): called as watcher(rec, residual,
# module, args, output) after each of its forwards. A new kind of submodule gets its own with a line
# here; what it appends to rec under a key of its own (numbers, or lists of them) is reported under
# that key in analysis.json. Depth reads (DepthAttention) are watched in watch(), in every method.
WATCHERS = {DepthWeightedAverage: on_average, DynamicDenseWeights: on_dense, HCConnections: on_connections,
            ManifoldCoefficients: on_coefficients, StreamGates: on_gates}
RECORDED = ('inputs', 'reads', 'streams', 'mixing', 'gates', 'dense')  # turned into numbers by analyze()


def watch(model, rec):
    """The forward hooks that fill rec (see record) on the sublayers, the depth reads and the routing
    submodules of WATCHERS; returns their handles."""
    residual, hooks = model.residual, []

    def on_read(module, args, kwargs, output):
        i, sources, *rest = args
        weights = module.weights(*args, **kwargs).mean(dim=(1, 2)).tolist()
        rec['reads'].append({'reader': i, 'weights': weights, 'details': len(kwargs.get('details', rest[0] if rest else ()))})

    def on_pool(module, args, output):  # MGR's AttnPool reads the streams (n, B, T, C)
        i, streams = args
        if i < model.config.n_layer * 2:
            rec['streams'].append(streams.detach())

    for f in model.sublayers():
        hooks.append(f.register_forward_pre_hook(lambda module, args: rec['inputs'].append(args[0].detach())))
    for module in residual.modules():
        if isinstance(module, DepthAttention):  # a depth read, or MGR's AttnPool
            pooled = isinstance(residual, MultiGateResiduals) and module is residual.pool
            hooks.append(module.register_forward_hook(on_pool) if pooled else
                         module.register_forward_hook(on_read, with_kwargs=True))
        hooks += [module.register_forward_hook(functools.partial(watcher, rec, residual))
                  for cls, watcher in WATCHERS.items() if isinstance(module, cls)]
    return hooks


def activation_stats(inputs):
    """Per sublayer, the RMS and max |h| of its input, and its growth with depth: the last sublayer's
    input RMS over the first's (the embedding's, for most methods) and over the third's (layer 1's
    attention: the growth past layer 0, whose first update sets the scale)."""
    rms = [h.pow(2).mean().sqrt().item() for h in inputs]
    return {'rms': rms, 'max_abs': [h.abs().max().item() for h in inputs],
            'growth': {'from_first': rms[-1] / rms[0], 'past_layer_0': rms[-1] / rms[2] if len(rms) > 2 else None}}


def routing_stats(reads):
    """Per reader: the mean weight on each source (the details last), and the total on details."""
    return {'reader': [r['reader'] for r in reads],
            'mean_weights': [r['weights'] for r in reads],
            'detail_weight': [sum(r['weights'][len(r['weights']) - r['details']:]) if r['details'] else 0.0
                              for r in reads]}


def stream_angles(streams):
    """Mean pairwise angular distance (angle / pi) between the streams (n, B, T, C), per sublayer."""
    angles = []
    for s in streams:
        unit = torch.nn.functional.normalize(s.float(), dim=-1)
        pairs = [(a, b) for a in range(len(unit)) for b in range(a)]
        if not pairs:
            angles.append(0.0)
            continue
        # the angle between unit vectors as 2 atan2(|a - b|, |a + b|): exact near 0 and pi, unlike arccos
        angle = torch.stack([2 * torch.atan2((unit[a] - unit[b]).norm(dim=-1), (unit[a] + unit[b]).norm(dim=-1))
                             for a, b in pairs])
        angles.append((angle / math.pi).mean().item())
    return angles


def composite_gain(mixing):
    """For each depth l, the product M_l ... M_0 of the per-token mixing matrices (..., n, n) and its
    worst token's largest absolute row sum (forward gain) and column sum (backward gain)."""
    forward, backward, product = [], [], None
    for M in mixing:
        product = M.double() if product is None else M.double() @ product
        forward.append(product.abs().sum(-1).amax().item())
        backward.append(product.abs().sum(-2).amax().item())
    return {'forward': forward, 'backward': backward}


def pruning(model, val_tokens, block_size, budget, batch_size):
    """Val loss on `budget` tokens with all layers, then with each layer's updates skipped in turn
    (a forward hook makes both of its sublayers return zeros)."""
    device, ctx = torch.device('cpu'), torch.no_grad()
    evaluate = lambda: data.evaluate(model, val_tokens, block_size, budget, batch_size, device, ctx)
    base, increases = evaluate(), []
    for block in model.transformer.h:
        hooks = [f.register_forward_hook(lambda module, args, out: torch.zeros_like(out)) for f in (block.attn, block.mlp)]
        try:
            increases.append(evaluate() - base)
        finally:
            for hook in hooks:
                hook.remove()
    tokens = min(budget, len(val_tokens) - 1) // block_size * block_size  # whole windows, as data.evaluate reads
    return {'val_loss': base, 'tokens': tokens, 'increase': increases}


def analyze(path, n_sequences, budget):
    """The diagnostics of one checkpoint; budget: validation tokens for pruning, 0 = the run's eval_tokens."""
    ckpt = load_checkpoint(path)
    model = GPT.from_checkpoint(ckpt, path).eval()
    ds = data.load(ckpt['config']['dataset'], ckpt['config']['data_dir'])
    T = model.config.block_size
    val = ds.splits['val']
    n = min(n_sequences, (len(val) - 1) // T)
    idx, _ = data.get_batch(val, [i * T for i in range(n)], T, torch.device('cpu'))
    rec = record(model, idx)
    result = {'checkpoint': path, 'residual': model.config.residual, 'n_layer': model.config.n_layer,
              'iter': ckpt['iter_num'], 'activations': activation_stats(rec['inputs'])}
    if rec['reads']:
        result['routing'] = routing_stats(rec['reads'])
    if rec['dense']:
        result['dense_weights'] = rec['dense']
    if rec['streams']:
        result['streams'] = {'angular_distance': stream_angles(rec['streams'])}
    if rec['mixing']:
        result['composite_gain'] = composite_gain(rec['mixing'])
    if rec['gates']:
        result['gates'] = [beta.float().mean(dim=(1, 2)).tolist() for beta in rec['gates']]
    result.update({key: values for key, values in rec.items() if key not in RECORDED and values})
    run = ckpt['config']  # the run's own evaluation: its tokens, in its batches
    result['pruning'] = pruning(model, val, T, budget or run['eval_tokens'], run['batch_size'])
    return result


def plot(results, folder):
    """The figures of the results that have something to show, as PNGs in folder; returns their names."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed, so no plots; pip install matplotlib", file=sys.stderr)
        return []
    names = [r['residual'] for r in results]
    label = lambda r: r['residual'] if names.count(r['residual']) == 1 else \
        f"{r['residual']} ({os.path.basename(os.path.dirname(r['checkpoint'])) or r['checkpoint']})"
    written = []
    for name, draw in (('activations.png', plot_activations), ('pruning.png', plot_pruning),
                       ('routing.png', plot_routing), ('streams.png', plot_streams),
                       ('composite_gain.png', plot_composite_gain), ('gates.png', plot_gates)):
        fig = draw(plt, results, label)
        if fig is not None:
            fig.tight_layout()
            fig.savefig(os.path.join(folder, name), dpi=100)
            plt.close(fig)
            written.append(name)
    return written


def plot_activations(plt, results, label):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        for ax, key in zip(axes, ('rms', 'max_abs')):
            ax.plot(r['activations'][key], marker='.', label=label(r))
    for ax, key in zip(axes, ('RMS', 'max |h|')):
        ax.set(xlabel='sublayer (attention even, MLP odd)', ylabel=f'{key} of the sublayer input', yscale='log')
        ax.legend(fontsize=8)
    return fig


def plot_pruning(plt, results, label):
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        ax.plot(range(len(r['pruning']['increase'])), r['pruning']['increase'], marker='o', label=label(r))
    ax.set(xlabel='layer skipped', ylabel='val loss increase (nats)')
    ax.legend(fontsize=8)
    return fig


def plot_routing(plt, results, label):
    """A heat map of the mean weights per routed result, and every result's total weight on details."""
    routed = [r for r in results if 'routing' in r]
    if not routed:
        return None
    fig, axes = plt.subplots(1, len(routed) + 1, figsize=(5 * (len(routed) + 1), 4), squeeze=False)
    for ax, r in zip(axes[0], routed):
        weights = r['routing']['mean_weights']
        width = max(len(w) for w in weights)
        grid = torch.full((len(weights), width), float('nan'))
        for row, w in enumerate(weights):
            grid[row, :len(w)] = torch.tensor(w)
        image = ax.imshow(grid.numpy(), aspect='auto', origin='lower', cmap='viridis')
        ax.set(title=f"{label(r)}: mean weight", xlabel='source (e first, details last)',
               ylabel='reader (last = output)')
        fig.colorbar(image, ax=ax)
    for r in routed:
        axes[0][-1].plot(r['routing']['detail_weight'], marker='.', label=label(r))
    axes[0][-1].set(xlabel='reader', ylabel='total weight on detail sources')
    axes[0][-1].legend(fontsize=8)
    return fig


def plot_streams(plt, results, label):
    streamed = [r for r in results if 'streams' in r]
    if not streamed:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in streamed:
        ax.plot(r['streams']['angular_distance'], marker='.', label=label(r))
    ax.set(xlabel='sublayer', ylabel='mean pairwise angular distance of streams')
    ax.legend(fontsize=8)
    return fig


def plot_composite_gain(plt, results, label):
    mixed = [r for r in results if 'composite_gain' in r]
    if not mixed:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in mixed:
        for key, style in (('forward', '-'), ('backward', '--')):
            ax.plot(r['composite_gain'][key], style, label=f"{label(r)} {key}")
    ax.set(xlabel='sublayer l', ylabel='gain of the mixing product up to l', yscale='log')
    ax.legend(fontsize=8)
    return fig


def plot_gates(plt, results, label):
    gated = [r for r in results if 'gates' in r]
    if not gated:
        return None
    fig, axes = plt.subplots(1, len(gated), figsize=(5 * len(gated), 4), squeeze=False)
    for ax, r in zip(axes[0], gated):
        image = ax.imshow(torch.tensor(r['gates']).T.numpy(), aspect='auto', origin='lower', cmap='magma')
        ax.set(title=f"{label(r)}: mean gate", xlabel='gated sublayer', ylabel='stream',
               yticks=range(len(r['gates'][0])))
        fig.colorbar(image, ax=ax)
    return fig


def main(argv):
    cfg, _ = configurator.parse(argv, configurator.keys_of(globals()), __doc__)
    configurator.check(cfg, {'batch_size': (lambda v: v >= 1, 'at least 1'),
                             'eval_tokens': (lambda v: v >= 0, "at least 0 (0 = the run's own)")})
    try:
        results = [analyze(os.path.join(folder, cfg['ckpt_name']), cfg['batch_size'], cfg['eval_tokens'])
                   for folder in cfg['out_dir'].split(',')]
    except (CheckpointError, data.DataError) as e:
        sys.exit(f"error: {e}")
    os.makedirs(cfg['report_dir'], exist_ok=True)
    with open(os.path.join(cfg['report_dir'], 'analysis.json'), 'w') as f:
        json.dump(results, f, indent=1)
    written = plot(results, cfg['report_dir'])
    for r in results:
        act, growth = r['activations'], r['activations']['growth']
        print(f"{r['checkpoint']}: {r['residual']}, val loss {r['pruning']['val_loss']:.4f} on "
              f"{r['pruning']['tokens']:,} tokens, input RMS "
              f"{act['rms'][0]:.3f} -> {act['rms'][-1]:.3f} over {len(act['rms'])} sublayers ({growth['from_first']:.2f}x"
              + (f"; past layer 0: {growth['past_layer_0']:.2f}x)" if growth['past_layer_0'] else ')')
              + f", most harmful layer to skip: {max(range(len(r['pruning']['increase'])), key=r['pruning']['increase'].__getitem__)}")
    print(f"wrote {os.path.join(cfg['report_dir'], 'analysis.json')}" + (f" and {', '.join(written)}" if written else ''))


if __name__ == '__main__':
    main(sys.argv[1:])
