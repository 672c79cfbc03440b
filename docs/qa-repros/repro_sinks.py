# Repro: GPT-OSS attention sinks are ignored by ferrobatch's paged attention.
import torch, transformers
import ferrobatch.engine as fe
from ferrobatch import Engine, ContinuousBatchingConfig, SamplingParams
torch.set_num_threads(1)
cfg = transformers.GptOssConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
    max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)
torch.manual_seed(0)
m = transformers.GptOssForCausalLM(cfg).eval()
with torch.no_grad():
    for layer in m.model.layers:
        layer.self_attn.sinks.fill_(3.0)  # trained models have sizeable sinks
fe._check_architecture = lambda *a: None          # bypass the engine's guards
fe.Engine._probe_model = lambda self: None
p = [(7 * i + 3) % 512 for i in range(23)]
with torch.no_grad():
    want = m.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
with Engine(m, config=ContinuousBatchingConfig(page_size=8, num_blocks=32)) as e:
    got = e.generate([p], SamplingParams(max_new_tokens=8), progress=False)[0].token_ids
print("expected", want); print("actual  ", got)
