"""The small Llama that llm_decode, llm_prefill (and phased --model llama) build.

Random weights from a LlamaConfig (nothing is downloaded), created straight on
the GPU, then cast to bf16. The default is ~0.75 B parameters: hidden 2048,
12 layers, 16 heads (8 KV heads), MLP 5632, vocabulary 32000.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def add_model_args(ap) -> None:
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)


def build_llama(a, device="cuda"):
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads,
                      num_key_value_heads=a.kv_heads, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model = model.to(device=device, dtype=torch.bfloat16).eval()   # (a no-op move if built there)
    params = sum(p.numel() for p in model.parameters())
    return model, cfg, params
