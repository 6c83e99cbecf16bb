"""
The papers' diagnostics for trained checkpoints, as PNG plots and one JSON of the numbers.

    python analyze.py --out_dir=out-prenorm,out-wav,out-mgr --report_dir=analysis

For each checkpoint, on a fixed batch of its validation split:
- activations: RMS and max-abs of every sublayer's input (before its own pre-norm), per sublayer:
  the "massive activations" that grow with depth under PreNorm;
- routing (AttnRes family, WAV): the mean softmax weight each query puts on each source, and for
  WAV the total weight on detail sources per query;
- streams (hc, mhc_lite, mgr): the mean pairwise angular distance between streams after each
  sublayer (0 = identical directions, 1 = opposite);
- pruning: the validation-loss increase when one transformer layer's updates are skipped (both of
  its sublayers return zero), for every layer.
Plots need matplotlib (optional); without it only analysis.json is written.
"""
import json
import math
import os
import sys

import torch

import data
from model import GPT, GPTConfig
from train import CheckpointError, apply_override, evaluate, get_batch, load_checkpoint, module_config

out_dir = 'out'  # one run folder, or several separated by commas
ckpt_name = 'ckpt.pt'
report_dir = 'analysis'
batch_size = 8  # sequences in the fixed batch for activations, routing and streams
eval_tokens = 16384  # validation tokens per pruning evaluation (the first ones of the val split)


def sublayer_inputs(model, idx):
    """Forward idx, recording each sublayer's input; also returns the residual's recordings."""
    inputs, residual = [], model.residual
    sublayers = GPT.sublayers(model)

    def watch(f):
        def watched(h):
            inputs.append(h.detach())
            return f(h)
        return watched
    model.sublayers = lambda: [watch(f) for f in sublayers]
    recorded = residual.recorded = [] if hasattr(residual, 'recorded') else None
    try:
        with torch.no_grad():
            model(idx)
    finally:
        del model.sublayers
        if recorded is not None:
            residual.recorded = None
    return inputs, recorded


def activation_stats(inputs):
    return {'rms': [h.pow(2).mean().sqrt().item() for h in inputs],
            'max_abs': [h.abs().max().item() for h in inputs]}


def routing_stats(recorded):
    """Per query: the mean weight on each source, and the total on detail sources."""
    return {'query': [r['query'] for r in recorded],
            'mean_weights': [r['weights'].mean(dim=(1, 2)).tolist() for r in recorded],
            'detail_weight': [r['weights'][torch.tensor(r['is_detail'])].sum(0).mean().item() for r in recorded]}


def stream_angles(recorded):
    """Mean pairwise angular distance arccos(cos)/pi between the streams (n, B, T, C), per sublayer."""
    angles = []
    for streams in recorded:
        unit = torch.nn.functional.normalize(streams.float(), dim=-1)
        n = len(unit)
        pairs = [(a, b) for a in range(n) for b in range(a)]
        if not pairs:
            angles.append(0.0)
            continue
        cos = torch.stack([(unit[a] * unit[b]).sum(-1) for a, b in pairs])
        angles.append((torch.arccos(cos.clamp(-1, 1)) / math.pi).mean().item())
    return angles


def pruning(model, val_tokens, block_size, budget):
    """Val loss on `budget` tokens with all layers, then with each layer's updates skipped in turn."""
    cfg = {'block_size': block_size, 'eval_tokens': budget, 'batch_size': 16}
    device, ctx = torch.device('cpu'), torch.no_grad()
    base = evaluate(model, val_tokens, cfg, device, ctx)
    sublayers = GPT.sublayers(model)
    skipped = lambda h: torch.zeros_like(h)
    increases = []
    for layer in range(model.config.n_layer):
        model.sublayers = lambda: [skipped if j // 2 == layer else f for j, f in enumerate(sublayers)]
        try:
            increases.append(evaluate(model, val_tokens, cfg, device, ctx) - base)
        finally:
            del model.sublayers
    return {'val_loss': base, 'increase': increases}


def analyze(path, n_sequences, budget):
    ckpt = load_checkpoint(path)
    model = GPT(GPTConfig(**ckpt['model_args']))
    model.load_state_dict(ckpt['model'])
    model.eval()
    ds = data.load(ckpt['config']['dataset'], ckpt['config']['data_dir'])
    T = model.config.block_size
    val = ds.splits['val']
    n = min(n_sequences, (len(val) - 1) // T)
    idx, _ = get_batch(val, [i * T for i in range(n)], T, torch.device('cpu'))
    inputs, recorded = sublayer_inputs(model, idx)
    result = {'checkpoint': path, 'residual': model.config.residual, 'n_layer': model.config.n_layer,
              'iter': ckpt['iter_num'], 'activations': activation_stats(inputs)}
    if recorded and isinstance(recorded[0], dict):
        result['routing'] = routing_stats(recorded)
    elif recorded:
        result['streams'] = {'angular_distance': stream_angles(recorded)}
    result['pruning'] = pruning(model, val, T, budget)
    return result


def plot(results, folder):
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed, so no plots; pip install matplotlib", file=sys.stderr)
        return []
    label = lambda r: f"{r['residual']} ({os.path.basename(os.path.dirname(r['checkpoint'])) or r['checkpoint']})"
    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(os.path.join(folder, name), dpi=100)
        plt.close(fig)
        written.append(name)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        for ax, key in zip(axes, ('rms', 'max_abs')):
            ax.plot(r['activations'][key], marker='.', label=label(r))
    for ax, key in zip(axes, ('RMS', 'max |h|')):
        ax.set(xlabel='sublayer (attention even, MLP odd)', ylabel=f'{key} of the sublayer input', yscale='log')
        ax.legend(fontsize=8)
    save(fig, 'activations.png')

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        ax.plot(range(len(r['pruning']['increase'])), r['pruning']['increase'], marker='o', label=label(r))
    ax.set(xlabel='layer skipped', ylabel='val loss increase (nats)')
    ax.legend(fontsize=8)
    save(fig, 'pruning.png')

    routed = [r for r in results if 'routing' in r]
    if routed:
        fig, axes = plt.subplots(1, len(routed) + 1, figsize=(5 * (len(routed) + 1), 4), squeeze=False)
        for ax, r in zip(axes[0], routed):
            weights = r['routing']['mean_weights']
            width = max(len(w) for w in weights)
            grid = torch.full((len(weights), width), float('nan'))
            for row, w in enumerate(weights):
                grid[row, :len(w)] = torch.tensor(w)
            image = ax.imshow(grid.numpy(), aspect='auto', origin='lower', cmap='viridis')
            ax.set(title=f"{label(r)}: mean weight", xlabel='source (e first)', ylabel='query (last = output)')
            fig.colorbar(image, ax=ax)
        for r in routed:
            axes[0][-1].plot(r['routing']['detail_weight'], marker='.', label=label(r))
        axes[0][-1].set(xlabel='query', ylabel='total weight on detail sources')
        axes[0][-1].legend(fontsize=8)
        save(fig, 'routing.png')

    streamed = [r for r in results if 'streams' in r]
    if streamed:
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in streamed:
            ax.plot(r['streams']['angular_distance'], marker='.', label=label(r))
        ax.set(xlabel='sublayer', ylabel='mean pairwise angular distance of streams')
        ax.legend(fontsize=8)
        save(fig, 'streams.png')
    return written


def main(argv):
    cfg = module_config(globals())
    for arg in argv:
        apply_override(cfg, arg)
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
        print(f"{r['checkpoint']}: {r['residual']}, val loss {r['pruning']['val_loss']:.4f}, input RMS "
              f"{r['activations']['rms'][0]:.3f} -> {r['activations']['rms'][-1]:.3f} over {len(r['activations']['rms'])} "
              f"sublayers, most harmful layer to skip: {max(range(len(r['pruning']['increase'])), key=r['pruning']['increase'].__getitem__)}")
    print(f"wrote {os.path.join(cfg['report_dir'], 'analysis.json')}" + (f" and {', '.join(written)}" if written else ''))


if __name__ == '__main__':
    main(sys.argv[1:])
