"""
Datasets as flat token files (numpy memmaps) with JSON metadata, prepared once under data_dir:

    data_dir/NAME/train.bin, val.bin   tokens, uint8 or uint16
    data_dir/NAME/meta.json            vocabulary and facts about the split (never pickle)

Datasets:
    pydoc        the embedded default: the Python documentation's topic texts, shipped with
                 every Python in the standard library (pydoc_data), ~465k characters, char level
    PATH         any local text file, char level

Prepare explicitly with `python data.py NAME [--data_dir=DIR]`; train.py prepares on first use.
The validation split is the last 10% of the text: fixed and identical for every method and run.
"""
import hashlib
import json
import os
import shutil
import sys

import numpy as np

EMBEDDED = 'pydoc'
VAL_FRACTION = 0.1


class DataError(Exception):
    """Bad input about data: a missing dataset, a malformed file. The message says what to do."""


def embedded_text():
    from pydoc_data.topics import topics
    return '\n\n'.join(topics[key] for key in sorted(topics))


def char_tokenize(text):
    """Character-level tokens: the vocabulary is the sorted set of characters in the text."""
    codepoints = np.frombuffer(text.encode('utf-32-le'), dtype=np.uint32)
    uniq, ids = np.unique(codepoints, return_inverse=True)
    vocab = [chr(c) for c in uniq]
    return ids.astype(token_dtype(len(vocab))), vocab


def token_dtype(vocab_size):
    return np.uint8 if vocab_size <= 256 else np.uint16


def write_dataset(out_dir, splits, meta):
    """Write splits {name: 1-D token array} and meta.json atomically: into a temporary folder
    that is renamed into place at the end, so a killed prepare never leaves a half dataset."""
    tmp = out_dir + '.tmp'
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for split, tokens in splits.items():
        tokens.tofile(os.path.join(tmp, f'{split}.bin'))
    meta = dict(meta, splits={split: int(len(tokens)) for split, tokens in splits.items()})
    with open(os.path.join(tmp, 'meta.json'), 'w') as f:
        json.dump(meta, f, indent=1, ensure_ascii=False)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


def prepare_char_text(text, out_dir, source):
    if len(text) < 100:
        raise DataError(f"{source} holds only {len(text)} characters; a dataset needs far more")
    tokens, vocab = char_tokenize(text)
    n_val = int(len(tokens) * VAL_FRACTION)
    write_dataset(out_dir, {'train': tokens[:-n_val], 'val': tokens[-n_val:]},
                  dict(kind='char', vocab=vocab, vocab_size=len(vocab),
                       dtype=np.dtype(token_dtype(len(vocab))).name, source=source))


def file_sha256(path):
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for chunk in iter(lambda: f.read(1 << 20), b''):
            h.update(chunk)
    return h.hexdigest()


def dataset_dir(name, data_dir):
    """Where NAME is prepared. A local file gets its stem and a content hash, so an edited file
    is prepared afresh instead of silently reusing stale tokens."""
    if name == EMBEDDED:
        return os.path.join(data_dir, name)
    if os.path.isfile(name):
        stem = os.path.splitext(os.path.basename(name))[0]
        return os.path.join(data_dir, f'{stem}-{file_sha256(name)[:12]}')
    raise DataError(f"unknown dataset {name!r}: pass --dataset={EMBEDDED} (embedded, no download) "
                    f"or the path of an existing text file")


def prepare(name, data_dir='data'):
    """Prepare dataset NAME under data_dir (if not there yet) and return its folder."""
    out_dir = dataset_dir(name, data_dir)
    if os.path.exists(os.path.join(out_dir, 'meta.json')):
        return out_dir
    os.makedirs(data_dir, exist_ok=True)
    if name == EMBEDDED:
        prepare_char_text(embedded_text(), out_dir, source='pydoc_data.topics')
    else:
        try:
            with open(name, encoding='utf-8') as f:
                text = f.read()
        except UnicodeDecodeError as e:
            raise DataError(f"{name} is not UTF-8 text ({e}); char-level datasets need a UTF-8 text file")
        prepare_char_text(text, out_dir, source=os.path.abspath(name))
    return out_dir


class Dataset:
    """A prepared dataset: memmapped splits, the metadata, and encode/decode for char level."""

    def __init__(self, path):
        with open(os.path.join(path, 'meta.json')) as f:
            self.meta = json.load(f)
        dtype = np.dtype(self.meta['dtype'])
        self.splits = {split: np.memmap(os.path.join(path, f'{split}.bin'), dtype=dtype, mode='r')
                       for split in self.meta['splits']}
        for split, n in self.meta['splits'].items():
            if len(self.splits[split]) != n:
                raise DataError(f"{path}/{split}.bin holds {len(self.splits[split])} tokens but meta.json "
                                f"says {n}; delete {path} and prepare it again")
        self.vocab_size = self.meta['vocab_size']
        self.char_level = self.meta['kind'] == 'char'
        self.stoi = {ch: i for i, ch in enumerate(self.meta['vocab'])} if self.char_level else None

    def encode(self, text):
        unknown = sorted(set(text) - set(self.stoi))
        if unknown:
            raise DataError(f"characters {unknown!r} are not in this dataset's vocabulary")
        return [self.stoi[ch] for ch in text]

    def decode(self, tokens):
        return ''.join(self.meta['vocab'][t] for t in tokens)


def load(name, data_dir='data'):
    return Dataset(prepare(name, data_dir))


def main(argv):
    args = dict(data_dir='data')
    names = []
    for arg in argv:
        if arg.startswith('--') and '=' in arg and arg[2:].split('=')[0] in args:
            key, value = arg[2:].split('=', 1)
            args[key] = value
        elif arg.startswith('-'):
            sys.exit(f"error: unknown option {arg!r}; usage: python data.py NAME [--data_dir=DIR]")
        else:
            names.append(arg)
    if len(names) != 1:
        sys.exit("usage: python data.py NAME [--data_dir=DIR]   (NAME: pydoc or a text file)")
    try:
        ds = load(names[0], args['data_dir'])
    except DataError as e:
        sys.exit(f"error: {e}")
    print(f"{names[0]}: vocab {ds.vocab_size}, " + ', '.join(f'{k} {v:,} tokens' for k, v in ds.meta['splits'].items()))


if __name__ == '__main__':
    main(sys.argv[1:])
