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
import os
import sys
import traceback
from typing import Any

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


def _raised_in_users_code(ref: str, doing: str, module: str, e: BaseException) -> ConfigError:
    """One line for an exception the user's own code raised while pipezero read the spec: where (the
    innermost frame outside pipezero and Python's import machinery, or a SyntaxError's own place)
    and what, and how to see the whole traceback. Settings are being checked: no rank has started."""
    place = ""
    if isinstance(e, SyntaxError) and e.filename:
        place = f" at {e.filename}:{e.lineno}"
    else:
        frames = [f for f in traceback.extract_tb(e.__traceback__)
                  if "importlib" not in f.filename and os.sep + "pipezero" + os.sep not in f.filename]
        if frames:
            place = f" at {frames[-1].filename}:{frames[-1].lineno}"
    said = str(e).splitlines()[0] if str(e) else ""
    return ConfigError(f"--model-spec {ref!r}: {doing} raised {type(e).__name__}{': ' + said if said else ''}{place}; "
                       f"fix it there (python -c 'import {module}' shows the whole traceback)")


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
        raise ConfigError(f"--model-spec {ref!r} gives a {type(obj).__name__}, not a pipezero.models.ModelSpec; "
                          f"subclass ModelSpec (examples/own_model.py) and name the class, an instance, or a "
                          f"function returning one")
    if problem := incomplete(obj):
        raise ConfigError(f"--model-spec {ref!r}: {type(obj).__name__} {problem}; see pipezero/models/spec.py's "
                          f"ModelSpec and examples/own_model.py")
    _probe_layers(obj, ref, module_name)
    return obj


def _probe_layers(spec: ModelSpec, ref: str, module: str) -> None:
    """Every layer built on the meta device (allocating nothing, as the engine does for names and
    shapes) and layer_param_counts() called, so a build_layer that raises or returns no module, or
    counts that are not one integer >= 0 a layer, is one line now, before the run folder is made;
    unchecked, each was a traceback from pipezero's own set-up, or the loss taken on another layer's
    output (round ten)."""
    import torch
    from torch import nn

    cls, n = type(spec).__name__, spec.n_layers + 2
    for i in range(n):
        try:
            with torch.device("meta"):
                layer = spec.build_layer(i)
        except Exception as e:  # noqa: BLE001 - the user's build_layer raised
            raise _raised_in_users_code(ref, f"{cls}.build_layer({i})", module, e) from None
        if not isinstance(layer, nn.Module):
            raise ConfigError(f"--model-spec {ref!r}: {cls}.build_layer({i}) gives a {type(layer).__name__}, not a "
                              f"torch.nn.Module; return layer {i} of [embedding, block x n_layers, head]")
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


ABSTRACT = ("build_layer", "init_layer", "layer_param_counts", "flops_per_token")


def incomplete(spec: ModelSpec) -> str | None:
    """What `spec` lacks of what ModelSpec asks of a subclass (the sizes, the four abstract methods),
    said as the end of a sentence; None when nothing. Unchecked, a subclass without n_layers was an
    AttributeError traceback from pipezero's own code (round nine)."""
    bad = [n for n in ("n_layers", "dim", "vocab_size")
           if isinstance(v := getattr(spec, n, None), bool) or not isinstance(v, int) or v < 1]
    if bad:
        return f"gives no integer >= 1 as {', '.join(bad)}"
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
