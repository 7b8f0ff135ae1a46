"""`pipezero verify`: a correct layout passes, one drifted replica fails and is named."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pipezero.cli import main
from pipezero.verify import TEST_PERTURB_ENV

SMALL = ["--tokenizer", "bytes", "--seq-len", "32", "--no-progress"]


def verify(text_dir, out, *flags: str, env: dict | None = None) -> tuple[int, str, dict]:
    cmd = [sys.executable, "-m", "pipezero.cli", "verify", "--data", str(text_dir), "--out", str(out), *SMALL, *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    report = json.loads((out / "verify.json").read_text())
    return proc.returncode, proc.stdout + proc.stderr, report


def test_one_process_layout_verifies_in_process(text_dir, tmp_path, capsys):
    assert main(["verify", "--data", str(text_dir), "--out", str(tmp_path), "--steps", "2", *SMALL]) == 0
    report = json.loads((tmp_path / "verify.json").read_text())
    assert report["ok"] and report["transfer_order"]["proven"] and report["steps"] == 2
    assert {c["what"] for c in report["checks"]} == {"loss", "grad_norm", "param"}
    assert "OK" in capsys.readouterr().out


def test_pipeline_with_tied_ends_on_one_rank_verifies(text_dir, tmp_path):
    """ZB-V with M < 2P and tied embeddings (both ends on rank 0): exit 0, every tensor compared."""
    toml = tmp_path / "tied.toml"
    toml.write_text("[model]\ntie_embeddings = true\n")
    code, log, report = verify(text_dir, tmp_path / "v", "--config", str(toml), "--nproc", "2", "--pp", "2",
                               "--schedule", "zb-v", "--virtual-stages", "2", "--microbatches", "3")
    assert code == 0, log[-3000:]
    assert "proven free of deadlock" in log and report["ok"] and not report["problems"]
    params = {(c["rank"], c["name"]) for c in report["checks"] if c["what"] == "param"}
    assert {(0, "layers.0.weight"), (0, "layers.3.proj.weight")} <= params  # both tied ends
    steps = [c for c in report["checks"] if c["what"] == "loss"]
    assert len(steps) == 2 * 3 and all(c["error"] <= 1e-5 for c in steps)  # every rank, every step


def test_one_drifted_replica_fails_verify_and_is_named(text_dir, tmp_path):
    """ZeRO-3 over two replicas; the test-only hook nudges replica 1's copy of one weight by 1e-3."""
    code, log, report = verify(text_dir, tmp_path / "v", "--nproc", "2", "--dp", "2", "--zero", "3",
                               "--microbatches", "2", env={TEST_PERTURB_ENV: "1:layers.1.attn.wq.weight"})
    assert code == 1, log[-3000:]
    assert report["failed"] == [report["failed"][0]] and "rank 1 (stage 0, replica 1) layers.1.attn.wq.weight" \
        in report["failed"][0]
    assert "FAILED" in log and "layers.1.attn.wq.weight" in log
    ok = [c for c in report["checks"] if c["rank"] == 0 and c["what"] == "param"]
    assert ok and all(c["ok"] for c in ok)  # the other replica is right
