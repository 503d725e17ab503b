"""The transformers pieces the language-model workloads share.

`build` makes a model from its config: random weights (seeded; nothing is
downloaded), created straight on the GPU, cast, in eval mode. `build_llama`
is the small Llama of llm_decode and llm_prefill: ~0.75 B parameters by
default (hidden 2048, 12 layers, 16 heads, 8 KV heads, MLP 5632, vocabulary
32000), bf16. `decode` is one request of a streaming server: a prefill, then
a token at a time with the KV cache, each token read back to the host.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def build(model_cls, cfg, dtype=torch.bfloat16, device="cuda"):
    """(model, parameter count) of `model_cls(cfg)` on `device` in `dtype`."""
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls(cfg)
    model = model.to(device=device, dtype=dtype).eval()   # (a no-op move if built there)
    return model, sum(p.numel() for p in model.parameters())


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
    model, params = build(LlamaForCausalLM, cfg, device=device)
    return model, cfg, params


@torch.no_grad()
def decode(model, prompt, pick, new_tokens: int, rep=None) -> None:
    """A request: one forward pass over `prompt` (batch x tokens), then
    new_tokens - 1 passes of one token each with the KV cache. `pick` turns
    the last position's logits into the next tokens (batch x 1). Every
    token is read back to the host (a synchronize per token, as a server
    that streams or checks for an end token does) and counted on `rep`
    (batch units); the request ends early once rep.done()."""
    out = model(input_ids=prompt, use_cache=True)
    for i in range(new_tokens):
        tok = pick(out.logits[:, -1])
        tok.view(-1).tolist()
        if rep:
            rep.add(prompt.shape[0])
            if rep.done():
                return
        if i + 1 < new_tokens:
            out = model(input_ids=tok, past_key_values=out.past_key_values, use_cache=True)
