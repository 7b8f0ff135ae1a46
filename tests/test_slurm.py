"""Slurm: one task a rank (`srun pipezero train`) reads SLURM_* as torchrun's variables, and
`srun torchrun` keeps torchrun's. The pure rules are tested here in one process; the daemons'
test (a real slurmctld, slurmd and munged on this machine) is at the end."""

from __future__ import annotations

import pytest

from pipezero.errors import ConfigError
from pipezero.slurm import expand_hostlist, job_port, rank_variables, tasks_per_node


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
        monkeypatch.delenv(name, raising=False)
    env = step_env(SLURM_NTASKS="4", SLURM_PROCID="2", SLURM_LOCALID="0", SLURM_STEP_TASKS_PER_NODE="2(x2)",
                   SLURM_TASKS_PER_NODE="2(x2)", **extra)
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
