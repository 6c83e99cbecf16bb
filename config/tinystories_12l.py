# The WAV paper's character-level grid: 12 layers on TinyStoriesV2-GPT4 at character level.
#   python train.py config/tinystories_12l.py --residual=wav        (or prenorm, rezero, layerscale,
#   block_attnres; attnres, hc, mhc_lite and mgr run on the same config)
# Every method gets the same budget: 15,000 steps x 64 x 256 = 246M characters, about 0.11 of TinyStoriesV2's 2.2B.
# Our choices (the paper gives no hyperparameters): width 256 with 64-dim heads, context 256,
# learning rate 1e-3 (a little lower for deeper models), cosine to a tenth, no dropout.
# Expected cost: roughly 0.3 GPU-hours per prenorm run on one H100 (an estimate, not measured;
# AttnRes-family and multi-stream methods cost more, see bench.py).
dataset = 'tinystories'
out_dir = 'out-tinystories-12l'
n_layer = 12
n_head = 4
n_embd = 256
block_size = 256
batch_size = 64
gradient_accumulation_steps = 1
max_iters = 15000
warmup_iters = 500
learning_rate = 1e-3
min_lr = 1e-3 / 10
eval_interval = 1000
eval_tokens = 1048576  # the first 1M characters of the validation split, for every method
log_interval = 50
