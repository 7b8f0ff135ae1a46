"""Load an exported Hugging Face folder with transformers and compare its logits with the pipezero
checkpoint it came from.

    python examples/hf_compare.py EXPORTED_FOLDER RUN_DIR
"""
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from pipezero.checkpoint.export import read_model
from pipezero.checkpoint.store import committed

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
ours = read_model(committed(Path(sys.argv[2]) / "checkpoints")[-1][1]).eval()
tokens = torch.randint(0, model.config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    diff = (model(tokens).logits - ours(tokens)).abs().max().item()
print(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()):,} parameters; "
      f"max |transformers - pipezero| logit difference {diff:.2e}")
