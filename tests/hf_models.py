"""Tiny random Hugging Face models, made here with transformers (nothing downloaded), for tests/test_hf.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SHAPE = dict(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=7, num_attention_heads=4,
             max_position_embeddings=128, rms_norm_eps=1e-6)
# One config a family, each switching on what that family adds to the plain decoder.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", num_key_value_heads=2, attention_bias=True, mlp_bias=True,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 16}, tie_word_embeddings=False),
    "llama-tied": dict(model_type="llama", num_key_value_heads=4, tie_word_embeddings=True, rope_theta=500000.0),
    "mistral": dict(model_type="mistral", num_key_value_heads=2, sliding_window=8, head_dim=16, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2, tie_word_embeddings=True),
    # a window on blocks 3-6 only (layer_types from max_window_layers), untied
    "qwen2-window": dict(model_type="qwen2", num_key_value_heads=2, tie_word_embeddings=False, use_sliding_window=True,
                         sliding_window=8, max_window_layers=3),
}


def tokenizer_json(path: Path, vocab: int = 300) -> None:
    """A byte-level BPE with an end-of-text token, trained on a few lines of Python source."""
    import inspect

    from pipezero.data.tokenizer import BPETokenizer

    text = inspect.getsource(inspect)
    BPETokenizer.train([text[i:i + 2000] for i in range(0, len(text), 2000)], vocab, eos=True).hf.save(str(path))


def make_model(folder: Path, family: str, seed: int = 0, **changes: Any) -> Path:
    """save_pretrained of a randomly initialised model of `family` (FAMILIES) into `folder`, plus a
    tokenizer.json; the model's config.json names the tokenizer's end-of-text id as EOS."""
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {**SHAPE, **FAMILIES[family], **changes}
    kind = kw.pop("model_type")
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer_json(folder / "tokenizer.json")
    eos = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id("<|endoftext|>")
    config = AutoConfig.for_model(kind, eos_token_id=eos, bos_token_id=None, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a lost one shows
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def pipezero_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    """The whole model built by pipezero from `folder` (config mapping and per-chunk loading)."""
    from pipezero.config import ModelConfig
    from pipezero.models import build_chunk
    from pipezero.models.hf import model_fields
    from pipezero.models.hf_weights import load_chunk

    cfg = ModelConfig(**model_fields(folder), pretrained=str(folder))
    model = build_chunk(cfg, 0, cfg.n_layers + 2, seed=0)
    load_chunk(model, cfg)
    with torch.no_grad():
        return model.eval()(tokens)


def tokenizer_folder(folder: Path, family: str, pad: dict[str, Any], **tokenizer_kw: Any) -> Path:
    """A model folder's tokenizer and config files (no weights) as transformers writes them: the
    family's own tokenizer class trained here on a few lines of source (so its tokenizer.json is
    the pipeline transformers rebuilds for that class), saved with save_pretrained; `pad` holds the
    pad settings: `config` (config.json's pad_token_id), `generation` (generation_config.json's)."""
    import inspect

    from transformers import AutoConfig, GenerationConfig, LlamaTokenizer, Qwen2Tokenizer

    text = inspect.getsource(inspect)
    base = {"llama": LlamaTokenizer, "qwen2": Qwen2Tokenizer}[family](**tokenizer_kw)
    tok = base.train_new_from_iterator([text[i:i + 2000] for i in range(0, len(text), 2000)], vocab_size=300)
    tok.save_pretrained(folder)
    AutoConfig.for_model(family, **SHAPE, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                         pad_token_id=pad.get("config")).save_pretrained(folder)
    if "generation" in pad:
        GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=pad["generation"]).save_pretrained(folder)
    return folder


def hf_overrides(folder: Path, data: str, out: str, **extra: object) -> dict:
    """Settings of a short run from the model folder `folder` (tests' small sizes)."""
    base = {"model.pretrained": str(folder), "data.path": data, "data.seq_len": 16, "parallel.microbatches": 2,
            "parallel.micro_batch_size": 2, "run.max_steps": 3, "run.out": out, "run.progress": False,
            "run.sample_tokens": 0, "run.eval_every": 0, "run.eval_batches": 1, "optim.warmup_steps": 1,
            "optim.lr": 1e-3, "parallel.timeout_s": 60.0, "parallel.bucket_mb": 0.01}
    return {**base, **extra}
