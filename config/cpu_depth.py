# The CPU depth trend (python sweep.py cpu_depth --jobs=2): prenorm, block_attnres and wav at 6, 12 and
# 24 layers of width 64 on the text8 slice from ../shared/data, 2.5M characters per run (1200 steps of
# 16 x 128), the learning rate of cpu_methods. Block AttnRes and WAV take the auto block size
# (n_layer // 8 layers: 1, 1 and 3, so 6, 12 and 8 blocks).
#   python data.py text8 --source=../shared/data/text8_head.txt
#   python train.py config/cpu_depth.py --n_layer=24 --residual=wav
dataset = 'text8'
out_dir = 'out-cpu-depth'
n_layer = 12
n_head = 4
n_embd = 64
block_size = 128
batch_size = 16
max_iters = 1200
warmup_iters = 50
learning_rate = 6e-3
min_lr = 6e-4
eval_interval = 200
eval_tokens = 32768  # the first 32k characters of the val split, the same for every run
log_interval = 50
device = 'cpu'
