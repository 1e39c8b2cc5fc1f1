"""Which part of 8da4w costs the quality on the default model: symmetric int4 weight groups, or per-token int8
activations? Each variant fake-quantizes every linear layer but the head in float32 (eager HF), scored with
``kvtrace.perplexity`` against the float32 model on the text's first 4 chunks of 512 (whitespace squashed, as
bench/perplexity.py --squash-whitespace does).

    .venv/bin/python bench/why_8da4w.py /usr/share/common-licenses/GPL-3
"""

import sys

import torch

from kvtrace.sources.load import load_model
from kvtrace.tools.perplexity import chunk_tokens, perplexity, text_ids
from kvtrace.tools.runners import EagerRunner

torch.set_num_threads(2)
text = " ".join(open(sys.argv[1], encoding="utf-8").read().split())
ref = load_model(None)
ids, bos = text_ids(ref.tokenizer, text, ref.bos_id)
chunks = chunk_tokens(ids, 512, chunks=4, bos_id=bos)

def w_sym4(w, g=32):  # symmetric int4 groups in [-8, 7], scale = max|w| / 7.5 (torchao's 8da4w)
    o, i = w.shape
    x = w.view(o, i // g, g)
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-9) / 7.5
    q = (x / s).round().clamp(-8, 7)
    return (q * s).view(o, i)

def w_asym4(w, g=32):
    o, i = w.shape
    x = w.view(o, i // g, g)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    s = ((hi - lo) / 15).clamp_min(1e-9)
    q = ((x - lo) / s).round().clamp(0, 15)
    return (q * s + lo).view(o, i)

def a_int8_token(x):  # asymmetric per-token int8 (torchao's 8da4w dynamic activation quant)
    lo, hi = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)
    s = ((hi - lo) / 255).clamp_min(1e-9)
    zp = (-128 - lo / s).round()
    q = (x / s + zp).round().clamp(-128, 127)
    return (q - zp) * s

def variant(weights=None, acts=False):
    lm = load_model(None)
    for name, mod in lm.model.named_modules():
        if isinstance(mod, torch.nn.Linear) and "lm_head" not in name:
            if weights:
                mod.weight.data = weights(mod.weight.data)
            if acts:
                mod.register_forward_pre_hook(lambda m, a: (a_int8_token(a[0]),))
    return lm.model

runners = [EagerRunner(ref.model, name="fp32"),
           EagerRunner(variant(w_sym4), name="w sym4 g32"),
           EagerRunner(variant(w_asym4), name="w asym4 g32"),
           EagerRunner(variant(None, True), name="a int8/token"),
           EagerRunner(variant(w_sym4, True), name="w sym4 + a int8")]
with torch.inference_mode():
    rep = perplexity(runners, chunks)
for r in rep.rows:
    print(f"{r.name:18s} ppl {r.ppl:.4f} kl {r.kl_mean if r.kl_mean is None else round(r.kl_mean,5)} top1 {r.top1_agree}")
