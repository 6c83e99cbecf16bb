"""
A nanoGPT-style decoder-only transformer whose residual stream is pluggable.

The transformer layers provide 2*n_layer sublayer callables (attention, MLP, attention, ...);
the residual class chosen by `config.residual` (see residuals.py) owns the loop over them.
Every method shares these attention/MLP modules and their init, so comparing two methods
changes the residual routing alone.
"""
import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

from residuals import RESIDUALS


@dataclass
class GPTConfig:
    block_size: int = 256
    vocab_size: int = 96
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = False  # biases in Linears and LayerNorms, as in GPT-2 when True
    residual: str = 'prenorm'  # a key of residuals.RESIDUALS
    # --- knobs of the residual methods (../shared/SPEC.md names them) ---
    layerscale_init: float = 0.0  # 0 = CaiT's depth rule
    res_block_size: int = 0  # layers per block of block_attnres and wav; 0 = max(1, n_layer // 8)
    wav_detail_bias: float = -2.0  # initial bias of every detail source
    wav_rho: float = 2.0  # cap of the detached RMS-matching scale (our choice: the paper gives none)
    wav_detail_readout: bool = False  # True: the output mixer reads the detail sources too
    wav_levels: int = 1  # Haar levels of detail bases (beyond the paper); 1 = the paper's split basis
    wav_learned_basis: bool = False  # learnable zero-sum detail coefficients (beyond the paper)
    hc_streams: int = 4  # streams of hc and mhc_lite
    hc_dynamic: bool = True  # hc: input-dependent connections on top of the static ones
    mgr_streams: int = 4
    mgr_gate: str = 'competitive'  # or 'independent'
    mgr_b_base: float = -3.0  # gate bias of the reference depth, see mgr_L_base
    mgr_L_base: float = 21.0  # reference number of gated sublayers for the depth-scaled gate init

    def __post_init__(self):
        if self.residual not in RESIDUALS:
            raise ValueError(f"unknown residual {self.residual!r}; choose one of: {', '.join(RESIDUALS)}")
        for name in ('block_size', 'vocab_size', 'n_layer', 'n_head', 'n_embd'):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")
        if self.hc_streams < 1 or self.mgr_streams < 1:
            raise ValueError("hc_streams and mgr_streams must be at least 1")
        if self.res_block_size < 0 or self.wav_levels < 1 or self.wav_rho <= 0:
            raise ValueError("res_block_size must be >= 0 (0 = auto), wav_levels >= 1 and wav_rho > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's has no bias=False before 2.1)."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One transformer layer, seen as two sublayers f(h) = module(norm(h)).

    It has no forward of its own: the residual class decides how the two sublayers' inputs
    and outputs are combined. Methods that drop the pre-norm (ReZero) get identity norms."""

    def __init__(self, config, sublayer_norm):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, config.bias) if sublayer_norm else nn.Identity()
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, config.bias) if sublayer_norm else nn.Identity()
        self.mlp = MLP(config)

    def attn_sublayer(self, h):
        return self.attn(self.ln_1(h))

    def mlp_sublayer(self, h):
        return self.mlp(self.ln_2(h))


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        residual_cls = RESIDUALS[config.residual]
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, residual_cls.sublayer_norm) for _ in range(config.n_layer)]),
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

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def set_kernels(self, backend, mgr_fallback_p=1):
        """How the routing runs; neither changes the maths. backend: 'torch' or 'triton' (see
        kernels.resolve) computes the depth mixing and the MGR step. mgr_fallback_p: MGR's backward
        rebuilds its streams by inverting the lerp, keeping the originals of the p largest gates per
        token; -1 keeps every input instead (with torch: the plain autograd reference)."""
        if mgr_fallback_p < -1:
            raise ValueError(f"mgr_fallback_p must be -1 (no inversion) or >= 0, got {mgr_fallback_p}")
        if hasattr(self.residual, 'kernels'):
            self.residual.kernels = backend
        if hasattr(self.residual, 'fallback_p'):
            self.residual.fallback_p = mgr_fallback_p

    def get_num_params(self, non_embedding=True):
        """Parameter count; the position embedding is left out by default, as in nanoGPT."""
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n_params -= self.transformer.wpe.weight.numel()
        return n_params

    def sublayers(self):
        """The L = 2*n_layer sublayer callables, in order: attention, MLP, attention, MLP, ..."""
        return [f for block in self.transformer.h for f in (block.attn_sublayer, block.mlp_sublayer)]

    def forward(self, idx, targets=None):
        B, T = idx.size()
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size={self.config.block_size}")
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        x = self.residual(x, self.sublayers())
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

    def estimate_mfu(self, tokens_per_iter, dt, peak_flops=989e12):
        """Model FLOPs utilisation against `peak_flops` (default: H100 bf16 dense). Uses the
        PaLM estimate 6N + 12*L*H*Q*T per token, which ignores the residual routing's own cost."""
        cfg = self.config
        N = self.get_num_params()
        L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
        flops_per_token = 6 * N + 12 * L * H * Q * T
        return flops_per_token * tokens_per_iter / dt / peak_flops

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Extend idx (B, T) by max_new_tokens sampled tokens, cropping the context to block_size."""
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float('inf')
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx
