"""
Sample from a trained model.

    python sample.py                                   # out/ckpt.pt, 3 samples
    python sample.py --out_dir=out --start="def " --num_samples=1 --max_new_tokens=500
    python sample.py --start=FILE:prompt.txt           # the prompt read from a file
"""
import sys
import torch

import data
from model import GPT, GPTConfig
from train import CheckpointError, apply_override, load_checkpoint, module_config, precision, resolve_device

out_dir = 'out'
ckpt_name = 'ckpt.pt'  # or best.pt, the lowest val loss
start = ''  # the prompt, or FILE:path; empty = the first token of the val split
num_samples = 3
max_new_tokens = 400
temperature = 0.8  # < 1 sharpens, > 1 flattens the distribution
top_k = 200  # keep the top_k most likely tokens; 0 = all
seed = 1337
device = 'auto'
dtype = 'auto'


def main(argv):
    cfg = module_config(globals())
    for arg in argv:
        apply_override(cfg, arg)
    device = resolve_device(cfg['device'])
    _, ctx = precision(device, cfg['dtype'])

    try:
        ckpt = load_checkpoint(f"{cfg['out_dir']}/{cfg['ckpt_name']}")
        ds = data.load(ckpt['config']['dataset'], ckpt['config']['data_dir'])
        prompt = cfg['start']
        if prompt.startswith('FILE:'):
            with open(prompt[5:], encoding='utf-8') as f:
                prompt = f.read()
        start_ids = ds.encode(prompt) if prompt else ds.splits['val'][:1].tolist()
    except (CheckpointError, data.DataError, OSError) as e:
        sys.exit(f"error: {e}")
    model = GPT(GPTConfig(**ckpt['model_args']))
    model.load_state_dict(ckpt['model'])
    model.eval().to(device)
    generator = torch.Generator(device=device).manual_seed(cfg['seed'])
    x = torch.tensor(start_ids, dtype=torch.long, device=device)[None, ...]
    with ctx:
        for _ in range(cfg['num_samples']):
            y = model.generate(x, cfg['max_new_tokens'], temperature=cfg['temperature'],
                               top_k=cfg['top_k'] or None, generator=generator)
            print(ds.decode(y[0].tolist()))
            print('---------------')


if __name__ == '__main__':
    main(sys.argv[1:])
