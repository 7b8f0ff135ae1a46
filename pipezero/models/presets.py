"""Named model shapes and their analytic size: parameters per layer and FLOPs per token.

The counts are computed from the shape alone (no tensors), so the planner and simulator can reason
about a 70B model on a laptop. `tests/test_model.py` checks them against a built model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pipezero.config import ModelConfig
from pipezero.errors import ConfigError
from pipezero.schedules.model_shapes import LayerTensors, ModelShapes, TensorShape, cut_shapes

# Trainable presets use the 4096-token BPE vocabulary of the built-in corpus; the large shapes use
# Llama's 32000 (70B: 128256, as Llama 3) and exist for planning and simulation.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=4096, dim=128, n_layers=2, n_heads=4, max_seq_len=1024),  # ~1.3M
    "small": dict(vocab_size=4096, dim=320, n_layers=8, n_heads=5, max_seq_len=1024),  # ~12M
    "base": dict(vocab_size=4096, dim=768, n_layers=16, n_heads=12, max_seq_len=1024),  # ~119M
    "1b": dict(vocab_size=32000, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, max_seq_len=4096),
    "7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, max_seq_len=4096),
    "13b": dict(vocab_size=32000, dim=5120, n_layers=40, n_heads=40, ffn_dim=13824, max_seq_len=4096),
    "70b": dict(vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, max_seq_len=4096),
}

# Peak learning rate a preset trains stably with (AdamW, the warm-up and cosine decay of optim.py,
# global batches of tens of thousands of tokens): smaller for larger models, as in the GPT-3 paper's
# table (125M: 6e-4, 1.3B: 2e-4) and Llama's (7B, 13B: 3e-4; 65B: 1.5e-4). At 3e-3 a 1B model's
# loss swings between 5 and 16 over its first ten steps. The two small presets train on the built-in
# corpus in minutes, which their higher rates are for.
PRESET_LR: dict[str, float] = {"tiny": 3e-3, "small": 2e-3, "base": 6e-4, "1b": 2e-4, "7b": 3e-4, "13b": 3e-4,
                               "70b": 1.5e-4}

# Warm-up steps where the default of 20 (optim.warmup_steps) is too short: Llama's 2000, at every size.
# From its initial weights, one AdamW step moves every weight by the rate, and the residual
# projections (wo, w2) turn that into a change of their output of the rate times their fan-in of
# 2048-8192. One step of 1e-5 lowers 1b's loss by 3.5 nats (bench/lr_stability.py --probe; cut to
# 4 blocks, 2.9 at 1e-5 and 0.03 at 1e-7), so a 20-step warm-up's 1e-5, 2e-5, 3e-5, 4e-5 throws the first
# steps about: +3.2 nats at step 4 on CPU, above the first step's loss on a GPU. The small presets'
# test shows their 20 steps are enough.
PRESET_WARMUP: dict[str, int] = {"1b": 2000, "7b": 2000, "13b": 2000, "70b": 2000}


def apply_preset(model: ModelConfig, name: str) -> ModelConfig:
    """Overwrite `model`'s shape with preset `name` (fields not in the preset return to defaults)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    fresh = ModelConfig(preset=name, **PRESETS[name])
    for f in dataclasses.fields(ModelConfig):
        setattr(model, f.name, getattr(fresh, f.name))
    return model


def ffn_dim(cfg: ModelConfig) -> int:
    """SwiGLU hidden size: 8/3 of dim keeps the MLP's parameters equal to a 4x GELU MLP."""
    if cfg.ffn_dim is not None:
        return cfg.ffn_dim
    hidden = int(8 * cfg.dim / 3)
    return 64 * ((hidden + 63) // 64)


def block_params(cfg: ModelConfig) -> int:
    hd = cfg.head_dim or cfg.dim // cfg.n_heads
    q, kv = cfg.n_heads * hd, (cfg.n_kv_heads or cfg.n_heads) * hd
    attn = 2 * cfg.dim * q + 2 * cfg.dim * kv  # wq, wo, wk, wv
    attn += (q + 2 * kv) * cfg.qkv_bias + cfg.dim * cfg.out_bias
    hidden = ffn_dim(cfg)
    mlp = 3 * cfg.dim * hidden + (2 * hidden + cfg.dim) * cfg.mlp_bias
    return attn + mlp + 2 * cfg.dim  # two RMSNorm weights


def layer_param_counts(cfg: ModelConfig) -> list[int]:
    """Parameters of each entry of the layer list: [embedding, block x n_layers, head]."""
    emb = cfg.vocab_size * cfg.dim
    head = cfg.dim + (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)
    return [emb] + [block_params(cfg)] * cfg.n_layers + [head]


# the block's parts for ZeRO-3 `--zero3-unit sublayer` (models/spec.py `layer_parts`): its forward
# (models/llama.py Block) runs them in this order, joined by residual sums only
BLOCK_PARTS = (("attn_norm", "attn"), ("mlp_norm", "mlp"))


def layer_tensors(cfg: ModelConfig) -> list[LayerTensors]:
    """Every layer's tensors by name and shape, as models/llama.py builds them (a tied head still
    lists its projection: schedules/model_shapes.cut_shapes lists a weight tied inside one chunk once), so
    the plan groups the built-in decoder's buckets tensor by tensor without building it;
    tests/test_model.py holds it against the built model."""
    hd = cfg.head_dim or cfg.dim // cfg.n_heads
    q, kv, d, hidden = cfg.n_heads * hd, (cfg.n_kv_heads or cfg.n_heads) * hd, cfg.dim, ffn_dim(cfg)

    def linear(name: str, n_in: int, n_out: int, bias: bool) -> list[tuple[str, tuple[int, ...]]]:
        return [(f"{name}.weight", (n_out, n_in))] + ([(f"{name}.bias", (n_out,))] if bias else [])

    block = [("attn_norm.weight", (d,)), *linear("attn.wq", d, q, cfg.qkv_bias),
             *linear("attn.wk", d, kv, cfg.qkv_bias), *linear("attn.wv", d, kv, cfg.qkv_bias),
             *linear("attn.wo", q, d, cfg.out_bias),
             ("mlp_norm.weight", (d,)), *linear("mlp.w1", d, hidden, cfg.mlp_bias),
             *linear("mlp.w3", d, hidden, cfg.mlp_bias), *linear("mlp.w2", hidden, d, cfg.mlp_bias)]
    head = [("norm.weight", (d,)), ("proj.weight", (cfg.vocab_size, d))]
    layers = [[("weight", (cfg.vocab_size, d))]] + [block] * cfg.n_layers + [head]
    return [LayerTensors(i, tuple(TensorShape(f"layers.{i}.{n}", s) for n, s in named),
                         parts=BLOCK_PARTS if 0 < i <= cfg.n_layers else ())
            for i, named in enumerate(layers)]


def unit_param_counts(cfg: ModelConfig, sublayer: bool) -> list[int]:
    """Each ZeRO-3 unit's parameters in model order: a layer's (layer_param_counts), or with
    `sublayer` a block's attention and its MLP apart (each with its norm)."""
    counts = layer_param_counts(cfg)
    if not sublayer:
        return counts
    parts = [sum(t.numel for t in ts) for _, ts in layer_tensors(cfg)[1].units(True)]
    return counts[:1] + parts * cfg.n_layers + counts[-1:]


def tied_pair(cfg: ModelConfig) -> tuple[str, str] | None:
    """The built-in decoder's tied weight (models/llama_spec.py `tied_names`), without building it."""
    return ("layers.0.weight", f"layers.{cfg.n_layers + 1}.proj.weight") if cfg.tie_embeddings else None


def decoder_shapes(cfg: ModelConfig, bounds: list[tuple[int, int]]) -> ModelShapes:
    """The built-in decoder cut into chunks [start, stop), as the plan sees it (every tensor trains)."""
    return cut_shapes(layer_tensors(cfg), bounds, tied_pair(cfg))


def layer_costs(cfg: ModelConfig, seq_len: int) -> list[float]:
    """Relative training time per layer: matmul FLOPs (6 per weight a token) plus attention; the
    embedding costs its gather and scatter-add, about one pass over its rows' bytes."""
    attn = 12.0 * seq_len * cfg.dim
    block = 6.0 * (block_params(cfg) - 2 * cfg.dim) + attn
    head = 6.0 * cfg.vocab_size * cfg.dim
    emb = 2.0 * cfg.dim
    return [emb] + [block] * cfg.n_layers + [head]


def param_count(cfg: ModelConfig) -> int:
    return sum(layer_param_counts(cfg))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 per matmul weight (forward 2, backward 4) plus causal attention.

    Embedding lookups are free; the LM head is a matmul. Attention scores and values cost
    2 * 2 * T * dim per layer forward for full attention; causal masking does half of that work in
    an ideal kernel, but SDPA computes the full square, so we count it (PaLM's 6N + 12*L*T*d).
    """
    matmul_params = cfg.n_layers * (block_params(cfg) - 2 * cfg.dim) + cfg.vocab_size * cfg.dim  # biases: noise
    return 6.0 * matmul_params + 12.0 * cfg.n_layers * seq_len * cfg.dim
