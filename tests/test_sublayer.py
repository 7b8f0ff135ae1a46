"""ZeRO-3 layer by layer with a block's attention and MLP as units of their own (--zero3-unit
sublayer): where it is refused, the parts a spec names held to its layers, the memory model's
gathered bytes and the planner's costs of the parts. Pure data and one process; the runs that train
with it are in tests/test_zero.py (equal to one process) and tests/test_program_played.py (the
runtime plays the program's collectives)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from one_line import assert_one_line, run_main
from pipezero.errors import ConfigError
from pipezero.models.presets import layer_param_counts
from pipezero.settings import build_config
from pipezero.memory.model import _layerwise_gathered, build_plan, prefetch_choice
from pipezero.planner.prefetch import layer_seconds

EXAMPLES = str(Path(__file__).resolve().parent.parent / "examples")


def config(**extra: str):
    return build_config(None, {"model.preset": "tiny", "model.n_layers": "4", "parallel.dp": "2",
                               "parallel.zero": "3", "parallel.microbatches": "2", **extra})


@pytest.mark.parametrize("args, needle", [
    (["--zero", "2"], "--zero3-unit sublayer with --zero 2 --pp 1: only ZeRO-3 layer by layer gathers a unit"),
    (["--zero", "3", "--pp", "2"], "--zero3-unit sublayer with --zero 3 --pp 2: only ZeRO-3 layer by layer"),
    (["--zero", "3", "--dp", "2", "--compile"], "--zero3-unit sublayer with --compile: a compiled block runs its attention"),
])
def test_sublayer_is_refused_where_nothing_gathers_a_unit(args, needle, tmp_path, capsys):
    code, err = run_main(["train", "--zero3-unit", "sublayer", "--max-steps", "1", "--out", str(tmp_path / "o"),
                          *args], capsys)
    assert_one_line(code, err, needle)
    assert not (tmp_path / "o").exists()


def gpt_spec(parts: str):
    """examples/own_model.py's GPTSpec, its blocks' parts as `parts` says (a Python expression)."""
    sys.path.insert(0, EXAMPLES)
    try:
        from own_model import GPTSpec
    finally:
        sys.path.remove(EXAMPLES)

    class Parted(GPTSpec):
        def layer_parts(self, index: int):
            return eval(parts) if 0 < index <= self.n_layers else ()  # noqa: S307 (the test's own literal)
    return Parted()


def test_a_specs_parts_are_held_to_the_layers_it_builds():
    from pipezero.stage import model_shapes

    good = gpt_spec("(('ln1', 'q', 'k', 'v', 'out'), ('ln2', 'fc', 'proj'))")
    assert not any(x.parts for x in model_shapes(good, [(0, good.n_layers + 2)], None).chunks[0].layers)  # unasked
    shapes = model_shapes(good, [(0, good.n_layers + 2)], None, parts=True)
    block = shapes.chunks[0].layers[1]
    units = block.units(True)
    assert [j for j, _ in units] == [0, 1] and {t.name.split(".")[2] for t in units[1][1]} == {"ln2", "fc", "proj"}
    assert sum(len(ts) for _, ts in units) == len(block.tensors)
    with pytest.raises(ConfigError, match=r"\['attn'\] is no sub-module of layer 1 \(Block\)"):
        model_shapes(gpt_spec("(('ln1', 'attn'), ('ln2', 'fc', 'proj'))"), [(0, good.n_layers + 2)], None, True)
    with pytest.raises(ConfigError, match=r"layers\.1\.q\.weight lies in none of them"):
        model_shapes(gpt_spec("(('ln1', 'out'), ('ln2', 'fc', 'proj'))"), [(0, good.n_layers + 2)], None, True)
    for said in ("('attn', 'mlp')", "'ln1'", "((1, 2),)", "None"):
        with pytest.raises(ConfigError, match=r"expected groups of sub-module names"):
            model_shapes(gpt_spec(said), [(0, good.n_layers + 2)], None, True)
    # held to the order a forward runs them (on the meta device): parts swapped, or a part's last
    # module not the last it runs (the part's end would release weights its next module reads)
    ran = r"enters its modules in the order \['ln1', 'q', 'k', 'v', 'out', 'ln2', 'fc', 'proj'\]"
    for parts in ("(('ln2', 'fc', 'proj'), ('ln1', 'q', 'k', 'v', 'out'))",
                  "(('ln1', 'q', 'k', 'out', 'v'), ('ln2', 'fc', 'proj'))"):
        with pytest.raises(ConfigError, match=ran):
            model_shapes(gpt_spec(parts), [(0, good.n_layers + 2)], None, True)


@pytest.mark.parametrize("body, needle", [
    ("", "--zero3-unit sublayer with --model-spec {name}:S: its layers name no parts"),
    ("    def layer_parts(self, index):\n        raise KeyError('parts')\n",
     "--model-spec '{name}:S': S.layer_parts raised KeyError: 'parts' at"),
    # checked with the settings, so under --nproc too it is one line before any rank starts
    ("    def layer_parts(self, index):\n        return (('ln2', 'fc', 'proj'), ('ln1', 'q', 'k', 'v', 'out')) "
     "if 0 < index <= self.n_layers else ()\n", "S.layer_parts(1) = (('ln2', 'fc', 'proj'), ('ln1', 'q', 'k', 'v', "
     "'out')): a forward of layer 1 enters its modules in the order"),
    # the same parts in a block that cannot run on the meta device (its forward reads its input's values)
    ("    def build_layer(self, index):\n        layer = super().build_layer(index)\n"
     "        if 0 < index <= self.n_layers:\n            forward = layer.forward\n"
     "            layer.forward = lambda x: forward(x) if bool(x.isfinite().all()) else x\n        return layer\n"
     "    def layer_parts(self, index):\n        return (('ln2', 'fc', 'proj'), ('ln1', 'q', 'k', 'v', 'out')) "
     "if 0 < index <= self.n_layers else ()\n", "S.layer_parts(1) = (('ln2', 'fc', 'proj'), ('ln1', 'q', 'k', 'v', "
     "'out')): a forward of layer 1 enters its modules in the order"),
    # None for the embedding (a layer without parts is ()): each rank refused it after launch
    ("    def layer_parts(self, index):\n        return None if index == 0 else (('ln1', 'q', 'k', 'v', 'out'), "
     "('ln2', 'fc', 'proj')) if index <= self.n_layers else ()\n",
     "S.layer_parts(0) = None: expected groups of sub-module names"),
])
def test_a_spec_without_parts_or_whose_parts_raise_is_one_line(body, needle, tmp_path, monkeypatch, capsys):
    name = f"parts_{abs(hash(body)):x}"
    (tmp_path / f"{name}.py").write_text(f"import sys\nsys.path.insert(0, {EXAMPLES!r})\nfrom own_model import GPTSpec\n"
                                         f"class S(GPTSpec):\n    pass\n{body}")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    code, err = run_main(["train", "--model-spec", f"{name}:S", "--tokenizer", "bytes", "--zero", "3", "--nproc", "2",
                          "--dp", "2", "--zero3-unit", "sublayer", "--max-steps", "1", "--out", "o"], capsys)
    assert_one_line(code, err, needle.format(name=name))
    assert not (tmp_path / "o").exists()


def test_the_memory_model_gathers_a_part_not_a_block():
    whole, parts = (build_plan(config(**{"parallel.zero3_unit": u})) for u in ("layer", "sublayer"))
    assert len(parts.buckets.layouts[0]) == len(whole.buckets.layouts[0]) + 4
    units = [lay.numel for lay in reversed(parts.buckets.layouts[0])]
    assert sum(units) == sum(lay.numel for lay in whole.buckets.layouts[0])
    for span in (2, 3):
        assert _layerwise_gathered(parts, 0, span) == 4 * max(sum(units[i:i + span]) for i in range(len(units)))
        assert _layerwise_gathered(parts, 0, span) < _layerwise_gathered(whole, 0, span)


def test_the_planners_parts_cost_what_their_block_costs():
    m = config().model
    link = lambda n, kind: n * 4 / 1e8  # noqa: E731
    whole, parts = layer_seconds(m, 4, 64, 0.05, link), layer_seconds(m, 4, 64, 0.05, link, sublayer=True)
    assert len(parts) == len(whole) + m.n_layers
    for field in ("forward_s", "gather_s", "reduce_s"):
        assert sum(getattr(c, field) for c in parts) == pytest.approx(sum(getattr(c, field) for c in whole))
    attention, mlp = parts[1], parts[2]
    assert attention.gather_s + mlp.gather_s == pytest.approx(whole[1].gather_s)
    assert attention.gather_s < mlp.gather_s  # SwiGLU's three matrices outweigh four square ones
    assert layer_param_counts(m)[1] * 4 / 1e8 == pytest.approx(whole[1].gather_s)
    # where the link keeps up with the blocks, a step's first gather and last reduction are what is
    # exposed, and a part's are smaller; where it does not, the bytes are the same and so is the wait
    auto = {"parallel.zero3_prefetch": "auto", "parallel.link_gbps": "0.5"}
    best = {u: min(prefetch_choice(config(**auto, **{"parallel.zero3_unit": u})).exposed_s) for u in ("layer", "sublayer")}
    assert best["sublayer"] < 0.9 * best["layer"], best


def test_plan_proposes_parts_where_the_link_keeps_up_and_whole_layers_where_it_does_not():
    """The cluster bench's model and rates (bench/cluster_overlap.py, D=2, 2 nodes): at 500 Mbit a
    step's first gather and last reduction are what is left exposed, and a part's are smaller (measured:
    sublayer at depth 3 stepped 0.402 s where whole layers took 0.424 s); at 200 Mbit the link is
    busy throughout and looking further ahead wins (whole layers at depth 5 0.659 s, parts 0.741 s)."""
    from pipezero.config import ModelConfig, ScheduleKind, Zero3Unit
    from pipezero.models import apply_preset
    from pipezero.planner.layouts import Cluster, Layout
    from pipezero.planner.prefetch import plan_choice

    model = apply_preset(ModelConfig(), "tiny")
    model.dim, model.n_layers, model.vocab_size = 256, 4, 256
    lay = Layout(1, 2, 3, ScheduleKind.ONE_F_ONE_B, 1, 16, 1, False)

    def choice(mbit: int, spare: float = 2**30):
        cluster = Cluster(2, 2, node_size=1, intra_gbps=1e3, inter_gbps=mbit / 8e3, tflops=0.114, mfu=1.0,
                          wire_bytes=4, cpu=True, bucket_mb=1)
        return plan_choice(model, 128, cluster, lay, spare)

    fast, slow = choice(500), choice(200)
    assert fast.unit is Zero3Unit.SUBLAYER and fast.depth >= 2 and "whole layers" in fast.why
    assert slow.unit is Zero3Unit.LAYER and slow.depth >= 3
    assert min(fast.exposed_s) < min(choice(500).exposed_s[:1])


def test_verify_compares_a_sublayer_layout_with_one_process(tmp_path):
    """verify's one-process reference gathers nothing: it drops the unit (kept, its validation
    refused --zero3-unit sublayer with ZeRO-0 after the layout had trained)."""
    from pipezero.config import ParallelConfig, TrainConfig, Zero3Unit
    from pipezero.verify import reference_config

    layout = TrainConfig(parallel=ParallelConfig(dp=2, zero=3, zero3_unit=Zero3Unit.SUBLAYER))
    ref = reference_config(layout, tmp_path)
    assert (ref.parallel.zero, ref.parallel.zero3_unit) == (0, Zero3Unit.LAYER)
    assert layout.parallel.zero3_unit is Zero3Unit.SUBLAYER


def test_plan_says_which_unit_in_its_json_and_why(capsys):
    """`plan` reports the unit beside the depth (JSON `zero3_unit`, the `why` naming the flag)."""
    from pipezero.cli import main

    argv = ["plan", "--preset", "tiny", "--nodes", "2", "--gpus-per-node", "1", "--gpu-memory", "8",
            "--global-batch", "32", "--seq-len", "128", "--device", "cpu", "--tflops", "0.114", "--mfu", "1",
            "--top", "400", "--json"]
    units = {}
    for bw in ("0.1", "0.2"):
        assert main([*argv, "--inter-bw", bw]) == 0
        rows = [r for r in json.loads(capsys.readouterr().out)["layouts"] if r["zero"] == 3 and r["pp"] == 1]
        units[bw] = {r["zero3_unit"] for r in rows}
        for r in rows:
            assert (r["zero3_unit"] == "sublayer") == ("--zero3-unit sublayer" in r["why"])
    assert units["0.1"] == {"layer"} and "sublayer" in units["0.2"]
    others = [r for r in json.loads((main([*argv, "--inter-bw", "0.2"]), capsys.readouterr().out)[1])["layouts"]
              if r["zero"] != 3 or r["pp"] > 1]
    assert others and all(r["zero3_unit"] is None for r in others)


@pytest.mark.parametrize("args, needle", [
    (["--zero", "3", "--dp", "2"], "--zero3-unit sublayer applies with --zero3-layerwise"),
    (["--zero", "2", "--dp", "2", "--zero3-layerwise"], "--zero3-layerwise is read only by ZeRO-3"),
    (["--zero", "1", "--dp", "2"], "--zero3-unit is read only by ZeRO-3"),
    ([], "--zero3-unit applies with --zero"),
])
def test_simulate_refuses_the_unit_where_it_would_read_none(args, needle, capsys):
    """simulate's timing run lowers its program with the unit; where no gather is a unit's, one line."""
    assert_one_line(*run_main(["simulate", "--zero3-unit", "sublayer", *args, "--json"], capsys), needle)


def test_simulate_lowers_a_bucket_a_part(capsys):
    from pipezero.cli import main

    base = ["simulate", "--zero", "3", "--dp", "2", "--pp", "2", "--microbatches", "4", "--zero3-layerwise", "--json"]
    got = {}
    for unit in ("layer", "sublayer"):
        assert main([*base, "--zero3-unit", unit]) == 0
        got[unit] = json.loads(capsys.readouterr().out)
    assert got["sublayer"]["zero3_unit"] == "sublayer" and got["layer"]["zero3_unit"] == "layer"
    blocks = [n - 1 for n in got["layer"]["buckets_per_chunk"]]  # each chunk: its blocks and an end layer
    assert got["sublayer"]["buckets_per_chunk"] == [n + b for n, b in zip(got["layer"]["buckets_per_chunk"], blocks)]


def test_parts_the_runtime_finds_out_of_order_are_one_line_naming_the_spec(monkeypatch):
    """A layer too large to try on CPU that cannot run on meta is held to its parts only by the
    runtime: its refusal is each rank's one line naming the spec, not a traceback."""
    from pipezero.cli.train import failure_line
    from pipezero.zero.gathering import UngatheredUse

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    cfg = config(**{"parallel.zero3_unit": "sublayer"})
    cfg.model.spec = "big:S"
    said = failure_line(cfg, UngatheredUse("rank 1: 0F0, layer 1 part 1 computes with bucket 0.7 (layers.1.out.bias, "
                                           "...), which its program never gathered"))
    assert said is not None and said[0] == 2, said
    assert "\n" not in said[1] and said[1].startswith("rank 1: ") and "--model-spec big:S" in said[1], said
    assert "layer_parts" in said[1] and "order they run" in said[1], said
    cfg.model.spec = None  # the built-in model's parts: a bug of pipezero's, whose traceback is the report
    assert failure_line(cfg, UngatheredUse("rank 1: ...")) is None
