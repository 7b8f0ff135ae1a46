"""Slurm: one task a rank (`srun pipezero train`) reads SLURM_* as torchrun's variables, and
`srun torchrun` keeps torchrun's. The pure rules are tested here in one process; the daemons'
test (a real slurmctld, munged and a slurmd on each of two nodes emulated on this machine,
tests/local_slurm.py) is at the end."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path

import pytest
from local_slurm import LocalSlurm, pids_marked

from pipezero.cluster import require_root
from pipezero.errors import ConfigError
from pipezero.settings import build_config
from pipezero.slurm import expand_hostlist, job_port, rank_variables, tasks_per_node

REPO = Path(__file__).resolve().parent.parent


def step_env(**extra: str) -> dict[str, str]:
    """What srun -N2 -n6 gives task 4 (node 1, its second task) of job 4242, as seen in 22.05."""
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "4", "SLURM_NTASKS": "6",
           "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "3(x2)",
           "SLURM_TASKS_PER_NODE": "3(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_NODELIST": "gpu[07-08]"}
    env.update(extra)
    return env


# --- host lists -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, hosts", [
    ("node1", ["node1"]),
    ("gpu[01-04,07],cpu3", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("a[1-2]-ib,b", ["a1-ib", "a2-ib", "b"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("x[3]", ["x3"]),
])
def test_compressed_host_lists_expand_in_slurms_order_keeping_zero_padding(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["", "gpu[01-04", "gpu01-04]", "gpu[04-01]", "gpu[a-b]", "gpu[]", "a,,b"])
def test_a_malformed_host_list_is_refused(text):
    with pytest.raises(ValueError):
        expand_hostlist(text)


# --- tasks per node ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text, counts", [("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3])])
def test_tasks_per_node_expands_the_repeat_form(text, counts):
    assert tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "2(x)", "2(3)", "x", "2(x3", "0"])
def test_a_malformed_tasks_per_node_is_refused(text):
    with pytest.raises(ValueError):
        tasks_per_node(text)


# --- the variables a one-task-a-rank step gives -----------------------------------------------------

def test_a_srun_task_becomes_a_rank_with_slurms_numbers():
    assert rank_variables(step_env()) == {"RANK": "4", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3",
                                          "MASTER_ADDR": "gpu07", "MASTER_PORT": str(job_port("4242"))}


def test_local_world_size_is_this_nodes_count_in_an_uneven_layout():
    env = step_env(SLURM_NTASKS="7", SLURM_NODEID="2", SLURM_PROCID="6", SLURM_LOCALID="0",
                   SLURM_STEP_TASKS_PER_NODE="3(x2),1", SLURM_TASKS_PER_NODE="3(x2),1",
                   SLURM_JOB_NODELIST="gpu[07-08],cpu3", SLURM_STEP_NODELIST="gpu[07-08],cpu3")
    assert rank_variables(env)["LOCAL_WORLD_SIZE"] == "1"


def test_tasks_per_node_falls_back_to_ntasks_per_node():
    env = step_env()
    del env["SLURM_STEP_TASKS_PER_NODE"], env["SLURM_TASKS_PER_NODE"]
    env["SLURM_NTASKS_PER_NODE"] = "3"
    assert rank_variables(env)["LOCAL_WORLD_SIZE"] == "3"


def test_the_rendezvous_host_is_the_first_of_the_job_nodelist_when_the_step_has_none():
    env = step_env(SLURM_JOB_NODELIST="cpu3,gpu[01-04]")
    del env["SLURM_STEP_NODELIST"]
    assert rank_variables(env)["MASTER_ADDR"] == "cpu3"


def test_master_addr_and_port_set_by_the_user_are_kept():
    got = rank_variables(step_env(MASTER_ADDR="10.0.0.5", MASTER_PORT="31000"))
    assert (got["MASTER_ADDR"], got["MASTER_PORT"]) == ("10.0.0.5", "31000")


def test_the_port_follows_the_job_id_and_stays_below_the_ephemeral_range():
    ports = {job_port(str(j)) for j in range(1, 20001)}
    assert len(ports) == 10000 and min(ports) >= 15000 and max(ports) < 32768
    assert job_port("4242") != job_port("4243")


def test_a_torchrun_child_keeps_torchruns_variables():
    """srun torchrun, one task a node: the worker sees SLURM_PROCID of its node's task beside
    torchrun's own RANK; torchrun's win and nothing is read from Slurm."""
    env = step_env(TORCHELASTIC_RUN_ID="j", RANK="5", WORLD_SIZE="6", LOCAL_RANK="2", LOCAL_WORLD_SIZE="3",
                   SLURM_NTASKS="2", SLURM_PROCID="1", SLURM_LOCALID="0")
    assert rank_variables(env) == {}


def test_the_batch_script_itself_is_not_a_rank():
    """sbatch's shell has SLURM_PROCID=0 and SLURM_NTASKS of the job, but no step: `pipezero train
    --nproc N` there is the local launcher."""
    env = step_env(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0")
    del env["SLURM_STEP_ID"]
    assert rank_variables(env) == {}


def test_a_step_of_one_task_is_a_lone_process():
    assert rank_variables(step_env(SLURM_NTASKS="1", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0",
                                   SLURM_STEP_TASKS_PER_NODE="1", SLURM_TASKS_PER_NODE="1")) == {}


def test_outside_slurm_nothing_is_read():
    assert rank_variables({"RANK": "1", "WORLD_SIZE": "2"}) == {}


@pytest.mark.parametrize("ours, slurms, value", [
    ("RANK", "SLURM_PROCID", "3"), ("WORLD_SIZE", "SLURM_NTASKS", "8"), ("LOCAL_RANK", "SLURM_LOCALID", "0"),
    ("LOCAL_WORLD_SIZE", "tasks per node", "4"),
])
def test_a_variable_that_disagrees_with_slurm_is_one_line_naming_both(ours, slurms, value):
    with pytest.raises(ConfigError) as e:
        rank_variables(step_env(**{ours: value}))
    line = str(e.value)
    assert "\n" not in line and f"{ours}={value}" in line and slurms in line, line


def test_a_variable_that_agrees_with_slurm_is_fine():
    assert rank_variables(step_env(RANK="4", WORLD_SIZE="6"))["RANK"] == "4"


def test_a_malformed_slurm_variable_is_one_line_naming_it():
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        rank_variables(step_env(SLURM_STEP_NODELIST="", SLURM_JOB_NODELIST="gpu[01-"))
    with pytest.raises(ConfigError, match="SLURM_PROCID"):
        rank_variables(step_env(SLURM_PROCID="four"))


# --- the CLI under srun, before any process group -----------------------------------------------------

TRAIN = ["train", "--pp", "2", "--dp", "2", "--microbatches", "2", "--tokenizer", "bytes", "--max-steps", "1"]


def in_step(monkeypatch: pytest.MonkeyPatch, **extra: str) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID"):
        # set, then removed: monkeypatch then removes at the end what adopt_slurm writes into the process's
        # environment (a delenv of an unset name is not recorded, and later tests would run as rank 2 of 4)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    env = step_env(**{"SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_LOCALID": "0",
                      "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_TASKS_PER_NODE": "2(x2)", **extra})
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_nproc_inside_a_step_of_several_tasks_is_refused(monkeypatch, tmp_path, capsys):
    from pipezero.cli import main

    in_step(monkeypatch)
    code = main([*TRAIN, "--nproc", "4", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--nproc 4" in err and "SLURM_NTASKS=4" in err, err
    assert not (tmp_path / "run").exists()


def test_a_rank_that_disagrees_with_slurm_stops_the_cli_with_exit_2(monkeypatch, tmp_path, capsys):
    from pipezero.cli import main

    in_step(monkeypatch, RANK="0")
    code = main([*TRAIN, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "RANK=0" in err and "SLURM_PROCID" in err, err
    assert not (tmp_path / "run").exists()


def test_adopting_slurm_sets_torchruns_variables_for_the_rest_of_the_process():
    from pipezero.launch import adopt_slurm

    env = step_env(SLURM_NTASKS="4", SLURM_PROCID="2", SLURM_LOCALID="0", SLURM_STEP_TASKS_PER_NODE="2(x2)")
    adopt_slurm(None, env)
    assert [env[n] for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")] == \
        ["2", "4", "0", "2", "gpu07"]


def test_a_nproc_launcher_in_a_step_of_one_task_stays_a_launcher():
    from pipezero.launch import adopt_slurm

    env = step_env(SLURM_NTASKS="1", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0",
                   SLURM_STEP_TASKS_PER_NODE="1", SLURM_TASKS_PER_NODE="1")
    adopt_slurm(4, env)
    assert "RANK" not in env and "WORLD_SIZE" not in env


# --- a real Slurm of two nodes on this machine, both sbatch forms ----------------------------------

SLURM_COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel", "nsenter", "unshare")
NODES = ["node1", "node2"]  # a network and UTS namespace each (tests/local_slurm.py)
FORMS = {"srun_ranks": ["--ntasks=4", "--ntasks-per-node=2", "--cpus-per-task=1"],  # one task a rank
         "srun_torchrun": ["--ntasks-per-node=1", "--cpus-per-task=2"]}  # one task a node, torchrun's 2 ranks
JOB_WAIT_S = 240.0  # both jobs, on a loaded 2-core machine: seen up to 75 s


@pytest.fixture
def local_slurm(tmp_path: Path):
    missing = [c for c in SLURM_COMMANDS if shutil.which(c) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing): run .ci/setup_slurm.sh")
    require_root()  # fails (not skips) where the host cannot build namespaces: CI runs as root
    root = Path(f"/tmp/pz-slurm-{os.getpid()}-{random.randrange(1 << 30):x}")  # short: socket paths <= 108 bytes
    cluster = LocalSlurm(root, NODES)
    try:
        cluster.start()
        yield cluster
    finally:
        try:
            cluster.stop()
        finally:
            cluster.kill_leftovers()
            shutil.rmtree(root, ignore_errors=True)


def toml_of(overrides: dict) -> str:
    """`section.field` settings as a TOML file's tables (strings, numbers, booleans, enums)."""
    tables: dict[str, list[str]] = {}
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        value = getattr(value, "value", value)
        tables.setdefault(section, []).append(f"{name} = {json.dumps(value)}")
    return "".join(f"[{section}]\n" + "\n".join(lines) + "\n" for section, lines in tables.items())


def prepared_run(text_dir: Path, tmp_path: Path, steps: int) -> tuple[object, Path, dict[str, str]]:
    """The one-process reference of the tiny preset at P=2 D=2 (1F1B, M=2, B=2), the same settings
    as a TOML file for the jobs, and the jobs' environment (this interpreter's scripts first)."""
    from training import tiny_overrides

    from pipezero.config import ScheduleKind
    from pipezero.engine import train
    from pipezero.settings import build_config
    from pipezero.verify import reference_config

    settings = tiny_overrides(str(text_dir), str(tmp_path / "layout"), 2, 2, ScheduleKind.ONE_F_ONE_B, 2,
                              **{"run.max_steps": steps})
    ref = train(reference_config(build_config(None, settings), tmp_path))  # also fills the token cache
    config = tmp_path / "run.toml"
    config.write_text(toml_of({k: v for k, v in settings.items() if k != "run.out"}))
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO),
           "CHECKPOINT_EVERY": "2", "NPROC_PER_NODE": "2"}
    return ref, config, env


def submit_form(cluster: LocalSlurm, form: str, config: Path, env: dict[str, str], tmp_path: Path) -> str:
    """sbatch examples/slurm/FORM.sbatch on the two local nodes, logging to tmp_path/FORM.log."""
    return cluster.submit(REPO / f"examples/slurm/{form}.sbatch",
                          [f"--nodes={len(NODES)}", *FORMS[form], f"--output={tmp_path}/{form}.log", f"--chdir={tmp_path}",
                           f"--export=ALL,OUT={tmp_path}/{form}"], env, ["--config", str(config)])


def check_like_one_process(run: Path, ref: object, steps: int) -> None:
    """Every step in metrics.jsonl once, its loss and gradient norm within verify's tolerance."""
    from pipezero.config import DType
    from pipezero.verify import TOLERANCES, RankResult, compare_steps

    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, steps + 1)), run
    assert json.loads((run / "summary.json").read_text())["layout"]["pp"] == 2
    mine = RankResult(0, 0, 0, [r["loss"] for r in lines], [r["grad_norm"] for r in lines], {})
    bad = [c for c in compare_steps([mine], ref.losses, ref.grad_norms, TOLERANCES[DType.FP32]) if not c.ok]
    assert not bad, (run, bad)


def rank_hosts(run: Path) -> list[str]:
    """Each rank's host name, in rank order (summary.json): the node whose UTS namespace it ran in."""
    return [r["host"] for r in json.loads((run / "summary.json").read_text())["ranks"]]


def assert_completed(tmp_path: Path, form: str, final: tuple[str, str]) -> str:
    log = (tmp_path / f"{form}.log").read_text(errors="replace")
    assert final == ("COMPLETED", "0:0"), f"{form}: {final}\n{log[-3000:]}"
    return log


@pytest.mark.distributed
@pytest.mark.slow(32)
def test_both_sbatch_forms_train_on_a_real_slurm_like_one_process(local_slurm, text_dir, tmp_path):
    ref, config, env = prepared_run(text_dir, tmp_path, 4)
    t0 = time.monotonic()
    jobs = {form: submit_form(local_slurm, form, config, env, tmp_path) for form in FORMS}
    final, seen = local_slurm.wait(jobs, JOB_WAIT_S, str(config))
    took = time.monotonic() - t0
    for form in FORMS:
        assert_completed(tmp_path, form, final[form])
        check_like_one_process(tmp_path / form, ref, 4)
        assert sorted(p.name for p in (tmp_path / form / "checkpoints").iterdir()) == \
            ["step-00000002", "step-00000004"], form  # the scripts' --checkpoint-every
    # srun places tasks in blocks (node1: tasks 0 and 1); torchrun's nodes take their rank blocks in
    # the order they join its rendezvous
    assert rank_hosts(tmp_path / "srun_ranks") == ["node1", "node1", "node2", "node2"]
    assert rank_hosts(tmp_path / "srun_torchrun") in (["node1", "node1", "node2", "node2"],
                                                      ["node2", "node2", "node1", "node1"])
    assert seen >= 4, seen  # pids_marked sees the ranks: their command lines name the config
    local_slurm.stop()
    assert local_slurm.left() == []  # no daemon, slurmstepd or rank, namespace or link left
    assert pids_marked(str(tmp_path)) == []
    print(f"both Slurm forms: {took:.1f} s from submission to done")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("PIPEZERO_SLURM_REQUEUE") != "1",
                    reason="110 s, past the full suite's 6-minute budget: PIPEZERO_SLURM_REQUEUE=1 runs it")
def test_a_requeued_job_resumes_and_ends_on_the_losses_of_one_process(local_slurm, text_dir, tmp_path):
    """The scripts' requeue lines: SIGUSR1 to the batch shell (what --signal=B:USR1@120 sends near
    the time limit) requeues the job; its next start resumes from the newest checkpoint."""
    steps, form = 24, "srun_ranks"
    ref, config, env = prepared_run(text_dir, tmp_path, steps)
    job = submit_form(local_slurm, form, config, env, tmp_path)
    first = tmp_path / form / "checkpoints" / "step-00000002"
    local_slurm.wait_for(lambda: first.exists(), f"job {job}'s first checkpoint ({first})", JOB_WAIT_S)
    t0 = time.monotonic()
    local_slurm.ctl(["scancel", "--signal=USR1", "--batch", job])
    show = ["scontrol", "-o", "show", "job", job]
    local_slurm.wait_for(lambda: "JobState=PENDING" in local_slurm.ctl(show) and "Restarts=1" in local_slurm.ctl(show),
                         f"job {job} requeued and pending", 60)
    # Slurm holds a requeued job for 2 minutes (its begin time); release it now, once it is pending.
    def released() -> bool:
        local_slurm.ctl(["scontrol", "update", f"jobid={job}", "StartTime=now"])
        state = local_slurm.ctl(show)
        return "JobState=" in state and "Reason=BeginTime" not in state

    local_slurm.wait_for(released, f"job {job} released", 30)
    print(f"requeued and released in {time.monotonic() - t0:.1f} s")
    final, _ = local_slurm.wait({form: job}, JOB_WAIT_S, str(config))
    log = assert_completed(tmp_path, form, final[form])
    assert "requeueing" in log and "pipezero: resumed from" in log, log[-3000:]
    check_like_one_process(tmp_path / form, ref, steps)
    assert rank_hosts(tmp_path / form) == ["node1", "node1", "node2", "node2"]  # the second start's ranks
    local_slurm.stop()
    assert local_slurm.left() == [] and pids_marked(str(tmp_path)) == []


# --- values Slurm never sets: one line, at once ------------------------------------------------------

@pytest.mark.parametrize("extra, needle", [
    # a task numbered past the step waited at the rendezvous for peers that never came
    ({"SLURM_PROCID": "6"}, "SLURM_PROCID=6 is not a task of 6 (SLURM_NTASKS)"),
    ({"SLURM_PROCID": "-1"}, "SLURM_PROCID='-1' is not what Slurm sets"),
    ({"SLURM_NTASKS": "0"}, "SLURM_NTASKS=0: a step has at least one task"),
    ({"SLURM_LOCALID": "3"}, "SLURM_LOCALID=3 is not a task of 3 (the tasks per node"),
    ({"SLURM_STEP_TASKS_PER_NODE": "3(x0)"}, "'3(x0)' is not N or N(xK) with N, K >= 1"),
    ({"MASTER_PORT": "99999"}, "MASTER_PORT='99999' is not a port (1 to 65535)"),
    ({"MASTER_PORT": "abc"}, "MASTER_PORT='abc' is not a port"),
    ({"SLURM_JOB_ID": "9" * 5000}, "SLURM_JOB_ID='999"),
])
def test_a_variable_slurm_would_not_set_is_one_line(extra, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)) as e:
        rank_variables(step_env(**extra))
    assert "\n" not in str(e.value) and len(str(e.value)) < 400


def test_huge_host_lists_and_layouts_are_read_without_expanding_them():
    """`n[1-1000000000]` and `2(x1000000000)` were expanded whole to take one host and one count:
    gigabytes, then the kernel killed the rank (a MemoryError under a limit)."""
    env = step_env(SLURM_STEP_NODELIST="n[1-1000000000]", SLURM_STEP_TASKS_PER_NODE="3(x1000000000)",
                   SLURM_NODEID="999999999")
    t0 = time.process_time()  # this process's CPU: a list expanded, not a loaded machine's wait
    got = rank_variables(env)
    assert (got["MASTER_ADDR"], got["LOCAL_WORLD_SIZE"]) == ("n1", "3")
    assert time.process_time() - t0 < 1
    with pytest.raises(ConfigError, match="SLURM_NODEID=1000000000 but SLURM_STEP_TASKS_PER_NODE='3.x1000000000.' "
                                          "lists 1000000000 nodes"):
        rank_variables({**env, "SLURM_NODEID": "1000000000"})
    with pytest.raises(ConfigError, match="an empty host name"):  # a bad part after a huge one is still seen
        rank_variables(step_env(SLURM_STEP_NODELIST="n[1-1000000000],,x"))


@pytest.mark.parametrize("missing", ["SLURM_LOCALID", "SLURM_NTASKS"])
def test_a_slurm_step_variable_missing_is_one_line(missing):
    """A hand-made srun environment lacking one of srun's variables: named, with what says it is a step."""
    from pipezero.errors import ConfigError
    from pipezero.slurm import rank_variables

    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "5"}
    del env[missing]
    with pytest.raises(ConfigError, match=f"{missing} is not set, but SLURM_STEP_ID and SLURM_PROCID say"):
        rank_variables(env)


# --- Slurm's numbers are digits: anything int() would also take is refused, naming the variable -------

@pytest.mark.parametrize("name, value", [
    ("SLURM_NTASKS", " 0_2"), ("SLURM_NTASKS", "+6"), ("SLURM_NTASKS", "6 "), ("SLURM_NTASKS", "\u0666"),
    ("SLURM_PROCID", " 4"), ("SLURM_PROCID", "0_4"), ("SLURM_LOCALID", "+1"), ("SLURM_NODEID", "\u0661"),
    ("SLURM_JOB_ID", " 4242"), ("SLURM_JOB_ID", "42_42"), ("SLURM_STEP_TASKS_PER_NODE", "\u0663(x2)"),
    ("SLURM_STEP_NODELIST", "gpu[\u0660\u0667-08]"),
])
def test_a_slurm_number_int_would_read_but_slurm_never_writes_is_refused(name, value):
    """`int(' 0_2')` is 2 (whitespace, underscores, a sign and any script's digits pass): a step of 3
    tasks read as 2 waited at the rendezvous until --timeout. Slurm writes ASCII digits only."""
    with pytest.raises(ConfigError, match=f"^{re.escape(name)}=") as e:
        rank_variables(step_env(**{name: value}))
    assert "\n" not in str(e.value), str(e.value)


def test_ntasks_per_node_is_read_strictly_too():
    env = step_env(SLURM_NTASKS_PER_NODE=" 3")
    del env["SLURM_STEP_TASKS_PER_NODE"], env["SLURM_TASKS_PER_NODE"]
    with pytest.raises(ConfigError, match="^SLURM_NTASKS_PER_NODE=' 3' is not what Slurm sets"):
        rank_variables(env)


def test_nproc_in_a_step_reads_its_task_count_strictly():
    from pipezero.launch import adopt_slurm

    with pytest.raises(ConfigError, match="^SLURM_NTASKS=' 1' is not what Slurm sets"):
        adopt_slurm(4, step_env(SLURM_NTASKS=" 1", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0"))


# --- the rendezvous host: named, and resolved before any rank waits on it -------------------------------

def test_an_empty_master_addr_without_a_node_list_is_one_line(monkeypatch, tmp_path, capsys):
    """MASTER_ADDR='' and no node list: a TypeError traceback (os.environ asked for the variable None)."""
    from one_line import assert_one_line, run_main

    in_step(monkeypatch, MASTER_ADDR="")
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        monkeypatch.delenv(name, raising=False)
    assert_one_line(*run_main([*TRAIN, "--out", str(tmp_path / "run")], capsys),
                    "MASTER_ADDR is empty and no SLURM_STEP_NODELIST or SLURM_JOB_NODELIST names the step's nodes")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("extra, source", [
    ({}, "gpu07, the first node of SLURM_STEP_NODELIST,"),
    ({"MASTER_ADDR": "rank0.example"}, "MASTER_ADDR='rank0.example'"),
])
def test_a_rendezvous_host_that_does_not_resolve_is_one_line(extra, source, monkeypatch, tmp_path, capsys):
    """A first node that does not resolve: 40 lines of C++ frames from every rank, then the whole
    --timeout, blamed on a timeout. Resolved before anything else, and said."""
    import socket

    from one_line import assert_one_line, run_main

    asked = []

    def resolve(host, *args, **kwargs):
        asked.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    in_step(monkeypatch, **extra)
    assert_one_line(*run_main([*TRAIN, "--out", str(tmp_path / "run")], capsys),
                    f"{source} does not resolve on this node (Name or service not known)")
    assert asked == [extra.get("MASTER_ADDR", "gpu07")]
    assert not (tmp_path / "run").exists()


def test_a_rendezvous_host_that_resolves_is_let_through(monkeypatch):
    import socket

    from pipezero.launch import check_rendezvous_host

    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: [(socket.AF_INET, 1, 6, "", ("10.0.0.7", 0))])
    env = {**step_env(), "RANK": "4", "WORLD_SIZE": "6", "MASTER_ADDR": "gpu07", "MASTER_PORT": "19242"}
    check_rendezvous_host(env)
    check_rendezvous_host({"RANK": "0", "WORLD_SIZE": "1"})  # one process: no rendezvous to check


# --- advice that fits where the user is: srun's own options inside a step -------------------------------

def test_a_step_whose_task_count_is_not_the_layout_names_srun(monkeypatch, tmp_path, capsys):
    """--pp 2 x --dp 2 in a step of 3 tasks: each rank said 'use --nproc 4', which is refused
    inside a step; the fix is the step's task count."""
    import socket

    from one_line import assert_one_line, run_main

    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: [(socket.AF_INET, 1, 6, "", ("10.0.0.7", 0))])
    in_step(monkeypatch, SLURM_NTASKS="3", SLURM_STEP_TASKS_PER_NODE="2,1", SLURM_TASKS_PER_NODE="2,1")
    code, err = run_main([*TRAIN, "--out", str(tmp_path / "run")], capsys)
    assert_one_line(code, err, "--pp 2 x --dp 2 = 4 ranks, but this srun step has 3 tasks (SLURM_NTASKS)")
    assert "srun --ntasks 4" in err and "--nproc" not in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("env, want, not_want", [
    ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, "srun --ntasks 4", "--nproc"),
    ({"TORCHELASTIC_RUN_ID": "x"}, "torchrun", "--nproc 4"),
    ({}, "--nproc 4", "srun"),
])
def test_how_to_start_n_ranks_is_said_for_the_launcher_in_use(env, want, not_want):
    from pipezero.slurm import start_ranks_advice

    said = start_ranks_advice(env, 4)
    assert want in said and not_want not in said, said


@pytest.mark.parametrize("env, want, not_want", [
    ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, "srun --ntasks-per-node 2", "torchrun"),
    ({}, "--nproc / torchrun --nproc-per-node", "srun"),
])
def test_ranks_a_machine_is_said_for_the_launcher_in_use(env, want, not_want):
    from pipezero.slurm import ranks_per_node_advice

    said = ranks_per_node_advice(env, 2)
    assert want in said and not_want not in said, said


def test_a_failed_rendezvous_under_srun_names_the_steps_node_not_nproc(monkeypatch):
    from pipezero.cli.train import failure_line

    class DistNetworkError(RuntimeError):
        pass

    cfg = build_config(None, {"parallel.dp": "2"})
    for name, value in {**step_env(), "RANK": "4", "MASTER_ADDR": "gpu07", "MASTER_PORT": "19242"}.items():
        monkeypatch.setenv(name, value)
    code, line = failure_line(cfg, DistNetworkError("connect() timed out"))
    assert "gpu07:19242" in line and "SLURM_STEP_NODELIST" in line and "--nproc" not in line, line


def test_max_restarts_under_srun_names_slurms_requeue(monkeypatch, tmp_path, capsys):
    from one_line import assert_one_line, run_main

    in_step(monkeypatch)
    code, err = run_main([*TRAIN, "--max-restarts", "2", "--out", str(tmp_path / "run")], capsys)
    assert_one_line(code, err, "--max-restarts 2")
    assert "requeue" in err and "torchrun" not in err, err


@pytest.mark.parametrize("extra", [[], ["--nproc", "4"]])
def test_verify_in_a_step_of_several_tasks_names_a_step_of_one(extra, monkeypatch, tmp_path, capsys):
    """verify starts its ranks itself: in a step of 4 tasks each said 'pass --nproc 4', and with it
    each task would start its own 4 ranks."""
    from one_line import assert_one_line, run_main

    in_step(monkeypatch)
    verify = ["verify", *TRAIN[1:TRAIN.index("--max-steps")], "--steps", "1", *extra, "--out", str(tmp_path / "v")]
    assert_one_line(*run_main(verify, capsys), "`srun --ntasks 1 pipezero verify --nproc 4 ...`")
    assert not (tmp_path / "v").exists()


def test_a_task_does_not_hold_the_whole_steps_memory_to_its_own_host(monkeypatch, tmp_path, capsys):
    """The host-memory check adds up every CPU rank this command starts on this host: an srun task
    starts one (its step's others are on their own nodes), so it is not held to the step's sum. With
    a host of 4 KiB here, the next check (the step's task count) is what speaks."""
    import socket

    from one_line import assert_one_line, run_main

    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: [(socket.AF_INET, 1, 6, "", ("10.0.0.7", 0))])
    monkeypatch.setattr(os, "sysconf", lambda name: 1 if name == "SC_PHYS_PAGES" else 4096)
    in_step(monkeypatch, SLURM_NTASKS="3", SLURM_STEP_TASKS_PER_NODE="2,1", SLURM_TASKS_PER_NODE="2,1")
    assert_one_line(*run_main([*TRAIN, "--device", "cpu", "--out", str(tmp_path / "run")], capsys),
                    "but this srun step has 3 tasks (SLURM_NTASKS)")
