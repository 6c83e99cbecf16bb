# The MGR paper's small FineWeb-10BT scale: S, about 0.12B parameters (GPT-2 small shape).
#   python data.py fineweb --shards=27     # 2.7B tokens, ~5.4 GB: fetch them first
#   torchrun --standalone --nproc_per_node=8 train.py config/fineweb_S.py --residual=mgr --mgr_streams=4
# Methods on the same budget: prenorm, mhc_lite, block_attnres, attnres, and mgr with
# --mgr_gate=independent|competitive and --mgr_streams=4|8.
# Budget (our choice): 5,000 steps of 524,288 tokens = 2.6B tokens, about 21 tokens per parameter.
# The global batch stays 512 x 1024 whatever the number of GPUs (gradient accumulation).
# Expected cost: about 1.5 H100-hours for prenorm at 40% MFU (an estimate, not measured).
dataset = 'fineweb'
out_dir = 'out-fineweb-S'
n_layer = 12
n_head = 12
n_embd = 768
block_size = 1024
batch_size = 16
gradient_accumulation_steps = 32
max_iters = 5000
warmup_iters = 250
learning_rate = 6e-4
min_lr = 6e-5
weight_decay = 0.1
beta2 = 0.95
eval_interval = 250
eval_tokens = 10485760  # the common FineWeb validation budget
log_interval = 10
