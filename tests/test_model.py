import dataclasses

import pytest
import torch
from torch import nn

from pipezero.config import ModelConfig
from pipezero.models import PRESETS, apply_preset, build_chunk, flops_per_token, layer_param_counts, param_count


def tiny(**kw) -> ModelConfig:
    cfg = apply_preset(ModelConfig(), "tiny")
    return dataclasses.replace(cfg, **kw)


def test_shapes_and_layer_list():
    cfg = tiny()
    model = build_chunk(cfg, 0, cfg.n_layers + 2, seed=0)
    x = torch.randint(0, cfg.vocab_size, (3, 17))
    assert model(x).shape == (3, 17, cfg.vocab_size)
    assert [k for k in model.layers] == [str(i) for i in range(cfg.n_layers + 2)]
    assert all(n.startswith("layers.") for n, _ in model.named_parameters())


@pytest.mark.parametrize("kv", [None, 2])
def test_causal_mask(kv):
    cfg = tiny(n_kv_heads=kv)
    model = build_chunk(cfg, 0, cfg.n_layers + 2, seed=0)
    x = torch.randint(0, cfg.vocab_size, (2, 12))
    y = x.clone()
    y[:, 7:] = (y[:, 7:] + 1) % cfg.vocab_size  # change the future only
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_slices_compose_to_whole_and_init_is_layout_independent():
    cfg = tiny(n_layers=4)
    whole = build_chunk(cfg, 0, 6, seed=3)
    parts = [build_chunk(cfg, a, b, seed=3) for a, b in [(0, 1), (1, 4), (4, 6)]]
    for part in parts:
        for name, p in part.named_parameters():
            torch.testing.assert_close(p, whole.get_parameter(name), rtol=0, atol=0)
    x = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        h = x
        for part in parts:
            h = part(h)
        torch.testing.assert_close(h, whole(x))


def test_tied_embeddings_share_one_parameter_and_start_equal_apart():
    cfg = tiny(tie_embeddings=True)
    whole = build_chunk(cfg, 0, cfg.n_layers + 2, seed=1)
    head_key = f"layers.{cfg.n_layers + 1}.proj.weight"
    assert whole.get_parameter(head_key) is whole.get_parameter("layers.0.weight")
    last = build_chunk(cfg, cfg.n_layers + 1, cfg.n_layers + 2, seed=1)
    torch.testing.assert_close(last.get_parameter(head_key), whole.get_parameter("layers.0.weight"))
    unique = sum(p.numel() for p in whole.parameters())
    assert unique == param_count(cfg)


@pytest.mark.parametrize("preset", ["tiny", "small", "base"])
def test_param_count_matches_built_model(preset):
    cfg = apply_preset(ModelConfig(), preset)
    if preset == "base":
        cfg = dataclasses.replace(cfg, n_layers=1)  # same per-layer shapes, less memory
    model = build_chunk(cfg, 0, cfg.n_layers + 2, seed=0)
    per_layer = [sum(p.numel() for p in m.parameters()) for _, m in model.layer_modules()]
    assert per_layer == layer_param_counts(cfg)


def test_preset_sizes_and_flops():
    sizes = {name: param_count(apply_preset(ModelConfig(), name)) for name in PRESETS}
    assert 0.8e6 < sizes["tiny"] < 2e6
    assert 8e6 < sizes["small"] < 15e6
    assert 100e6 < sizes["base"] < 140e6
    assert 6.4e9 < sizes["7b"] < 7e9
    assert 65e9 < sizes["70b"] < 72e9
    cfg = apply_preset(ModelConfig(), "7b")
    # Kaplan/PaLM: about 6N per token plus attention.
    assert 6 * sizes["7b"] * 0.95 < flops_per_token(cfg, 2048) < 6 * sizes["7b"] * 1.3


def test_split_backward_knows_linear_and_norm_and_names_what_it_cannot_split():
    from pipezero.models.llama import RMSNorm
    from pipezero.runtime.weight_grad import WeightGradCapture, weight_grad

    cfg = apply_preset(ModelConfig(), "tiny")
    chunk = build_chunk(cfg, 1, cfg.n_layers + 2, seed=1)
    assert WeightGradCapture(chunk).supported
    chunk.layers["1"].extra = torch.nn.Conv1d(2, 2, 1)  # a weighted module with no (x, dy) rule
    assert WeightGradCapture(chunk).unsupported == ["Conv1d"]
    norm = RMSNorm(8, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, dy = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    norm(x).backward(dy)
    torch.testing.assert_close(weight_grad(norm, x, dy), norm.weight.grad)  # the model's norm: nn.RMSNorm's rule


def test_a_model_built_for_its_shapes_runs_no_initialiser_and_keeps_every_tensor():
    """The plan's view of the model (stage.py `model_shapes`) and a pretrained model's frame are built
    on the meta device, where torch.nn's initialisers fill nothing: their Python is about half of
    building a tiny model there, once a run on every rank. Skipped, the chunk holds the same
    tensors (names, shapes, the tied weight once); a tensor given a real device inside is still
    initialised."""
    import sys

    from pipezero.models import StageChunk
    from pipezero.models.meta import shapes_only

    cfg = tiny(tie_embeddings=True)

    def build(context) -> tuple[StageChunk, int]:
        fans = 0

        def count(frame, event, arg):
            nonlocal fans
            if event == "call" and frame.f_code.co_name == "_calculate_correct_fan":  # kaiming's first step
                fans += 1
        sys.setprofile(count)
        try:
            with context():
                chunk = StageChunk(cfg, 0, cfg.n_layers + 2, seed=0, init=False)
        finally:
            sys.setprofile(None)
        return chunk, fans

    plain, plain_fans = build(lambda: torch.device("meta"))
    quick, quick_fans = build(shapes_only)
    assert plain_fans > 0 and quick_fans == 0
    assert [(n, q.shape, q.is_meta) for n, q in quick.named_parameters()] == \
        [(n, q.shape, True) for n, q in plain.named_parameters()]
    assert len(list(quick.parameters())) == len(list(plain.parameters()))  # tied: one tensor for both names
    with shapes_only():
        real = nn.Linear(4, 4, device="cpu")
    assert real.weight.abs().sum() > 0
    with shapes_only():
        assert torch.empty(2).is_meta  # the meta device's context is still on
