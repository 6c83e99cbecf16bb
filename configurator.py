"""
The command line of every script, nanoGPT-style. A script's public module-level defaults are its
keys; config files (Python files that assign keys) and --key=value override them, in order.

    python train.py config/text8_12l.py --residual=wav --seed=2

Values are type-checked against the defaults (an int may stand for a float); strings are taken as
written. Unknown keys, bad values and broken config files fail with one line that names the key or
the file and what would be right. Also here: what every script needs to run somewhere, the device
and the precision.
"""
import ast
import difflib
import importlib
import os
import sys
import traceback
import types
from contextlib import nullcontext

import torch


def keys_of(scope):
    """The keys of a script: its public module-level ints, floats, bools and strings, constants (NAMES
    in capitals) left out."""
    return {k: v for k, v in scope.items()
            if not k.startswith('_') and not k.isupper() and type(v) in (int, float, bool, str)}


def script_keys(path):
    """The keys of a script read from its source, without running it (keys_of gives the same once it
    has run): its module-level assignments to public names of a literal, or of a constant of a module
    it imports (module.NAME). sweep.py checks train.py's command lines with them."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    modules = {alias.asname or alias.name: alias.name for node in tree.body if isinstance(node, ast.Import)
               for alias in node.names}
    keys = {}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        name, value = node.targets[0].id, node.value
        if name.startswith('_') or name.isupper():
            continue
        if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id in modules:
            value = getattr(importlib.import_module(modules[value.value.id]), value.attr)
        else:
            try:
                value = ast.literal_eval(value)
            except ValueError:
                sys.exit(f"error: {path}, line {node.lineno}: the default of {name} is neither a literal nor a "
                         f"constant of a module it imports, so other tools cannot read it")
        if type(value) in (int, float, bool, str):
            keys[name] = value
    return keys


def parse(argv, defaults, doc):
    """Defaults, then config files and --key=value in order -> (config, the keys set explicitly).
    -h/--help prints the script's docstring and every key with its default."""
    cfg, given = dict(defaults), set()
    for arg in argv:
        if arg in ('-h', '--help'):
            print(doc.strip() + '\n\nkeys and defaults:\n' + '\n'.join(f'  --{k}={v!r}' for k, v in cfg.items()))
            sys.exit(0)
        if arg.startswith('--'):
            key, eq, raw = arg[2:].partition('=')
            if not eq:
                sys.exit(f"error: {arg!r} is not of the form --key=value (see --help)")
            set_key(cfg, key, raw if isinstance(cfg.get(key), str) else literal(raw), arg)
            given.add(key)
        else:
            for key, value in read_config_file(arg).items():
                set_key(cfg, key, value, arg)
                given.add(key)
    return cfg, given


def literal(raw):
    """A Python literal (3, 1e-3, True, 'x'), or the raw text if it is none."""
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def read_config_file(path):
    """The keys a config file assigns (its imports and functions left out)."""
    if not os.path.isfile(path):
        sys.exit(f"error: config file {path!r} not found (positional arguments are config files; "
                 f"overrides are written --key=value)")
    with open(path) as f:
        source = f.read()
    scope = {}
    try:
        exec(compile(source, path, 'exec'), scope)
    except SyntaxError as e:
        sys.exit(f"error: config file {path}, line {e.lineno}: {e.msg}")
    except Exception as e:
        line = next((f.lineno for f in reversed(traceback.extract_tb(e.__traceback__)) if f.filename == path), '?')
        sys.exit(f"error: config file {path}, line {line}: {type(e).__name__}: {e}")
    return {k: v for k, v in scope.items()
            if not k.startswith('_') and not callable(v) and not isinstance(v, types.ModuleType)}


def set_key(cfg, key, value, where):
    """Type-check value against the default of key and store it; exit with a clear line if bad."""
    if key not in cfg:
        close = difflib.get_close_matches(key, cfg, n=1)
        sys.exit(f"error: unknown key {key!r} in {where}" + (f"; did you mean {close[0]!r}?" if close else
                 "; run with --help to list the keys"))
    default = cfg[key]
    if type(default) is float and type(value) is int:
        value = float(value)
    if type(value) is not type(default):
        sys.exit(f"error: {key} expects {type(default).__name__} (like {default!r}), got {value!r} in {where}")
    cfg[key] = value


def check(cfg, rules):
    """Range checks, rules = {key: (is_valid, what is valid)}: exit with one line naming the first bad key."""
    for key, (valid, wanted) in rules.items():
        if not valid(cfg[key]):
            sys.exit(f"error: {key}={cfg[key]!r} is out of range; it must be {wanted}")


# ----------------------------------------------------------------------------- where it runs

def devices_here():
    here = ['cpu']
    if torch.cuda.is_available():
        here.append('cuda' + (f' (cuda:0..cuda:{torch.cuda.device_count() - 1})' if torch.cuda.device_count() > 1 else ''))
    if torch.backends.mps.is_available():
        here.append('mps')
    return here


def resolve_device(name):
    """'auto' = cuda > mps > cpu; anything else must exist here (ValueError naming what does)."""
    if name == 'auto':
        name = 'cuda' if torch.cuda.is_available() else 'mps' if torch.backends.mps.is_available() else 'cpu'
    here = ', '.join(devices_here())
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device={name!r} is not a device; use auto or one of the devices here: {here}")
    present = {'cpu': True, 'cuda': torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count(),
               'mps': torch.backends.mps.is_available()}
    if not present.get(device.type, False):
        raise ValueError(f"device={name!r} is not available on this machine (torch {torch.__version__}); "
                         f"devices here: {here}")
    return device


def precision(device, dtype):
    """The dtype name ('auto' = bfloat16 on a GPU that supports it, else float32) and the autocast
    context to run forward passes in."""
    if dtype not in ('auto', 'float32', 'bfloat16'):
        raise ValueError(f"dtype={dtype!r}; choose one of: auto, float32, bfloat16")
    if dtype == 'auto':
        dtype = 'bfloat16' if device.type == 'cuda' and torch.cuda.is_bf16_supported() else 'float32'
    ctx = nullcontext() if dtype == 'float32' else torch.autocast(device_type=device.type, dtype=getattr(torch, dtype))
    return dtype, ctx
