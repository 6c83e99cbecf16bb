"""
Datasets as flat token files (numpy memmaps) with JSON metadata, prepared once under data_dir:

    data_dir/NAME/train.bin, val.bin (, test.bin)   tokens: uint8/uint16 for char level
    data_dir/NAME/meta.json                         vocabulary and facts (never pickle)
    data_dir/downloads/                             the downloaded files

    python data.py NAME [--source=PATH] [--data_dir=DIR] [--shards=N] [--max_chars=N]

NAME:
    pydoc        the embedded default: the Python documentation's topic texts, shipped with every
                 Python in the standard library (pydoc_data), ~465k characters; no download
    text8        100M characters of Wikipedia, a-z and space; 90M/5M/5M split; reported in bpc
    tinystories  TinyStoriesV2-GPT4 train and valid files, char level
    tinystories_slice  the CPU studies' slice: the first 2 MiB of TinyStories-train.txt (V1), sha256-checked
    fineweb      GPT-2 token shards of FineWeb-10BT (--shards=N of them, plus the val shard)
    PATH         any local UTF-8 text file, char level, last 10% for validation

--source prepares from a local file (or folder) instead of the download, for offline machines; a
prepared dataset is prepared again when --source names another file than the one it came from.
--max_chars=N (text8 only) keeps the first N characters of text8 and splits them 90/5/5 the same
way: the CPU studies' slice is `python data.py text8 --max_chars=3010294`, its first 3,010,294
characters, checked against their sha256 (TEXT8_SLICE_SHA256).
text8 is a plain download (a .part file that a rerun resumes, size- and md5-checked); TinyStories
and FineWeb come from the Hugging Face Hub through huggingface_hub (resumable, cached, size-checked,
honouring HF_ENDPOINT mirrors and HF_TOKEN). train.py downloads text8 (31 MB) when it is missing,
but not the multi-GB TinyStories and FineWeb: it names the command to run instead.
"""
import hashlib
import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
import zipfile

import numpy as np
import torch
from huggingface_hub import hf_hub_download
from huggingface_hub.utils import logging as hf_logging
from tqdm import tqdm

EMBEDDED = 'pydoc'
VAL_FRACTION = 0.1

TEXT8_URL = 'http://mattmahoney.net/dc/text8.zip'
TEXT8_ZIP_BYTES = 31_344_016
TEXT8_CHARS = 100_000_000
TEXT8_MD5 = '3bea1919949baf155f99411df5fada7e'  # of the unzipped text
TEXT8_VOCAB = ' abcdefghijklmnopqrstuvwxyz'
TEXT8_SLICE_CHARS = 3_010_294  # the CPU studies' slice (config/cpu_*.py): this prefix of text8
TEXT8_SLICE_SHA256 = 'f3413b8d00bc41ef9dda3f92d1c7d028545d385ed476e518fdb0491f57e5a137'

TINYSTORIES_REPO = 'roneneldan/TinyStories'  # a dataset on the Hugging Face Hub
TINYSTORIES_FILES = {'train': ('TinyStoriesV2-GPT4-train.txt', 2_227_753_162),
                     'val': ('TinyStoriesV2-GPT4-valid.txt', 22_502_601)}
# the CPU studies' TinyStories slice: the first 2 MiB of the V1 train file, sha256-checked (its last,
# cut story dropped; its last ~10% of stories validate)
TINYSTORIES_SLICE = ('TinyStories-train.txt', 2_097_152,
                     '5352b299dcb1a32898b2d779b145b5a05f3e1265953fd21c264c9f9f9c9ae33d')
STORY_SEPARATOR = '<|endoftext|>'  # one token in our vocabulary
UNKNOWN = '\ufffd'  # stands for every character rarer than TINYSTORIES_MIN_PER_MILLION
TINYSTORIES_MIN_PER_MILLION = 1  # about 2,200 occurrences in the full train file

FINEWEB_REPO = 'kjj0/fineweb10B-gpt2'
FINEWEB_SHARD_BYTES = 200_001_024  # a train shard: 256 int32 of header, then 100M uint16 tokens
FINEWEB_MAGIC, FINEWEB_VERSION, FINEWEB_HEADER_INTS = 20240520, 1, 256
FINEWEB_VOCAB, FINEWEB_VOCAB_PADDED = 50257, 50304  # padded to a multiple of 64 for speed
FINEWEB_SHARDS = 4  # default number of train shards (~100M tokens each)


class DataError(Exception):
    """Bad input about data: a missing dataset, a malformed file. The message says what to do."""


# ----------------------------------------------------------------------------- files

def download(url, dest, size=None, dataset='NAME'):
    """Fetch url into dest with a progress bar. Bytes go to dest.part, which a later call resumes
    with an HTTP Range request; the file is renamed to dest only once complete (and size-checked)."""
    if os.path.exists(dest):
        return dest
    os.makedirs(os.path.dirname(dest) or '.', exist_ok=True)
    part = dest + '.part'
    have = os.path.getsize(part) if os.path.exists(part) else 0
    request = urllib.request.Request(url, headers={'Range': f'bytes={have}-'} if have else {})
    try:
        response = urllib.request.urlopen(request, timeout=60)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # the range is past the end: the .part is bad, start over
            os.remove(part)
            return download(url, dest, size, dataset)
        raise DataError(f"downloading {url} failed: HTTP {e.code} {e.reason}")
    except (urllib.error.URLError, OSError) as e:
        raise DataError(f"cannot download {url} ({getattr(e, 'reason', e)}). On a machine without internet, "
                        f"fetch that file elsewhere and put it at {dest}, or prepare from a local copy with "
                        f"python data.py {dataset} --source=PATH")
    with response:
        if have and response.status != 206:  # the server ignored the range: start over
            have = 0
        length = response.headers.get('Content-Length')
        total = have + int(length) if length else size
        with open(part, 'ab' if have else 'wb') as f, \
                tqdm(total=total, initial=have, unit='B', unit_scale=True, desc=os.path.basename(dest)) as bar:
            while chunk := response.read(1 << 20):
                f.write(chunk)
                bar.update(len(chunk))
    got = os.path.getsize(part)
    if size is not None and got != size:
        os.remove(part)
        raise DataError(f"{url} gave {got:,} bytes, expected {size:,}; the partial file was deleted, run again")
    os.replace(part, dest)
    return dest


def hub_download(repo, filename, folder, dataset):
    """One file of a Hugging Face dataset repository into folder (huggingface_hub: resumable, cached,
    size-checked; HF_ENDPOINT and HF_TOKEN honoured), or a DataError that says how to go on offline."""
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its retries' warnings; the error below says what happened
    try:
        return hf_hub_download(repo, filename, repo_type='dataset', local_dir=folder,
                               endpoint=os.environ.get('HF_ENDPOINT'))
    except Exception as e:  # offline, a mirror that does not answer, a missing file, no space left
        reason = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise DataError(f"cannot download {filename} of the Hugging Face dataset {repo} ({reason[:200]}). On a "
                        f"machine without internet, fetch it elsewhere and prepare from a local copy: python data.py "
                        f"{dataset} --source=FOLDER (a folder holding {filename})")
    finally:
        hf_logging.set_verbosity(verbosity)


def write_dataset(out_dir, splits, meta):
    """Write splits {name: 1-D token array} and meta.json atomically: into a temporary folder
    that is renamed into place at the end, so a killed prepare never leaves a half dataset."""
    tmp = out_dir + '.tmp'
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for split, tokens in splits.items():
        tokens.tofile(os.path.join(tmp, f'{split}.bin'))
    write_meta(tmp, dict(meta, splits={split: int(len(tokens)) for split, tokens in splits.items()}))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


def write_meta(folder, meta):
    with open(os.path.join(folder, 'meta.json'), 'w') as f:
        json.dump(meta, f, indent=1, ensure_ascii=False)


def token_dtype(vocab_size):
    return np.uint8 if vocab_size <= 256 else np.uint16


def file_sha256(path):
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for chunk in iter(lambda: f.read(1 << 20), b''):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------- char level

def char_tokenize(text, vocab=None):
    """Character tokens. The vocabulary is the sorted set of the text's characters unless given;
    characters outside a given vocabulary map to UNKNOWN (which must then be in it)."""
    codepoints = np.frombuffer(text.encode('utf-32-le'), dtype=np.uint32)
    if vocab is None:
        uniq, ids = np.unique(codepoints, return_inverse=True)
        vocab = [chr(c) for c in uniq]
        return ids.astype(token_dtype(len(vocab))), vocab
    lookup = np.full(0x110000, vocab.index(UNKNOWN) if UNKNOWN in vocab else -1, dtype=np.int32)
    for i, symbol in enumerate(vocab):
        if len(symbol) == 1:
            lookup[ord(symbol)] = i
    ids = lookup[codepoints]
    if (ids < 0).any():
        bad = sorted({chr(c) for c in codepoints[ids < 0]})[:10]
        raise DataError(f"characters {bad!r} are not in the vocabulary {''.join(vocab)!r}")
    return ids.astype(token_dtype(len(vocab))), vocab


def prepare_char_text(text, out_dir, source):
    if len(text) < 100:
        raise DataError(f"{source} holds only {len(text)} characters; a dataset needs far more")
    tokens, vocab = char_tokenize(text)
    n_val = int(len(tokens) * VAL_FRACTION)
    write_dataset(out_dir, {'train': tokens[:-n_val], 'val': tokens[-n_val:]},
                  dict(kind='char', vocab=vocab, vocab_size=len(vocab),
                       dtype=np.dtype(token_dtype(len(vocab))).name, source=source))


def embedded_text():
    from pydoc_data.topics import topics
    return '\n\n'.join(topics[key] for key in sorted(topics))


def prepare_pydoc(out_dir, data_dir, source):
    prepare_char_text(embedded_text(), out_dir, source='pydoc_data.topics')


def decode_text(raw, path):
    """The text of a file's bytes, or a DataError for a file that is not UTF-8 text."""
    try:
        return raw.decode('utf-8')
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason}); char-level datasets need a "
                        f"UTF-8 text file")


def prepare_local_file(path, out_dir):
    with open(path, 'rb') as f:
        prepare_char_text(decode_text(f.read(), path), out_dir, source=os.path.abspath(path))


def read_text8(path):
    """The bytes of text8: the file 'text8' of a zip, or a plain text file."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            if 'text8' not in z.namelist():
                raise DataError(f"{path} holds {z.namelist()[:5]}, not the file 'text8'")
            return z.read('text8')
    with open(path, 'rb') as f:
        return f.read()


def text8_prefix(text, max_chars, path, source):
    """The first max_chars characters of text; the studies' slice length is checked against its sha256."""
    if max_chars > len(text):
        raise DataError(f"--max_chars={max_chars} is more than the {len(text):,} characters of {path}")
    text = text[:max_chars]
    if max_chars == TEXT8_SLICE_CHARS:
        found = hashlib.sha256(text.encode('utf-8')).hexdigest()
        if found != TEXT8_SLICE_SHA256:
            remedy = (f"give --source= a copy of the original text8 ({TEXT8_URL}), or leave out --source to "
                      f"download it" if source else "delete it and run again to download it afresh")
            raise DataError(f"the first {max_chars:,} characters of {path} have sha256 {found}, expected "
                            f"{TEXT8_SLICE_SHA256} (the studies' text8 slice): {path} is not the original "
                            f"text8; {remedy}")
        print(f"the first {max_chars:,} characters of {path} are the studies' text8 slice (sha256 "
              f"{TEXT8_SLICE_SHA256[:12]}...)", file=sys.stderr)
    return text


def prepare_text8(out_dir, data_dir, source, max_chars=None):
    """The standard split: first 90M characters train, next 5M val, last 5M test. max_chars keeps
    only the first max_chars characters (a prefix of text8) and splits them in the same proportions;
    so is another text than the full text8 from --source, with a warning, unless its prefix is the
    studies' slice (TEXT8_SLICE_CHARS, checked)."""
    path = source or download(TEXT8_URL, os.path.join(data_dir, 'downloads', 'text8.zip'), TEXT8_ZIP_BYTES, 'text8')
    raw = read_text8(path)
    full = len(raw) == TEXT8_CHARS and hashlib.md5(raw).hexdigest() == TEXT8_MD5
    if not full and not source:
        raise DataError(f"{path} does not unzip to the canonical text8 (md5 {TEXT8_MD5}); delete it and run again")
    text = decode_text(raw, path)
    if max_chars is not None:
        text = text8_prefix(text, max_chars, path, source)
    if not full and max_chars != TEXT8_SLICE_CHARS:
        kept = f"its first {max_chars:,} characters" if max_chars is not None else "it"
        print(f"warning: {path} is not the full text8 ({len(raw):,} characters, not {TEXT8_CHARS:,}); "
              f"splitting {kept} 90/5/5 all the same", file=sys.stderr)
    tokens, vocab = char_tokenize(text, list(TEXT8_VOCAB))
    n_train, n_val = len(tokens) * 90 // 100, len(tokens) * 5 // 100
    write_dataset(out_dir, {'train': tokens[:n_train], 'val': tokens[n_train:n_train + n_val],
                            'test': tokens[n_train + n_val:]},
                  dict(kind='char', vocab=vocab, vocab_size=len(vocab), dtype='uint8', source=os.path.abspath(path),
                       max_chars=max_chars))


def read_stories(path, chunk_bytes=1 << 24):
    """Stream a TinyStories file as (text, bytes read) in chunks that end at a line end (so no
    UTF-8 character is cut), each separator line turned into one \\x00 symbol."""
    with open(path, 'rb') as f:
        carry = b''
        while chunk := f.read(chunk_bytes):
            chunk = carry + chunk
            cut = chunk.rfind(b'\n') + 1
            carry, chunk = (chunk[cut:], chunk[:cut]) if cut else (chunk, b'')
            if chunk:
                yield decode_text(chunk, path).replace(STORY_SEPARATOR + '\n', '\x00'), len(chunk)
        if carry:
            yield decode_text(carry, path).replace(STORY_SEPARATOR, '\x00'), len(carry)


def download_prefix(url, dest, n_bytes, dataset):
    """The first n_bytes of url into dest (an HTTP Range request; a server that ignores it is read
    only that far), with a progress bar; written whole or not at all."""
    if os.path.exists(dest):
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers={'Range': f'bytes=0-{n_bytes - 1}'}),
                                          timeout=60)
    except (urllib.error.URLError, OSError) as e:
        raise DataError(f"cannot download {url} ({getattr(e, 'reason', e)}). On a machine without internet, prepare "
                        f"from a local copy of its first {n_bytes:,} bytes (or of the whole file): python data.py "
                        f"{dataset} --source=PATH")
    with response, open(dest + '.part', 'wb') as f, tqdm(total=n_bytes, unit='B', unit_scale=True,
                                                        desc=os.path.basename(dest)) as bar:
        while (left := n_bytes - f.tell()) and (chunk := response.read(min(left, 1 << 20))):
            f.write(chunk)
            bar.update(len(chunk))
    os.replace(dest + '.part', dest)
    return dest


def prepare_tinystories_slice(out_dir, data_dir, source):
    """The CPU studies' TinyStories slice (TINYSTORIES_SLICE): the first 2 MiB of TinyStories-train.txt
    (V1), from a Range download or the prefix of --source (the whole file, or any copy of its head),
    checked against its sha256; cut after its last whole story and prepared as a one-file TinyStories
    (the vocabulary of its characters, the last ~10% of its stories for validation)."""
    name, n_bytes, sha256 = TINYSTORIES_SLICE
    endpoint = os.environ.get('HF_ENDPOINT', 'https://huggingface.co').rstrip('/')
    path = source or download_prefix(f'{endpoint}/datasets/{TINYSTORIES_REPO}/resolve/main/{name}',
                                     os.path.join(data_dir, 'downloads', f'{name}.head'), n_bytes, 'tinystories_slice')
    with open(path, 'rb') as f:
        head = f.read(n_bytes)
    found = hashlib.sha256(head).hexdigest()
    if len(head) != n_bytes or found != sha256:
        raise DataError(f"the first {n_bytes:,} bytes of {path} have sha256 {found} ({len(head):,} bytes), expected "
                        f"{sha256}: it is not the head of the TinyStories V1 file {name}; give --source= a copy of "
                        f"it, or leave out --source to download its first {n_bytes:,} bytes")
    stories = os.path.join(data_dir, 'downloads', 'tinystories_slice.txt')
    os.makedirs(os.path.dirname(stories), exist_ok=True)
    with open(stories, 'wb') as f:  # whole stories: up to the last separator line
        f.write(head[:head.rindex((STORY_SEPARATOR + '\n').encode()) + len(STORY_SEPARATOR) + 1])
    prepare_tinystories(out_dir, data_dir, stories)


def prepare_tinystories(out_dir, data_dir, source):
    """Two streaming passes in bounded memory: count characters, then encode. The vocabulary is
    every character seen at least TINYSTORIES_MIN_PER_MILLION times per million in the train file;
    the rest (stray Unicode) all map to one UNKNOWN symbol. Each story ends with the separator.
    --source: a folder holding both V2 files, or one text file (split 90/10 at a story boundary)."""
    if source and os.path.isfile(source):
        files = {'train': source}
    elif source:
        files = {split: os.path.join(source, name) for split, (name, _) in TINYSTORIES_FILES.items()}
        for path in files.values():
            if not os.path.isfile(path):
                raise DataError(f"{path} not found; --source=DIR must hold {', '.join(n for n, _ in TINYSTORIES_FILES.values())}")
    else:
        files = {split: hub_download(TINYSTORIES_REPO, name, os.path.join(data_dir, 'downloads', 'tinystories'),
                                     'tinystories') for split, (name, _) in TINYSTORIES_FILES.items()}
    counts = np.zeros(0x110000, dtype=np.int64)
    total = os.path.getsize(files['train'])
    with tqdm(total=total, unit='B', unit_scale=True, desc='count characters') as bar:
        for chunk, n_bytes in read_stories(files['train']):
            counts += np.bincount(np.frombuffer(chunk.encode('utf-32-le'), dtype=np.uint32), minlength=0x110000)
            bar.update(n_bytes)
    keep = counts >= max(1, counts.sum() * TINYSTORIES_MIN_PER_MILLION // 1_000_000)
    keep[0] = False
    vocab = [STORY_SEPARATOR] + [chr(c) for c in np.flatnonzero(keep)] + [UNKNOWN]
    vocab_lookup = list(vocab)
    vocab_lookup[0] = '\x00'  # the separator arrives as \x00 from read_stories
    tmp = out_dir + '.tmp'
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    sizes = {}
    for split, path in files.items():
        with open(os.path.join(tmp, f'{split}.bin'), 'wb') as out, \
                tqdm(total=os.path.getsize(path), unit='B', unit_scale=True, desc=f'encode {split}') as bar:
            for chunk, n_bytes in read_stories(path):
                char_tokenize(chunk, vocab_lookup)[0].tofile(out)
                bar.update(n_bytes)
        sizes[split] = os.path.getsize(os.path.join(tmp, f'{split}.bin'))
    if 'val' not in files:  # one file: the last ~10% of the stories validate
        train_path = os.path.join(tmp, 'train.bin')
        tokens = np.memmap(train_path, dtype=np.uint8, mode='r')
        start = int(len(tokens) * (1 - VAL_FRACTION))
        later = np.flatnonzero(tokens[start:] == 0)
        if not len(later):
            raise DataError(f"{source} has no story separator ({STORY_SEPARATOR}) in its last 10%")
        cut = start + int(later[0]) + 1
        tokens[cut:].tofile(os.path.join(tmp, 'val.bin'))
        tokens[:cut].tofile(train_path + '.cut')
        sizes = {'train': cut, 'val': len(tokens) - cut}
        del tokens
        os.replace(train_path + '.cut', train_path)
        print(f"warning: {source} is one file; its last {sizes['val']:,} characters (whole stories) validate",
              file=sys.stderr)
    write_meta(tmp, dict(kind='char', vocab=vocab, vocab_size=len(vocab), dtype='uint8', splits=sizes,
                         source={k: os.path.abspath(v) for k, v in files.items()}))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


# ----------------------------------------------------------------------------- FineWeb token shards

def read_shard(path):
    """A FineWeb shard as a read-only memmap of uint16 GPT-2 tokens, after checking its header:
    256 int32 (magic 20240520, version 1, token count) and a size that matches the count."""
    with open(path, 'rb') as f:
        header = np.frombuffer(f.read(FINEWEB_HEADER_INTS * 4), dtype=np.int32)
    if len(header) < FINEWEB_HEADER_INTS:
        raise DataError(f"{path} is too short for a FineWeb shard header ({len(header) * 4} bytes)")
    if header[0] != FINEWEB_MAGIC:
        raise DataError(f"{path}: bad magic {header[0]}, expected {FINEWEB_MAGIC}; not a FineWeb token shard")
    if header[1] != FINEWEB_VERSION:
        raise DataError(f"{path}: version {header[1]}, expected {FINEWEB_VERSION}")
    n_tokens, size = int(header[2]), os.path.getsize(path)
    if size != FINEWEB_HEADER_INTS * 4 + 2 * n_tokens:
        raise DataError(f"{path}: header promises {n_tokens:,} tokens ({FINEWEB_HEADER_INTS * 4 + 2 * n_tokens:,} "
                        f"bytes) but the file has {size:,} bytes: truncated or corrupt, delete it and fetch it again")
    return np.memmap(path, dtype=np.uint16, mode='r', offset=FINEWEB_HEADER_INTS * 4, shape=(n_tokens,))


def write_shard(path, tokens):
    """Write tokens in the FineWeb shard format (for tests and for converting other corpora)."""
    header = np.zeros(FINEWEB_HEADER_INTS, dtype=np.int32)
    header[:3] = FINEWEB_MAGIC, FINEWEB_VERSION, len(tokens)
    with open(path, 'wb') as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16).tobytes())


class Shards:
    """Several shards read as one sequence: len() and slices that may cross a shard boundary."""

    def __init__(self, arrays):
        self.arrays = arrays
        self.starts = np.cumsum([0] + [len(a) for a in arrays])

    def __len__(self):
        return int(self.starts[-1])

    def __getitem__(self, index):
        start, stop = index.start or 0, index.stop
        pieces, k = [], int(np.searchsorted(self.starts, start, side='right')) - 1
        while start < stop:
            local = start - self.starts[k]
            piece = self.arrays[k][local:local + stop - start]
            pieces.append(piece)
            start += len(piece)
            k += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def fineweb_names(shards):
    return {'val': ['fineweb_val_000000.bin'], 'train': [f'fineweb_train_{i:06d}.bin' for i in range(1, shards + 1)]}


def prepare_fineweb(out_dir, data_dir, source, shards=FINEWEB_SHARDS):
    """The shards stay as they are (no re-encoding): fetched or copied into out_dir, validated."""
    os.makedirs(out_dir, exist_ok=True)
    names = fineweb_names(shards)
    for name in names['val'] + names['train']:
        dest = os.path.join(out_dir, name)
        if os.path.exists(dest):
            pass
        elif source:
            if not os.path.isfile(os.path.join(source, name)):
                raise DataError(f"{os.path.join(source, name)} not found; --source=DIR must hold {name}")
            shutil.copyfile(os.path.join(source, name), dest + '.part')
            os.replace(dest + '.part', dest)
        else:
            hub_download(FINEWEB_REPO, name, out_dir, 'fineweb')
        read_shard(dest)  # validate now, not in the middle of training
    write_meta(out_dir, dict(kind='gpt2', vocab_size=FINEWEB_VOCAB_PADDED, true_vocab_size=FINEWEB_VOCAB,
                             dtype='uint16', shards=names, source=os.path.abspath(source) if source else FINEWEB_REPO))


# ----------------------------------------------------------------------------- loading

PREPARE = {'pydoc': prepare_pydoc, 'text8': prepare_text8, 'tinystories': prepare_tinystories,
           'tinystories_slice': prepare_tinystories_slice, 'fineweb': prepare_fineweb}


def dataset_dir(name, data_dir):
    """Where NAME is prepared. A local file gets its stem and a content hash, so an edited file
    is prepared afresh instead of silently reusing stale tokens."""
    if name in PREPARE:
        return os.path.join(data_dir, name)
    if os.path.isfile(name):
        stem = os.path.splitext(os.path.basename(name))[0]
        return os.path.join(data_dir, f'{stem}-{file_sha256(name)[:12]}')
    raise DataError(f"unknown dataset {name!r}: pass --dataset= one of {', '.join(PREPARE)} "
                    f"or the path of an existing text file")


# what train.py will not download unasked: (size, what to run)
BIG_DOWNLOADS = {'tinystories': '2.25 GB', 'fineweb': f'about {(FINEWEB_SHARDS + 1) * FINEWEB_SHARD_BYTES / 1e9:.1f} GB'}


def source_of(source):
    """How a prepared dataset remembers where it came from: the absolute path of --source."""
    return os.path.abspath(source) if source else None


def origin(source, max_chars=None):
    """Where a dataset comes from, in a message: its source (or the download) and the prefix kept."""
    return f"{source or 'the download'}" + (f" (its first {max_chars:,} characters)" if max_chars else '')


def prepare(name, data_dir='data', source=None, shards=None, download=True, max_chars=None):
    """Prepare dataset NAME under data_dir, unless it is there already (from the same --source and
    --max_chars), and return its folder. download=False: refuse the multi-GB downloads (BIG_DOWNLOADS)
    and say which command prepares them. max_chars: text8's first max_chars characters only."""
    out_dir = dataset_dir(name, data_dir)
    meta_path = os.path.join(out_dir, 'meta.json')
    if source and not os.path.exists(source):
        raise DataError(f"--source={source} does not exist (give the path of a local copy of {name})")
    if max_chars is not None and name != 'text8':
        raise DataError(f"--max_chars applies to text8 only, not to {name}")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        stale = (source and name in PREPARE and source_of(source) not in (meta.get('source'), *(
            meta['source'].values() if isinstance(meta.get('source'), dict) else ()))) or (
            max_chars is not None and meta.get('max_chars') != max_chars)
        more_shards = name == 'fineweb' and shards is not None and shards > len(meta['shards']['train'])
        if not stale and not more_shards:
            return out_dir
        if stale:
            print(f"note: {out_dir} was prepared from {origin(meta.get('source'), meta.get('max_chars'))}; "
                  f"preparing it again from {origin(source, max_chars)}", file=sys.stderr)
    elif name in BIG_DOWNLOADS and not source and not download:
        raise DataError(f"{name} is not prepared in {out_dir}, and preparing it downloads {BIG_DOWNLOADS[name]}; run "
                        f"`python data.py {name} --data_dir={data_dir}` first (or --source=FOLDER for a local copy)")
    os.makedirs(data_dir, exist_ok=True)
    t0 = time.time()
    if name in PREPARE:
        extra = {'shards': shards} if name == 'fineweb' and shards else {}
        if max_chars is not None:  # text8 (checked above)
            extra['max_chars'] = max_chars
        PREPARE[name](out_dir, data_dir, source, **extra)
    else:
        prepare_local_file(name, out_dir)
    print(f"prepared {name} in {out_dir} ({time.time() - t0:.1f}s)", file=sys.stderr)
    return out_dir


class Dataset:
    """A prepared dataset: memmapped splits, the metadata, and encode/decode."""

    def __init__(self, path):
        with open(os.path.join(path, 'meta.json')) as f:
            self.meta = json.load(f)
        self.vocab_size = self.meta['vocab_size']
        self.char_level = self.meta['kind'] == 'char'
        if self.meta['kind'] == 'gpt2':
            self.splits = {split: Shards([read_shard(os.path.join(path, n)) for n in names])
                           for split, names in self.meta['shards'].items()}
            return
        dtype = np.dtype(self.meta['dtype'])
        self.splits = {split: np.memmap(os.path.join(path, f'{split}.bin'), dtype=dtype, mode='r')
                       for split in self.meta['splits']}
        for split, n in self.meta['splits'].items():
            if len(self.splits[split]) != n:
                raise DataError(f"{path}/{split}.bin holds {len(self.splits[split])} tokens but meta.json "
                                f"says {n}; delete {path} and prepare it again")
        self.stoi = {symbol: i for i, symbol in enumerate(self.meta['vocab'])}

    def encode(self, text):
        if not self.char_level:
            return gpt2_encoding().encode(text, allowed_special={'<|endoftext|>'})
        unknown = sorted(set(text) - set(self.stoi))
        if unknown:
            raise DataError(f"characters {unknown!r} are not in this dataset's vocabulary")
        return [self.stoi[ch] for ch in text]

    def decode(self, tokens):
        if not self.char_level:
            return gpt2_encoding().decode([t for t in tokens if t < FINEWEB_VOCAB])
        return ''.join(self.meta['vocab'][t] for t in tokens)


# ----------------------------------------------------------------------------- batches and the fixed validation

def get_batch(tokens, offsets, block_size, device):
    """Inputs and next-token targets (len(offsets), block_size) starting at the given offsets."""
    x = np.stack([tokens[i:i + block_size] for i in offsets]).astype(np.int64)
    y = np.stack([tokens[i + 1:i + 1 + block_size] for i in offsets]).astype(np.int64)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    if device.type == 'cuda':
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def evaluate(model, tokens, block_size, eval_tokens, batch_size, device, ctx):
    """Mean loss of model(x, y) over the fixed validation windows: consecutive block_size windows
    from the start of `tokens`, eval_tokens in all. The same tokens for every method, run and step."""
    n_windows = min(eval_tokens, len(tokens) - 1) // block_size
    was_training = model.training
    model.eval()
    total = 0.0
    with torch.no_grad():
        for start in range(0, n_windows, batch_size):
            offsets = [w * block_size for w in range(start, min(start + batch_size, n_windows))]
            x, y = get_batch(tokens, offsets, block_size, device)
            with ctx:
                _, loss = model(x, y)
            total += loss.item() * len(offsets)
    model.train(was_training)
    return total / n_windows


def gpt2_encoding():
    try:
        import tiktoken
    except ImportError:
        raise DataError("GPT-2 tokens need tiktoken to encode or decode text: pip install tiktoken")
    return tiktoken.get_encoding('gpt2')


def load(name, data_dir='data', download=True):
    return Dataset(prepare(name, data_dir, download=download))


def positive_int(option, value):
    """An option's value as a positive integer (None when not given), or exit with a one-line error."""
    if value is not None and not (value.isdigit() and int(value) > 0):
        sys.exit(f"error: --{option} expects a positive integer, got {value!r}")
    return int(value) if value is not None else None


def main(argv):
    usage = "usage: python data.py NAME [--source=PATH] [--data_dir=DIR] [--shards=N] [--max_chars=N]"
    args, names = dict(data_dir='data', source=None, shards=None, max_chars=None), []
    for arg in argv:
        key, eq, value = arg.removeprefix('--').partition('=')
        if arg in ('-h', '--help'):
            print(__doc__.strip())
            sys.exit(0)
        if arg.startswith('--') and eq and key in args:
            args[key] = value
        elif arg.startswith('-'):
            sys.exit(f"error: unknown option {arg!r}; {usage}")
        else:
            names.append(arg)
    names_help = f"{usage}\nNAME: {', '.join(PREPARE)}, or the path of an existing text file"
    if len(names) != 1:
        sys.exit(f"error: name one dataset; {names_help}")
    if names[0] not in PREPARE and not os.path.isfile(names[0]):  # dataset_dir's message is in train.py's terms
        sys.exit(f"error: unknown dataset {names[0]!r}; {names_help}")
    shards, max_chars = positive_int('shards', args['shards']), positive_int('max_chars', args['max_chars'])
    try:
        folder = dataset_dir(names[0], args['data_dir'])
        existed = os.path.exists(os.path.join(folder, 'meta.json'))
        ds = Dataset(prepare(names[0], args['data_dir'], args['source'], shards, max_chars=max_chars))
    except DataError as e:
        sys.exit(f"error: {e}")
    if existed and ds.meta.get('source') and not args['source'] and max_chars is None:
        print(f"using {folder}, prepared before from {origin(ds.meta['source'], ds.meta.get('max_chars'))}; "
              f"delete that folder to prepare it again", file=sys.stderr)
    print(f"{names[0]}: vocab {ds.vocab_size}, " + ', '.join(f'{k} {len(v):,} tokens' for k, v in ds.splits.items()))


if __name__ == '__main__':
    main(sys.argv[1:])
