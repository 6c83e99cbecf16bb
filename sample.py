"""
Sample from a trained model.

    python sample.py                                   # out/ckpt.pt, 3 samples
    python sample.py --out_dir=out --start="def " --num_samples=1 --max_new_tokens=500
    python sample.py --start=FILE:prompt.txt           # the prompt read from a file
    python sample.py --kv_cache=False                  # the whole context run again for every token

Decoding keeps every layer's keys and values (GPT.generate, model.py): the prompt runs once, then each
new token alone. --kv_cache=False gives the same text, slower. A prompt holds at most block_size tokens;
past block_size the window jumps to keep its last half (GPT.generate says why).
"""
import os
import sys

import torch

import configurator
import data
from model import GPT, CheckpointError, load_checkpoint

out_dir = 'out'
ckpt_name = 'ckpt.pt'  # or best.pt, the lowest val loss
start = ''  # the prompt, or FILE:path; empty = the first token of the val split
num_samples = 3
max_new_tokens = 400
temperature = 0.8  # < 1 sharpens, > 1 flattens the distribution
top_k = 200  # keep the top_k most likely tokens; 0 = all, 1 = greedy
kv_cache = True  # decode with the keys and values of earlier positions kept (False: rerun the context)
seed = 1337
device = 'auto'
dtype = 'auto'


def main(argv):
    cfg, _ = configurator.parse(argv, configurator.keys_of(globals()), __doc__)
    configurator.check(cfg, {'num_samples': (lambda v: v >= 1, 'at least 1'),
                             'max_new_tokens': (lambda v: v >= 1, 'at least 1'),
                             'temperature': (lambda v: v > 0, 'above 0'),
                             'top_k': (lambda v: v >= 0, 'at least 0 (0 = all tokens)')})
    try:
        device = configurator.resolve_device(cfg['device'])
        _, ctx = configurator.precision(device, cfg['dtype'])
        path = os.path.join(cfg['out_dir'], cfg['ckpt_name'])
        ckpt = load_checkpoint(path)
        model = GPT.from_checkpoint(ckpt, path)
        ds = data.load(ckpt['config']['dataset'], ckpt['config']['data_dir'])
        prompt = cfg['start']
        if prompt.startswith('FILE:'):
            with open(prompt[5:], encoding='utf-8') as f:
                prompt = f.read()
        start_ids = ds.encode(prompt) if prompt else ds.splits['val'][:1].tolist()
        if len(start_ids) > model.config.block_size:
            raise ValueError(f"the prompt is {len(start_ids)} tokens long and the model reads at most "
                             f"block_size={model.config.block_size}; shorten it")
    except (CheckpointError, data.DataError, OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    model.eval().to(device)
    generator = torch.Generator(device=device).manual_seed(cfg['seed'])
    x = torch.tensor(start_ids, dtype=torch.long, device=device)[None, ...]
    with ctx:
        for _ in range(cfg['num_samples']):
            y = model.generate(x, cfg['max_new_tokens'], temperature=cfg['temperature'],
                               top_k=cfg['top_k'] or None, generator=generator, kv_cache=cfg['kv_cache'])
            print(ds.decode(y[0].tolist()))
            print('---------------')


if __name__ == '__main__':
    main(sys.argv[1:])
