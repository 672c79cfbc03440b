# Repro: Nemotron dispatches through AttentionInterface but its decoder layer drops **kwargs,
# so the step metadata (forward kwarg ferrobatch_step) never reaches attention.
import torch, transformers
from ferrobatch.runner import ModelRunner
from ferrobatch.core import Scheduler
torch.set_num_threads(1)
cfg = transformers.NemotronConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    partial_rotary_factor=0.5, max_position_embeddings=1024)
torch.manual_seed(0)
m = transformers.NemotronForCausalLM(cfg).eval()
r = ModelRunner(m, num_blocks=8, page_size=8)
s = Scheduler(8, 8, 64, layer_types=["full_attention"] * 2)
s.add_request("a", [5, 6, 7], 4)
try:
    r.execute(s.schedule())
except Exception as exc:
    print(type(exc).__name__, str(exc)[:200])
