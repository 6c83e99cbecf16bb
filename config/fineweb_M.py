# The MGR paper's medium FineWeb-10BT scale: M, about 0.35B parameters (GPT-2 medium shape).
#   python data.py fineweb --shards=53     # 5.2B tokens: fetch them first
#   torchrun --standalone --nproc_per_node=8 train.py config/fineweb_M.py --residual=mgr --mgr_streams=8
# Methods as in fineweb_S.py, all on the same budget.
# Budget (our choice): 10,000 steps of 524,288 tokens = 5.2B tokens, about 15 tokens per parameter.
# Expected cost: about 9 H100-hours for prenorm at 40% MFU (an estimate, not measured).
dataset = 'fineweb'
out_dir = 'out-fineweb-M'
n_layer = 24
n_head = 16
n_embd = 1024
block_size = 1024
batch_size = 8
gradient_accumulation_steps = 64
max_iters = 10000
warmup_iters = 500
learning_rate = 3e-4
min_lr = 3e-5
weight_decay = 0.1
beta2 = 0.95
eval_interval = 500
eval_tokens = 10485760
log_interval = 10
