# The MGR paper's large FineWeb-10BT scale: L, about 0.77B parameters (GPT-2 large shape).
#   python data.py fineweb --shards=103    # all of FineWeb-10BT: fetch it first
#   torchrun --standalone --nproc_per_node=8 train.py config/fineweb_L.py --residual=mgr --mgr_streams=8
# Methods as in fineweb_S.py, all on the same budget.
# Budget (our choice): 19,000 steps of 524,288 tokens = 10B tokens, one pass over FineWeb-10BT.
# Expected cost: about 35 H100-hours for prenorm at 40% MFU (an estimate, not measured).
dataset = 'fineweb'
out_dir = 'out-fineweb-L'
n_layer = 36
n_head = 20
n_embd = 1280
block_size = 1024
batch_size = 8
gradient_accumulation_steps = 64
max_iters = 19000
warmup_iters = 700
learning_rate = 2.5e-4
min_lr = 2.5e-5
weight_decay = 0.1
beta2 = 0.95
eval_interval = 500
eval_tokens = 10485760
log_interval = 10
