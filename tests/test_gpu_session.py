"""bench/gpu_session.sh, the one call a GPU machine's short loan runs: its shape is checked here (each
part under its own timeout, writing its own result file, the dry run wired), and its summary from
part files alone. The whole dry run is CI's (.ci/run), not the suite's: it starts ranks for minutes."""

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_session  # noqa: E402

SCRIPT = (ROOT / "bench" / "gpu_session.sh").read_text()


def test_every_part_runs_under_its_own_timeout_and_writes_its_own_file():
    parts = re.findall(r'^part (\w) "\$t_\1" (.*)$', SCRIPT, re.M)
    assert [p for p, _ in parts] == ["a", "b", "c", "d"]
    files = [re.search(r'--json "\$out/(\w+\.json)"', cmd).group(1) for _, cmd in parts]
    assert files == list(gpu_session.PARTS.values())
    assert 'timeout "$limit" "$@"' in SCRIPT
    # the GPU's limits fit a ten-minute loan
    limits = re.search(r"^    t_a=(\d+) t_b=(\d+) t_c=(\d+) t_d=(\d+)  # 600 s in all$", SCRIPT, re.M)
    assert limits and sum(map(int, limits.groups())) <= 600


def test_the_dry_run_is_wired_and_ci_runs_it():
    assert re.search(r"--dry-run\) dry=--dry-run", SCRIPT)
    for part in ("layouts", "fit", "offload", "summary"):
        assert re.search(rf"gpu_session\.py {part} \$dry", SCRIPT), part
    assert "bash bench/gpu_session.sh --dry-run" in (ROOT / ".ci" / "run").read_text()


def test_the_layouts_cover_what_the_issue_asks():
    lays = gpu_session.LAYOUTS
    assert len(lays) == 8 and all(2 <= lay["pp"] * lay["dp"] <= 4 for lay in lays)
    assert {"zb-v", "dualpipe-v"} <= {lay["schedule"] for lay in lays}
    assert {lay["zero"] for lay in lays} == {0, 1, 2, 3} and "bf16" in {lay["dtype"] for lay in lays}


def write(folder: Path, name: str, report: dict) -> None:
    (folder / name).write_text(json.dumps(report))


def test_the_summary_says_which_part_failed_timed_out_or_passed(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gpu_session, "_machine", lambda: {"torch": "2.x", "device": "H200", "commit": "abc"})
    lay = gpu_session.LAYOUTS[0]
    write(tmp_path, "layouts.json", {"ok": True, "what": "layouts", "rows": [
        {"layout": lay, "matches_one_process": True, "worst_memory_error": 0.04, "memory_within": True,
         "seconds": 20.0, "code": 0}]})
    write(tmp_path, "fit.json", {"ok": False, "what": "fit", "rows": [
        {"check": "forced past the check: out of memory", "ok": False, "code": 0}]})
    write(tmp_path, "gpu_step.json", {"cases": [{"name": "base", "ratio": 0.95, "pipezero": {"mfu_6n": 0.31},
                                                 "plain": {"mfu_6n": 0.33}}], "skipped": []})
    code = gpu_session.main(["summary", "--dir", str(tmp_path), "--codes", "a=0,b=1,c=0,d=124"])
    out = capsys.readouterr().out
    assert code == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [summary["parts"][p]["ok"] for p in "abcd"] == [True, False, True, False]
    assert summary["parts"]["d"]["result"] == "no result (timed out)"
    assert "P2 D1 1f1b ZeRO-0 fp32 M=4: one process =, memory worst 4.0%" in out
    assert "base: MFU 31.0% (plain 33.0%), throughput 0.950 of plain" in out
    assert "SOME PARTS FAILED" in out


def test_memory_rows_hold_each_rank_to_ten_percent():
    rows = gpu_session.memory_rows({"memory": {"ranks": [
        {"rank": 0, "predicted_peak_bytes": 109, "measured_peak_bytes": 100},
        {"rank": 1, "predicted_peak_bytes": 89, "measured_peak_bytes": 100},
        {"rank": 2, "predicted_peak_bytes": 100, "measured_peak_bytes": None}]}})
    assert [r["within"] for r in rows] == [True, False, False]


@pytest.mark.distributed  # a shell, refused at once: no rank starts
def test_arguments_past_the_first_are_refused_not_ignored():
    import subprocess

    for args in (["--dry-run", "--steps", "1"], ["--fast"]):
        done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_session.sh"), *args], capture_output=True, text=True,
                              timeout=30)
        assert done.returncode == 2 and "usage: bash bench/gpu_session.sh [--dry-run]" in done.stderr, done
