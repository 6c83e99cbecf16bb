"""
The AttnRes family and WAV.

Full, Block and Delta AttnRes and WAV as their classes compute them, with every read a depth mix
in the AttnRes paper's two phases. Sublayer i reads h_i = sum_s softmax_s(q_i . RMSNorm(v_s)
+ b_is) v_s over its sources (Full: e and every update so far; Block: e, the finished blocks'
sums and its own block's partial sum; WAV: those and the blocks' matched details). Phase 1: the
queries of a block (Full and Delta AttnRes: of a chunk of about sqrt(L) sublayers) read the
sources finished before it in one pass; phase 2: each sublayer continues its row with the
sources of its own block. The backward is the reads' (depth_mix.py). The schedules read through a
Reads, which holds the backend.
"""
import math

import torch
from torch import Tensor
from torch.nn import functional as F

from residuals import detail_signs

from .common import on_device
from .depth_mix import reads


# ------------------------------------------------------------------------------------- the Function

class GatedAdd(torch.autograd.Function):
    """x + gate read for a scalar gate: one operator forward, two backward (autograd's mul and add
    take two forward and three backward: the gate's gradient as a product and a sum,
    not one dot)."""

    @staticmethod
    def forward(ctx, x, gate, read):
        ctx.save_for_backward(gate, read)
        return torch.addcmul(x, gate, read)

    @staticmethod
    def backward(ctx, grad):
        gate, read = ctx.saved_tensors
        grad_gate = torch.dot(grad.reshape(-1), read.reshape(-1).to(grad.dtype)).to(gate.dtype)
        return grad, grad_gate, (grad * gate).to(read.dtype)


# ------------------------------------------------------------------------------------ the schedules

def rows_of(queries, start, m):
    """The queries of sublayers start..start+m-1 as one (m, C) tensor for a phase-1 read; `queries`
    are the parameter's rows (1, C), split once per forward: one gradient node for them all, where
    indexing the parameter would give each read a full-size zero gradient."""
    return torch.cat(queries[start:start + m]) if m > 1 else queries[start]


def chunked(queries, e, L, read, step):
    """Full AttnRes's reads in chunks of about sqrt(L) sublayers: the chunk's queries read the
    finished sources in one pass, and each merges the chunk's own fresh updates. queries: rows;
    read: a Reads; step(i, h) runs sublayer i on its read h and returns its update. Returns the
    sources e, u_0, ..., u_{L-1}."""
    sources, chunk = [e], max(1, math.isqrt(L))
    for start in range(0, L, chunk):
        m = min(chunk, L - start)
        finished, fresh = read.many(rows_of(queries, start, m), sources, None), []
        for k in range(m):
            h = read.continued(finished[k], queries[start + k], fresh, None)
            fresh.append(step(start + k, h))
        sources = sources + fresh
    return sources


def attnres(module, x, sublayers, backend):
    """Full AttnRes, chunked; the output mixer reads every source."""
    queries, L, read = module.read.queries.split(1), len(sublayers), reads(backend)
    sources = chunked(queries, x, L, read, lambda i, h: sublayers[i](h))
    return read.one(queries[L], sources, None)


def delta_attnres(module, x, sublayers, backend):
    """Delta AttnRes with Full AttnRes's chunked reads of the deltas; x is the PreNorm stream."""
    gates = torch.sigmoid(module.gate_logit).unbind(0)

    def step(i, read):
        nonlocal x
        u = sublayers[i](GatedAdd.apply(x, gates[i], read))
        x = x + u
        return u
    chunked(module.read.queries.split(1), x, len(sublayers), reads(backend), step)
    return x


def block_attnres(module, x, sublayers, backend):
    """Block AttnRes in two phases: the queries of a block read e and the finished block sums in one
    pass; each then merges the block's partial sum PC, once the block has begun."""
    queries, L, sources, read = module.read.queries.split(1), len(sublayers), [x], reads(backend)
    for start in range(0, L, module.block_len):
        m = min(module.block_len, L - start)
        finished, partial = read.many(rows_of(queries, start, m), sources, None), None
        for k in range(m):
            more = [] if partial is None else [partial]
            h = read.continued(finished[k], queries[start + k], more, None)
            u = sublayers[start + k](h)
            partial = u if partial is None else partial + u
        sources = sources + [partial]
    return read.one(queries[L], sources, None)


def wav_plan(module, L):
    """The types of the sources of every read of one WAV forward (-1: e, a block sum or PC; d >= 0:
    a detail of type d): per block (start, m, the finished pool's types, and for each sublayer k the
    types of the block's own sources it merges: none for k = 0, then PC and the begun details), and
    the types of the whole pool at the end."""
    blocks, pool = [], [-1]
    for start in range(0, L, module.block_len):
        m = min(module.block_len, L - start)
        blocks.append((start, m, pool,
                       [[] if k == 0 else [-1] + module.begun(m, k) for k in range(m)]))
        pool = pool + [-1] + module.begun(m, m)
    return blocks, pool


def detail_biases(module, blocks, readout):
    """Every read's bias, in the order wav() reads (each block's phase 1, its sublayers' phase 2,
    the output mixer), gathered in one indexing of detail_bias padded with a zero column (type -1):
    one operator forward and a few backward instead of several per read. -> a list of each read's
    rows x S numbers, flat (the reads take the rows one after another: no view per read)."""
    padded = F.pad(module.detail_bias, (1, 0))
    width, index, shapes = padded.shape[1], [], []

    def read(rows, types):
        index.extend(r * width + t + 1 for r in rows for t in types)
        shapes.append((len(rows), len(types)))
    for start, m, pool, own in blocks:
        read(range(start, start + m), pool)
        for k in range(1, m):
            read([start + k], own[k])
    read([len(padded) - 1], readout)
    flat = padded.flatten()[on_device(index, padded.device)].split([r * c for r, c in shapes])
    return flat


def accumulate(total, c, u):
    """total + c u for a coefficient c: a number of the paper's fixed bases (+1, -1 or 0: a sum, a
    difference or nothing, one operator at most) or a tensor entry of a learned basis."""
    if isinstance(c, Tensor):
        term = c.to(u.dtype) * u
        return term if total is None else total + term
    if c == 0:
        return total
    if total is None:
        return u if c == 1 else -u
    return total + u if c == 1 else total - u


def wav(module, x, sublayers, backend):
    """WAV in Block AttnRes's two phases: the queries of a block read the finished pool (e, the
    block sums and their matched details) in one pass; each then merges PC and the block's partial
    details, which are accumulated online (one tensor per detail type). The plan of the sources'
    types is made first, so that every read's bias is gathered at once."""
    queries, L = module.read.queries.split(1), len(sublayers)
    blocks, types = wav_plan(module, L)
    # the output mixer reads every source, or (conservative) e and the block sums only
    readout = types if module.detail_readout else [t for t in types if t < 0]
    biases = iter(detail_biases(module, blocks, readout))
    sources, read = [x], reads(backend)  # the finished pool
    for start, m, _, own in blocks:
        coeffs = detail_signs(m, module.levels) if module.basis_delta is None else module.basis(m)
        # a fixed basis may repeat a row (m = 2: phase and split are both (+1, -1)):
        # accumulated once
        same = [coeffs.index(row) if module.basis_delta is None else d
                for d, row in enumerate(coeffs)]
        finished = read.many(rows_of(queries, start, m), sources, next(biases))
        partial = raw = None  # PC and the raw partial details P_d
        for k in range(m):
            more = []
            if k > 0:
                more = [partial] + read.matched([raw[d] for d in own[k][1:]], partial, module.rho)
            h = read.continued(finished[k], queries[start + k], more, next(biases) if k else None)
            u = sublayers[start + k](h)
            partial = u if partial is None else partial + u
            if raw is None:
                raw = [None] * len(coeffs)
            raw = [accumulate(raw[d], coeffs[d][k], u) if same[d] == d else None
                   for d in range(len(coeffs))]
            raw = [raw[same[d]] for d in range(len(coeffs))]
        begun = module.begun(m, m)
        # (the last block's details: only by a detail readout)
        read_later = module.detail_readout or start + m < L
        details = [None] * len(begun)
        if read_later:
            details = read.matched([raw[d] for d in begun], partial, module.rho)
        sources = sources + [partial] + details
    if not module.detail_readout:
        sources = [s for s, t in zip(sources, types) if t < 0]
    return read.one(queries[L], sources, next(biases))
