#!/usr/bin/env python3
"""Write a tiny Llama model directory: config.json only.

vLLM loads it with load_format="dummy" (random weights, no files to read) and
skip_tokenizer_init=True (prompts are token ids), so nothing is fetched from a
model hub.  Two layers of head_dim 64: small enough for a CPU, and the shape
the CPU attention backend supports.

usage: make-tiny-model.py DIR [--layers N]
"""
import argparse
import json
import os

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("dir")
p.add_argument("--layers", type=int, default=2)
args = p.parse_args()
config = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": args.layers,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
os.makedirs(args.dir, exist_ok=True)
with open(os.path.join(args.dir, "config.json"), "w") as f:
    json.dump(config, f, indent=1)
    f.write("\n")
print(args.dir)
