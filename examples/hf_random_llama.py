"""A random 8-layer Llama standing in for a checkpoint of yours (made locally; nothing downloaded).

    python examples/hf_random_llama.py models/llama-8l
"""
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipezero.data import stdlib_files
from pipezero.data.tokenizer import BPETokenizer

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
tok = BPETokenizer.train([f.read_text(errors="replace") for f in stdlib_files()[:300]], 4096, eos=True)
tok.hf.save(str(out / "tokenizer.json"))
config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                     tie_word_embeddings=True, bos_token_id=None, eos_token_id=tok.eos_id)
torch.manual_seed(0)
LlamaForCausalLM(config).save_pretrained(out)
