# The WAV paper's character-level grid: 48 layers on text8 (90M train characters, 27 symbols; reported in bpc).
#   python train.py config/text8_48l.py --residual=wav        (or prenorm, rezero, layerscale,
#   block_attnres; attnres, hc, mhc_lite and mgr run on the same config)
# Every method gets the same budget: 15,000 steps x 64 x 256 = 246M characters, about 2.7 passes over text8's 90M.
# Our choices (the paper gives no hyperparameters): width 256 with 64-dim heads, context 256,
# learning rate 6e-4 (a little lower for deeper models), cosine to a tenth, no dropout.
# Expected cost: roughly 1.2 GPU-hours per prenorm run on one H100 (an estimate, not measured;
# AttnRes-family and multi-stream methods cost more, see bench.py).
dataset = 'text8'
out_dir = 'out-text8-48l'
n_layer = 48
n_head = 4
n_embd = 256
block_size = 256
batch_size = 64
gradient_accumulation_steps = 1
max_iters = 15000
warmup_iters = 500
learning_rate = 6e-4
min_lr = 6e-4 / 10
eval_interval = 1000
eval_tokens = 1048576  # the first 1M characters of the validation split, for every method
log_interval = 50
