# The CPU study of every method on the recipe the pilot chose by its noise (python sweep.py pilot; docs/RESULTS.md):
# cpu_methods' 6-layer, width-96 model and compute (1600 steps of 16 x 128 characters of the text8 slice,
# text8's first 3,010,294 characters) at a lower peak learning rate, a 100-step warmup and a 4x larger
# fixed validation set; five seeds (python sweep.py cpu_study --jobs=2, about 4 hours on 2 cores).
#   python data.py text8 --max_chars=3010294    (the slice the committed results used; the full text8 runs too, on another split)
#   python train.py config/cpu_study.py --residual=mudd
dataset = 'text8'
out_dir = 'out-cpu-study'
n_layer = 6
n_head = 4
n_embd = 96
block_size = 128
batch_size = 16
max_iters = 1600
warmup_iters = 100
learning_rate = 2e-3
min_lr = 2e-4
eval_interval = 200
eval_tokens = 131072  # the first 131k characters of the val split, the same for every run
log_interval = 50
device = 'cpu'
