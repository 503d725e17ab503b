#!/usr/bin/env python3
"""llm_decode: greedy decoding with a KV cache, as a simple serving loop runs it.

A transformers LlamaForCausalLM (llm_common.py: random weights, bf16). Each
request: one prefill of a --prompt-token prompt, then --new-tokens decode
steps of one token each, the next token read back to the host every step
(.tolist(): a synchronize per token, as a loop that streams or checks for an
end token does); then the cache is dropped and the next request starts. With --generate,
each request is one transformers `model.generate()` call instead (greedy,
exactly --new-tokens tokens), its own loop checking every token for the end
of the sequences, as a service built on it runs.
Unit: tokens/s (generated tokens, batch x steps).
"""
import torch

from common import parser, run_requests, wait_go
from llm_common import add_model_args, build_llama, decode


def main():
    ap = parser(__doc__)
    add_model_args(ap)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--generate", action="store_true",
                    help="decode each request with model.generate() rather than an explicit loop")
    a = ap.parse_args()
    wait_go(a)
    model, cfg, params = build_llama(a)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev)
    g.manual_seed(0)

    def stream(rep):
        prompt = torch.randint(0, cfg.vocab_size, (a.batch, a.prompt_tokens), device=dev, generator=g)
        decode(model, prompt, lambda logits: logits.argmax(-1, keepdim=True), a.new_tokens, rep)

    request = generate_request(a, model, cfg, dev, g) if a.generate else stream
    run_requests(a, "llm_decode", "tokens/s", request, params=params, batch=a.batch,
                 prompt_tokens=a.prompt_tokens, new_tokens=a.new_tokens)


def generate_request(a, model, cfg, dev, g):
    """A request as model.generate() decodes it: a streamer counts each
    token as generate's loop hands it out, a stopping criterion ends the
    request once the timed loop is over."""
    from transformers import StoppingCriteria, StoppingCriteriaList
    from transformers.generation.streamers import BaseStreamer

    class Count(BaseStreamer):
        def __init__(self, rep):
            self.rep, self.prompt_seen = rep, False

        def put(self, value):
            if not self.prompt_seen:    # generate hands out the prompt first
                self.prompt_seen = True
            elif self.rep:
                self.rep.add(a.batch)

        def end(self):
            pass

    class Done(StoppingCriteria):
        def __init__(self, rep):
            self.rep = rep

        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), bool(self.rep and self.rep.done()),
                              dtype=torch.bool, device=input_ids.device)

    @torch.no_grad()
    def request(rep):
        prompt = torch.randint(0, cfg.vocab_size, (a.batch, a.prompt_tokens), device=dev, generator=g)
        model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                       max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, pad_token_id=0,
                       streamer=Count(rep), stopping_criteria=StoppingCriteriaList([Done(rep)]))
    return request


if __name__ == "__main__":
    main()
