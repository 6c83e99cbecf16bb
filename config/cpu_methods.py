# The CPU study of all ten methods (python sweep.py cpu_methods --jobs=2): a 6-layer, width-96 model
# on the text8 slice (text8's first 3,010,294 characters), 3.3M characters per run (1600 steps of
# 16 x 128), for 2 CPU cores: about 5 minutes per prenorm run on one core, and 1.0-2.3x that for the
# other methods.
#   python data.py text8 --max_chars=3010294    (the slice; the full text8, `python data.py text8`, works too)
#   python train.py config/cpu_methods.py --residual=wav
# The learning rate is the one the sweep `python sweep.py cpu_lr` chose for prenorm and block_attnres.
dataset = 'text8'
out_dir = 'out-cpu-methods'
n_layer = 6
n_head = 4
n_embd = 96
block_size = 128
batch_size = 16
max_iters = 1600
warmup_iters = 50
learning_rate = 6e-3
min_lr = 6e-4
eval_interval = 200
eval_tokens = 32768  # the first 32k characters of the val split, the same for every run
log_interval = 50
device = 'cpu'
