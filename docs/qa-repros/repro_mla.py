# Repro: DeepSeek-V3 (MLA) cannot run: the cache's head_dim comes from config.head_dim
# (= qk_rope_head_dim), keys are qk_nope_head_dim + qk_rope_head_dim, values v_head_dim.
import torch, transformers
from ferrobatch.runner import ModelRunner
from ferrobatch.core import Scheduler
torch.set_num_threads(1)
cfg = transformers.DeepseekV3Config(vocab_size=512, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=32, kv_lora_rank=16, q_lora_rank=None,
    qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8, first_k_dense_replace=1,
    n_group=1, topk_group=1, max_position_embeddings=1024)
torch.manual_seed(0)
m = transformers.DeepseekV3ForCausalLM(cfg).eval()
r = ModelRunner(m, num_blocks=8, page_size=8)
print("cache head_dim", r.cache.keys[0].shape, "config.head_dim", cfg.head_dim,
      "key head dim", cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, "value head dim", cfg.v_head_dim)
s = Scheduler(8, 8, 64, layer_types=["full_attention"] * 2)
s.add_request("a", [5, 6, 7], 4)
try:
    r.execute(s.schedule())
except Exception as exc:
    print(type(exc).__name__, str(exc)[:200])
