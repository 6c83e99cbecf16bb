"""
Residual routing methods, one class each; ../shared/SPEC.md gives the maths.

Interface: `Cls(config)` is an nn.Module whose `forward(x, sublayers)` takes the embedding
output x = e (B, T, C) and the list of the L = 2*n_layer sublayer callables (attention, MLP,
attention, ...), runs them, and returns the (B, T, C) tensor that goes into the final norm.
The class attribute `sublayer_norm` says whether sublayers keep their own pre-norm.
Everything here works per token, so causality is the attention's alone.

To add a method: write one class below and add one line to RESIDUALS at the bottom.
"""
import functools

import torch
import torch.nn as nn
from torch.nn import functional as F


class PreNorm(nn.Module):
    """x <- x + f_i(x): the standard pre-norm residual (GPT-2, nanoGPT)."""
    sublayer_norm = True

    def __init__(self, config):
        super().__init__()

    def forward(self, x, sublayers):
        for f in sublayers:
            x = x + f(x)
        return x


class ReZero(nn.Module):
    """x <- x + a_i f_i(x), a_i init 0, no pre-norm (Bachlechner et al. 2020, arXiv 2003.04887)."""
    sublayer_norm = False

    def __init__(self, config):
        super().__init__()
        # one scalar per sublayer (our choice; the reference shares one per layer)
        self.alpha = nn.Parameter(torch.zeros(2 * config.n_layer))

    def forward(self, x, sublayers):
        for alpha, f in zip(self.alpha, sublayers):
            x = x + alpha * f(x)
        return x


class LayerScale(nn.Module):
    """x <- x + diag(lambda_i) f_i(x), lambda_i init eps (Touvron et al. 2021, CaiT, arXiv 2103.17239)."""
    sublayer_norm = True

    def __init__(self, config):
        super().__init__()
        eps = config.layerscale_init or self.depth_rule(config.n_layer)
        self.scale = nn.Parameter(torch.full((2 * config.n_layer, config.n_embd), eps))

    @staticmethod
    def depth_rule(n_layer):
        """CaiT's initial scale: 0.1 up to 18 layers, 1e-5 up to 24, 1e-6 deeper."""
        return 0.1 if n_layer <= 18 else 1e-5 if n_layer <= 24 else 1e-6

    def forward(self, x, sublayers):
        for scale, f in zip(self.scale, sublayers):
            x = x + scale * f(x)
        return x


# ----------------------------------------------------------------------------- Attention Residuals

def rms_norm(x, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def depth_mix(sources, query, bias=None):
    """Softmax attention over depth: sum_s softmax_s(query . RMSNorm(v_s) + bias_s) v_s.

    sources (S, B, T, C), query (C,), bias (S,) or None -> mixed (B, T, C), weights (S, B, T).
    Keys are normalised, values stay raw; scores and softmax in float32, no 1/sqrt(C) scale."""
    values = sources.float()
    logits = rms_norm(values) @ query.float()
    if bias is not None:
        logits = logits + bias.float()[:, None, None]
    weights = logits.softmax(dim=0)
    return torch.einsum('sbt,sbtc->btc', weights, values).to(sources.dtype), weights


class DepthRouter(nn.Module):
    """What the AttnRes family shares: one zero-init pseudo-query per sublayer (index i) and one
    for the output mixer (index L), so that at init every read is the plain average of its
    sources. Set `self.recorded = []` to collect every softmax's weights (S, B, T), in order."""
    sublayer_norm = True

    def __init__(self, config):
        super().__init__()
        self.queries = nn.Parameter(torch.zeros(2 * config.n_layer + 1, config.n_embd))
        self.recorded = None

    def mix(self, i, sources, bias=None):
        mixed, weights = depth_mix(torch.stack(sources), self.queries[i], bias)
        if self.recorded is not None:
            self.recorded.append(weights.detach())
        return mixed


class AttnRes(DepthRouter):
    """Full AttnRes: h_i = sum_s alpha_{s->i} v_s over {e, u_0..u_{i-1}} (Kimi Team, arXiv 2603.15031)."""

    def forward(self, x, sublayers):
        sources = [x]  # e, u_0, u_1, ...
        for i, f in enumerate(sublayers):
            sources.append(f(self.mix(i, sources)))
        return self.mix(len(sublayers), sources)


class BlockAttnRes(DepthRouter):
    """Block AttnRes: read {e, C_0..C_{n-1}, PC}, block sums C_n of res_block_size layers and the
    running partial sum PC of the current block (Kimi Team, arXiv 2603.15031)."""

    def __init__(self, config):
        super().__init__(config)
        # sublayers per block; auto gives about 8 blocks, as the paper recommends
        self.block_len = 2 * (config.res_block_size or max(1, config.n_layer // 8))

    def ends_block(self, i, n_sublayers):
        return (i + 1) % self.block_len == 0 or i == n_sublayers - 1  # the last block may be shorter

    def forward(self, x, sublayers):
        sources = [x]  # e, C_0, C_1, ...: e is never summed into a block
        partial = None  # PC: the sum of the current block's updates so far (excludes u_i itself)
        for i, f in enumerate(sublayers):
            u = f(self.mix(i, sources if partial is None else sources + [partial]))
            partial = u if partial is None else partial + u
            if self.ends_block(i, len(sublayers)):
                sources.append(partial)
                partial = None
        return self.mix(len(sublayers), sources)


class DeltaAttnRes(DepthRouter):
    """Delta AttnRes: the PreNorm stream plus a gated routed read over the individual deltas,
    h_i = x_i + sigmoid(c_i) sum_s alpha_{s->i} v_s, V = {e, u_0..u_{i-1}} (arXiv 2605.18855).
    The output is the PreNorm stream x_L (the output query is unused; our reading)."""

    def __init__(self, config):
        super().__init__(config)
        self.gate_logit = nn.Parameter(torch.full((2 * config.n_layer,), -2.0))  # our choice of gate mode

    def forward(self, x, sublayers):
        deltas = [x]  # e, u_0, u_1, ...
        for i, f in enumerate(sublayers):
            u = f(x + torch.sigmoid(self.gate_logit[i]) * self.mix(i, deltas))
            x = x + u
            deltas.append(u)
        return x


@functools.lru_cache
def detail_signs(m, levels):
    """The detail bases of a block of m sublayers, one row each: phase (+1 attention, -1 MLP),
    then Haar levels: level l contrasts the two halves of each of its 2^(l-1) segments (level 1
    is the split basis: first half +1, second half -1). A segment of odd length leaves its middle
    sublayer at 0, so every row sums to zero; a segment too short gives a row of zeros."""
    rows = [[1.0 if k % 2 == 0 else -1.0 for k in range(m)]]
    for level in range(1, levels + 1):
        n_segments = 2 ** (level - 1)
        bounds = [j * m // n_segments for j in range(n_segments + 1)]
        for lo, hi in zip(bounds, bounds[1:]):
            half = (hi - lo) // 2
            rows.append([1.0 if lo <= k < lo + half else -1.0 if hi - half <= k < hi else 0.0 for k in range(m)])
    return torch.tensor(rows)


def rms_match(detail, state, rho, eps=1e-6):
    """Detached RMS matching: rescale a detail tensor to its block's state RMS, at most rho times."""
    rms = lambda v: v.float().pow(2).mean(-1, keepdim=True).sqrt()
    scale = (rms(state) / (rms(detail) + eps)).clamp(max=rho).detach()
    return detail * scale.to(detail.dtype)


class WAV(BlockAttnRes):
    """WAV v1: Block AttnRes whose blocks also offer zero-sum detail bases, phase and split, with a
    negative learnable detail bias, detached RMS matching and a conservative readout (seed
    documents 000/001). Beyond the paper: Haar levels (wav_levels) and learned bases."""

    def __init__(self, config):
        super().__init__(config)
        m = self.block_len
        levels = max(1, min(config.wav_levels, (m // 2).bit_length()))  # while segments hold 2 sublayers
        self.levels, self.rho, self.detail_readout = levels, config.wav_rho, config.wav_detail_readout
        n_details = len(detail_signs(m, levels))
        self.detail_bias = nn.Parameter(torch.full((2 * config.n_layer + 1, n_details), config.wav_detail_bias))
        # learned bases (off by default): the signs plus a learned zero-sum correction per position
        self.basis_delta = nn.Parameter(torch.zeros(n_details, m)) if config.wav_learned_basis else None

    def basis(self, m):
        """Coefficients (n_details, m) of a block of m sublayers; every row sums to zero."""
        signs = detail_signs(m, self.levels).to(self.detail_bias.device)
        if self.basis_delta is None:
            return signs
        delta = self.basis_delta[:, :m]
        return signs + delta - delta.mean(dim=1, keepdim=True)

    def forward(self, x, sublayers):
        L = len(sublayers)
        sources, kinds = [x], [-1]  # the pool of finished blocks; kinds: -1 = e or C, d = detail row d
        for start in range(0, L, self.block_len):
            m = min(self.block_len, L - start)
            signs = detail_signs(m, self.levels)
            coeffs = self.basis(m)
            partial = details = None  # PC and the raw partial details P (n_details, B, T, C)
            for k in range(m):
                i = start + k
                pool, pool_kinds = sources, kinds
                if k > 0:  # the P terms only once the block has begun; rows whose support has begun
                    rows = [d for d in range(len(signs)) if signs[d, :k].any()]
                    pool = pool + [partial] + [rms_match(details[d], partial, self.rho) for d in rows]
                    pool_kinds = pool_kinds + [-1] + rows
                u = sublayers[i](self.mix(i, pool, self.pool_bias(i, pool_kinds)))
                partial = u if partial is None else partial + u
                contribution = coeffs[:, k, None, None, None].to(u.dtype) * u
                details = contribution if details is None else details + contribution
            rows = [d for d in range(len(signs)) if signs[d].any()]
            sources = sources + [partial] + [rms_match(details[d], partial, self.rho) for d in rows]
            kinds = kinds + [-1] + rows
        if not self.detail_readout:  # conservative readout: e and the block sums only
            sources = [s for s, kind in zip(sources, kinds) if kind < 0]
            kinds = [-1] * len(sources)
        return self.mix(L, sources, self.pool_bias(L, kinds))

    def pool_bias(self, i, kinds):
        """Per-source bias for query i: 0 for e, C and PC; detail_bias[i, d] for detail row d."""
        padded = F.pad(self.detail_bias[i], (1, 0))
        return padded[torch.tensor(kinds, device=padded.device) + 1]


RESIDUALS = {
    'prenorm': PreNorm,
    'rezero': ReZero,
    'layerscale': LayerScale,
    'attnres': AttnRes,
    'block_attnres': BlockAttnRes,
    'delta_attnres': DeltaAttnRes,
    'wav': WAV,
}
