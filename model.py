"""
A nanoGPT-style decoder-only transformer whose residual stream is pluggable.

The transformer layers provide 2*n_layer sublayers (attention, MLP, attention, ...), each a module
that applies its own pre-norm; the residual class chosen by `config.residual` (see residuals.py)
owns the loop over them, and the kernels package may run the same maths faster (`GPT.set_kernels`). Every
method shares these attention/MLP modules and their init, so comparing two methods changes the
residual routing alone. Checkpoints are written and read here too.
"""
import functools
import inspect
import math
import os
import pickle
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
from torch.nn import functional as F

import kernels
from residuals import RESIDUALS


COMPILE_SCOPES = ('model', 'sublayers')  # of GPT.compiled
COMPILE_MODES = ('default', 'reduce-overhead', 'max-autotune')  # torch.compile's modes (reduce-overhead: CUDA graphs)


@dataclass
class GPTConfig:
    block_size: int = 128
    vocab_size: int = 96  # set from the dataset by train.py
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False  # biases in Linears and LayerNorms, as in GPT-2 when True
    residual: str = 'prenorm'  # a key of residuals.RESIDUALS
    # --- knobs of the residual methods (docs/METHODS.md names them) ---
    layerscale_init: float = 0.0  # 0 = CaiT's depth rule
    res_block_size: int = 0  # layers per block of block_attnres and wav; 0 = max(1, n_layer // 8)
    wav_detail_bias: float = -2.0  # initial bias of every detail source
    wav_rho: float = 2.0  # cap of the detached RMS-matching scale (our choice: the paper gives none)
    wav_detail_readout: bool = False  # True: the output mixer reads the detail sources too
    wav_levels: int = 1  # Haar levels of detail bases (beyond the paper); 1 = the paper's split basis
    wav_learned_basis: bool = False  # learnable zero-sum detail coefficients (beyond the paper)
    hc_streams: int = 4  # streams of hc, mhc, mhc_lite and kromhc
    hc_dynamic: bool = True  # hc and frac: input-dependent connections on top of the static ones
    frac_parts: int = 2  # frac: the fractions m the channels are split into (n_embd must be a multiple)
    laurel_rank: int = 16  # laurel_lr: the rank r of the learned map B A
    mgr_streams: int = 4
    mgr_gate: str = 'competitive'  # or 'independent'
    mgr_b_base: float = -3.0  # gate bias of the reference depth, see mgr_L_base
    mgr_L_base: float = 21.0  # reference number of gated sublayers for the depth-scaled gate init
    denseformer_dilation: int = 1  # a DWA averages the stored states of its own residue mod k
    denseformer_period: int = 1  # layers per DWA (n_layer must be a multiple)
    mudd_multiway: bool = True  # separate query, key, value and residual inputs; False: one way
    mudd_hidden: int = 0  # width of the weight generator's hidden layer; 0 = the official rule

    def __post_init__(self):
        if self.residual not in RESIDUALS:
            raise ValueError(f"unknown residual {self.residual!r}; choose one of: {', '.join(RESIDUALS)}")
        for name in ('block_size', 'vocab_size', 'n_layer', 'n_head', 'n_embd', 'hc_streams', 'mgr_streams',
                     'wav_levels', 'denseformer_dilation', 'denseformer_period', 'frac_parts', 'laurel_rank'):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")
        if self.res_block_size < 0:
            raise ValueError(f"res_block_size must be >= 0 (0 = auto), got {self.res_block_size}")
        if self.wav_rho <= 0:
            raise ValueError(f"wav_rho must be > 0, got {self.wav_rho}")
        if self.layerscale_init < 0:
            raise ValueError(f"layerscale_init must be >= 0 (0 = CaiT's depth rule), got {self.layerscale_init}")
        if self.mgr_L_base <= 0:
            raise ValueError(f"mgr_L_base must be > 0 (a number of gated sublayers), got {self.mgr_L_base}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.mgr_gate not in ('independent', 'competitive'):
            raise ValueError(f"mgr_gate={self.mgr_gate!r}; choose independent or competitive")
        if self.residual == 'denseformer' and self.n_layer % self.denseformer_period:
            raise ValueError(f"denseformer_period={self.denseformer_period} must divide n_layer={self.n_layer}")
        if self.residual == 'kromhc' and self.hc_streams & (self.hc_streams - 1):
            raise ValueError(f"kromhc builds H_res from 2 x 2 factors: hc_streams={self.hc_streams} must be a "
                             f"power of 2 (1, 2, 4, 8, ...)")
        if self.residual == 'mhc_lite' and self.hc_streams > 6:
            raise ValueError(f"mhc_lite sums over all n! permutation matrices: hc_streams={self.hc_streams} would "
                             f"need {math.factorial(self.hc_streams)}; use hc_streams <= 6")
        if self.residual == 'mgr':
            self.check_mgr_gates()
        if self.residual == 'frac' and self.n_embd % self.frac_parts:
            raise ValueError(f"frac_parts={self.frac_parts} must divide n_embd={self.n_embd}")
        if self.residual == 'laurel_lr' and self.laurel_rank > self.n_embd:
            raise ValueError(f"laurel_rank={self.laurel_rank} must be at most n_embd={self.n_embd}")
        if self.mudd_hidden < 0:
            raise ValueError(f"mudd_hidden must be >= 0 (0 = the official rule), got {self.mudd_hidden}")

    def check_mgr_gates(self):
        """MGR's first n - 1 sublayers start its streams, and the gates of the others start at
        g = sigmoid(mgr_b_base) sqrt(mgr_L_base / gated), which must leave each stream a keep weight
        (residuals.StreamGates)."""
        n, n_gated = self.mgr_streams, 2 * self.n_layer - (self.mgr_streams - 1)
        if n_gated < 1:
            raise ValueError(f"mgr with mgr_streams={n} needs more than {n - 1} sublayers to start its "
                             f"streams; use n_layer >= {n // 2 + 1} or fewer streams")
        g = torch.sigmoid(torch.tensor(self.mgr_b_base)).item() * math.sqrt(self.mgr_L_base / n_gated)
        if self.mgr_gate == 'independent' and g >= 1:
            raise ValueError(f"mgr: the initial gate sigmoid(mgr_b_base) sqrt(mgr_L_base / {n_gated}) = {g:.3f} "
                             f"must be below 1; use a lower mgr_b_base or mgr_L_base")
        if self.mgr_gate == 'competitive' and g * n >= 1:
            raise ValueError(f"mgr: the initial gate {g:.3f} leaves no keep weight for {n} competing streams; "
                             f"use more layers, fewer streams or a lower mgr_b_base")


def method_knobs():
    """The residual methods' knobs: GPTConfig's fields after `residual`, with their defaults."""
    names = [f.name for f in fields(GPTConfig)]
    return {f.name: f.default for f in fields(GPTConfig)[names.index('residual') + 1:]}


def attention_inputs(residual_cls, config, layer):
    """How many inputs the attention of a layer takes: 1, or 3 where the residual class says so
    (its optional `attention_inputs(config, layer)`: MUDDFormer's multiway)."""
    return residual_cls.attention_inputs(config, layer) if hasattr(residual_cls, 'attention_inputs') else 1


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's has no bias=False before 2.1)."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    """Sublayer f(h) = attention(norm(h)); the norm is the identity for methods without pre-norm.
    Built with inputs=3 (MUDDFormer's multiway), it also takes f(h_q, h_k, h_v): the query, key and
    value each projected from an input of its own through a pre-norm of its own (ln, ln_k, ln_v)."""

    def __init__(self, config, prenorm=True, inputs=1):
        super().__init__()
        self.ln = LayerNorm(config.n_embd, config.bias) if prenorm else nn.Identity()
        if inputs == 3:
            self.ln_k, self.ln_v = LayerNorm(config.n_embd, config.bias), LayerNorm(config.n_embd, config.bias)
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, h, h_k=None, h_v=None, cache=None):
        """cache: (KVCache, this layer's index) when decoding: the new positions' keys and values are
        stored there, and the queries attend to every cached position before them too."""
        B, T, C = h.size()
        if h_k is None:  # one input: one projection of one normalised h
            q, k, v = self.c_attn(self.ln(h)).split(C, dim=2)
        else:  # three inputs: each through its own norm and its third of c_attn
            biases = self.c_attn.bias.split(C) if self.c_attn.bias is not None else (None,) * 3
            q, k, v = (F.linear(norm(x), weight, bias) for norm, x, weight, bias in
                       zip((self.ln, self.ln_k, self.ln_v), (h, h_k, h_v), self.c_attn.weight.split(C), biases))
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        mask, causal = None, True
        if cache is not None:
            kv_cache, layer = cache
            past = kv_cache.length
            k, v = kv_cache.store(layer, k, v)
            if past and T == 1:  # one new position: it sees every cached one
                causal = False
            elif past:  # several after cached ones: position past + t sees 0..past + t
                mask, causal = torch.ones(T, past + T, dtype=torch.bool, device=q.device).tril(past), False
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=causal)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Sublayer f(h) = MLP(norm(h)); the norm is the identity for methods without pre-norm."""

    def __init__(self, config, prenorm=True):
        super().__init__()
        self.ln = LayerNorm(config.n_embd, config.bias) if prenorm else nn.Identity()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, h):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(self.ln(h)))))


class Block(nn.Module):
    """One transformer layer: two sublayers, attention then MLP. It has no forward of its own: the
    residual class decides how the sublayers' inputs and outputs are combined."""

    def __init__(self, config, prenorm, attention_inputs=1):
        super().__init__()
        self.attn = CausalSelfAttention(config, prenorm, attention_inputs)
        self.mlp = MLP(config, prenorm)


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        residual_cls = RESIDUALS[config.residual]
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, residual_cls.sublayer_norm, attention_inputs(residual_cls, config, layer))
                             for layer in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        # The shared modules are initialised before the residual is built, and residual classes
        # initialise deterministically, so two methods with the same seed share these weights.
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith('c_proj.weight'):  # GPT-2's scaled init of the residual projections
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        self.residual = residual_cls(config)
        self.kernels, self.mgr_fallback_p = 'torch', kernels.MGR_FALLBACK_P  # see set_kernels

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def set_kernels(self, name='auto', mgr_fallback_p=kernels.MGR_FALLBACK_P):
        """How the routing runs, not what it computes (the kernels package): 'reference' (the classes
        of residuals.py as written), 'torch', 'triton', or 'auto' (triton on CUDA, else torch), for
        the device the model is on now. mgr_fallback_p: MGR's fast backward rebuilds its streams by
        inverting the lerp, keeping the originals of the p largest gates per token; -1 keeps every
        input instead (kernels.route hands it to MGR's twin, the one that reads it). Returns the
        backend chosen."""
        self.mgr_fallback_p = kernels.check_mgr_fallback_p(mgr_fallback_p)
        self.kernels = kernels.resolve(name, self.lm_head.weight.device.type)
        return self.kernels

    def get_num_params(self, non_embedding=True):
        """Parameter count; the position embedding is left out by default, as in nanoGPT."""
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n_params -= self.transformer.wpe.weight.numel()
        return n_params

    def sublayers(self, cache=None):
        """The L = 2*n_layer sublayer modules, in order: attention, MLP, attention, MLP, ...; with a
        KVCache, each attention bound to its layer's keys and values."""
        if cache is None:
            return [f for block in self.transformer.h for f in (block.attn, block.mlp)]
        return [f for layer, block in enumerate(self.transformer.h)
                for f in (functools.partial(block.attn, cache=(cache, layer)), block.mlp)]

    def compiled(self, scope='model', mode='default'):
        """torch.compile over a scope (COMPILE_SCOPES): 'model', the whole model as one graph, the
        routing included (returns the compiled wrapper); 'sublayers', compile_sublayers (returns self).
        mode: torch.compile's (COMPILE_MODES); 'reduce-overhead' replays the step as CUDA graphs, which
        removes the launches' host time on a GPU."""
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile mode {mode!r}; choose one of: {', '.join(COMPILE_MODES)}")
        if scope == 'sublayers':
            self.compile_sublayers(mode=mode)
            return self
        return torch.compile(self, mode=mode)

    def compile_sublayers(self, **options):
        """Regional compilation: torch.compile each sublayer in place. Every attention shares one
        compiled graph and every MLP another (their parameters are the graphs' inputs), so compiling
        takes about as long at 48 layers as at 2; the routing between them runs eager, on its kernels."""
        for f in self.sublayers():
            f.compile(**options)

    def forward(self, idx, targets=None, cache=None):
        """Logits (and the loss, given targets) for the tokens idx (B, T). With a KVCache (decoding),
        idx holds the positions after the cached ones: every method routes per token, so only the
        attention needs the earlier positions, and it reads their keys and values from the cache."""
        B, T = idx.size()
        past = 0 if cache is None else cache.length
        if past + T > self.config.block_size:
            raise ValueError(f"sequence of length {past + T} is longer than block_size={self.config.block_size}")
        pos = torch.arange(past, past + T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        x = kernels.route(self.residual, x, self.sublayers(cache), self.kernels,  # residual(x, sublayers)
                          self.mgr_fallback_p)
        if cache is not None:
            cache.length += T
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1), ignore_index=-1)
        else:  # inference: only the last position is needed
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW; weight decay on the 2-D weights of the shared modules only. Routing parameters
        (everything owned by the residual class) and gains/biases/1-D tensors get none."""
        routing = {id(p) for p in self.residual.parameters()}
        decay, no_decay = [], []
        for p in self.parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 and id(p) not in routing else no_decay).append(p)
        groups = [{'params': decay, 'weight_decay': weight_decay},
                  {'params': no_decay, 'weight_decay': 0.0}]
        fused = device_type == 'cuda' and 'fused' in inspect.signature(torch.optim.AdamW).parameters
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **({'fused': True} if fused else {}))

    @classmethod
    def from_checkpoint(cls, ckpt, path='the checkpoint'):
        """The model a checkpoint (see load_checkpoint) holds."""
        try:
            config = GPTConfig(**ckpt['model_args'])
        except (TypeError, ValueError) as e:  # a method or a knob this version does not have
            raise CheckpointError(f"{path} holds a model this version of model.py cannot build: {e}")
        return load_weights(cls(config), ckpt, path)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None, kv_cache=True):
        """Extend the prompts idx (B, T), T <= block_size, by max_new_tokens sampled tokens (top_k=1:
        greedy). kv_cache=True runs the prompt once, then each new token alone, its attention reading the
        earlier positions' keys and values from a KVCache; False runs the whole context for every token.
        Both read the same context, so they give the same tokens: the tokens since the window's start.
        When it has filled block_size, the window jumps to keep the last half: the positions are learned
        and absolute, so the kept tokens run again at their new positions, one prefill every
        block_size // 2 tokens (a window sliding one token a step would change every cached key)."""
        T, window = idx.size(1), self.config.block_size
        if not 1 <= T <= window:
            raise ValueError(f"the prompt has {T} tokens; it must have 1 to block_size={window} "
                             f"(keep its last {window})")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens}; generate at least 1 token")
        cache = KVCache(self.config) if kv_cache else None
        start = 0  # the window's first position in idx
        for _ in range(max_new_tokens):
            if idx.size(1) - start > window:
                start = idx.size(1) - max(1, window // 2)
                if cache is not None:
                    cache.length = 0
            if cache is None:
                logits, _ = self(idx[:, start:])
            else:  # the window's tokens that the cache has not seen: the prompt (or what a jump kept), or the last one
                logits, _ = self(idx[:, start + cache.length:], cache=cache)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float('inf')
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


class KVCache:
    """The keys and values of every layer's attention for the `length` positions decoded so far, in
    buffers of block_size positions made at the first store (in the dtype and on the device of the
    keys: bfloat16 under autocast). GPT.forward advances length after each forward."""

    def __init__(self, config):
        self.n_layer, self.block_size = config.n_layer, config.block_size
        self.keys = self.values = None
        self.length = 0

    def store(self, layer, k, v):
        """Keep layer's keys and values (B, n_head, T, head_dim) of the positions length.. length+T-1;
        return the layer's keys and values of every position so far."""
        if self.keys is None:
            B, H, _, D = k.shape
            self.keys, self.values = (k.new_empty(self.n_layer, B, H, self.block_size, D) for _ in range(2))
        elif k.shape[:2] != self.keys.shape[1:3] or k.dtype != self.keys.dtype:
            raise ValueError(f"this cache holds {tuple(self.keys.shape[1:3])} (batch, heads) in {self.keys.dtype}, "
                             f"not {tuple(k.shape[:2])} in {k.dtype}: one KVCache serves one batch of one model")
        end = self.length + k.size(2)
        self.keys[layer, :, :, self.length:end] = k
        self.values[layer, :, :, self.length:end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def nbytes(self):
        """The buffers' size (block_size positions of every layer's keys and values)."""
        return 0 if self.keys is None else 2 * self.keys.numel() * self.keys.element_size()


# ----------------------------------------------------------------------------- checkpoints

class CheckpointError(Exception):
    """A checkpoint that is missing, unreadable, not of this project, or of another model than the one
    asked for (the command line's, or the one its own settings describe)."""


def save_checkpoint(obj, path):
    """Atomic: write a temporary file, flush it to disk, then rename over the old one. A crash
    at any point leaves the previous checkpoint intact."""
    tmp = path + '.tmp'
    with open(tmp, 'wb') as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path, map_location='cpu'):
    """torch.load(weights_only=True), with one clear error for a missing or unreadable file, or a
    file that is not a checkpoint of this project."""
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint at {path}; train without --init_from=resume first, "
                              f"or point --out_dir at the run's folder")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises several types for empty, truncated or foreign files
        best = os.path.join(os.path.dirname(path), 'best.pt')
        also = f"; {best}, the lowest-val-loss checkpoint, is there" if os.path.isfile(best) and \
            os.path.abspath(best) != os.path.abspath(path) else ''
        raise CheckpointError(f"checkpoint {path} is unreadable ({unreadable(path, e)}); it is left untouched{also}")
    if not (isinstance(ckpt, dict) and 'model' in ckpt and 'model_args' in ckpt):
        raise CheckpointError(f"{path} is not a checkpoint of this project: torch.load reads it, but it holds "
                              f"a {type(ckpt).__name__} without the 'model' and 'model_args' that train.py saves")
    return ckpt


def unreadable(path, error):
    """Why torch.load failed on path, in words: what the file is not."""
    with open(path, 'rb') as f:
        head = f.read(16)
        f.seek(max(0, os.path.getsize(path) - 22 - 65535))  # a zip archive ends with its index, and a comment
        tail = f.read()
    if not head:
        return 'it is empty'
    if not head.startswith(b'PK'):  # torch.save (and so train.py) writes a zip archive
        return f"not a checkpoint of this project: torch.save writes a zip archive, and this file begins {head!r}"
    if isinstance(error, pickle.UnpicklingError) and 'weights_only' in str(error):
        return 'it holds Python objects that a safe load refuses: not a checkpoint of this project'
    if b'PK\x05\x06' not in tail:  # the signature of that index's last record
        return 'a truncated file: a zip archive without its end, as a copy or a save cut short leaves it'
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), '')
    return f"{type(error).__name__}: {first.split('. ')[0]}" if first else type(error).__name__


def settings(model_args):
    """A model's settings in a message: its method and shape, then the knobs it sets away from their defaults."""
    knobs = method_knobs()
    shown = [k for k in ('residual', 'n_layer', 'n_head', 'n_embd', 'block_size', 'vocab_size') if k in model_args]
    shown += [k for k, v in model_args.items() if k in knobs and v != knobs[k]]
    return ', '.join(f"{k}={model_args[k]!r}" for k in shown)


def load_weights(model, ckpt, path='the checkpoint'):
    """model.load_state_dict(ckpt['model']); for weights that do not fit, an error that names the first
    missing, unexpected and reshaped ones, and the settings the checkpoint was trained with."""
    own, saved = model.state_dict(), ckpt['model']
    misfits = {'missing': [k for k in own if k not in saved],
               'unexpected': [k for k in saved if k not in own],
               'of another shape': [f"{k} {tuple(saved[k].shape)}, here {tuple(own[k].shape)}" for k in own
                                    if k in saved and saved[k].shape != own[k].shape]}
    if not any(misfits.values()):
        model.load_state_dict(saved)
        return model
    listed = '; '.join(f"{what}: {', '.join(keys[:3])}" + (f" and {len(keys) - 3} more" if len(keys) > 3 else '')
                       for what, keys in misfits.items() if keys)
    trained = ckpt['model_args']
    trained_as = settings(trained) + (f" on {ckpt['config']['dataset']}" if 'dataset' in ckpt.get('config', {}) else '')
    differ = ', '.join(f"{k}={v!r}" for k, v in vars(model.config).items() if trained.get(k) != v)
    if differ:  # the model was built from another configuration (train.py on resume: the dataset's vocab_size)
        raise CheckpointError(f"{path} was trained as {trained_as}, and this model has {differ}: "
                              f"its weights do not fit ({listed})")
    raise CheckpointError(f"the weights in {path} are not those of the model its settings describe "
                          f"({trained_as}): {listed}. They are another model's (its weights and settings "
                          f"were put together from different runs), or model.py has changed since it was saved")
