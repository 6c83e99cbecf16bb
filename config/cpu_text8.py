# The CPU-scale depth trend (python sweep.py cpu_trend --jobs=2): a width-64 model on the text8
# slice from ../shared/data, 1.5M characters per run (750 steps of 16 x 128), for 2 CPU cores.
#   python data.py text8 --source=../shared/data/text8_head.txt    (the full text8 works too)
#   python train.py config/cpu_text8.py --n_layer=16 --residual=wav
dataset = 'text8'
out_dir = 'out-cpu-text8'
n_layer = 8
n_head = 4
n_embd = 64
block_size = 128
batch_size = 16
max_iters = 750
warmup_iters = 50
learning_rate = 6e-3
min_lr = 6e-4
eval_interval = 250
eval_tokens = 32768  # the first 32k characters of the val split, the same for every run
log_interval = 50
device = 'cpu'
