"""
data.py: the embedded corpus, local files, text8, TinyStories and FineWeb shards prepared from the
shared slices and local files (downloads cannot run here: a local server stands in), the studies'
text8 slice cut from the full text8 by --max_chars and TinyStories slice from the head of the V1
file, the fixed validation windows.
"""
import hashlib
import http.server
import math
import os
import threading
import zipfile

import numpy as np
import pytest
import torch

import data
import train
from conftest import SHARED_DATA, TEXT8, TINY_TRAIN, exit_message, need_shared


def test_embedded_corpus_is_real_text_with_a_fixed_split(data_dir):
    ds = data.load(data.EMBEDDED, data_dir)
    text = ds.decode(ds.splits['val'][:2000].tolist())
    assert text.count(' the ') > 5  # English prose, not noise
    assert len(ds.splits['train']) > 300_000
    again = data.Dataset(data.prepare(data.EMBEDDED, data_dir))
    assert np.array_equal(again.splits['val'], ds.splits['val'])
    assert len(ds.splits['val']) == int((len(ds.splits['train']) + len(ds.splits['val'])) * data.VAL_FRACTION)



def test_local_text_file_round_trips_and_is_reprepared_when_edited(tmp_path):
    src = tmp_path / 'mine.txt'
    src.write_text('héllo wörld, ' * 100, encoding='utf-8')
    ds = data.load(str(src), str(tmp_path / 'd'))
    both = np.concatenate([ds.splits['train'], ds.splits['val']])
    assert ds.decode(both.tolist()) == src.read_text(encoding='utf-8')
    src.write_text('something else entirely. ' * 100, encoding='utf-8')
    assert 'y' in data.load(str(src), str(tmp_path / 'd')).stoi
    assert 'ö' not in data.load(str(src), str(tmp_path / 'd')).stoi



def test_fixed_validation_is_identical_across_methods_and_runs(tmp_path, data_dir):
    """Two methods evaluated at init on the fixed val windows see exactly the same tokens."""
    ds = data.load(data.EMBEDDED, data_dir)
    seen = []

    class Spy(torch.nn.Module):
        def forward(self, x, y):
            seen.append(x.clone())
            return None, torch.tensor(1.0)
    data.evaluate(Spy(), ds.splits['val'], 32, 1000, 7, torch.device('cpu'), torch.no_grad())
    first = torch.cat(seen)
    seen.clear()
    data.evaluate(Spy(), ds.splits['val'], 32, 1000, 7, torch.device('cpu'), torch.no_grad())
    assert torch.equal(first, torch.cat(seen))
    assert first.shape == (1000 // 32, 32)
    assert first[1, 0].item() == ds.splits['val'][32]



def test_text8_from_a_zip_splits_90_5_5_and_reports_bpc(tmp_path, capsys):
    head = need_shared(TEXT8)
    archive = tmp_path / 'text8.zip'
    with zipfile.ZipFile(archive, 'w') as z:
        z.write(head, 'text8')
    data.prepare('text8', str(tmp_path / 'd'), source=str(archive))
    assert 'not the full text8' in capsys.readouterr().err
    ds = data.load('text8', str(tmp_path / 'd'))
    n = head.stat().st_size
    assert {k: len(v) for k, v in ds.splits.items()} == {'train': n * 90 // 100, 'val': n * 5 // 100,
                                                          'test': n - n * 90 // 100 - n * 5 // 100}
    assert ds.vocab_size == 27 and ds.decode(ds.splits['train'][:26].tolist()) == head.read_text()[:26]
    metrics = train.main(['--dataset=text8', f'--data_dir={tmp_path / "d"}', f'--out_dir={tmp_path / "o"}',
                          '--max_iters=5', '--eval_interval=5', *TINY_TRAIN])
    assert metrics['val_bpc'] == pytest.approx(metrics['val_loss'] / math.log(2))
    assert 'parameters, text8 (vocab 27)' in capsys.readouterr().out  # all of it: no prefix named



def test_tinystories_keeps_story_boundaries(tmp_path):
    source = need_shared(SHARED_DATA / 'tinystories_train_head_2MiB.txt')
    data.prepare('tinystories', str(tmp_path), source=str(source))
    ds = data.load('tinystories', str(tmp_path))
    raw = source.read_text(encoding='utf-8')
    sep = ds.stoi[data.STORY_SEPARATOR]
    train_tokens, val_tokens = ds.splits['train'], ds.splits['val']
    assert train_tokens[-1] == sep  # validation starts at the beginning of a story
    assert (train_tokens == sep).sum() + (val_tokens == sep).sum() == raw.count(data.STORY_SEPARATOR)
    stories = ds.decode(np.concatenate([train_tokens, val_tokens]).tolist()).split(data.STORY_SEPARATOR)
    source_stories = raw.split(data.STORY_SEPARATOR + '\n')
    assert len(stories) == len(source_stories)
    for got, want in zip(stories, source_stories):  # rare characters become the one UNKNOWN symbol
        assert len(got) == len(want)
        assert all(a == b or a == data.UNKNOWN for a, b in zip(got, want))
    assert data.UNKNOWN in ds.stoi and 0.05 < len(val_tokens) / len(train_tokens) < 0.15



def test_fineweb_shards_read_back_exactly_and_bad_ones_fail_clearly(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 50257, 5000).astype(np.uint16)
    data.write_shard(tmp_path / 'good.bin', tokens)
    assert np.array_equal(data.read_shard(tmp_path / 'good.bin'), tokens)
    raw = (tmp_path / 'good.bin').read_bytes()
    header = np.frombuffer(raw[:1024], dtype=np.int32).copy()
    for name, mutate, message in [('magic', lambda h: h.__setitem__(0, 1234), 'bad magic 1234'),
                                  ('version', lambda h: h.__setitem__(1, 7), 'version 7, expected 1')]:
        bad = header.copy()
        mutate(bad)
        (tmp_path / f'{name}.bin').write_bytes(bad.tobytes() + raw[1024:])
        with pytest.raises(data.DataError, match=message):
            data.read_shard(tmp_path / f'{name}.bin')
    (tmp_path / 'short.bin').write_bytes(raw[:-100])
    with pytest.raises(data.DataError, match='truncated'):
        data.read_shard(tmp_path / 'short.bin')



def test_fineweb_prepared_from_local_shards_trains_on_sequences_across_shards(tmp_path):
    rng = np.random.default_rng(1)
    src = tmp_path / 'src'
    src.mkdir()
    shards = {name: rng.integers(0, 50257, 3000).astype(np.uint16)
              for name in ['fineweb_val_000000.bin', 'fineweb_train_000001.bin', 'fineweb_train_000002.bin']}
    for name, tokens in shards.items():
        data.write_shard(src / name, tokens)
    data.prepare('fineweb', str(tmp_path / 'd'), source=str(src), shards=2)
    ds = data.load('fineweb', str(tmp_path / 'd'))
    both = np.concatenate([shards['fineweb_train_000001.bin'], shards['fineweb_train_000002.bin']])
    assert len(ds.splits['train']) == 6000 and ds.vocab_size == 50304 and not ds.char_level
    assert np.array_equal(ds.splits['train'][2990:3010], both[2990:3010])  # across the boundary
    metrics = train.main(['--dataset=fineweb', f'--data_dir={tmp_path / "d"}', f'--out_dir={tmp_path / "o"}',
                          '--max_iters=3', '--eval_interval=3', *TINY_TRAIN])
    assert 'val_bpc' not in metrics and math.isfinite(metrics['val_ppl'])



class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Serves one payload, honouring Range requests, and can cut the connection half-way."""
    payload, cut_after, requests = b'', None, []

    def do_GET(self):
        start = int(self.headers['Range'].split('=')[1].rstrip('-')) if self.headers['Range'] else 0
        RangeHandler.requests.append(start)
        body = self.payload[start:]
        self.send_response(206 if start else 200)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body[:self.cut_after] if self.cut_after else body)

    def log_message(self, *args):
        pass



def test_download_resumes_an_interrupted_file_and_renames_when_complete(tmp_path):
    RangeHandler.payload = bytes(range(256)) * 4000
    RangeHandler.cut_after, RangeHandler.requests = 300_000, []
    server = http.server.HTTPServer(('127.0.0.1', 0), RangeHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url, dest = f'http://127.0.0.1:{server.server_port}/file.bin', str(tmp_path / 'file.bin')
    try:
        with pytest.raises(data.DataError, match='expected'):  # the connection died half-way
            data.download(url, dest, size=len(RangeHandler.payload))
        assert not os.path.exists(dest)
        (tmp_path / 'file.bin.part').write_bytes(RangeHandler.payload[:300_000])  # as left by a killed run
        RangeHandler.cut_after = None
        data.download(url, dest, size=len(RangeHandler.payload))
        assert RangeHandler.requests[-1] == 300_000  # it asked only for the rest
        assert (tmp_path / 'file.bin').read_bytes() == RangeHandler.payload
        assert not (tmp_path / 'file.bin.part').exists()
    finally:
        server.shutdown()



def test_offline_download_names_the_url_and_where_to_put_the_file(tmp_path):
    with pytest.raises(data.DataError) as error:
        data.download('http://127.0.0.1:9/text8.zip', str(tmp_path / 'downloads' / 'text8.zip'))
    assert 'http://127.0.0.1:9/text8.zip' in str(error.value) and str(tmp_path / 'downloads' / 'text8.zip') in str(error.value)
    assert '--source' in str(error.value)



class HubHandler(http.server.BaseHTTPRequestHandler):
    """A stand-in for the Hugging Face Hub: serves files at /datasets/REPO/resolve/main/NAME with the
    headers huggingface_hub reads (commit, etag, size), honouring Range requests."""
    files, requests = {}, []

    def send_file_headers(self):
        name = self.path.split('/resolve/main/')[-1]
        body = self.files.get(name)
        if body is None:
            self.send_response(404)
            self.end_headers()
            return None
        start = int(self.headers['Range'].split('=')[1].split('-')[0]) if self.headers['Range'] else 0
        self.send_response(206 if start else 200)
        self.send_header('X-Repo-Commit', 'a' * 40)
        self.send_header('ETag', f'"{hashlib.sha256(body).hexdigest()}"')
        self.send_header('Content-Length', str(len(body) - start))
        if start:
            self.send_header('Content-Range', f'bytes {start}-{len(body) - 1}/{len(body)}')
        self.end_headers()
        return body[start:]

    def do_HEAD(self):
        HubHandler.requests.append(('HEAD', self.path))
        self.send_file_headers()

    def do_GET(self):
        HubHandler.requests.append(('GET', self.path))
        body = self.send_file_headers()
        if body is not None:
            self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_tinystories_downloads_through_huggingface_hub_from_a_mirror(tmp_path, monkeypatch):
    """HF_ENDPOINT points huggingface_hub at a local mirror; the files it downloads prepare the same
    dataset as the same files given with --source, and a second prepare downloads nothing."""
    stories = [f"Once upon a time there was a {animal} named {name}. It liked {thing}.\n"
               for animal in ('cat', 'dog', 'bird') for name in ('Tom', 'Lily', 'Sam') for thing in ('tea', 'rain')]
    text = lambda part: ''.join(s + data.STORY_SEPARATOR + '\n' for s in part).encode()
    HubHandler.files = {'TinyStoriesV2-GPT4-train.txt': text(stories * 20), 'TinyStoriesV2-GPT4-valid.txt': text(stories)}
    HubHandler.requests = []
    server = http.server.HTTPServer(('127.0.0.1', 0), HubHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv('HF_ENDPOINT', f'http://127.0.0.1:{server.server_port}')
    monkeypatch.setenv('HF_HUB_DISABLE_XET', '1')
    try:
        hub = data.load('tinystories', str(tmp_path / 'hub'))
        gets = [path for method, path in HubHandler.requests if method == 'GET']
        assert sorted(gets) == [f'/datasets/{data.TINYSTORIES_REPO}/resolve/main/{name}' for name in sorted(HubHandler.files)]
        data.load('tinystories', str(tmp_path / 'hub'))
        assert [path for method, path in HubHandler.requests if method == 'GET'] == gets  # prepared: no download
    finally:
        server.shutdown()
    local = tmp_path / 'local'
    local.mkdir()
    for name, body in HubHandler.files.items():
        (local / name).write_bytes(body)
    copy = data.Dataset(data.prepare('tinystories', str(tmp_path / 'copy'), source=str(local)))
    assert hub.meta['vocab'] == copy.meta['vocab']
    assert all(np.array_equal(hub.splits[k], copy.splits[k]) for k in ('train', 'val'))
    assert hub.decode(hub.splits['val'][:30].tolist()) == stories[0][:30]


def test_train_does_not_start_a_multi_gigabyte_download_unasked(tmp_path, monkeypatch):
    monkeypatch.setenv('HF_ENDPOINT', 'http://127.0.0.1:9')  # nothing may be fetched
    for name, size in [('tinystories', '2.25 GB'), ('fineweb', 'GB')]:
        with pytest.raises(data.DataError) as error:
            data.load(name, str(tmp_path), download=False)
        assert size in str(error.value) and f'python data.py {name}' in str(error.value)
    message = exit_message(train.main, ['--dataset=tinystories', f'--data_dir={tmp_path}', f'--out_dir={tmp_path / "o"}'])
    assert 'python data.py tinystories' in message and not (tmp_path / 'o').exists()


def test_a_missing_source_is_one_line_naming_the_path(tmp_path):
    message = exit_message(data.main, ['text8', '--source=../shared/data/no_such_file.txt', f'--data_dir={tmp_path}'])
    assert message == ("error: --source=../shared/data/no_such_file.txt does not exist (give the path of a local copy "
                       "of text8)")


def test_an_unknown_dataset_is_named_in_the_terms_of_the_script_it_was_given_to(tmp_path, monkeypatch):
    """data.py takes the name as a positional, train.py as --dataset=: each error says it that way."""
    monkeypatch.chdir(tmp_path)
    message = exit_message(data.main, ['nope', f'--data_dir={tmp_path}'])
    assert message.startswith("error: unknown dataset 'nope'; usage: python data.py NAME")
    assert '--dataset=' not in message and 'pydoc' in message
    message = exit_message(train.main, ['--dataset=nope', f'--data_dir={tmp_path}', f'--out_dir={tmp_path / "o"}'])
    assert "unknown dataset 'nope': pass --dataset= one of pydoc" in message
    assert not (tmp_path / 'nope').exists() and not (tmp_path / 'o').exists()


def test_a_binary_source_gets_the_same_clear_error_on_every_path(tmp_path):
    binary = tmp_path / 'image.bin'
    binary.write_bytes(bytes(range(256)) * 10)
    wanted = f"error: {binary} is not UTF-8 text (byte 128: invalid start byte); char-level datasets need a UTF-8 text file"
    assert exit_message(data.main, ['text8', f'--source={binary}', f'--data_dir={tmp_path}']) == wanted
    assert exit_message(data.main, [str(binary), f'--data_dir={tmp_path}']) == wanted
    assert exit_message(train.main, [f'--dataset={binary}', f'--data_dir={tmp_path}', f'--out_dir={tmp_path / "o"}']) == wanted


def test_a_different_source_prepares_the_dataset_again(tmp_path, capsys):
    text = ' '.join(['anarchism originated as a term of abuse'] * 500)
    first, second = tmp_path / 'first.txt', tmp_path / 'second.txt'
    first.write_text(text)
    second.write_text(text[:len(text) // 2])
    data.main(['text8', f'--source={first}', f'--data_dir={tmp_path}'])
    assert len(data.load('text8', str(tmp_path)).splits['train']) == len(text) * 90 // 100
    capsys.readouterr()
    data.main(['text8', f'--data_dir={tmp_path}'])  # no --source: the prepared copy, and which one it is
    assert f"prepared before from {first}" in capsys.readouterr().err
    data.main(['text8', f'--source={second}', f'--data_dir={tmp_path}'])
    assert f"was prepared from {first}; preparing it again from {second}" in capsys.readouterr().err
    assert len(data.load('text8', str(tmp_path)).splits['train']) == (len(text) // 2) * 90 // 100


def serve_as_text8(monkeypatch, tmp_path, text):
    """A local server that stands in for the text8 download, serving a zip of text (whose size and md5
    data.py then takes for the canonical text8's). Returns the server, to shut down."""
    archive = tmp_path / 'served.zip'
    with zipfile.ZipFile(archive, 'w', zipfile.ZIP_DEFLATED) as z:
        z.writestr('text8', text)
    RangeHandler.payload, RangeHandler.cut_after, RangeHandler.requests = archive.read_bytes(), None, []
    server = http.server.HTTPServer(('127.0.0.1', 0), RangeHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(data, 'TEXT8_URL', f'http://127.0.0.1:{server.server_port}/text8.zip')
    monkeypatch.setattr(data, 'TEXT8_ZIP_BYTES', len(RangeHandler.payload))
    monkeypatch.setattr(data, 'TEXT8_CHARS', len(text))
    monkeypatch.setattr(data, 'TEXT8_MD5', hashlib.md5(text.encode()).hexdigest())
    return server


def test_text8_max_chars_cuts_the_studies_slice_from_the_full_text8(tmp_path, monkeypatch, capsys):
    """`python data.py text8 --max_chars=3010294` (the command the study configs give) prepares the
    same files as the shared slice did with --source, from the download and from a local copy alike.
    The "full text8" here is the slice with more text after it, served by a local server."""
    head = need_shared(TEXT8)
    assert head.stat().st_size == data.TEXT8_SLICE_CHARS
    full = head.read_text() + ' and then some more words of wikipedia' * 1000
    reference = data.Dataset(data.prepare('text8', str(tmp_path / 'ref'), source=str(head)))
    assert 'not the full text8' in capsys.readouterr().err  # the slice itself is not the full text8
    server = serve_as_text8(monkeypatch, tmp_path, full)
    try:
        data.main(['text8', '--max_chars=3010294', f'--data_dir={tmp_path / "cut"}'])
    finally:
        server.shutdown()
    assert RangeHandler.requests == [0] and (tmp_path / 'cut' / 'downloads' / 'text8.zip').is_file()
    (tmp_path / 'full.txt').write_text(full)
    data.main(['text8', '--max_chars=3010294', f'--source={tmp_path / "full.txt"}', f'--data_dir={tmp_path / "local"}'])
    err = capsys.readouterr().err
    assert err.count("are the studies' text8 slice") == 2 and 'warning' not in err
    for folder in ('cut', 'local'):
        cut = data.Dataset(str(tmp_path / folder / 'text8'))
        assert cut.meta['vocab'] == reference.meta['vocab'] and cut.meta['splits'] == reference.meta['splits']
        assert cut.meta['max_chars'] == data.TEXT8_SLICE_CHARS
        for split in ('train', 'val', 'test'):
            assert (tmp_path / folder / 'text8' / f'{split}.bin').read_bytes() == \
                (tmp_path / 'ref' / 'text8' / f'{split}.bin').read_bytes()
    data.main(['text8', f'--data_dir={tmp_path / "cut"}'])  # what is there, and that it is the cut
    err = capsys.readouterr().err
    assert 'prepared before from' in err and '(its first 3,010,294 characters)' in err
    # a run on it says so too (the full text8 and the slice are both prepared as data/text8)
    train.main(['--dataset=text8', f'--data_dir={tmp_path / "cut"}', f'--out_dir={tmp_path / "o"}', '--max_iters=1',
                '--eval_interval=1', *TINY_TRAIN])
    assert 'parameters, text8 (its first 3,010,294 characters) (vocab 27)' in capsys.readouterr().out


def test_a_text8_whose_prefix_is_not_the_slice_names_both_hashes_and_what_to_do(tmp_path):
    text = ('anarchism originated as a term of abuse ' * 80_000)[:data.TEXT8_SLICE_CHARS + 500]
    source = tmp_path / 'not_text8.txt'
    source.write_text(text)
    found = hashlib.sha256(text[:data.TEXT8_SLICE_CHARS].encode()).hexdigest()
    message = exit_message(data.main, ['text8', '--max_chars=3010294', f'--source={source}', f'--data_dir={tmp_path}'])
    assert message == (f"error: the first 3,010,294 characters of {source} have sha256 {found}, expected "
                       f"{data.TEXT8_SLICE_SHA256} (the studies' text8 slice): {source} is not the original text8; "
                       f"give --source= a copy of the original text8 ({data.TEXT8_URL}), or leave out --source to "
                       f"download it")
    assert not (tmp_path / 'text8').exists()


def test_bad_max_chars_values_are_one_line_errors(tmp_path):
    for value in ('0', '-5', '1.5', 'abc', '3_010_294', ''):
        assert exit_message(data.main, ['text8', f'--max_chars={value}', f'--data_dir={tmp_path}']) == \
            f"error: --max_chars expects a positive integer, got {value!r}"
    source = tmp_path / 'short.txt'
    source.write_text('a short text ' * 100)
    assert exit_message(data.main, ['text8', '--max_chars=1301', f'--source={source}', f'--data_dir={tmp_path}']) == \
        f"error: --max_chars=1301 is more than the 1,300 characters of {source}"
    assert exit_message(data.main, ['pydoc', '--max_chars=1000', f'--data_dir={tmp_path}']) == \
        "error: --max_chars applies to text8 only, not to pydoc"
    assert not (tmp_path / 'text8').exists() and not (tmp_path / 'pydoc').exists()


def test_max_chars_of_another_text_warns_what_it_splits_and_a_new_value_prepares_again(tmp_path, capsys):
    text = ' '.join(['anarchism originated as a term of abuse'] * 500)
    source = tmp_path / 'other.txt'
    source.write_text(text)
    data.main(['text8', '--max_chars=1000', f'--source={source}', f'--data_dir={tmp_path}'])
    assert (f"warning: {source} is not the full text8 ({len(text):,} characters, not 100,000,000); splitting its "
            f"first 1,000 characters 90/5/5 all the same") in capsys.readouterr().err
    ds = data.load('text8', str(tmp_path))
    assert {k: len(v) for k, v in ds.splits.items()} == {'train': 900, 'val': 50, 'test': 50}
    assert ds.decode(np.concatenate(list(ds.splits.values())).tolist()) == text[:1000]
    data.main(['text8', '--max_chars=2000', f'--source={source}', f'--data_dir={tmp_path}'])
    assert (f"was prepared from {source} (its first 1,000 characters); preparing it again from {source} (its "
            f"first 2,000 characters)") in capsys.readouterr().err
    assert len(data.load('text8', str(tmp_path)).splits['train']) == 1800


class PathHandler(http.server.BaseHTTPRequestHandler):
    """Serves one payload at one path, ignoring Range (as some servers do); records the paths asked."""
    payload, path, requests = b'', '', []

    def do_GET(self):
        PathHandler.requests.append((self.path, self.headers['Range']))
        found = self.path == PathHandler.path
        self.send_response(200 if found else 404)
        self.send_header('Content-Length', str(len(self.payload) if found else 0))
        self.end_headers()
        if found:
            self.wfile.write(self.payload)

    def log_message(self, *args):
        pass


def test_the_tinystories_slice_is_the_checked_head_of_the_v1_file_in_whole_stories(tmp_path, monkeypatch):
    """`python data.py tinystories_slice` (the TinyStories depth study's data): the first 2 MiB of
    TinyStories-train.txt, downloaded with a Range request from the Hub (HF_ENDPOINT: a local server
    here, which ignores the range and sends more) or the head of --source, sha256-checked; cut after
    its last whole story; its last ~10% of stories validate. Another file's head is refused."""
    head = need_shared(SHARED_DATA / 'tinystories_train_head_2MiB.txt').read_bytes()
    PathHandler.payload = head + b'Once upon a time, more of the file followed.\n'
    PathHandler.path, PathHandler.requests = '/datasets/roneneldan/TinyStories/resolve/main/TinyStories-train.txt', []
    server = http.server.HTTPServer(('127.0.0.1', 0), PathHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv('HF_ENDPOINT', f'http://127.0.0.1:{server.server_port}')
    try:
        downloaded = data.load('tinystories_slice', str(tmp_path / 'a'))
    finally:
        server.shutdown()
    assert PathHandler.requests == [(PathHandler.path, 'bytes=0-2097151')]
    data.prepare('tinystories_slice', str(tmp_path / 'b'), source=str(SHARED_DATA / 'tinystories_train_head_2MiB.txt'))
    from_source = data.load('tinystories_slice', str(tmp_path / 'b'))
    sep = downloaded.stoi[data.STORY_SEPARATOR]
    for split in ('train', 'val'):
        assert np.array_equal(downloaded.splits[split], from_source.splits[split])
    train_tokens, val_tokens = downloaded.splits['train'], downloaded.splits['val']
    assert train_tokens[-1] == sep and val_tokens[-1] == sep  # both end with a whole story
    stories = head.decode('utf-8', errors='ignore').count(data.STORY_SEPARATOR)
    assert (train_tokens == sep).sum() + (val_tokens == sep).sum() == stories
    assert 0.05 < len(val_tokens) / len(train_tokens) < 0.15 and len(train_tokens) > 1_800_000
    other = need_shared(SHARED_DATA / 'tinystories_hf_validation_head.txt')
    with pytest.raises(data.DataError, match='is not the head of the TinyStories V1 file'):
        data.prepare('tinystories_slice', str(tmp_path / 'c'), source=str(other))
