# The CPU depth trend (python sweep.py cpu_depth --jobs=2): prenorm, block_attnres and wav (the WAV
# paper's comparison), and denseformer and mudd (the dense baselines), at 12, 24 and 48 layers of width 64
# on the text8 slice (text8's first 3,010,294 characters), on cpu_study's recipe (peak learning rate 2e-3,
# 100 warmup steps, the 131k-character validation set; the pilot chose it by its noise), 1200 steps of 16
# x 128 characters. Block AttnRes and WAV take the auto block size (n_layer // 8 layers: 1, 3 and 6, so
# 12, 8 and 8 blocks).
#   python data.py text8 --max_chars=3010294    (downloads text8, keeps the slice, checks its sha256)
#   python train.py config/cpu_depth.py --n_layer=48 --residual=wav
dataset = 'text8'
out_dir = 'out-cpu-depth'
n_layer = 12
n_head = 4
n_embd = 64
block_size = 128
batch_size = 16
max_iters = 1200
warmup_iters = 100
learning_rate = 2e-3
min_lr = 2e-4
eval_interval = 200
eval_tokens = 131072  # the first 131k characters of the val split, the same for every run
log_interval = 50
device = 'cpu'
