"""
What one step of a method costs, counted exactly, without timing, on any device: the operators it
dispatches, the bytes they move, the bytes autograd saves for the backward, and a decode step's
working memory. bench.py reports them; the tests pin them (OPERATORS and BYTES in test_kernels.py,
DECODE_OPERATORS in test_decode.py).

    python bench.py --count_ops=True --config=ops                    # operators of a training step
    TRITON_INTERPRET=1 python bench.py --count_bytes=True --kernels=triton --config=gpt2   # its bytes
    python bench.py --decode=True --count_ops=True --config=ops      # operators of a decode step

Operators (OpCounter): those one training step's forward and backward dispatch (the optimizer's step
left out, the same for every method). A compute operator is a kernel launch on a GPU (5-20 us of host
time each in eager mode, which is where most of the routing's cost goes at small and medium shapes); a
Triton kernel wrapped as a custom op counts once, the operators inside it not at all; a view launches
nothing. The Triton kernels count the same through their interpreter on a CPU as on a GPU.

Bytes (ByteCounter): a GPU's memory traffic outside the caches: every compute operator reads its tensor
inputs and writes its outputs (and the inputs it writes in place); a Triton kernel wrapped as a custom
op reads and writes its arguments, its insides unseen; views, allocations and metadata move nothing.
The step runs on fake tensors (shapes and dtypes only, no data, no arithmetic), so any shape counts
exactly and at once on a CPU, GPT-2's included (a test holds fake and real counts equal).
"""
import contextlib
import json
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from model import GPT, GPTConfig, KVCache, method_knobs


def model_config(name, shape, cfg):
    """The GPTConfig of method `name` at a shape of bench.CONFIGS, with the method knobs cfg sets (the
    others at their defaults)."""
    return GPTConfig(**shape, **{k: cfg[k] for k in method_knobs() if k in cfg}, vocab_size=cfg['vocab_size'],
                     residual=name)


def saved_bytes(model, x, y):
    """Bytes autograd keeps for backward after one forward: the storages of the saved tensors that
    the graph still holds when the forward is done (a branch whose graph was dropped on the way
    holds none, and its memory may be reused), each counted once, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []

    def pack(t):
        saved.append(weakref.ref(t))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(x, y)
    storages = {}
    for t in filter(lambda t: t is not None, (ref() for ref in saved)):
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    del loss
    return sum(storages.values())


def is_view(op):
    """An operator whose outputs alias its inputs without writing them (view, expand, t, unbind, ...)."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns)


class OpCounter(TorchDispatchMode):
    """Counts the operators dispatched while it is active, compute operators by name."""

    def __init__(self):
        super().__init__()
        self.compute, self.views = {}, 0

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        if is_view(op):
            self.views += 1
        else:
            self.compute[str(op)] = self.compute.get(str(op), 0) + 1
        return op(*args, **(kwargs or {}))  # the ops inside run with this mode off: a custom op counts once


def counted_step(name, shape, x, y, ctx, backend, cfg, counter):
    """One forward and backward of a model of this method (made on x's device) with `counter`, a dispatch
    mode, active, after one uncounted step, so that nothing lazy is counted -> the counter."""
    with x.device:
        torch.manual_seed(cfg['seed'])
        model = GPT(model_config(name, shape, cfg))
    model.set_kernels(backend, cfg['mgr_fallback_p'])
    for mode in (contextlib.nullcontext(), counter):
        model.zero_grad(set_to_none=True)
        with ctx, mode:
            _, loss = model(x, y)
        with mode:
            loss.backward()
    return counter


def operator_counts(name, shape, B, x, y, dev, ctx, backend, cfg):
    """The operators of one forward and backward of a model of this method."""
    counter = counted_step(name, shape, x, y, ctx, backend, cfg, OpCounter())
    return dict(method=name, compute=sum(counter.compute.values()), views=counter.views, ops=counter.compute)


def report_ops(results, cfg, shape, backend):
    """The routing's extra operators per sublayer, over prenorm's (the first row)."""
    base, sublayers = results[0], 2 * shape['n_layer']
    print(f"\noperators per training step (forward + backward), kernels={backend}, {sublayers} sublayers")
    print(f"{'method':<14} {'compute':>8} {'views':>7} {'+compute/sublayer':>18} {'views x prenorm':>16}")
    for r in results:
        r['extra_per_sublayer'] = (r['compute'] - base['compute']) / sublayers
        r['views_ratio'] = r['views'] / base['views']
        print(f"{r['method']:<14} {r['compute']:>8} {r['views']:>7} {r['extra_per_sublayer']:>+18.1f} "
              f"{r['views_ratio']:>16.2f}")
    if cfg['json_path']:
        with open(cfg['json_path'], 'w') as f:
            json.dump({'config': cfg, 'shape': shape, 'kernels': backend, 'torch': torch.__version__,
                       'results': results}, f, indent=1)


# operators that move no data: they allocate, alias an input as a view without saying so, or change a
# tensor's shape in place
NO_TRAFFIC = {'aten::empty', 'aten::empty_like', 'aten::empty_strided', 'aten::new_empty', 'aten::_unsafe_view',
              'aten::squeeze_', 'aten::unsqueeze_', 'aten::t_', 'aten::transpose_', 'aten::as_strided_', 'aten::detach_'}


def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class ByteCounter(TorchDispatchMode):
    """The bytes that the compute operators dispatched while it is active read and write, by name:
    each reads its tensor arguments and writes its outputs and the arguments it mutates (an output
    that is a mutated argument counts once)."""

    def __init__(self):
        super().__init__()
        self.moved = {}

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        out = op(*args, **(kwargs or {}))
        schema = op._schema
        if is_view(op) or op.namespace == 'prim' or schema.name in NO_TRAFFIC:
            return out
        kwargs = kwargs or {}
        given = [kwargs.get(a.name) if a.kwarg_only or k >= len(args) else args[k]
                 for k, a in enumerate(schema.arguments)]
        mutated = [v for v, a in zip(given, schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
        outs = out if len(schema.returns) > 1 else (out,)  # (one return may be a list of tensors)
        fresh = [o for o, r in zip(outs, schema.returns) if r.alias_info is None]
        moved = sum(tensor_bytes(tree_leaves(t)) for t in ((args, kwargs), mutated, fresh))
        self.moved[str(op)] = self.moved.get(str(op), 0) + moved
        return out


def bytes_moved(name, shape, B, dev, ctx, backend, cfg, fake=True):
    """The bytes one forward and backward of a model of this method move, by operator, on fake tensors
    (fake=False: real ones, which a test compares them with)."""
    with FakeTensorMode() if fake else contextlib.nullcontext(), dev:  # (made on dev: fakes do not move)
        x, y = (torch.randint(cfg['vocab_size'], (B, shape['block_size'])) for _ in range(2))
        counter = counted_step(name, shape, x, y, ctx, backend, cfg, ByteCounter())
    return dict(method=name, bytes=sum(counter.moved.values()), ops=counter.moved)


def report_bytes(results, cfg, shape, B, backend, dtype_name, top=3):
    """Bytes per step, x prenorm's (the first row), the routing's extra per sublayer, and the operators
    that move the most more than prenorm's do."""
    base, sublayers = results[0], 2 * shape['n_layer']
    print(f"\nbytes moved per training step (forward + backward), kernels={backend}, {dtype_name}, "
          f"{B} x {shape['block_size']} tokens, {sublayers} sublayers")
    print(f"{'method':<14} {'GB':>7} {'x prenorm':>10} {'+MB/sublayer':>13}  largest extra operators (GB)")
    for r in results:
        r['ratio'] = r['bytes'] / base['bytes']
        r['extra_per_sublayer'] = (r['bytes'] - base['bytes']) / sublayers
        extra = {op: b - base['ops'].get(op, 0) for op, b in r['ops'].items()}
        largest = sorted((kv for kv in extra.items() if kv[1] > 0), key=lambda kv: -kv[1])[:top]
        print(f"{r['method']:<14} {r['bytes'] / 1e9:>7.2f} {r['ratio']:>10.3f} {r['extra_per_sublayer'] / 1e6:>+13.1f}  "
              + ', '.join(f"{op.removeprefix('aten.').removesuffix('.default')} {b / 1e9:.2f}" for op, b in largest))
    if cfg['json_path']:
        with open(cfg['json_path'], 'w') as f:
            json.dump({'config': cfg, 'shape': shape, 'batch_size': B, 'kernels': backend, 'dtype': dtype_name,
                       'torch': torch.__version__, 'results': results}, f, indent=1)


# ----------------------------------------------------------------------------- decoding

class PeakMemory(TorchDispatchMode):
    """The most bytes of tensors made while it is active that are alive at once, each storage once
    (what existed before, the weights and a cache, is not counted)."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0  # storage address -> (bytes, weak refs of its tensors)

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        out = op(*args, **(kwargs or {}))
        for address, (size, refs) in list(self.live.items()):  # free what nothing holds any more
            refs[:] = [r for r in refs if r() is not None]
            if not refs:
                del self.live[address]
                self.now -= size
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out) if not is_view(op) else ():  # a view or an in-place write makes no memory
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given | {0}:
                address, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                if address not in self.live:
                    self.live[address] = (size, [])
                    self.now += size
                self.live[address][1].append(weakref.ref(t))
        self.peak = max(self.peak, self.now)
        return out


def decode_counts(names, shape, B, dev, ctx, backend, cfg):
    """One decode step of each method (the last of block_size positions, after a prefill of the others),
    watched: its operators and its working memory (the most bytes of new tensors alive at once) per sequence."""
    T, gen = shape['block_size'], torch.Generator().manual_seed(cfg['seed'])
    tokens = torch.randint(cfg['vocab_size'], (B, T), generator=gen).to(dev)  # the same tokens bench.py times
    models = {}
    for name in names:
        torch.manual_seed(cfg['seed'])
        model = GPT(model_config(name, shape, cfg)).to(dev).eval()
        model.set_kernels(backend, cfg['mgr_fallback_p'])
        models[name] = model
    results = []
    with torch.no_grad(), ctx:
        for name, model in models.items():
            cache, watched = KVCache(model.config), {}
            model(tokens[:, :T - 1], cache=cache)
            for key, mode in (('ops', OpCounter()), ('memory', PeakMemory())):
                with mode:
                    model(tokens[:, T - 1:], cache=cache)
                cache.length, watched[key] = T - 1, mode
            results.append(dict(method=name, compute=sum(watched['ops'].compute.values()), views=watched['ops'].views,
                                ops=watched['ops'].compute, step_bytes=watched['memory'].peak / B))
    return results
