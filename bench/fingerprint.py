"""A fingerprint of training on twelve layouts: losses, gradient norms and every rank's parameters,
hashed, so a refactor can show it changed nothing (bit for bit) and a numerical change shows where.

    python bench/fingerprint.py [--json bench/results/fingerprint/fingerprint.json]

Four gloo ranks train the tiny model three steps on each layout (the settings of tests/training.py's
tiny model, written out here so the bench needs nothing of tests/: the standard library corpus,
fp32, lr 1e-3); each layout's line is a sha256 over its losses, norms and
parameters in rank order. Run it on two commits and compare the lines.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # rank_spawner.py

from pipezero.config import ScheduleKind as K  # noqa: E402

LAYOUTS = [
    {"pp": 2, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 4, "parallel.zero": z} for z in (0, 1, 2, 3)
] + [
    {"pp": 2, "dp": 2, "kind": K.ZB_V, "m": 4, "parallel.zero": 1},
    {"pp": 2, "dp": 2, "kind": K.INTERLEAVED_1F1B, "m": 4, "parallel.zero": 3},
    {"pp": 1, "dp": 4, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": 2},
    {"pp": 1, "dp": 4, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": 3},
] + [{"pp": 4, "dp": 1, "kind": k, "m": 8} for k in (K.ONE_F_ONE_B, K.ZB_H1, K.DUALPIPE_V, K.GPIPE)]


def tiny_settings(data: str, out: str, pp: int, dp: int, kind: K, m: int, **extra: object) -> dict:
    """One layout's settings: the tests' tiny model and run (tests/training.py tiny_overrides), so a
    fingerprint is comparable with one taken when this bench read them from there."""
    from pipezero.schedules.registry import default_virtual

    return {
        "model.preset": "tiny", "model.n_layers": 6, "model.dim": 64, "model.n_heads": 4, "model.vocab_size": 256,
        "data.path": data, "data.tokenizer": "bytes", "data.seq_len": 32,
        "parallel.pp": pp, "parallel.dp": dp, "parallel.schedule": kind.value, "parallel.microbatches": m,
        "parallel.micro_batch_size": 2, "parallel.virtual_stages": default_virtual(kind) if pp > 1 else 1,
        "parallel.timeout_s": 60.0, "parallel.bucket_mb": 0.05,
        "run.max_steps": 3, "run.out": out, "run.progress": False, "run.sample_tokens": 0, "run.eval_every": 0,
        "run.save_final": False, "run.eval_batches": 1, "optim.warmup_steps": 2, "optim.lr": 1e-3, **extra,
    }


def fingerprint(rank: int, world: int, data: str, out: str) -> list[str]:
    import torch

    from pipezero.engine import train
    from pipezero.settings import build_config

    digests = []
    for i, case in enumerate(LAYOUTS):
        res = train(build_config(None, tiny_settings(data, f"{out}/case{i}", **case)), snapshot=True)
        h = hashlib.sha256(json.dumps([res.losses, res.grad_norms]).encode())
        for name in sorted(res.params):
            h.update(name.encode())
            h.update(res.params[name].to(torch.float32).contiguous().numpy().tobytes())
        digests.append(h.hexdigest())
    return digests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    from pipezero.data import stdlib_files
    from rank_spawner import run_ranks  # before 2026-12-06 (703e589 and older): pipezero.parallel.spawn

    with tempfile.TemporaryDirectory() as tmp:
        corpus, total = Path(tmp) / "corpus", 0
        corpus.mkdir()
        for i, f in enumerate(stdlib_files()):  # the tests' corpus (tests/conftest.py text_dir)
            text = f.read_text(encoding="utf-8", errors="replace")
            (corpus / f"{i:04d}.py").write_text(text)
            total += len(text)
            if total > 400_000:
                break
        per_rank = run_ranks(fingerprint, 4, str(corpus), str(Path(tmp) / "runs"), timeout=900)
    rows = []
    for i, case in enumerate(LAYOUTS):
        h = hashlib.sha256("".join(r[i] for r in per_rank).encode()).hexdigest()[:16]
        name = f"pp{case['pp']} dp{case['dp']} {case['kind'].value} M={case['m']} zero={case.get('parallel.zero', 0)}"
        rows.append({"layout": name, "sha256": h})
        print(f"{h}  {name}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
