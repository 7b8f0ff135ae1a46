"""Checkpoints: layout-free pieces, complete-or-absent folders, resume, resharding, export, and
skipping non-finite steps."""

from __future__ import annotations

import json
import numpy as np
import shutil
from pathlib import Path

import pytest
import torch

from one_line import run_main
from pipezero.checkpoint.pieces import Owned, Piece, owned_ranges
from pipezero.checkpoint.store import Team, committed, latest, problems, write
from pipezero.config import ScheduleKind as K
from pipezero.settings import build_config
from ranks import run_ranks
from tiny_runs import TRAIN_TINY
from user_files import read_only, writable
from training import tiny_overrides


def test_owned_ranges_cut_parameters_at_shard_edges_and_skip_padding():
    # a bucket [a: 5 elements][b: 4 elements] padded to 12 for D = 3: shards of 4
    names, offsets, numels = ["a", "b"], [0, 5], [5, 4]
    assert owned_ranges(names, offsets, numels, slice(0, 4)) == [Owned("a", 5, 0, 4, 0)]
    assert owned_ranges(names, offsets, numels, slice(4, 8)) == [Owned("a", 5, 4, 5, 0), Owned("b", 4, 0, 3, 1)]
    assert owned_ranges(names, offsets, numels, slice(8, 12)) == [Owned("b", 4, 3, 4, 0)]  # 9..12 is padding


def test_piece_refuses_ranges_outside_its_tensor_and_any_arithmetic():
    with pytest.raises(ValueError, match="does not fit"):
        Piece(4, 3, torch.zeros(2))
    with pytest.raises(NotImplementedError, match="only feeds torch.distributed.checkpoint"):
        Piece(4, 0, torch.zeros(2)) + 1


def _save(root: Path, step: int, value: float, keep: int = 5) -> Path:
    return write(root, step, {"w": torch.full((1000,), value)}, {"note": "test"}, keep, Team(step=step))


def test_checkpoints_commit_atomically_keep_newest_and_skip_corrupt(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    (root / ".tmp-step-00000009").mkdir(parents=True)  # debris of a crash mid-write: never a candidate
    (root / "step-00000008").mkdir()  # no manifest: never committed
    for step in (1, 2, 3, 4):
        _save(root, step, float(step), keep=3)
    assert [s for s, _ in committed(root)] == [2, 3, 4]  # step 1 pruned
    manifest = json.loads((root / "step-00000004" / "manifest.json").read_text())
    assert manifest["step"] == 4 and manifest["note"] == "test" and len(manifest["files"]) >= 2
    assert all(len(f["sha256"]) == 64 for f in manifest["files"].values())
    assert latest(root, Team()).path.name == "step-00000004"

    # truncate the newest checkpoint's data file; flip a byte of the next one (same size)
    data4 = next((root / "step-00000004").glob("*.distcp"))
    data4.write_bytes(data4.read_bytes()[:-10])
    data3 = next((root / "step-00000003").glob("*.distcp"))
    raw = bytearray(data3.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data3.write_bytes(bytes(raw))
    found = latest(root, Team())
    assert found is not None and found.path.name == "step-00000002"
    assert [p.name for p, _ in found.skipped] == ["step-00000004", "step-00000003"]
    assert "wrong size" in found.skipped[0][1] and "checksum mismatch" in found.skipped[1][1]
    err = capsys.readouterr().err
    assert "skipping corrupt checkpoint" in err and "step-00000004" in err and "step-00000003" in err
    assert problems(root / "step-00000002", Team()) is None

    # writing step 4 again replaces the corrupt copy
    _save(root, 4, 4.0)
    assert latest(root, Team()).path.name == "step-00000004"



def test_a_disk_that_fills_during_a_save_is_named_with_advice_that_works(tmp_path, monkeypatch):
    """DCP reports a full disk in torch's words ("unexpected pos 704 vs 598"): the line names the
    full disk first, and says --resume only where the run has an earlier checkpoint to resume (the
    only save, the final one, failing: --resume is refused there, so the advice is to train again)."""
    import torch.distributed.checkpoint as dcp

    from pipezero.checkpoint import store
    from pipezero.checkpoint.store import CheckpointError

    root = tmp_path / "checkpoints"
    write(root, 2, {"w": torch.zeros(8)}, {"run": "r"}, 3, Team(step=2))

    def full(*args, **kwargs):
        raise RuntimeError("unexpected pos 704 vs 598")

    monkeypatch.setattr(dcp, "save", full)
    monkeypatch.setattr(store, "free_bytes", lambda folder: 300 * 1024)
    for run, advice in (("r", "then --resume continues from step-00000002"),
                        ("other", "this run has no earlier checkpoint to --resume from: free space, then train it "
                                  "again")):
        with pytest.raises(CheckpointError) as failed:
            write(root, 3, {"w": torch.zeros(8)}, {"run": run}, 3, Team(step=3))
        line = str(failed.value)
        assert f"the disk under {root} is full (0.3 MiB free" in line and advice in line, line
        assert line.index("is full") < line.index("unexpected pos"), line  # torch's words after the cause
        assert "then --resume" not in line or run == "r", line
        assert not (root / ".tmp-step-00000003").exists()


def test_a_full_disk_under_the_runs_records_advises_resume_only_where_it_works(tmp_path):
    """metrics.jsonl (or summary, tensorboard) refused by a full disk: "--resume" is the advice only
    when the run has a checkpoint of its own; a run without one is refused by --resume (its records
    would be replaced by a start from step 0)."""
    import errno

    from pipezero.cli.train import failure_line

    out = tmp_path / "run"
    out.mkdir()
    (out / ".run-id").write_text("r\n")
    cfg = build_config(overrides={"run.out": str(out)})
    full = OSError(errno.ENOSPC, "No space left on device", str(out / "metrics.jsonl"))
    code, line = failure_line(cfg, full)
    assert code == 1 and "free space there" in line and "then --resume" not in line and "train it again" in line
    write(out / "checkpoints", 4, {"w": torch.zeros(8)}, {"run": "r"}, 3, Team(step=4))
    assert "then --resume continues from step-00000004" in failure_line(cfg, full)[1]

def test_pruning_keeps_the_checkpoint_just_written_when_newer_ones_are_corrupt(tmp_path, capsys):
    """A resume past a corrupt newest checkpoint writes older steps again; pruning must not count the
    corrupt newer one among the newest N and delete the good one it just wrote."""
    root = tmp_path / "checkpoints"
    for step in (4, 6):
        _save(root, step, float(step), keep=2)
    data6 = next((root / "step-00000006").glob("*.distcp"))
    data6.write_bytes(data6.read_bytes()[:-10])
    assert latest(root, Team()).path.name == "step-00000004"
    _save(root, 5, 5.0, keep=1)  # resumed from 4 with --keep-checkpoints 1: step 5's save
    found = latest(root, Team())
    assert found is not None and found.path.name == "step-00000005"
    capsys.readouterr()


def disagreeing_ranks(rank: int, world: int, root: str) -> list[str]:
    """Checkpoints 2 and 4, then ranks that see them differently (a folder that is not shared): the
    last rank misses a file of step 4, then step 4's manifest, then all of step 2 too."""
    from unittest import mock

    from pipezero.checkpoint.store import CheckpointError

    root_ = Path(root)
    for step in (2, 4):
        write(root_, step, {f"w{rank}": torch.full((100,), float(step))}, {}, 5, Team.current(step))
    hidden: set[str] = set()
    real_is_file = Path.is_file
    said = []
    for hide in (["step-00000004/.metadata"], ["step-00000004/manifest.json"],
                 ["step-00000004/manifest.json", "step-00000002/manifest.json"]):
        hidden.clear()
        if rank == world - 1:
            hidden.update(str(root_ / h) for h in hide)
        with mock.patch.object(Path, "is_file", lambda self: str(self) not in hidden and real_is_file(self)), \
                mock.patch.object(Path, "read_text", lambda self, *a, _real=Path.read_text, **k:
                                  _real(Path("/nonexistent")) if str(self) in hidden else _real(self, *a, **k)):
            try:
                found = latest(root_, Team.current(0))
                said.append(f"found {found.path.name if found else None}")
            except CheckpointError as e:
                said.append(f"error {e}")
    return said


@pytest.mark.distributed
@pytest.mark.slow
def test_ranks_that_see_different_checkpoints_stop_with_one_error_instead_of_hanging(tmp_path):
    said = run_ranks(disagreeing_ranks, 2, str(tmp_path / "checkpoints"), timeout=90)
    for case in zip(*said):
        assert all(s.startswith("error") for s in case), case
        assert all("filesystem all nodes share" in s and "rank 1 sees" in s for s in case), case


# --- distributed: one process group, every scenario --------------------------------------------------

STEPS = 6
LAYOUT_A = {"pp": 2, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 4, "parallel.zero": 1}  # global batch 16


def run(data: str, out: str, **case) -> dict:
    """Train `case`, held to its program on every step (tests/training.py `record_departure`): a
    resumed run's first step, a skipped non-finite step (its gathers of updated weights not played)
    and the checkpoints' waits outside the programs included."""
    from pipezero.engine import train
    from training import record_departure, watch_program

    case = {"run.max_steps": STEPS, **case}
    seen = watch_program()
    seen.clear()
    res = train(build_config(None, tiny_overrides(data, out, **case)), snapshot=True)
    if problem := record_departure(seen):
        raise AssertionError(f"{out}: {problem}")
    if res.skipped_steps and not any(not applied for *_, applied in seen["records"]):
        raise AssertionError(f"{out}: a step was skipped, yet every record says its step was applied")
    return {"losses": res.losses, "params": res.params, "resumed_from": res.resumed_from,
            "skipped": res.skipped_steps}


def copy_checkpoints(src: str, dst: str, steps: list[int]) -> None:
    """Rank 0 seeds a new run directory with some of another run's checkpoints."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        for s in steps:
            name = f"checkpoints/step-{s:08d}"
            shutil.copytree(Path(src) / name, Path(dst) / name)
    dist.barrier()


def poison(steps: set[int]) -> None:
    """Make the loss of the given steps NaN, on the last pipeline stage (where the loss is made)."""
    from pipezero.models.llama_spec import LlamaSpec
    from pipezero.zero.sharded import ZeroDP

    if not hasattr(ZeroDP, "_clean_begin"):  # the executor asks the model's spec for the loss
        ZeroDP._clean_begin, LlamaSpec._clean_loss = ZeroDP.begin_step, LlamaSpec.loss
    current = {"step": 0}

    def begin_step(self):
        ZeroDP._clean_begin(self)
        current["step"] = self.step_no

    def loss(self, *args):
        value = LlamaSpec._clean_loss(self, *args)
        return value * float("nan") if current["step"] in steps else value

    ZeroDP.begin_step, LlamaSpec.loss = begin_step, loss


def scenarios(rank: int, world: int, data: str, out: str) -> dict:
    from pipezero.nonfinite import TrainingDiverged

    res = {}
    res["a"] = run(data, f"{out}/a", **LAYOUT_A, **{"run.checkpoint_every": 2})
    # same layout, resumed from step 4
    copy_checkpoints(f"{out}/a", f"{out}/b", [4])
    res["b"] = run(data, f"{out}/b", **LAYOUT_A, **{"run.resume": True})
    # reshard: (P=2, D=2, ZeRO-1) step 2 -> (P=4, D=1, ZeRO-0, AdamW offloaded to the host) steps 3-4
    # -> (P=1, D=4, ZeRO-3, on the device again) steps 5-6
    copy_checkpoints(f"{out}/a", f"{out}/c", [2])
    res["c"] = run(data, f"{out}/c", pp=4, dp=1, kind=K.INTERLEAVED_1F1B, m=8,
                   **{"parallel.virtual_stages": 2, "parallel.zero": 0, "run.resume": True, "run.checkpoint_every": 2,
                      "parallel.offload": "optimizer"})
    copy_checkpoints(f"{out}/c", f"{out}/d", [4])
    res["d"] = run(data, f"{out}/d", pp=1, dp=4, kind=K.ONE_F_ONE_B, m=2,
                   **{"parallel.zero": 3, "run.resume": True})
    # a truncated newest checkpoint: fall back to the one before
    copy_checkpoints(f"{out}/a", f"{out}/e", [4, 6])
    if rank == 0:
        victim = sorted((Path(out) / "e/checkpoints/step-00000006").glob("*.distcp"))[-1]
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    res["e"] = run(data, f"{out}/e", **LAYOUT_A, **{"run.resume": True})
    # a NaN loss at step 3 is skipped (offloaded: no host step is played); NaN from step 3 on stops the
    # run after max_bad_steps in a row
    poison({3})
    res["f"] = run(data, f"{out}/f", **LAYOUT_A, **{"run.checkpoint_every": 1, "run.max_steps": 4,
                                                     "parallel.offload": "optimizer"})
    poison({3, 4, 5})
    try:
        run(data, f"{out}/g", **LAYOUT_A, **{"run.max_bad_steps": 2})
        res["g"] = "finished?"
    except TrainingDiverged as e:
        res["g"] = str(e)
    return res


@pytest.mark.distributed
@pytest.mark.slow(29)
def test_resume_reshard_corruption_and_nonfinite_steps(text_dir, tmp_path):
    from pipezero.checkpoint.export import read_model

    ranks = run_ranks(scenarios, 4, str(text_dir), str(tmp_path), timeout=600)
    a, b, c, d, e, f = (ranks[0][k] for k in "abcdef")
    # same layout: exactly the uninterrupted run, losses and parameters
    assert b["resumed_from"] == 4 and b["losses"] == a["losses"][4:]
    for r in ranks:
        assert all(torch.equal(r["b"]["params"][n], r["a"]["params"][n]) for n in r["a"]["params"])
    # other layouts: the same run to float tolerance
    assert c["resumed_from"] == 2 and c["losses"][:2] == pytest.approx(a["losses"][2:4], rel=1e-5)
    assert d["resumed_from"] == 4 and d["losses"] == pytest.approx(a["losses"][4:], rel=1e-5)
    final = {n: t for r in ranks for n, t in r["d"]["params"].items()}
    for n, t in ranks[0]["a"]["params"].items() | ranks[2]["a"]["params"].items():
        assert float((final[n] - t).norm() / t.norm()) <= 1e-5, n
    # the truncated step-6 checkpoint was skipped: resumed at 4, same losses as never failing
    assert e["resumed_from"] == 4 and e["losses"] == a["losses"][4:]
    # NaN at step 3: reported as skipped, parameters untouched by it, the run goes on
    assert f["skipped"] == [3] and f["losses"][:2] == a["losses"][:2]
    assert all(torch.isfinite(torch.tensor(f["losses"][3:])))
    metrics = [json.loads(x) for x in (tmp_path / "f" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[2]["skipped"] is True and metrics[2]["loss"] is None
    ckpt = tmp_path / "f" / "checkpoints"
    manifests = {s: json.loads((ckpt / f"step-{s:08d}" / "manifest.json").read_text()) for s in (2, 3, 4)}
    assert [manifests[s]["adam_steps"] for s in (2, 3, 4)] == [2, 2, 3]
    before, after = read_model(ckpt / "step-00000002"), read_model(ckpt / "step-00000003")
    assert all(torch.equal(x, y) for x, y in zip(before.parameters(), after.parameters()))
    assert "step 4: non-finite loss on stage [1]" in ranks[0]["g"] and "2 in a row" in ranks[0]["g"]
    assert all(r["g"] == ranks[0]["g"] for r in ranks)  # every rank stopped, none left hanging


def test_export_writes_safetensors_that_reproduce_the_run(text_dir, tmp_path):
    """One process: train, export, reload, and evaluate the held-out loss the run reported."""
    from pipezero.checkpoint.export import load_exported
    from pipezero.cli import main
    from pipezero.data import load_corpus
    from pipezero.data.packing import IGNORE
    from pipezero.engine import train
    from pipezero.models import lm_loss

    cfg = build_config(None, tiny_overrides(str(text_dir), str(tmp_path / "run"), 1, 1, K.ONE_F_ONE_B, 2,
                                            **{"run.max_steps": 3, "run.checkpoint_every": 3,
                                               "model.tie_embeddings": True}))
    res = train(cfg)
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "export")]) == 0
    model = load_exported(tmp_path / "export")
    # the run's held-out windows: eval_batches global batches of them, one batch here
    (held,) = load_corpus(cfg.data).eval_batches(1, cfg.run.eval_batches * cfg.global_batch, cfg.data.seq_len)
    tokens = int((held[1] != IGNORE).sum())
    with torch.no_grad():  # (tokens, targets[, document ids]): the run's packed held-out rows
        loss = float(lm_loss(model(held[0], *held[2:]), held[1], tokens))
    assert loss == pytest.approx(res.heldout[3], rel=1e-6)
    assert main(["export", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2



def test_resume_warns_when_the_run_would_differ(capsys):
    from pipezero.checkpoint.state import warn_changed

    saved = build_config(None, {}).to_dict()
    warn_changed(saved, build_config(None, {"parallel.pp": 2, "parallel.zero": 3}).to_dict(), Path("ck"))
    assert capsys.readouterr().err == ""  # another layout trains the same run
    warn_changed(saved, build_config(None, {"optim.lr": 1e-2, "parallel.dp": 2}).to_dict(), Path("ck"))
    err = capsys.readouterr().err
    assert "optim.lr: 0.003 -> 0.01" in err and "global batch" in err


TIED = [  # tied embeddings whose two ends sit on different pipeline ranks, each holding its own copy
    {"pp": 2, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 4, "parallel.zero": 1, "model.tie_embeddings": True},
    {"pp": 2, "dp": 2, "kind": K.ZB_H1, "m": 4, "parallel.zero": 3, "model.tie_embeddings": True},
]


def tied_scenarios(rank: int, world: int, data: str, out: str) -> list[dict]:
    res = []
    for i, case in enumerate(TIED):
        whole = run(data, f"{out}/a{i}", **case, **{"run.max_steps": 4, "run.checkpoint_every": 2})
        copy_checkpoints(f"{out}/a{i}", f"{out}/b{i}", [2])
        again = run(data, f"{out}/b{i}", **case, **{"run.max_steps": 4, "run.resume": True})
        # the same checkpoint on one pipeline stage, where one tensor is both ends
        copy_checkpoints(f"{out}/a{i}", f"{out}/c{i}", [2])
        flat = run(data, f"{out}/c{i}", pp=1, dp=4, kind=K.ONE_F_ONE_B, m=2,
                   **{"parallel.zero": 2, "model.tie_embeddings": True, "run.max_steps": 4, "run.resume": True,
                      "run.checkpoint_every": 2})
        res.append({"whole": whole, "again": again, "flat": flat})
    return res


@pytest.mark.distributed
@pytest.mark.slow(30)
def test_tied_embeddings_across_pipeline_ranks_checkpoint_and_resume(text_dir, tmp_path):
    """Each end of a tied embedding is saved under its own name by the rank that holds it: no
    overlapping ranges of one name (which DCP refuses to save), the same run on resume."""
    from pipezero.checkpoint.export import read_model
    from pipezero.checkpoint.safe_reader import SafeReader

    ranks = run_ranks(tied_scenarios, 4, str(text_dir), str(tmp_path), timeout=600)
    for i, case in enumerate(TIED):
        for r in ranks:
            whole, again = r[i]["whole"], r[i]["again"]
            assert again["resumed_from"] == 2 and again["losses"] == whole["losses"][2:], case
            assert all(torch.equal(again["params"][n], t) for n, t in whole["params"].items()), case
        flat = ranks[0][i]["flat"]
        assert flat["resumed_from"] == 2 and flat["losses"] == pytest.approx(ranks[0][i]["whole"]["losses"][2:],
                                                                             rel=1e-5), case
        # one stage saves its one tensor under both names, so a pipeline can read the head's
        meta = SafeReader(tmp_path / f"c{i}" / "checkpoints" / "step-00000004").read_metadata()
        assert meta.state_dict_metadata["model.layers.7.proj.weight"].size == torch.Size([256 * 64])
        model = read_model(tmp_path / f"a{i}" / "checkpoints" / "step-00000004")
        last = {n: t for r in ranks for n, t in r[i]["whole"]["params"].items()}
        assert all(torch.equal(q.detach(), last[n]) for n, q in model.named_parameters()), case


def test_the_last_step_is_saved_unless_told_not_to():
    """A run keeps what it trained: the last step is saved without --checkpoint-every, and
    --no-save-final turns that off: with --checkpoint-every only its own multiples are saved (the last
    step too when it is one), so a user who asked for no final save gets none."""
    from pipezero.checkpoint import saves_after
    from pipezero.settings import build_config

    def saved(**run) -> list[int]:
        cfg = build_config(overrides={"run.max_steps": 10, **{f"run.{k}": v for k, v in run.items()}})
        return [s for s in range(1, 11) if saves_after(cfg, s)]

    assert saved() == [10]
    assert saved(save_final=False) == []
    assert saved(checkpoint_every=4) == [4, 8, 10]
    assert saved(checkpoint_every=4, save_final=False) == [4, 8]
    assert saved(checkpoint_every=5) == [5, 10]
    assert saved(checkpoint_every=5, save_final=False) == [5, 10]


def test_a_checkpoint_of_non_finite_weights_is_refused_before_anything_is_written(tmp_path):
    """--lr 1e308 leaves every weight NaN after one update: such a state is no checkpoint to save."""
    import torch

    from pipezero.checkpoint.pieces import Piece
    from pipezero.checkpoint.state import check_finite, nonfinite_entries
    from pipezero.checkpoint.store import CheckpointError, Team

    shard = torch.zeros(8)
    state = {"model.a": Piece(16, 0, shard[:4]), "model.b": Piece(16, 4, shard[4:]), "step": torch.zeros(2, dtype=torch.long)}
    check_finite(state, Team(step=3), 1e-3)  # finite: nothing said
    shard[5] = float("nan")
    state["optim.exp_avg_sq.c"] = torch.tensor([float("inf")])
    assert nonfinite_entries(state) == ["model.b", "optim.exp_avg_sq.c"]
    with pytest.raises(CheckpointError, match=r"^step 3: checkpoint not saved: model.b, optim.exp_avg_sq.c hold NaN "
                                              r"or inf .*lower --lr \(now 1e\+308\)"):
        check_finite(state, Team(step=3), 1e308)


@pytest.mark.distributed  # trains twice in this process (~5 s)
def test_a_diverged_run_saves_no_checkpoint_and_keeps_the_earlier_ones(tmp_path, capsys):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 4000, 4000).astype(np.uint16))
    run = tmp_path / "run"
    base = [*TRAIN_TINY, "--data", str(tokens), "--out", str(run), "--checkpoint-every", "1", "--sample-tokens", "0",
            "--microbatches", "1", "--micro-batch-size", "1"]
    assert run_main(base, capsys)[0] == 0
    good = run / "checkpoints" / "step-00000001"
    kept = sorted((p.name, p.read_bytes()) for p in good.iterdir())
    code, err = run_main([*base, "--resume", "--max-steps", "3", "--lr", "1e308"], capsys)
    assert code == 1 and err.count("pipezero: error:") == 1, err
    assert "step 2: checkpoint not saved:" in err and "hold NaN or inf" in err, err
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000001"]
    assert sorted((p.name, p.read_bytes()) for p in good.iterdir()) == kept


@pytest.mark.parametrize("edit, needle", [
    ({"data": {"samples": "x"}}, "data.samples 'x' is not a count"),  # the resume would fail on it
    ({"data": {"samples": -3}}, "data.samples -3 is not a count"),
    ({"data": [1]}, "data is not a dict"),
    ({"adam_steps": -5}, "adam_steps -5 is not a count"),  # NaN weights after the resumed step
    ({"bad_in_a_row": -1}, "bad_in_a_row -1 is not a count"),
    ({"world": True}, "world True is not a count"),
])
def test_a_manifest_edited_by_hand_is_a_bad_checkpoint(edit, needle, tmp_path):
    from pipezero.checkpoint.store import FORMAT, MANIFEST, CheckpointError, read_manifest

    import json

    step = tmp_path / "step-00000001"
    step.mkdir()
    manifest = {"format": FORMAT, "step": 1, "files": {"a": {"bytes": 1, "sha256": "0" * 64}}, "config": {},
                "world": 1, "adam_steps": 1, "bad_in_a_row": 0, "data": {"samples": 1}}
    (step / MANIFEST).write_text(json.dumps(manifest))
    read_manifest(step)  # as saved: fine
    (step / MANIFEST).write_text(json.dumps({**manifest, **edit}))
    with pytest.raises(CheckpointError, match="bad manifest.json: " + needle):
        read_manifest(step)


def test_pruning_keeps_a_checkpoint_folder_that_holds_a_users_file(tmp_path):
    """--keep-checkpoints removes old `step-N` folders whole: one holding a file its manifest does
    not list (a user's notes.txt), or a link to elsewhere, is kept instead."""
    import json

    from pipezero.checkpoint.store import FORMAT, MANIFEST, prunable

    def checkpoint(step: int) -> Path:
        folder = tmp_path / f"step-{step:08d}"
        folder.mkdir()
        (folder / "a").write_text("x")
        (folder / MANIFEST).write_text(json.dumps({"format": FORMAT, "step": step, "run": "r",
                                                   "files": {"a": {"bytes": 1, "sha256": "0" * 64}}}))
        return folder

    first, second, third = checkpoint(1), checkpoint(2), checkpoint(3)
    assert prunable(tmp_path, "r", 3) == [first, second, third]
    (first / "notes.txt").write_text("mine")
    third.rename(tmp_path / "real-3")
    third.symlink_to(tmp_path / "real-3")
    assert prunable(tmp_path, "r", 3) == [second]


@pytest.mark.parametrize("scratch", [".tmp-step-00000002", ".deleting-step-00000001"])
def test_a_link_at_a_checkpoint_scratch_name_is_cleared_not_followed(scratch, tmp_path):
    """A link at checkpoints/.tmp-step-N (a save's scratch) or .deleting-step-N (a prune's) is
    unlinked, not removed as a folder (rmtree refuses a link, and would follow none): the link goes,
    what it points to stays."""
    import torch

    from pipezero.checkpoint.store import Team, committed, write

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    root = tmp_path / "checkpoints"
    write(root, 1, {"x": torch.zeros(4)}, {"run": "this"}, keep=5, team=Team())
    (root / scratch).symlink_to(mine)
    write(root, 2, {"x": torch.ones(4)}, {"run": "this"}, keep=1, team=Team())  # saves 2, prunes 1
    assert [p.name for _, p in committed(root)] == ["step-00000002"]
    assert (mine / "notes.txt").read_text() == "mine"
    assert not (root / scratch).is_symlink()


def test_a_checkpoints_folder_that_refuses_the_save_is_one_line_and_keeps_the_last(tmp_path):
    """An immutable (or read-only) OUT/checkpoints refuses the save's mkdir: a CheckpointError naming
    the folder and the fix, every rank alike, not torch's PermissionError; the checkpoint already
    there is untouched."""
    import torch

    from pipezero.checkpoint.store import CheckpointError, Team, committed, write

    root = tmp_path / "checkpoints"
    write(root, 1, {"x": torch.zeros(4)}, {"run": "this"}, keep=5, team=Team())
    before = {p.name: p.read_bytes() for p in (root / "step-00000001").iterdir()}
    read_only(root)
    try:
        with pytest.raises(CheckpointError, match=r"step 2: checkpoint .*\.tmp-step-00000002 cannot be made: .*"
                                                  r"writable.*--resume"):
            write(root, 2, {"x": torch.ones(4)}, {"run": "this"}, keep=5, team=Team())
    finally:
        writable(root)
    assert [p.name for _, p in committed(root)] == ["step-00000001"]
    assert {p.name: p.read_bytes() for p in (root / "step-00000001").iterdir()} == before


def test_an_old_checkpoint_that_cannot_be_pruned_is_kept_with_a_warning(tmp_path, capsys):
    """--keep-checkpoints 1 with an immutable old step: the prune's rename fails after the new
    checkpoint is committed, which is no reason to end the run. The old one stays, said in a warning."""
    import torch

    from pipezero.checkpoint.store import Team, committed, write

    root = tmp_path / "checkpoints"
    write(root, 1, {"x": torch.zeros(4)}, {"run": "this"}, keep=5, team=Team())
    read_only(root / "step-00000001")
    try:
        write(root, 2, {"x": torch.ones(4)}, {"run": "this"}, keep=1, team=Team())
    finally:
        writable(root / "step-00000001")
    assert [p.name for _, p in committed(root)] == ["step-00000001", "step-00000002"]
    err = capsys.readouterr().err
    assert "step-00000001 was kept, past --keep-checkpoints 1" in err, err


@pytest.mark.parametrize("scratch", [".tmp-step-00000002", ".deleting-step-00000001"])
def test_a_users_folder_at_a_scratch_name_is_kept(scratch, tmp_path):
    """A folder of the user's at checkpoints/.tmp-step-N (a save's scratch) or .deleting-step-N
    (a prune's) is no crash's debris to clear: it stays, and the save stops with a CheckpointError
    naming it (the prune warns and keeps the step)."""
    import torch

    from pipezero.checkpoint.store import CheckpointError, Team, committed, users_scratch, write

    root = tmp_path / "checkpoints"
    write(root, 1, {"x": torch.zeros(4)}, {"run": "this"}, keep=5, team=Team())
    (root / scratch).mkdir()
    (root / scratch / "notes.txt").write_text("mine")
    assert users_scratch(root) == [root / scratch]
    if scratch.startswith(".tmp"):
        with pytest.raises(CheckpointError, match=f"{scratch} holds notes.txt, which no checkpoint save writes"):
            write(root, 2, {"x": torch.ones(4)}, {"run": "this"}, keep=1, team=Team())
        assert [p.name for _, p in committed(root)] == ["step-00000001"]
    else:
        write(root, 2, {"x": torch.ones(4)}, {"run": "this"}, keep=1, team=Team())  # saves 2, keeps 1
        assert [p.name for _, p in committed(root)] == ["step-00000001", "step-00000002"]
    assert (root / scratch / "notes.txt").read_text() == "mine"


def test_a_crashs_debris_at_a_scratch_name_is_still_cleared(tmp_path):
    import torch

    from pipezero.checkpoint.store import Team, committed, users_scratch, write

    root = tmp_path / "checkpoints"
    write(root, 1, {"x": torch.zeros(4)}, {"run": "this"}, keep=5, team=Team())
    shutil.copytree(root / "step-00000001", root / ".tmp-step-00000002")  # a save killed before its rename
    (root / ".tmp-step-00000002" / ".manifest.json.a1b2.tmp").write_text("{")
    assert users_scratch(root) == []
    write(root, 2, {"x": torch.ones(4)}, {"run": "this"}, keep=5, team=Team())
    assert [p.name for _, p in committed(root)] == ["step-00000001", "step-00000002"]
    assert not (root / ".tmp-step-00000002").exists()


def test_a_checkpoint_write_that_fails_on_a_full_disk_says_how_much_room_is_left(tmp_path, monkeypatch):
    """DCP's write to a full disk fails in torch's words ('unexpected pos 704 vs 598'): the one line
    adds the free space of the checkpoints folder when it is short, so the fix is named."""
    import torch

    import pipezero.checkpoint.store as store

    class Full:
        f_bavail, f_frsize = 25, 4096  # 100 KiB

    monkeypatch.setattr(store.os, "statvfs", lambda path: Full())

    def torn(*a, **kw):  # noqa: ANN002, ANN003
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr("torch.distributed.checkpoint.save", torn)
    root = tmp_path / "checkpoints"
    with pytest.raises(store.CheckpointError, match=r"the disk under .*checkpoints is full \(0\.1 MiB free\) \(.*unexpected "
                                                    r"pos .*\); this run has no earlier checkpoint to --resume from"):
        store.write(root, 1, {"x": torch.zeros(4)}, {"run": "this"}, keep=5, team=store.Team())
    assert list(root.iterdir()) == []  # the failed save left nothing


def test_ctrl_c_inside_a_checkpoint_write_stays_an_interrupt():
    """Ctrl-C while DCP writes a checkpoint reaches us wrapped in a CheckpointException: it stays the
    interrupt (its line, '--resume continues ...', and 130), not 'checkpoint write of ... failed'."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from pipezero.checkpoint.store import CheckpointError, Team

    def interrupted():
        raise CheckpointException("save", {0: (KeyboardInterrupt(), traceback.StackSummary())})

    def refused():
        raise CheckpointException("save", {0: (OSError(28, "No space left on device"), traceback.StackSummary())})

    with pytest.raises(KeyboardInterrupt):
        Team().run("write of x", interrupted)
    with pytest.raises(CheckpointError, match="rank 0, step 0: checkpoint write of x failed: rank 0: OSError"):
        Team().run("write of x", refused)
