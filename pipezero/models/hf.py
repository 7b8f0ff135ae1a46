"""Hugging Face decoder folders as pipezero models: their config.json as a `ModelConfig`, and their
parameter names as ours.

Llama, Mistral and Qwen2 are the same decoder as pipezero's built-in one (pre-norm RMSNorm, rotary
on the full head dimension in the rotate-half layout, SwiGLU, optional GQA) with a few switches:
biases (Qwen2's q/k/v, Llama's attention_bias and mlp_bias), Llama 3's rope scaling, Mistral's
sliding window (Qwen2's, on the blocks its layer_types name), an explicit head_dim. So loading one
is a mapping of shape fields and of names, never a second model: q and k need no permutation because
both sides rotate the halves (x[..., :hd/2], x[..., hd/2:]) of a head. Only json is read here;
weights are safetensors (models/hf_weights.py), so nothing in a user's folder can run code.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipezero.errors import ConfigError

SUPPORTED = ("llama", "mistral", "qwen2")
CONFIG, TOKENIZER = "config.json", "tokenizer.json"
TOKENIZER_CONFIG, GENERATION = "tokenizer_config.json", "generation_config.json"
# Kept with a run and copied into an export: what the model is, beyond its weights. transformers
# 5 saves a chat template as its own file, no longer inside tokenizer_config.json.
METADATA = (CONFIG, TOKENIZER, TOKENIZER_CONFIG, "special_tokens_map.json", GENERATION, "chat_template.jinja")

# One block's parameters, pipezero name -> Hugging Face name under `model.layers.{j}.`; the three
# families name them alike.
BLOCK_NAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    **{f"attn.w{a}.{kind}": f"self_attn.{a}_proj.{kind}" for a in "qkvo" for kind in ("weight", "bias")},
    **{f"mlp.{ours}.{kind}": f"mlp.{theirs}_proj.{kind}" for ours, theirs in (("w1", "gate"), ("w3", "up"), ("w2", "down"))
       for kind in ("weight", "bias")},
}
_FROM_HF_BLOCK = {v: k for k, v in BLOCK_NAMES.items()}
_OURS = re.compile(r"^layers\.(\d+)\.(.+)$")
HF_BLOCK_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def to_hf(name: str, n_layers: int, tied: bool) -> str:
    """Our parameter name -> the Hugging Face tensor name. A tied head reads the embedding."""
    m = _OURS.match(name)
    if not m:
        raise KeyError(f"not a pipezero parameter name: {name!r}")
    index, rest = int(m.group(1)), m.group(2)
    if index == 0 and rest == "weight":
        return "model.embed_tokens.weight"
    if index == n_layers + 1:
        if rest == "norm.weight":
            return "model.norm.weight"
        if rest == "proj.weight":
            return "model.embed_tokens.weight" if tied else "lm_head.weight"
    elif 1 <= index <= n_layers and rest in BLOCK_NAMES:
        return f"model.layers.{index - 1}.{BLOCK_NAMES[rest]}"
    raise KeyError(f"pipezero parameter {name!r} has no Hugging Face name")


def from_hf(name: str, n_layers: int) -> str:
    """A Hugging Face tensor name -> our parameter name (the embedding for a tied lm_head's source)."""
    if name == "model.embed_tokens.weight":
        return "layers.0.weight"
    if name == "model.norm.weight":
        return f"layers.{n_layers + 1}.norm.weight"
    if name == "lm_head.weight":
        return f"layers.{n_layers + 1}.proj.weight"
    m = HF_BLOCK_NAME.match(name)
    if m and int(m.group(1)) < n_layers and m.group(2) in _FROM_HF_BLOCK:
        return f"layers.{int(m.group(1)) + 1}.{_FROM_HF_BLOCK[m.group(2)]}"
    raise KeyError(f"Hugging Face tensor {name!r} has no pipezero parameter")


def read_json(path: Path) -> dict[str, Any]:
    """A json object from a user's folder, or one ConfigError naming the file."""
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: a Hugging Face model folder needs {CONFIG}, {TOKENIZER} and "
                          f"model.safetensors (or model.safetensors.index.json with its shards)")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested deeper than json follows
        raise ConfigError(f"{path} is not readable json: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} holds a json {type(data).__name__}, not an object")
    return data


KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false"}


def _field(config: dict[str, Any], key: str, kind: type, path: Path, default: Any = ..., least: float | None = None,
           above: float | None = None, where: str = "") -> Any:
    """config[key] checked to be a `kind`, at least `least` or (finite and) above `above`; `default`
    when absent or null (no default: an error). A size of 0 or an eps of -1 would otherwise pass
    the type check and be refused later under pipezero's own setting names (model.dim), which the
    user never wrote; `where` prefixes the key of a nested object (rope_parameters.)."""
    name, value = f"{where}{key}", config.get(key)
    if value is None:
        if default is ...:
            raise ConfigError(f"{path}: field {name!r} is missing")
        return default
    shown = json.dumps(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ConfigError(f"{path}: field {name!r} = {shown} is not {KIND_NAMES[kind]}")
    if above is not None and not (math.isfinite(value) and value > above):
        raise ConfigError(f"{path}: field {name!r} = {shown} must be a number > {above:g}")
    if least is not None and value < least:
        raise ConfigError(f"{path}: field {name!r} = {shown} must be at least {least:g}")
    return value


def _rope(config: dict[str, Any], path: Path) -> tuple[float, list[float] | None]:
    """(theta, llama3 scaling or None) from `rope_parameters` (transformers 5) or the older
    `rope_theta` + `rope_scaling`. Both, differing, are refused: transformers 5 reads the older
    keys over rope_parameters, so reading rope_parameters alone trained another model than the
    one transformers loads (a yarn scaling silently dropped); so did a rope_scaling lacking keys that
    rope_parameters has (transformers refuses a llama3 one without its freq factors)."""
    legacy = config.get("rope_scaling")
    if config.get("rope_parameters") and (legacy is not None or config.get("rope_theta") is not None):
        params, older = config["rope_parameters"], dict(legacy) if isinstance(legacy, dict) else {"": legacy}
        if "type" in older:
            older.setdefault("rope_type", older.pop("type"))
        if config.get("rope_theta") is not None:
            older["rope_theta"] = config["rope_theta"]
        differ = [k for k, v in older.items() if not isinstance(params, dict) or params.get(k) != v]
        if isinstance(legacy, dict) and isinstance(params, dict):  # transformers takes rope_scaling whole:
            differ += [k for k in params if k != "rope_theta" and k not in older]  # one it lacks is not read
        if differ:
            raise ConfigError(f"{path}: rope settings are given twice and differ, in rope_parameters and in "
                              f"{'rope_theta' if differ[0] == 'rope_theta' else 'rope_scaling'} ({differ[0] or 'rope_scaling'}); "
                              f"transformers reads the older keys: keep one")
    where = "rope_parameters." if config.get("rope_parameters") else "rope_scaling."
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{path}: field {where[:-1]!r} is not an object")
    if "rope_theta" in params:
        theta = _field(params, "rope_theta", float, path, above=0, where=where)
    else:
        theta = _field(config, "rope_theta", float, path, 10000.0, above=0)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ConfigError(f"{path}: rope type {kind!r} is not supported; supported: default, llama3")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if params.get(k) is None]
    if missing:
        raise ConfigError(f"{path}: llama3 rope scaling lacks {', '.join(missing)}")
    # each divides (context / low, inv / factor), and the band between the cut-offs is blended by
    # (x - low) / (high - low): none may be zero, and high must lie above low
    factor, low, high = (_field(params, k, float, path, above=0, where=where) for k in keys[:3])
    context = _field(params, keys[3], float, path, least=1, where=where)
    if high <= low:
        raise ConfigError(f"{path}: {where[:-1]}' high_freq_factor {high} must be above its low_freq_factor {low} "
                          f"(the wavelengths between the two cut-offs are blended)")
    return theta, [factor, low, high, context]


SLIDING, FULL = "sliding_attention", "full_attention"


def _sliding_window(kind: str, config: dict[str, Any], path: Path) -> tuple[int | None, list[int] | None]:
    """(window, the blocks it applies to; None: all). Mistral windows every block. Qwen2 windows
    none unless use_sliding_window, then the blocks its layer_types call sliding_attention, or
    without layer_types (written by transformers before 5) blocks max_window_layers (default 28)
    and on, as transformers 5's Qwen2Config derives them."""
    if kind == "mistral":
        return _field(config, "sliding_window", int, path, None, least=1), None
    if kind != "qwen2" or not _field(config, "use_sliding_window", bool, path, False):
        return None, None
    window = _field(config, "sliding_window", int, path, least=1)
    n = _field(config, "num_hidden_layers", int, path, least=1)
    types = config.get("layer_types")
    if types is None:
        first = _field(config, "max_window_layers", int, path, 28, least=0)
        return window, [i for i in range(n) if i >= first]
    if not isinstance(types, list) or len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise ConfigError(f"{path}: field 'layer_types' must list {SLIDING!r} or {FULL!r} for each of the "
                          f"{n} layers")
    return window, [i for i, t in enumerate(types) if t == SLIDING]


def model_fields(folder: Path) -> dict[str, Any]:
    """The `ModelConfig` fields of the model in `folder`, from its config.json alone."""
    path = folder / CONFIG
    config = read_json(path)
    kind = config.get("model_type")
    if kind not in SUPPORTED:
        raise ConfigError(f"{path}: model_type {kind!r} is not supported; supported: {', '.join(SUPPORTED)}")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{path}: field 'hidden_act' = {json.dumps(act)}; only silu (SwiGLU) is supported")

    def size(key: str, default: Any = ...) -> Any:
        return _field(config, key, int, path, default, least=1)

    dim, heads, head_dim = size("hidden_size"), size("num_attention_heads"), size("head_dim", None)
    kv = size("num_key_value_heads", None)
    _check_heads(path, dim, heads, kv, head_dim)
    theta, llama3 = _rope(config, path)
    attention_bias = kind == "llama" and _field(config, "attention_bias", bool, path, False)
    return {
        "vocab_size": size("vocab_size"), "dim": dim, "n_layers": size("num_hidden_layers"), "n_heads": heads,
        "n_kv_heads": kv, "ffn_dim": size("intermediate_size"), "max_seq_len": size("max_position_embeddings"),
        "tie_embeddings": _field(config, "tie_word_embeddings", bool, path, False),
        "norm_eps": _field(config, "rms_norm_eps", float, path, 1e-6, above=0), "rope_theta": theta,
        "head_dim": head_dim if head_dim is not None and head_dim * heads != dim else None,
        "qkv_bias": kind == "qwen2" or attention_bias, "out_bias": attention_bias,
        "mlp_bias": kind == "llama" and _field(config, "mlp_bias", bool, path, False),
        "rope_llama3": llama3, **dict(zip(("sliding_window", "window_layers"), _sliding_window(kind, config, path))),
    }


def _check_heads(path: Path, dim: int, heads: int, kv: int | None, head_dim: int | None) -> None:
    """The attention shape config.json gives must split into heads, in the keys the user wrote
    (pipezero's validate would name its own settings, model.dim and n_heads)."""
    if head_dim is None and dim % heads:
        raise ConfigError(f"{path}: hidden_size {dim} is not a multiple of num_attention_heads {heads}; fix one, "
                          f"or give head_dim")
    if kv is not None and heads % kv:
        raise ConfigError(f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv} "
                          f"(each key/value head serves a whole group of query heads)")
    if (head_dim or dim // heads) % 2:
        what = f"head_dim {head_dim}" if head_dim else f"the head dimension {dim // heads} (hidden_size / num_attention_heads)"
        raise ConfigError(f"{path}: {what} is odd: rotary positions turn pairs of a head's dimensions")


def _token_id(config: dict[str, Any], key: str, path: Path, token_id: Callable[[str], int | None]) -> int | None:
    """An id field of a config file (an int, or a list whose first item names it); None for a
    missing, null or negative one (older Llama configs wrote pad_token_id -1 for "none"). A token
    written where its id belongs ("</s>") is refused, naming the id: ignored, it would leave the
    documents without their EOS, and transformers would not read it either."""
    value = config.get(key)
    items = value if isinstance(value, list) else [value]
    for item in items:
        if isinstance(item, str):
            found = token_id(item)
            what = "end-of-sequence" if key.startswith("eos") else "padding"
            fix = (f": write its id, {found} in tokenizer.json" if found is not None
                   else f", and tokenizer.json has no such token: write the {what} id")
            raise ConfigError(f"{path}: field {key!r} = {json.dumps(value)} is a token, not an id{fix}")
        if item is not None and (not isinstance(item, int) or isinstance(item, bool)):
            raise ConfigError(f"{path}: field {key!r} = {json.dumps(value)} is not an integer id")
    first = items[0] if items else None
    return first if isinstance(first, int) and first >= 0 else None


def _embedding_row(path: Path, what: str, token: int, config: dict[str, Any], fix: str) -> int:
    """`token` checked to be a row of the embedding (config.json's vocab_size): an id past it would
    fail inside a rank's embedding lookup, mid-run, rather than here in one line."""
    vocab = config.get("vocab_size")
    if isinstance(vocab, int) and token >= vocab:
        raise ConfigError(f"{path}: the {what} id {token} is not a row of the embedding (config.json's vocab_size "
                          f"is {vocab}); {fix}")
    return token


def eos_id(folder: Path, token_id: Callable[[str], int | None]) -> int | None:
    """The end-of-sequence id config.json names (the first of a list), or None; it is packed after
    every document, so it must be a row of the embedding. `token_id` looks a token up (to name the
    id of one written in its place)."""
    config = read_json(folder / CONFIG)
    eos = _token_id(config, "eos_token_id", folder / CONFIG, token_id)
    return None if eos is None else _embedding_row(folder / CONFIG, "end-of-sequence", eos, config,
                                                   "fix its eos_token_id")


def pad_id(folder: Path, token_id: Callable[[str], int | None]) -> int | None:
    """The id that fills a row past its document's end, as the model's files name it: config.json's
    pad_token_id, else generation_config.json's, else tokenizer_config.json's pad_token (a token,
    looked up with `token_id`); None when none names one. Padded positions are never attended to
    by a kept position nor predicted, so any row of the embedding would do; the model's own keeps
    what it sees the one it was trained with."""
    config = read_json(folder / CONFIG)
    generation = read_json(folder / GENERATION) if (folder / GENERATION).is_file() else {}
    found: tuple[str, int] | None = None
    if (pad := _token_id(config, "pad_token_id", folder / CONFIG, token_id)) is not None:
        found = (CONFIG, pad)
    elif (pad := _token_id(generation, "pad_token_id", folder / GENERATION, token_id)) is not None:
        found = (GENERATION, pad)
    elif (folder / TOKENIZER_CONFIG).is_file():
        token = read_json(folder / TOKENIZER_CONFIG).get("pad_token")
        if isinstance(token, dict):  # an AddedToken as transformers 4 wrote it
            token = token.get("content")
        if isinstance(token, str) and (pad := token_id(token)) is not None:
            found = (TOKENIZER_CONFIG, pad)
    if found is None:
        return None
    return _embedding_row(folder / found[0], "padding", found[1], config, "fix or drop that pad token")


def llama_config(fields: dict[str, Any], eos: int | None = None) -> dict[str, Any]:
    """A transformers LlamaConfig (config.json) for a built-in model's `ModelConfig` fields, so a
    preset-trained run exports like a loaded one."""
    dim, heads = fields["dim"], fields["n_heads"]
    from pipezero.config import ModelConfig
    from pipezero.models.presets import ffn_dim

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": fields["rope_theta"]}
    if fields.get("rope_llama3"):
        rope = {"rope_type": "llama3", "rope_theta": fields["rope_theta"],
                **dict(zip(("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                           fields["rope_llama3"]))}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "dtype": "float32",
        "vocab_size": fields["vocab_size"], "hidden_size": dim, "num_hidden_layers": fields["n_layers"],
        "num_attention_heads": heads, "num_key_value_heads": fields.get("n_kv_heads") or heads,
        "head_dim": fields.get("head_dim") or dim // heads,
        "intermediate_size": ffn_dim(ModelConfig(**fields)), "max_position_embeddings": fields["max_seq_len"],
        "rms_norm_eps": fields["norm_eps"], "rope_parameters": rope,
        "tie_word_embeddings": fields["tie_embeddings"], "attention_bias": False, "mlp_bias": False,
        "bos_token_id": None, "eos_token_id": eos, "pad_token_id": None,
    }


FINETUNE_LR = 3e-5  # a pretrained model's default peak rate: the presets' 3e-3 would wreck its weights


def apply_pretrained(cfg: Any, given: set[str]) -> None:
    """Fill `cfg` (a TrainConfig) from the folder `cfg.model.pretrained`: the shape from its
    config.json, and unless `given` (settings the user set) says otherwise its tokenizer.json and a
    fine-tuning learning rate. A shape setting given alongside is refused: the weights fix it."""
    folder = Path(cfg.model.pretrained)
    if not cfg.model.pretrained.strip():  # Path("") is the working directory
        raise ConfigError("--model is empty: name a local Hugging Face model folder")
    if not folder.is_dir():
        raise ConfigError(f"--model {folder}: not a folder; pass a local Hugging Face model folder (nothing "
                          f"is downloaded)")
    clash = sorted(k for k in given if k.startswith("model.") and k != "model.pretrained")
    if clash:
        raise ConfigError(f"--model {folder} fixes the model's shape; drop {', '.join(clash)}")
    fields = model_fields(folder)
    for key, value in fields.items():
        setattr(cfg.model, key, value)
    cfg.model.preset = read_json(folder / CONFIG)["model_type"]  # what the start-up line names
    if "data.tokenizer" not in given:
        cfg.data.tokenizer = str(folder / TOKENIZER)
    if "optim.lr" not in given:
        cfg.optim.lr = FINETUNE_LR


def keep_metadata(folder: Path, dest: Path) -> None:
    """Copy the folder's config and tokenizer files into the run (`dest`), so an export restores
    them even after the folder moved. Only reads `folder`."""
    from pipezero.files import atomic_write_bytes

    dest.mkdir(parents=True, exist_ok=True)
    for name in METADATA:
        if (folder / name).is_file():
            atomic_write_bytes(dest / name, (folder / name).read_bytes())
