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
from dataclasses import asdict, dataclass, field, fields

import torch
from tqdm import tqdm

import configurator
import data
import kernels as kernels_module
from kernels import resolve as resolve_kernels
from model import (COMPILE_MODES, COMPILE_SCOPES, GPT, GPTConfig, CheckpointError, load_checkpoint, load_weights,
                   save_checkpoint)

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
kernels = 'auto'  # how the routing runs (kernels/): reference, torch, triton; auto = triton on CUDA, else torch
mgr_fallback_p = kernels_module.MGR_FALLBACK_P  # MGR's fast backward keeps p originals per token; -1 = no inversion
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
    'mgr_fallback_p': kernels_module.MGR_FALLBACK_P_RULE,
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
        GPTConfig(**{k: cfg[k] for k in MODEL_KEYS})  # every knob's check, before any file
    except ValueError as e:
        sys.exit(f"error: {e}")
    return cfg, given


# ----------------------------------------------------------------------------- the start of a run

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


@dataclass
class Process:
    """This process's place in the run: rank among world processes (under torchrun; else rank 0 of
    1), its device, and its precision (the dtype's name and the autocast context, or none)."""
    ddp: bool
    rank: int
    world: int
    device: torch.device
    dtype: str
    ctx: object

    @property
    def master(self):  # rank 0 evaluates, checkpoints, logs and prints
        return self.rank == 0


def start_process(cfg):
    """Joins the process group under torchrun (gloo on CPU, nccl on GPUs) and picks the device and
    the precision; exits with one line when the batch cannot be shared out or the device is amiss."""
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
    try:
        if ddp and backend == 'nccl':
            device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}")
            torch.cuda.set_device(device)
        else:
            device = configurator.resolve_device(cfg['device'])
        dtype, ctx = configurator.precision(device, cfg['dtype'])
        resolve_kernels(cfg['kernels'], device.type)  # checked here, before the dataset is prepared
    except ValueError as e:
        sys.exit(f"error: {e}")
    return Process(ddp, rank, world, device, dtype, ctx)


def seed_process(cfg, proc, ckpt):
    """Seeds this process (seed + rank: each rank its own dropout) and, on resume, takes the number of
    CPU threads the run was started with."""
    torch.manual_seed(cfg['seed'] + proc.rank)
    if ckpt is not None and ckpt.get('threads', torch.get_num_threads()) != torch.get_num_threads():
        # CPU results depend on the number of threads (they split the sums), so a resumed run takes the
        # run's own number to compute what the uninterrupted run would have
        if proc.master:
            print(f"note: resuming with the {ckpt['threads']} CPU thread(s) this run was started with (this process "
                  f"has {torch.get_num_threads()}), to repeat its arithmetic exactly", file=sys.stderr)
        torch.set_num_threads(ckpt['threads'])


def build(cfg, proc, ckpt):
    """The dataset and the model (with the checkpoint's weights on resume), and the kernels the
    routing runs on; exits with one line on bad input."""
    try:
        if proc.ddp and not proc.master:
            torch.distributed.barrier()  # rank 0 prepares (downloads) the dataset first, alone
        ds = data.load(cfg['dataset'], cfg['data_dir'], download=False)  # no multi-GB download unasked
        for split in ('train', 'val'):
            if len(ds.splits[split]) <= cfg['block_size']:
                raise data.DataError(f"the {split} split of {cfg['dataset']} has {len(ds.splits[split])} tokens, "
                                     f"fewer than block_size={cfg['block_size']}+1")
        model = GPT(GPTConfig(**{k: cfg[k] for k in MODEL_KEYS}, vocab_size=ds.vocab_size)).to(proc.device)
        if proc.ddp and proc.master:
            torch.distributed.barrier()
        if ckpt is not None:
            load_weights(model, ckpt, os.path.join(cfg['out_dir'], 'ckpt.pt'))
        kernels_used = model.set_kernels(cfg['kernels'], cfg['mgr_fallback_p'])
    except (CheckpointError, data.DataError, ValueError, RuntimeError) as e:
        sys.exit(f"error: {e}")
    return ds, model, kernels_used


def compile_and_wrap(cfg, proc, model):
    """The model the steps call: compiled with --compile=True, in DistributedDataParallel under torchrun."""
    if cfg['compile']:
        if proc.master:
            print("compiling each sublayer with torch.compile: the first step takes a while"
                  if cfg['compile_scope'] == 'sublayers' else
                  "compiling the model with torch.compile: the first steps take a while (minutes for deep models "
                  "on a CPU; --compile_scope=sublayers takes seconds)", file=sys.stderr)
        model = model.compiled(cfg['compile_scope'], cfg['compile_mode'])
    if proc.ddp:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[proc.device.index] if proc.device.type == 'cuda' else None)
    return model


class Log:
    """The run's records: out_dir/log.jsonl, written by rank 0, and their numbers in Weights & Biases
    with --wandb_log=True."""

    def __init__(self, cfg, master, resumed_from):
        self.path, self.master = os.path.join(cfg['out_dir'], 'log.jsonl'), master
        if master and resumed_from >= 0:
            keep_history(self.path, resumed_from)
        self.wandb = start_wandb(cfg) if master and cfg['wandb_log'] else None

    def write(self, record):
        if self.master:
            with open(self.path, 'a') as f:
                f.write(json.dumps(record) + '\n')
            if self.wandb is not None and 'iter' in record:
                self.wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float)) and k != 'iter'},
                               step=record['iter'])

    def close(self):
        if self.wandb is not None:
            self.wandb.finish()


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


def tokens_per_step(cfg):
    return cfg['gradient_accumulation_steps'] * cfg['batch_size'] * cfg['block_size']


def announce(cfg, proc, ds, model, kernels_used):
    """Rank 0 says what it trains, and notes when the steps read the train split more than once."""
    if not proc.master:
        return
    train_tokens = len(ds.splits['train'])
    passes = cfg['max_iters'] * tokens_per_step(cfg) / train_tokens
    if passes > 1:
        print(f"note: {cfg['max_iters']} steps read {cfg['max_iters'] * tokens_per_step(cfg):,} tokens, {passes:.1f} "
              f"passes over the {train_tokens:,}-token train split", file=sys.stderr)
    prefix = ds.meta.get('max_chars')  # a slice (text8's CPU studies') says so: data/text8 holds either
    print(f"{cfg['residual']}: {model.get_num_params() / 1e6:.3f}M parameters, {cfg['dataset']} "
          + (f"(its first {prefix:,} characters) " if prefix else '') + f"(vocab {ds.vocab_size}), "
          f"{tokens_per_step(cfg):,} tokens/step, {proc.world} process(es) on "
          f"{proc.device} {proc.dtype}, kernels {kernels_used}"
          + ('' if type(model.residual) in kernels_module.FAST or kernels_used == 'reference' else
             " (no twin: the class's own forward)"))


@dataclass
class Run:
    """A run's state from one step to the next: what it trains, where it stands, how it reports."""
    cfg: dict
    proc: Process
    ds: data.Dataset
    raw_model: GPT
    model: torch.nn.Module  # raw_model, compiled and in DDP as asked: what the steps call
    optimizer: torch.optim.Optimizer
    data_gen: torch.Generator  # draws the batches, alike on every rank (see draw_offsets)
    log: Log
    bar: tqdm  # a progress bar on a terminal; in a file (a sweep's or nohup's log) plain lines instead
    terminal: bool  # whether stderr is a terminal
    iter_num: int  # the steps done
    best_val_loss: float
    resumed_from: int  # the iteration of the checkpoint this run resumed, -1 for a new run
    saved_iter: int  # the iteration of the last checkpoint, -1 before the first
    # The loss stays on the device between log steps: reading it every step would make the host wait
    # for the GPU at every step, exposing every launch's latency. Whether any step's loss was not
    # finite is kept there too (a flag), and checked where the loss is read: at every log step, which
    # is also every step before an evaluation (so no checkpoint is written after a bad step).
    nonfinite: torch.Tensor
    checked_iter: int  # the last iteration whose loss was read and finite
    metrics: dict = field(default_factory=dict)  # the last evaluation's
    t_start: float = field(default_factory=time.time)
    train_time: float = 0.0  # the time of the training steps since the last log step (not evaluations)
    logged_steps: int = 0  # the steps since the last log step


def start_run(cfg, given):
    """Everything before the first step, in order: the checkpoint to resume, this process, the dataset
    and the model, the optimizer (where the checkpoint left it), the log and the progress bar. Bad
    input exits with one line."""
    try:  # everything that can fail on bad input, before anything is written
        ckpt = resume_config(cfg, given)
    except CheckpointError as e:
        sys.exit(f"error: {e}")
    proc = start_process(cfg)
    seed_process(cfg, proc, ckpt)
    ds, raw_model, kernels_used = build(cfg, proc, ckpt)
    if proc.master:
        os.makedirs(cfg['out_dir'], exist_ok=True)
    optimizer = raw_model.configure_optimizers(cfg['weight_decay'], cfg['learning_rate'],
                                               (cfg['beta1'], cfg['beta2']), proc.device.type)
    data_gen = torch.Generator().manual_seed(cfg['seed'])
    iter_num, best_val_loss, resumed_from = 0, float('inf'), -1
    if ckpt is not None:
        optimizer.load_state_dict(ckpt['optimizer'])
        iter_num = resumed_from = ckpt['iter_num']
        best_val_loss = ckpt['best_val_loss']
        data_gen.set_state(ckpt['rng']['data'])
        if proc.rank == 0:
            torch.set_rng_state(ckpt['rng']['torch'])  # dropout; other ranks keep their own seeds
        del ckpt
    model = compile_and_wrap(cfg, proc, raw_model)
    log = Log(cfg, proc.master, resumed_from)
    announce(cfg, proc, ds, raw_model, kernels_used)
    log.write({'event': 'resume' if resumed_from >= 0 else 'start', 'iter': iter_num, 'config': cfg})
    terminal = sys.stderr.isatty()
    bar = tqdm(total=cfg['max_iters'], initial=iter_num, disable=not proc.master or not terminal, dynamic_ncols=True,
               desc='train')
    return Run(cfg, proc, ds, raw_model, model, optimizer, data_gen, log, bar, terminal, iter_num, best_val_loss,
               resumed_from, saved_iter=resumed_from, checked_iter=iter_num,
               nonfinite=torch.zeros((), device=proc.device, dtype=torch.bool))


# ----------------------------------------------------------------------------- the steps of the loop

def is_eval_step(it, cfg):  # evaluations and checkpoints: every eval_interval steps, and at the end
    return it % cfg['eval_interval'] == 0 or it == cfg['max_iters']


def is_log_step(it, cfg):
    return it % cfg['log_interval'] == 0 or it == cfg['max_iters']


def val_metrics(val_loss, char_level):
    metrics = {'val_loss': val_loss, 'val_ppl': math.exp(min(val_loss, 700))}
    if char_level:
        metrics['val_bpc'] = val_loss / math.log(2)
    return metrics


def evaluate_and_checkpoint(run):
    """Rank 0's validation loss on the first eval_tokens of the val split, logged, and the checkpoint:
    ckpt.pt, and best.pt when the loss is the lowest so far. Stops on a loss that is not finite."""
    cfg, it = run.cfg, run.iter_num
    val_loss = data.evaluate(run.raw_model, run.ds.splits['val'], cfg['block_size'], cfg['eval_tokens'],
                             cfg['batch_size'], run.proc.device, run.proc.ctx)
    if not math.isfinite(val_loss):
        stop(run, f"error: val loss is {val_loss} at iter {it}; stopped. The last good checkpoint is kept "
                  f"in {cfg['out_dir']}. Try a lower learning_rate, or dtype=float32.", diverged=True)
    run.metrics = val_metrics(val_loss, run.ds.char_level)
    run.bar.write(f"iter {it}: " + ', '.join(f'{k} {v:.4f}' for k, v in run.metrics.items()))
    run.log.write({'iter': it, **run.metrics})
    run.best_val_loss = min(run.best_val_loss, val_loss)
    checkpoint = {
        'model': run.raw_model.state_dict(), 'optimizer': run.optimizer.state_dict(),
        'model_args': asdict(run.raw_model.config), 'config': cfg, 'iter_num': it,
        'val_loss': val_loss, 'best_val_loss': run.best_val_loss,
        'rng': {'torch': torch.get_rng_state(), 'data': run.data_gen.get_state()},
        'threads': torch.get_num_threads(),
    }
    save_checkpoint(checkpoint, os.path.join(cfg['out_dir'], 'ckpt.pt'))
    run.saved_iter = it
    if val_loss == run.best_val_loss:
        save_checkpoint(checkpoint, os.path.join(cfg['out_dir'], 'best.pt'))


def get_lr(it, cfg):
    """Linear warmup, then cosine decay to min_lr at lr_decay_iters (0 = max_iters)."""
    decay_iters = cfg['lr_decay_iters'] or cfg['max_iters']
    if it < cfg['warmup_iters']:
        return cfg['learning_rate'] * (it + 1) / (cfg['warmup_iters'] + 1)
    if it >= decay_iters:
        return cfg['min_lr']
    ratio = (it - cfg['warmup_iters']) / max(1, decay_iters - cfg['warmup_iters'])
    return cfg['min_lr'] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg['learning_rate'] - cfg['min_lr'])


def draw_offsets(generator, n_tokens, block_size, micro_steps, batch_size, rank, world):
    """One step's batch start offsets for this rank, as (micro-steps, sequences). The generator is
    seeded alike on every rank and draws the global batch (micro_steps, batch_size); rank r keeps
    micro-steps r, r+world, ... when they divide evenly, else sequences r, r+world, ... of every
    micro-step. So ranks see different data, together exactly one process's, and resume restores it."""
    offsets = torch.randint(n_tokens - block_size, (micro_steps, batch_size), generator=generator)
    return offsets[rank::world] if micro_steps % world == 0 else offsets[:, rank::world]


def step(run):
    """One optimisation step on one global batch: its micro-steps' gradients accumulated (DDP averages
    them over the ranks at the last), clipped, and AdamW's update. Returns the batch's mean loss,
    left on the device (see read_loss), and flags a loss that is not finite."""
    cfg, proc, train_tokens = run.cfg, run.proc, run.ds.splits['train']
    offsets = draw_offsets(run.data_gen, len(train_tokens), cfg['block_size'], cfg['gradient_accumulation_steps'],
                           cfg['batch_size'], proc.rank, proc.world)
    loss_sum = torch.zeros((), device=proc.device)
    for micro, micro_offsets in enumerate(offsets):
        x, y = data.get_batch(train_tokens, micro_offsets.tolist(), cfg['block_size'], proc.device)
        if proc.ddp:  # all-reduce gradients on the last micro-step only
            run.model.require_backward_grad_sync = micro == len(offsets) - 1
        with proc.ctx:
            _, loss = run.model(x, y)
        (loss / len(offsets)).backward()  # DDP then averages over ranks: the mean over the global batch
        loss_sum += loss.detach() / len(offsets)
    if cfg['grad_clip']:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg['grad_clip'])
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.nonfinite |= ~torch.isfinite(loss_sum)
    return loss_sum


def read_loss(run, loss_sum):
    """The loss as a number on the host, which waits for the device here only; stops if any step's loss
    since the last read was not finite. Under DDP the ranks agree on the loss and on stopping."""
    if run.proc.ddp:
        state = torch.stack([loss_sum, run.nonfinite.to(loss_sum.dtype)])
        torch.distributed.all_reduce(state)
        loss_sum, run.nonfinite = state[0] / run.proc.world, state[1] > 0
    lossf, bad = loss_sum.item(), run.nonfinite.item()
    if bad:
        stop(run, f"error: training loss is not finite in a step after iter {run.checked_iter} up to iter "
                  f"{run.iter_num} (the last: {lossf}); stopped. The last good checkpoint is kept in "
                  f"{run.cfg['out_dir']}. Try a lower learning_rate, or dtype=float32.", diverged=True)
    run.checked_iter = run.iter_num
    return lossf


def log_progress(run, lossf, lr):
    """At a log step: the loss and the tokens per second of the training steps since the last log step
    (evaluations not counted; the device's time counts at the log step's read), on the progress bar
    or, in a file, as one plain line; and in the log."""
    cfg = run.cfg
    tok_s = run.logged_steps * tokens_per_step(cfg) / max(run.train_time, 1e-9)
    run.train_time, run.logged_steps = 0.0, 0
    run.bar.set_postfix(loss=f'{lossf:.4f}', tok_s=f'{tok_s:,.0f}')
    if run.proc.master and not run.terminal:
        print(f"iter {run.iter_num}/{cfg['max_iters']}: loss {lossf:.4f}, lr {lr:.2e}, {tok_s:,.0f} tokens/s",
              file=sys.stderr, flush=True)
    run.log.write({'iter': run.iter_num, 'loss': lossf, 'lr': lr, 'tokens_per_s': tok_s})


def stop(run, message, diverged=False):
    """Ends the run on an error: rank 0 exits with the message, the other ranks with status 1. A run
    stopped by a loss that is not finite says so in its log (sweep.py reports it as diverged)."""
    run.bar.close()
    if diverged and run.proc.master:
        run.log.write({'event': 'diverged', 'iter': run.iter_num})
    if run.proc.ddp:
        torch.distributed.destroy_process_group()
    sys.exit(message if run.proc.master else 1)


# ----------------------------------------------------------------------------- the end of a run

def interrupted(run):
    """Ctrl-C: says where the run can go on from, and exits with status 130."""
    run.bar.close()
    if run.proc.master:
        cfg, it = run.cfg, run.iter_num
        print(f"interrupted at iter {it}; the last checkpoint, {os.path.join(cfg['out_dir'], 'ckpt.pt')}, is "
              f"from iter {run.saved_iter}: continue with  python train.py --out_dir={cfg['out_dir']} --init_from=resume"
              if run.saved_iter >= 0 else f"interrupted at iter {it}, before the first checkpoint", file=sys.stderr)
    sys.exit(130)


def finish(run):
    """The last evaluation's metrics, logged and said; the log closed and the process group left."""
    run.bar.close()
    if run.metrics:
        run.log.write({'event': 'done', 'iter': run.iter_num, **run.metrics})
    if run.proc.master:
        wall = time.time() - run.t_start
        if run.metrics:
            print(f"final val loss {run.metrics['val_loss']:.4f} nats" +
                  (f", {run.metrics['val_bpc']:.4f} bpc" if 'val_bpc' in run.metrics else '') +
                  f", ppl {run.metrics['val_ppl']:.3f} at iter {run.iter_num} ({wall:.0f}s)")
        else:
            print(f"{run.cfg['out_dir']} already finished at iter {run.iter_num}; nothing to do")
    run.log.close()
    if run.proc.ddp:
        torch.distributed.destroy_process_group()
    return run.metrics


# ----------------------------------------------------------------------------- main

def main(argv):
    cfg, given = parse_config(argv)
    run = start_run(cfg, given)
    try:
        while True:
            if run.proc.master and is_eval_step(run.iter_num, cfg) and run.iter_num != run.resumed_from:
                evaluate_and_checkpoint(run)
            if run.iter_num >= cfg['max_iters']:
                break
            t0 = time.time()
            lr = get_lr(run.iter_num, cfg)
            for group in run.optimizer.param_groups:
                group['lr'] = lr
            loss = step(run)
            run.iter_num += 1
            if is_log_step(run.iter_num, cfg) or is_eval_step(run.iter_num, cfg):
                lossf = read_loss(run, loss)  # at log steps and before evaluations only
            run.train_time, run.logged_steps = run.train_time + time.time() - t0, run.logged_steps + 1
            run.bar.update(1)
            if is_log_step(run.iter_num, cfg):
                log_progress(run, lossf, lr)
    except KeyboardInterrupt:
        interrupted(run)
    return finish(run)


if __name__ == '__main__':
    try:
        main(sys.argv[1:])
    except SystemExit as e:  # under torchrun, rank 0 alone says what went wrong
        if int(os.environ.get('RANK', 0)) != 0 and isinstance(e.code, str):
            sys.exit(1)
        raise
