"""Model presets: the settings each changes from the defaults (linattn_lm.settings' fields)."""
from __future__ import annotations

from typing import Any

# A preset lists only the settings it changes from the defaults (the dataclass fields'); a dict
# value (feature_map_options) replaces the default's whole.
PRESETS: dict[str, dict[str, Any]] = {
    # CI smoke test: seconds on one CPU core.
    "tiny": dict(n_layer=2, d_model=64, n_head=2, seq_len=64, batch_size=8, warmup=5, steps=30,
                 feature_map_options=dict(num_features=32, redraw_interval=1000), chunk_size=32,
                 eval_interval=10, eval_iters=2, log_interval=5, ckpt_interval=10, sample_interval=30),
    # The defaults, and the budget of the RoPE-placement study (docs/results/study.md): about 6-8
    # (softmax) and 8-12 (FAVOR+) minutes of training per run on 2 CPU cores; softmax and FAVOR+ with
    # RoPE beat the order-2 n-gram line (3.31 val bpc) clearly, FAVOR+ without RoPE does not (3.50);
    # FAVOR+ post (the quick start) measured 3.02-3.04 at step 1200 on the torch backend, 3.06 on the cpp
    # backend (the same maths to float rounding: a different trajectory, like another seed).
    # No redraws: a redraw late in a short run costs more than it brings (the study measures it).
    "cpu": {},
    # EleutherAI rotary-embedding blog, Performer on enwik8: 8 layers, 512 wide, 8 heads, 1024 context.
    # No redraws here either: at the cpu preset redraws every 500 steps cost 0.22 val bpc [0.16, 0.28]
    # over 3 seeds, each redraw throwing the model back (docs/results/study.md); the map's default.
    "eleuther": dict(n_layer=8, d_model=512, n_head=8, dropout=0.1, seq_len=1024, batch_size=32, lr=6e-4,
                     min_lr=6e-5, warmup=1000, steps=20000, feature_map_options=dict(num_features=256, redraw_interval=0),
                     eval_interval=1000, eval_iters=50, log_interval=50, ckpt_interval=1000, sample_interval=2000),
    # RoFormer section 4.4: 12 layers, 768 wide, 12 heads, 1024 context, batch 128, lr 1e-4.  No
    # redraws, as in eleuther (the study's measurement above).
    "paper": dict(n_layer=12, d_model=768, n_head=12, dropout=0.1, seq_len=1024, batch_size=128, lr=1e-4,
                  min_lr=1e-5, warmup=2000, steps=100000, feature_map_options=dict(num_features=256, redraw_interval=0),
                  eval_interval=2000, eval_iters=50, log_interval=100, ckpt_interval=2000, sample_interval=5000),
}
# Long context at the cpu preset's tokens per step (4 x 1024 = 16 x 256) and steps: the study's third
# part, where far bytes can matter (docs/results/study.md).
PRESETS["long"] = dict(seq_len=1024, batch_size=4)
# MQAR-lite (Zoology's recall task, linattn_lm/mqar.py): 2 layers, 64 wide, 2 heads of 32, 32 tokens
# holding 4 key-value pairs and their 4 queries, vocab 256; 4,096 tokens a step, as the cpu preset.
# The smallest setting where softmax + RoPE learns recall within a 10-minute CPU run (90% at step 1500);
# at 8 pairs in 64 tokens every model stayed at 1/8, copying any of the pairs' values (docs/gap-closers.md).
PRESETS["mqar"] = dict(n_layer=2, d_model=64, n_head=2, seq_len=32, batch_size=128, steps=1500, eval_iters=8,
                       ckpt_interval=500, sample_interval=0, task="mqar", mqar_kv_pairs=4)
# CI smoke test of the task: seconds on one CPU core.
PRESETS["mqar-tiny"] = {**PRESETS["mqar"], "d_model": 32, "batch_size": 8, "warmup": 5, "steps": 20,
                        "feature_map_options": dict(num_features=16, redraw_interval=0), "chunk_size": 16,
                        "eval_interval": 10, "eval_iters": 2, "log_interval": 5, "ckpt_interval": 10}


DEFAULT_PRESET = "cpu"
TASK_PRESETS = {"enwik8": DEFAULT_PRESET, "mqar": "mqar"}   # the preset a task defaults to
