"""`--model-spec MODULE:NAME` (`[model] spec`): a model of one's own, named from the command line.

The user names their own Python code explicitly, `my_pkg.my_mod:make_spec`: NAME is a `ModelSpec`
instance, a `ModelSpec` subclass, or a function of no arguments returning one. Importing runs that module, which is the point: it is the
user's code, never a file found in a data or model folder.

The reference is a string in `ModelConfig`, so it travels with the run's config.json into every
rank, `--resume`, `pipezero export` and `verify`; each process imports it again (`spec_of`). The
working directory is searched first, as `python -m` does, so a module beside the user's shell
imports under the `pipezero` console script too, and in ranks torchrun starts from there.
Every mistake is one ConfigError naming the fix, raised while settings are validated, before any
process group starts.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import os
import sys
import sysconfig
import typing
from types import TracebackType
from typing import Any

from pipezero.config import MAX_LAYERS
from pipezero.errors import ConfigError
from pipezero.models.spec import ModelSpec

EXAMPLE = "my_pkg.my_mod:make_spec"


def _split(ref: str) -> tuple[str, str]:
    module, sep, name = ref.partition(":")
    if not sep or not module or not name or not all(p.isidentifier() for p in (*module.split("."), *name.split("."))):
        raise ConfigError(f"--model-spec {ref!r}: write MODULE:NAME (an importable module and a name in it), "
                          f"e.g. --model-spec {EXAMPLE}")
    return module, name


def _import(ref: str, module: str) -> Any:
    """The module, with the working directory searched first; a module that is missing (not one it
    imports) is one line saying where Python looked."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module)
    except SystemExit as e:  # would end pipezero as the module chose (exit 0: "done", nothing trained)
        raise ConfigError(f"--model-spec {ref!r}: importing {module} called sys.exit({e.code!r}); a spec's module "
                          f"must define it without ending the program (guard a script part with "
                          f"`if __name__ == \"__main__\":`)") from None
    except ModuleNotFoundError as e:
        if e.name is None or not (module == e.name or module.startswith(e.name + ".")):
            raise _raised_in_users_code(ref, f"importing {module}", module, e) from None
        raise ConfigError(f"--model-spec {ref!r}: no module named {e.name!r} in the working directory or on "
                          f"PYTHONPATH; run from the folder that holds it, add that folder to PYTHONPATH, or "
                          f"install its package") from None
    except Exception as e:  # noqa: BLE001 - the user's module raised (or would not compile) while it was imported
        raise _raised_in_users_code(ref, f"importing {module}", module, e) from None


PIPEZERO_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")
LIBRARY_DIRS = tuple({os.path.join(p, "") for k in ("stdlib", "platstdlib", "purelib", "platlib")
                      if (p := sysconfig.get_paths().get(k))})


def _whose(filename: str) -> str:
    """"pipezero", "library" (Python's own, installed packages such as torch: called by pipezero or
    by the user, so never the one at fault) or "user" for the file of a traceback's frame."""
    if filename.startswith(PIPEZERO_DIR):
        return "pipezero"
    if filename.startswith("<") or filename.startswith(LIBRARY_DIRS):  # <frozen importlib._bootstrap>, <string>
        return "library"
    return "user"


def _frames(tb: TracebackType | None) -> list[tuple[str, int, str, str]]:
    """(file, line, qualified function name, whose) of every frame of a traceback, outermost first,
    library frames left out."""
    out = []
    while tb is not None:
        code = tb.tb_frame.f_code
        if (whose := _whose(code.co_filename)) != "library":
            out.append((code.co_filename, tb.tb_lineno, code.co_qualname, whose))
        tb = tb.tb_next
    return out


def _raised_in_users_code(ref: str, doing: str, module: str, e: BaseException, hint: str | None = None) -> ConfigError:
    """One line for an exception the user's own code raised while pipezero read or ran the spec: where
    (the innermost frame in the user's files, skipping pipezero's and the libraries' it called into,
    or a SyntaxError's own place) and what, and how to see the whole traceback (`hint`; by default,
    importing the module shows it)."""
    place = ""
    if isinstance(e, SyntaxError) and e.filename:
        place = f" at {e.filename}:{e.lineno}"
    elif users := [f for f in _frames(e.__traceback__) if f[3] == "user"]:
        place = f" at {users[-1][0]}:{users[-1][1]}"
    said = str(e).splitlines()[0] if str(e) else ""
    hint = hint or f"python -c 'import {module}' shows the whole traceback"
    return ConfigError(f"--model-spec {ref!r}: {doing} raised {type(e).__name__}{': ' + said if said else ''}{place}; "
                       f"fix it there ({hint})")


CALL_IT = "it raises the same when called in Python, with its whole traceback"  # a spec run's error's hint


def users_fault(ref: str, e: BaseException) -> ConfigError | None:
    """The one line for an exception the spec's own code raised while the run trained (a layer's
    forward or backward, init_layer, loss): the innermost frame of pipezero's or the user's is the
    user's. None when it is pipezero's (a bug of ours: its traceback is the report) or memory ran
    out (no mistake in the code). Named by the spec function pipezero called, and the line that raised."""
    import torch

    if isinstance(e, (MemoryError, torch.cuda.OutOfMemoryError)):
        return None
    frames = _frames(e.__traceback__)
    if not frames or frames[-1][3] != "user":
        return None
    called = frames[1 + max((i for i, f in enumerate(frames) if f[3] == "pipezero"), default=-1)]
    return _raised_in_users_code(ref, called[2], ref.partition(":")[0], e,
                                 hint=CALL_IT)


def load_spec(ref: str) -> ModelSpec:
    """The ModelSpec that `ref` ("MODULE:NAME") names: an instance as it is, a subclass or a
    function called with no arguments."""
    module_name, name = _split(ref)
    module = _import(ref, module_name)
    obj: Any = module
    for part in name.split("."):
        if not hasattr(obj, part):
            where = getattr(module, "__file__", None) or module_name
            raise ConfigError(f"--model-spec {ref!r}: {where} has no attribute {name!r}; name a ModelSpec "
                              f"subclass or instance, or a function returning one, defined there")
        obj = getattr(obj, part)
    if callable(obj) and not isinstance(obj, ModelSpec):
        if (gives := _declared(obj)) is not None:  # never called: pipezero.cli:main ran pipezero in itself
            said = "" if gives is obj else f" ({name}'s declared return type)"
            raise ConfigError(f"--model-spec {ref!r} gives a {gives.__name__}{said}, not a pipezero.models.ModelSpec; "
                              f"{FIX}")
        if _loading(ref, sys._getframe(1)):
            raise ConfigError(f"--model-spec {ref!r} is loaded again while it is being loaded (its {name}() "
                              f"calls pipezero with it): it would never end; name a function that builds the spec")
        try:
            inspect.signature(obj).bind()
        except TypeError:
            raise ConfigError(f"--model-spec {ref!r}: {name} needs arguments; name one that takes none (a "
                              f"function that builds your spec with its settings)") from None
        except ValueError:  # no signature to inspect (a builtin): calling it says what it needs
            pass
        try:
            obj = obj()
        except Exception as e:  # noqa: BLE001 - the user's function or class raised while building the spec
            raise _raised_in_users_code(ref, f"calling {name}()", module_name, e) from None
    if not isinstance(obj, ModelSpec):
        raise ConfigError(f"--model-spec {ref!r} gives a {type(obj).__name__}, not a pipezero.models.ModelSpec; {FIX}")
    if problem := incomplete(obj):
        raise ConfigError(f"--model-spec {ref!r}: {type(obj).__name__} {problem}; see pipezero/models/spec.py's "
                          f"ModelSpec and examples/own_model.py")
    _probe_layers(obj, ref, module_name)
    _check_flops(obj, ref, module_name)
    return obj


FIX = ("subclass ModelSpec (examples/own_model.py) and name the class, an instance, or a function returning "
       "one")


def _declared(obj: Any) -> type | None:
    """The class `obj` says it makes, when that is no ModelSpec: a class that is none, or a function
    whose return annotation is a class that is none (`-> int`); None when it may give one (no
    annotation, one not resolvable, Any, a ModelSpec) and only calling it tells."""
    if inspect.isclass(obj):
        return None if issubclass(obj, ModelSpec) else obj
    try:
        returns = inspect.signature(obj, eval_str=True).return_annotation
    except Exception:  # noqa: BLE001 - no signature (a builtin), an annotation that does not evaluate
        return None
    if not inspect.isclass(returns) or returns in (inspect.Signature.empty, typing.Any, object) or issubclass(returns, ModelSpec):
        return None
    return returns


def _loading(ref: str, frame: Any) -> bool:
    """Whether load_spec(ref) is already under way further up the stack: a factory that loads its own
    reference (or runs pipezero's CLI with it) would call itself for ever, each level a line."""
    while frame is not None:
        if frame.f_code is load_spec.__code__ and frame.f_locals.get("ref") == ref:
            return True
        frame = frame.f_back
    return False


def _check_flops(spec: ModelSpec, ref: str, module: str) -> None:
    """flops_per_token a number >= 0: it sets --zero3-prefetch auto's depth and the metrics' MFU,
    where a nan or a negative count would be used as it is. Asked at the spec's longest
    sequence, or 2048 (the run's own --seq-len is not known here)."""
    cls, seq_len = type(spec).__name__, min(spec.max_seq_len or 2048, 2048)
    try:
        flops = spec.flops_per_token(seq_len)
    except Exception as e:  # noqa: BLE001 - the user's flops_per_token raised
        raise _raised_in_users_code(ref, f"{cls}.flops_per_token({seq_len})", module, e) from None
    if isinstance(flops, bool) or not isinstance(flops, numbers.Real) or not 0 <= flops < math.inf:
        raise ConfigError(f"--model-spec {ref!r}: {cls}.flops_per_token({seq_len}) gives {flops!r}; it must give "
                          f"a number >= 0 (the FLOPs of training one token: forward and backward)")


def _probe_layers(spec: ModelSpec, ref: str, module: str) -> None:
    """Every layer built on the meta device (allocating nothing, as the engine does for names and
    shapes) and layer_param_counts() called, so a build_layer that raises or returns no module, or
    counts that are not one integer >= 0 a layer, is one line now, before the run folder is made;
    unchecked, each would be a traceback from pipezero's own set-up, or the loss taken on another
    layer's output."""
    import torch
    from torch import nn

    cls, n = type(spec).__name__, spec.n_layers + 2
    layers = []
    for i in range(n):
        try:
            with torch.device("meta"):
                layer = spec.build_layer(i)
        except Exception as e:  # noqa: BLE001 - the user's build_layer raised
            raise _raised_in_users_code(ref, f"{cls}.build_layer({i})", module, e) from None
        if not isinstance(layer, nn.Module):
            raise ConfigError(f"--model-spec {ref!r}: {cls}.build_layer({i}) gives a {type(layer).__name__}, not a "
                              f"torch.nn.Module; return layer {i} of [embedding, block x n_layers, head]")
        layers.append(layer)
    try:
        counts = spec.layer_param_counts()
    except Exception as e:  # noqa: BLE001 - the user's layer_param_counts raised
        raise _raised_in_users_code(ref, f"{cls}.layer_param_counts()", module, e) from None
    if not isinstance(counts, (list, tuple)) or len(counts) != n:
        got = f"{len(counts)} counts" if isinstance(counts, (list, tuple)) else f"a {type(counts).__name__}"
        raise ConfigError(f"--model-spec {ref!r}: {cls}.layer_param_counts() gives {got}; it must give one a layer, "
                          f"n_layers + 2 = {n} (embedding, {spec.n_layers} blocks, head)")
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
        raise ConfigError(f"--model-spec {ref!r}: {cls}.layer_param_counts() gives {list(counts)}; it must give one "
                          f"integer >= 0 a layer (its parameters' numel)")
    if not spec.deferred_init:  # a pretrained model's layers are filled by its loader, never initialised
        for i, layer in enumerate(layers):
            _probe_init(spec, ref, module, layer, i, counts[i])
    _check_tied(spec, ref, module, layers)
    _check_widths(spec, ref, layers, sum(p.numel() for layer in layers for p in layer.parameters()))


def _check_widths(spec: ModelSpec, ref: str, layers: list[Any], params: int) -> None:
    """Every layer but the head gives (B, T, dim) on a few tokens, run on the meta device (no memory,
    no arithmetic): `dim` sizes the buffers activations cross pipeline ranks in, where a lie was a C++
    abort of gloo's on every rank. A forward that cannot run on meta (`.item()`, a mask it needs) is
    run once more on the model built for real where it is small (`params` at most PROBE_REAL); a
    larger one, or one that fails for real too, is left to the run."""
    import torch

    if _widths_agree(spec, ref, layers, "meta") or params > PROBE_REAL:
        return
    try:
        with torch.device("cpu"):
            real = [spec.build_layer(i) for i in range(len(layers))]
    except Exception:  # noqa: BLE001 - built on meta above: the run meets whatever this is
        return
    _widths_agree(spec, ref, real, "cpu")


def _widths_agree(spec: ModelSpec, ref: str, layers: list[Any], device: str) -> bool:
    """Whether every layer's forward ran on `device` (then each gave (1, T, dim), else ConfigError)."""
    import torch

    cls, tokens = type(spec).__name__, min(8, spec.max_seq_len or 8)
    with torch.device(device):
        x: Any = torch.zeros(1, tokens, dtype=torch.long)
        for i, layer in enumerate(layers[:-1]):
            try:
                with torch.no_grad():
                    x = layer(x)
            except Exception:  # noqa: BLE001 - on meta maybe no fault of the spec's; for real, the run says it
                return False
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != (1, tokens, spec.dim):
                got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"
                raise ConfigError(f"--model-spec {ref!r}: {cls} says dim = {spec.dim}, but layer {i} "
                                  f"({type(layer).__name__}) gives activations of {got}: dim is the width of what "
                                  f"layers 0 to {spec.n_layers} give (what crosses between pipeline ranks); make "
                                  f"them agree")
    return True


def _check_tied(spec: ModelSpec, ref: str, module: str, layers: list[Any]) -> None:
    """tied_names() a pair (a parameter of the embedding, one of the head) of one shape, or None:
    pipezero's own set-up ties them (StageChunk.tie), where a name of no parameter would be its
    AttributeError traceback and two shapes an error blamed on the user's forward."""
    cls, last = type(spec).__name__, spec.n_layers + 1
    try:
        names = spec.tied_names()
    except Exception as e:  # noqa: BLE001 - the user's tied_names raised
        raise _raised_in_users_code(ref, f"{cls}.tied_names()", module, e) from None
    if names is None:
        return
    prefixes = ("layers.0.", f"layers.{last}.")
    if (not isinstance(names, (tuple, list)) or len(names) != 2 or not all(isinstance(n, str) for n in names)
            or not all(n.startswith(p) for n, p in zip(names, prefixes))):
        raise ConfigError(f"--model-spec {ref!r}: {cls}.tied_names() gives {names!r}; it must name a parameter of "
                          f"layer 0 (the embedding), then one of layer {last} (the head), e.g. "
                          f"('layers.0.tok.weight', 'layers.{last}.lm.weight'), or None")
    shapes = []
    for name, index in zip(names, (0, last)):
        params = dict(layers[index].named_parameters())
        own = name.split(".", 2)[2]
        if own not in params:
            raise ConfigError(f"--model-spec {ref!r}: {cls}.tied_names() names {name}, which is no parameter of layer "
                              f"{index} ({type(layers[index]).__name__}: {', '.join(params) or 'none'}); name two "
                              f"parameters of one shape, or return None")
        shapes.append(tuple(params[own].shape))
    if shapes[0] != shapes[1]:
        raise ConfigError(f"--model-spec {ref!r}: {cls}.tied_names() ties {names[0]} {shapes[0]} to {names[1]} "
                          f"{shapes[1]}: a tied pair must have one shape")


PROBE_REAL = 1 << 22  # parameters: a layer this small is built and initialised for real in ~10 ms


def _probe_init(spec: ModelSpec, ref: str, module: str, layer: Any, i: int, count: int) -> None:
    """init_layer run on layer `i` built on the meta device: an init_layer that raises would otherwise
    be the user's traceback from pipezero's set-up, after the run folder was made. On meta tensors
    some valid code fails (`.item()` has no value there): what fails so is tried once more on the
    layer built for real, when it is small; if it raises there too, in the user's code, it is one
    line now; otherwise (a large layer) the run says it when it meets it (cli.train_here)."""
    import torch

    try:
        with torch.device("meta"):
            spec.init_layer(layer, i, 0)
        return
    except Exception:  # noqa: BLE001 - maybe no fault of the spec's: told below
        pass
    if count > PROBE_REAL:
        return
    try:
        with torch.device("cpu"):
            spec.init_layer(spec.build_layer(i), i, 0)
    except Exception as e:  # noqa: BLE001 - the user's init_layer raised on a real layer too
        if users_fault(ref, e) is None:
            raise
        raise _raised_in_users_code(ref, f"{type(spec).__name__}.init_layer(layer {i})", module, e,
                                    hint=CALL_IT) from None


ABSTRACT = ("build_layer", "init_layer", "layer_param_counts", "flops_per_token")


def incomplete(spec: ModelSpec) -> str | None:
    """What `spec` lacks of what ModelSpec asks of a subclass (the sizes, the four abstract methods),
    said as the end of a sentence; None when nothing. Unchecked, a subclass without n_layers would be
    an AttributeError traceback from pipezero's own code."""
    bad = [n for n in ("n_layers", "dim", "vocab_size")
           if isinstance(v := getattr(spec, n, None), bool) or not isinstance(v, int) or v < 1]
    if bad:
        return f"gives no integer >= 1 as {', '.join(bad)}"
    if spec.n_layers > MAX_LAYERS:  # said before its layers are built and probed, one by one
        return f"has n_layers = {spec.n_layers}: at most {MAX_LAYERS} blocks (model.n_layers' range)"
    missing = [n for n in ABSTRACT if getattr(type(spec), n) is getattr(ModelSpec, n)]
    if missing:
        return f"does not define {', '.join(missing)}"
    return None


def apply_spec(cfg: Any, given: set[str]) -> None:
    """Settle `cfg` (a TrainConfig) for the spec `cfg.model.spec` names: other [model] settings
    given beside it are refused (the spec is the whole model, so they would be silently unused);
    the start-up line and the run's config.json name the spec, with its own sizes (the Llama-only
    fields keep their defaults, unused)."""
    clash = sorted(k for k in given if k.startswith("model.") and k != "model.spec")
    if clash:
        raise ConfigError(f"--model-spec {cfg.model.spec} is the whole model; drop {', '.join(clash)}")
    spec = load_spec(cfg.model.spec)
    m = cfg.model
    m.preset, m.n_layers, m.dim, m.vocab_size = m.spec, spec.n_layers, spec.dim, spec.vocab_size
    if spec.max_seq_len is not None:
        m.max_seq_len = spec.max_seq_len
