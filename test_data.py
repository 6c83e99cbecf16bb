"""
data.py: the embedded corpus, local files, text8, TinyStories and FineWeb shards prepared from the
shared slices and local files (downloads cannot run here: a local server stands in), the fixed
validation windows.
"""
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
from conftest import SHARED_DATA, TEXT8, TINY_TRAIN, need_shared


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

