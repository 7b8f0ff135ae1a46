"""A fingerprint of training on twelve layouts: losses, gradient norms and every rank's parameters,
hashed, so a refactor can show it changed nothing (bit for bit) and a numerical change shows where.

    python bench/fingerprint.py [--json bench/results/fingerprint.json]

Four gloo ranks train the tiny model three steps on each layout (tests/training.py's settings: the
standard library corpus, fp32, lr 1e-3); each layout's line is a sha256 over its losses, norms and
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
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from pipezero.config import ScheduleKind as K  # noqa: E402

LAYOUTS = [
    {"pp": 2, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 4, "parallel.zero": z} for z in (0, 1, 2, 3)
] + [
    {"pp": 2, "dp": 2, "kind": K.ZB_V, "m": 4, "parallel.zero": 1},
    {"pp": 2, "dp": 2, "kind": K.INTERLEAVED_1F1B, "m": 4, "parallel.zero": 3},
    {"pp": 1, "dp": 4, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": 2},
    {"pp": 1, "dp": 4, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": 3},
] + [{"pp": 4, "dp": 1, "kind": k, "m": 8} for k in (K.ONE_F_ONE_B, K.ZB_H1, K.DUALPIPE_V, K.GPIPE)]


def fingerprint(rank: int, world: int, data: str, out: str) -> list[str]:
    import torch

    from training import train_cases

    cases = [{**c, "run.max_steps": 3} for c in LAYOUTS]
    digests = []
    for res in train_cases(rank, world, data, out, cases):
        h = hashlib.sha256(json.dumps([res["losses"], res["grad_norms"]]).encode())
        for name in sorted(res["params"]):
            h.update(name.encode())
            h.update(res["params"][name].to(torch.float32).contiguous().numpy().tobytes())
        digests.append(h.hexdigest())
    return digests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    from pipezero.data import stdlib_files
    from ranks import run_ranks  # before 2026-12-06 (703e589 and older): pipezero.parallel.spawn

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
