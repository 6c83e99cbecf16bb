"""
Train a GPT with a chosen residual method, nanoGPT-style.

    python train.py                                   # embedded text, small model, CPU minutes
    python train.py --residual=wav --n_layer=48 --dataset=text8
    python train.py config/some_config.py --seed=2    # config files, then --key=value
    python train.py --out_dir=out --init_from=resume  # continue a run where it stopped
    torchrun --standalone --nproc_per_node=2 train.py --device=cpu   # DDP (gloo on CPU)

Every default below, and every field of model.GPTConfig, is a key. Values are type-checked
against the defaults and range-checked before anything is written; unknown keys and bad values
fail with one line naming the key and what would be right. Under DDP the global batch stays
gradient_accumulation_steps x batch_size sequences: the processes share out whole micro-steps
when they divide evenly, else the sequences of every micro-step.
"""
import json
import math
import os
import sys
import time
from dataclasses import asdict, fields

import torch
from tqdm import tqdm

import configurator
import data
from model import COMPILE_MODES, COMPILE_SCOPES, GPT, GPTConfig, CheckpointError, load_checkpoint, save_checkpoint

# -----------------------------------------------------------------------------
# defaults: a small model (GPTConfig's defaults: 4 layers, width 128, context 128) that learns the
# embedded text in a few CPU minutes
# I/O
out_dir = 'out'
init_from = 'scratch'  # 'scratch' or 'resume' (continue out_dir/ckpt.pt)
eval_interval = 200
eval_tokens = 32768  # fixed validation budget: the first eval_tokens+1 tokens of the val split
log_interval = 10
seed = 1337
# data
dataset = 'pydoc'  # see data.py
data_dir = 'data'
batch_size = 32  # sequences per micro-step
gradient_accumulation_steps = 1  # micro-steps per step, over all processes (fixed global batch)
# model: every field of model.GPTConfig is a key too (--residual=wav, --n_layer=12, --res_block_size=2, ...)
# AdamW with warmup and cosine decay
learning_rate = 2e-3
max_iters = 1200
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.99
grad_clip = 1.0  # 0 = off
warmup_iters = 100
lr_decay_iters = 0  # 0 = max_iters
min_lr = 2e-4
# system
device = 'auto'  # auto = cuda > mps > cpu; or e.g. cpu, cuda, cuda:1
dtype = 'auto'  # auto = bfloat16 on a GPU that supports it, else float32
compile = False  # torch.compile the model (the first steps then take a while)
compile_scope = 'model'  # model: one graph, the routing included (minutes for deep models on a CPU);
# sublayers: each attention and MLP compiled once and reused at every layer (seconds at any depth;
# the routing then runs eager)
compile_mode = 'default'  # torch.compile's mode: default, reduce-overhead (CUDA graphs) or max-autotune
kernels = 'auto'  # how the routing runs (kernels.py): reference, torch, triton; auto = triton on CUDA, else torch
mgr_fallback_p = 1  # MGR's fast backward inverts the lerp, keeping p originals per token; -1 = no inversion
# logging to Weights & Biases (optional: pip install wandb), the records of log.jsonl
wandb_log = False
wandb_project = 'residual-routing'
wandb_run_name = ''  # '' = the out_dir's name
# -----------------------------------------------------------------------------

MODEL_KEYS = [f.name for f in fields(GPTConfig) if f.name != 'vocab_size']  # vocab_size comes from the dataset


def default_config():
    return {**{f.name: f.default for f in fields(GPTConfig) if f.name in MODEL_KEYS}, **configurator.keys_of(globals())}


AT_LEAST_1, AT_LEAST_0 = (lambda v: v >= 1, 'at least 1'), (lambda v: v >= 0, 'at least 0')
RULES = {  # the ranges of this script's numbers (the model's are checked by GPTConfig)
    'eval_interval': AT_LEAST_1, 'eval_tokens': AT_LEAST_1, 'log_interval': AT_LEAST_1, 'seed': AT_LEAST_0,
    'batch_size': AT_LEAST_1, 'gradient_accumulation_steps': AT_LEAST_1, 'max_iters': AT_LEAST_0,
    'learning_rate': (lambda v: v > 0, 'above 0'), 'min_lr': AT_LEAST_0, 'weight_decay': AT_LEAST_0,
    'beta1': (lambda v: 0 <= v < 1, 'in [0, 1)'), 'beta2': (lambda v: 0 <= v < 1, 'in [0, 1)'),
    'grad_clip': AT_LEAST_0, 'warmup_iters': AT_LEAST_0, 'lr_decay_iters': AT_LEAST_0,
    'mgr_fallback_p': (lambda v: v >= -1, '-1 (no inversion) or at least 0'),
    'init_from': (lambda v: v in ('scratch', 'resume'), 'scratch or resume'),
    'compile_scope': (lambda v: v in COMPILE_SCOPES, ' or '.join(COMPILE_SCOPES)),
    'compile_mode': (lambda v: v in COMPILE_MODES, ' or '.join(COMPILE_MODES)),
}


def parse_config(argv):
    """This script's config (see configurator.py) and the keys set explicitly; exits with one
    line on a bad key or value."""
    cfg, given = configurator.parse(argv, default_config(), __doc__)
    configurator.check(cfg, RULES)
    if cfg['eval_tokens'] < cfg['block_size']:
        sys.exit(f"error: eval_tokens={cfg['eval_tokens']} is less than one validation window; it must be at least "
                 f"block_size={cfg['block_size']}")
    try:
        GPTConfig(**{k: cfg[k] for k in MODEL_KEYS})
    except ValueError as e:
        sys.exit(f"error: {e}")
    return cfg, given


# ----------------------------------------------------------------------------- batches, learning rate, metrics

def draw_offsets(generator, n_tokens, block_size, micro_steps, batch_size, rank, world):
    """One step's batch start offsets for this rank, as (micro-steps, sequences). The generator is
    seeded alike on every rank and draws the global batch (micro_steps, batch_size); rank r keeps
    micro-steps r, r+world, ... when they divide evenly, else sequences r, r+world, ... of every
    micro-step. So ranks see different data, together exactly one process's, and resume restores it."""
    offsets = torch.randint(n_tokens - block_size, (micro_steps, batch_size), generator=generator)
    return offsets[rank::world] if micro_steps % world == 0 else offsets[:, rank::world]


def get_lr(it, cfg):
    """Linear warmup, then cosine decay to min_lr at lr_decay_iters (0 = max_iters)."""
    decay_iters = cfg['lr_decay_iters'] or cfg['max_iters']
    if it < cfg['warmup_iters']:
        return cfg['learning_rate'] * (it + 1) / (cfg['warmup_iters'] + 1)
    if it >= decay_iters:
        return cfg['min_lr']
    ratio = (it - cfg['warmup_iters']) / max(1, decay_iters - cfg['warmup_iters'])
    return cfg['min_lr'] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg['learning_rate'] - cfg['min_lr'])


def val_metrics(val_loss, char_level):
    metrics = {'val_loss': val_loss, 'val_ppl': math.exp(min(val_loss, 700))}
    if char_level:
        metrics['val_bpc'] = val_loss / math.log(2)
    return metrics


# ----------------------------------------------------------------------------- main

def resume_config(cfg, given):
    """For --init_from=resume: load out_dir/ckpt.pt and continue with its config, except for the
    keys given on this command line (e.g. a larger max_iters). Model keys cannot change."""
    ckpt_path = os.path.join(cfg['out_dir'], 'ckpt.pt')
    if cfg['init_from'] != 'resume':
        if os.path.exists(ckpt_path):
            raise CheckpointError(f"{ckpt_path} already exists; continue it with --init_from=resume, or choose "
                                  f"another --out_dir (nothing was overwritten)")
        return None
    ckpt = load_checkpoint(ckpt_path)
    for key in MODEL_KEYS:
        if key in given and cfg[key] != ckpt['config'][key]:
            raise CheckpointError(f"{ckpt_path} was trained with {key}={ckpt['config'][key]!r}; "
                                  f"--{key}={cfg[key]!r} cannot change it on resume")
    cfg.update({k: v for k, v in ckpt['config'].items() if k not in given})
    return ckpt


def build(cfg, device):
    """The dataset and the model; raises DataError or ValueError on bad input."""
    ds = data.load(cfg['dataset'], cfg['data_dir'], download=False)  # no multi-GB download unasked
    for split in ('train', 'val'):
        if len(ds.splits[split]) <= cfg['block_size']:
            raise data.DataError(f"the {split} split of {cfg['dataset']} has {len(ds.splits[split])} tokens, "
                                 f"fewer than block_size={cfg['block_size']}+1")
    gptconf = GPTConfig(**{k: cfg[k] for k in MODEL_KEYS}, vocab_size=ds.vocab_size)
    return ds, GPT(gptconf).to(device)


def main(argv):
    cfg, given = parse_config(argv)
    try:  # everything that can fail on bad input, before anything is written
        ckpt = resume_config(cfg, given)
    except CheckpointError as e:
        sys.exit(f"error: {e}")
    ddp = int(os.environ.get('RANK', -1)) != -1
    if ddp:
        backend = 'nccl' if cfg['device'] != 'cpu' and torch.cuda.is_available() else 'gloo'
        torch.distributed.init_process_group(backend=backend)
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        if cfg['gradient_accumulation_steps'] % world and cfg['batch_size'] % world:
            sys.exit(f"error: the global batch of gradient_accumulation_steps={cfg['gradient_accumulation_steps']} x "
                     f"batch_size={cfg['batch_size']} sequences cannot be shared out evenly over {world} processes; "
                     f"make one of them a multiple of {world}")
    else:
        rank, world = 0, 1
    master = rank == 0
    try:
        if ddp and backend == 'nccl':
            device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}")
            torch.cuda.set_device(device)
        else:
            device = configurator.resolve_device(cfg['device'])
        dtype, ctx = configurator.precision(device, cfg['dtype'])
    except ValueError as e:
        sys.exit(f"error: {e}")
    torch.manual_seed(cfg['seed'] + rank)
    if ckpt is not None and ckpt.get('threads', torch.get_num_threads()) != torch.get_num_threads():
        # CPU results depend on the number of threads (they split the sums), so a resumed run takes the
        # run's own number to compute what the uninterrupted run would have
        if master:
            print(f"note: resuming with the {ckpt['threads']} CPU thread(s) this run was started with (this process "
                  f"has {torch.get_num_threads()}), to repeat its arithmetic exactly", file=sys.stderr)
        torch.set_num_threads(ckpt['threads'])
    try:
        if ddp and not master:
            torch.distributed.barrier()  # rank 0 prepares (downloads) the dataset first, alone
        ds, model = build(cfg, device)
        if ddp and master:
            torch.distributed.barrier()
        if ckpt is not None:
            model.load_state_dict(ckpt['model'])
        kernels_used = model.set_kernels(cfg['kernels'], cfg['mgr_fallback_p'])
    except (data.DataError, ValueError, RuntimeError) as e:
        sys.exit(f"error: {e}")
    if master:
        os.makedirs(cfg['out_dir'], exist_ok=True)
    raw_model = model
    optimizer = model.configure_optimizers(cfg['weight_decay'], cfg['learning_rate'],
                                           (cfg['beta1'], cfg['beta2']), device.type)
    data_gen = torch.Generator().manual_seed(cfg['seed'])
    iter_num, best_val_loss, resumed_from = 0, float('inf'), -1
    if ckpt is not None:
        optimizer.load_state_dict(ckpt['optimizer'])
        iter_num = resumed_from = ckpt['iter_num']
        best_val_loss = ckpt['best_val_loss']
        data_gen.set_state(ckpt['rng']['data'])
        if rank == 0:
            torch.set_rng_state(ckpt['rng']['torch'])  # dropout; other ranks keep their own seeds
        del ckpt
    if cfg['compile']:
        if master:
            print("compiling each sublayer with torch.compile: the first step takes a while"
                  if cfg['compile_scope'] == 'sublayers' else
                  "compiling the model with torch.compile: the first steps take a while (minutes for deep models "
                  "on a CPU; --compile_scope=sublayers takes seconds)", file=sys.stderr)
        model = model.compiled(cfg['compile_scope'], cfg['compile_mode'])
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == 'cuda' else None)

    log_path = os.path.join(cfg['out_dir'], 'log.jsonl')
    if master and resumed_from >= 0:
        keep_history(log_path, resumed_from)
    wandb = start_wandb(cfg) if master and cfg['wandb_log'] else None

    def log(record):
        if master:
            with open(log_path, 'a') as f:
                f.write(json.dumps(record) + '\n')
            if wandb is not None and 'iter' in record:
                wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float)) and k != 'iter'},
                          step=record['iter'])

    G, B, T = cfg['gradient_accumulation_steps'], cfg['batch_size'], cfg['block_size']
    tokens_per_iter = G * B * T
    train_tokens, val_tokens = ds.splits['train'], ds.splits['val']
    passes = cfg['max_iters'] * tokens_per_iter / len(train_tokens)
    if master and passes > 1:
        print(f"note: {cfg['max_iters']} steps read {cfg['max_iters'] * tokens_per_iter:,} tokens, {passes:.1f} passes "
              f"over the {len(train_tokens):,}-token train split", file=sys.stderr)
    if master:
        print(f"{cfg['residual']}: {raw_model.get_num_params() / 1e6:.3f}M parameters, {cfg['dataset']} "
              f"(vocab {ds.vocab_size}), {tokens_per_iter:,} tokens/step, {world} process(es) on {device} {dtype}, "
              f"kernels {kernels_used}")
    log({'event': 'resume' if resumed_from >= 0 else 'start', 'iter': iter_num, 'config': cfg})

    def stop(message):
        bar.close()
        if ddp:
            torch.distributed.destroy_process_group()
        sys.exit(message if master else 1)

    metrics, saved_iter = {}, resumed_from
    # a progress bar on a terminal; in a file (a sweep's or nohup's log) one plain line per log interval instead
    terminal = sys.stderr.isatty()
    bar = tqdm(total=cfg['max_iters'], initial=iter_num, disable=not master or not terminal, dynamic_ncols=True,
               desc='train')
    t_start, train_time, logged_steps = time.time(), 0.0, 0
    # The loss stays on the device between log steps: reading it every step would make the host wait
    # for the GPU at every step, exposing every launch's latency. Whether any step's loss was not
    # finite is kept there too (a flag), and checked where the loss is read: at every log step, which
    # is also every step before an evaluation (so no checkpoint is written after a bad step).
    nonfinite, checked_iter = torch.zeros((), device=device, dtype=torch.bool), iter_num
    try:
        while True:
            if master and (iter_num == cfg['max_iters'] or iter_num % cfg['eval_interval'] == 0) and iter_num != resumed_from:
                val_loss = data.evaluate(raw_model, val_tokens, T, cfg['eval_tokens'], B, device, ctx)
                if not math.isfinite(val_loss):
                    stop(f"error: val loss is {val_loss} at iter {iter_num}; stopped. The last good checkpoint is kept "
                         f"in {cfg['out_dir']}. Try a lower learning_rate, or dtype=float32.")
                metrics = val_metrics(val_loss, ds.char_level)
                bar.write(f"iter {iter_num}: " + ', '.join(f'{k} {v:.4f}' for k, v in metrics.items()))
                log({'iter': iter_num, **metrics})
                best_val_loss = min(best_val_loss, val_loss)
                checkpoint = {
                    'model': raw_model.state_dict(), 'optimizer': optimizer.state_dict(),
                    'model_args': asdict(raw_model.config), 'config': cfg, 'iter_num': iter_num,
                    'val_loss': val_loss, 'best_val_loss': best_val_loss,
                    'rng': {'torch': torch.get_rng_state(), 'data': data_gen.get_state()},
                    'threads': torch.get_num_threads(),
                }
                save_checkpoint(checkpoint, os.path.join(cfg['out_dir'], 'ckpt.pt'))
                saved_iter = iter_num
                if val_loss == best_val_loss:
                    save_checkpoint(checkpoint, os.path.join(cfg['out_dir'], 'best.pt'))
            if iter_num >= cfg['max_iters']:
                break

            t0 = time.time()
            lr = get_lr(iter_num, cfg)
            for group in optimizer.param_groups:
                group['lr'] = lr
            offsets = draw_offsets(data_gen, len(train_tokens), T, G, B, rank, world)
            loss_sum = torch.zeros((), device=device)
            for micro, micro_offsets in enumerate(offsets):
                x, y = data.get_batch(train_tokens, micro_offsets.tolist(), T, device)
                if ddp:  # all-reduce gradients on the last micro-step only
                    model.require_backward_grad_sync = micro == len(offsets) - 1
                with ctx:
                    _, loss = model(x, y)
                (loss / len(offsets)).backward()  # DDP then averages over ranks: the mean over the global batch
                loss_sum += loss.detach() / len(offsets)
            if cfg['grad_clip']:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg['grad_clip'])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            nonfinite |= ~torch.isfinite(loss_sum)
            iter_num += 1
            if iter_num % cfg['log_interval'] == 0 or iter_num % cfg['eval_interval'] == 0 or iter_num == cfg['max_iters']:
                if ddp:  # the ranks agree on the loss and on stopping
                    state = torch.stack([loss_sum, nonfinite.to(loss_sum.dtype)])
                    torch.distributed.all_reduce(state)
                    loss_sum, nonfinite = state[0] / world, state[1] > 0
                lossf, bad = loss_sum.item(), nonfinite.item()  # the host waits for the device here only
                if bad:
                    stop(f"error: training loss is not finite in a step after iter {checked_iter} up to iter {iter_num} "
                         f"(the last: {lossf}); stopped. The last good checkpoint is kept in {cfg['out_dir']}. Try a "
                         "lower learning_rate, or dtype=float32.")
                checked_iter = iter_num
            train_time, logged_steps = train_time + time.time() - t0, logged_steps + 1
            bar.update(1)
            if iter_num % cfg['log_interval'] == 0 or iter_num == cfg['max_iters']:
                # training steps only, not evaluation; the device's time counts at the log step's read
                tok_s = logged_steps * tokens_per_iter / max(train_time, 1e-9)
                train_time, logged_steps = 0.0, 0
                bar.set_postfix(loss=f'{lossf:.4f}', tok_s=f'{tok_s:,.0f}')
                if master and not terminal:
                    print(f"iter {iter_num}/{cfg['max_iters']}: loss {lossf:.4f}, lr {lr:.2e}, {tok_s:,.0f} tokens/s",
                          file=sys.stderr, flush=True)
                log({'iter': iter_num, 'loss': lossf, 'lr': lr, 'tokens_per_s': tok_s})
    except KeyboardInterrupt:  # Ctrl-C: say where the run can go on from
        bar.close()
        if master:
            print(f"interrupted at iter {iter_num}; the last checkpoint, {os.path.join(cfg['out_dir'], 'ckpt.pt')}, is "
                  f"from iter {saved_iter}: continue with  python train.py --out_dir={cfg['out_dir']} --init_from=resume"
                  if saved_iter >= 0 else f"interrupted at iter {iter_num}, before the first checkpoint", file=sys.stderr)
        sys.exit(130)
    bar.close()
    if metrics:
        log({'event': 'done', 'iter': iter_num, **metrics})
    if master:
        wall = time.time() - t_start
        if metrics:
            print(f"final val loss {metrics['val_loss']:.4f} nats" +
                  (f", {metrics['val_bpc']:.4f} bpc" if 'val_bpc' in metrics else '') +
                  f", ppl {metrics['val_ppl']:.3f} at iter {iter_num} ({wall:.0f}s)")
        else:
            print(f"{cfg['out_dir']} already finished at iter {iter_num}; nothing to do")
    if wandb is not None:
        wandb.finish()
    if ddp:
        torch.distributed.destroy_process_group()
    return metrics


def keep_history(log_path, resumed_from):
    """On resume, drop the log rows past the checkpoint (the killed run's last steps, which the
    resumed run does again), so that log.jsonl tells one history. Atomic, like the checkpoints."""
    if not os.path.exists(log_path):
        return
    with open(log_path) as f:
        lines = [line for line in f if line.strip()]
    kept = []
    for line in lines:
        try:
            if json.loads(line).get('iter', 0) <= resumed_from:
                kept.append(line)
        except json.JSONDecodeError:  # a line cut short by the kill
            pass
    with open(log_path + '.tmp', 'w') as f:
        f.writelines(kept)
    os.replace(log_path + '.tmp', log_path)


def start_wandb(cfg):
    """Weights & Biases, imported only when --wandb_log=True (an optional dependency)."""
    try:
        import wandb
    except ImportError:
        sys.exit("error: --wandb_log=True needs the wandb package: pip install wandb")
    wandb.init(project=cfg['wandb_project'], name=cfg['wandb_run_name'] or os.path.basename(os.path.abspath(cfg['out_dir'])),
               config=cfg)
    return wandb


if __name__ == '__main__':
    try:
        main(sys.argv[1:])
    except SystemExit as stop:  # under torchrun, rank 0 alone says what went wrong
        if int(os.environ.get('RANK', 0)) != 0 and isinstance(stop.code, str):
            sys.exit(1)
        raise
