"""The Slurm launcher on a real single-node Slurm (slurmctld, slurmd, munge) started here.

A LowDiff job submitted with ``examples/gpt/slurm/pretrain_gpt.sbatch`` loses a rank to SIGKILL
after its first base; the job requeues itself, the new start resumes from the newest durable
differential, and the final state equals an uninterrupted run's (``torch.equal``). A job whose
retry budget is spent gives up instead of requeueing.

Needs root and Debian's ``slurm-wlm`` and ``munge``: ``make slurm-deps`` installs them, and
``.ci/run`` does so before the suite. Without them every test here is skipped with that reason,
except under ``CI=true``, where that is an error.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch import REPO, TINY_GPT, assert_same_state, load_dumps, rank_process, run_gpt

SBATCH = REPO / "examples" / "gpt" / "slurm" / "pretrain_gpt.sbatch"
NEEDED = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "squeue")
missing = [b for b in NEEDED if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
UNAVAILABLE = (
    f"needs root and slurm-wlm + munge ({', '.join(missing) or 'root'} missing): "
    "`make slurm-deps` installs them (as root)"
)
if (missing or os.geteuid() != 0) and os.environ.get("CI") == "true":
    # CI installs Slurm (.ci/run): a Slurm test that skips there protects nothing.
    raise RuntimeError(f"CI=true but Slurm is not usable: {UNAVAILABLE}")
pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(bool(missing) or os.geteuid() != 0, reason=UNAVAILABLE),
]

_CONF = """ClusterName=diffckpt-test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
SlurmctldPort=16817
SlurmdPort=16818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
JobRequeue=1
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
NodeName={host} CPUs={cpus} RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _sbin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A single-node Slurm for this module; the environment to reach it."""
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    host = socket.gethostname().split(".")[0]
    conf = d / "slurm.conf"
    conf.write_text(_CONF.format(host=host, d=d, cpus=os.cpu_count()))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    if subprocess.run(["munge", "-n"], capture_output=True).returncode != 0:
        Path("/run/munge").mkdir(exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", _sbin("munged"), "--force"], check=True)
    subprocess.run([_sbin("slurmctld"), "-f", str(conf)], env=env, check=True)
    subprocess.run([_sbin("slurmd"), "-f", str(conf)], env=env, check=True)
    deadline = time.monotonic() + 60
    while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env,
                                       capture_output=True, text=True).stdout:  # fmt: skip
        assert time.monotonic() < deadline, (d / "slurmctld.log").read_text()[-3000:]
        time.sleep(0.5)
    yield env
    subprocess.run(["scancel", "--full", "-u", "root"], env=env)
    for pidfile in ("slurmd.pid", "slurmctld.pid"):
        if (d / pidfile).exists():
            os.kill(int((d / pidfile).read_text()), signal.SIGTERM)


def _submit(env, out: Path, save: Path, args: list[str], **extra) -> str:
    proc = subprocess.run(
        ["sbatch", "--parsable", f"--output={out}", "--nodes=1", str(SBATCH), *args],
        env={
            **env,
            "SAVE": str(save),
            "NPROC_PER_NODE": "2",
            "TRAIN_SCRIPT": "examples/gpt/pretrain_gpt.py",
            "PYTHON": sys.executable,  # this lane's Python (the script's default is .venv's)
            **extra,
        },  # fmt: skip
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return proc.stdout.strip().split(";")[0]


def _wait(predicate, what: str, out: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        text = out.read_text() if out.exists() else ""
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{text[-4000:]}"
        time.sleep(0.25)


def _show(env, job: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True,
                          text=True).stdout  # fmt: skip


def _state(env, job: str) -> str:
    """The job's state (``PENDING``, ``RUNNING``, ``COMPLETED``, ``FAILED``, ...); a requeued job
    passes through ``REQUEUED`` to ``PENDING``, so only a final state means it ended."""
    m = re.search(r"JobState=(\w+)", _show(env, job))
    return m.group(1) if m else ""


FINAL = ("COMPLETED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def test_killed_task_requeues_and_resumes_exactly(slurm, tmp_path):
    common = [*TINY_GPT, "--use-distributed-optimizer", "--lr-decay-iters", "100"]
    total = 30
    run_gpt(2, *common, "--train-iters", str(total), "--dump-state", str(tmp_path / "straight"))
    out, save = tmp_path / "job.out", tmp_path / "ckpt"
    diff = ["--diffckpt-mode", "lowdiff", "--diffckpt-full-interval", "5"]
    job = _submit(slurm, out, save, [*common, "--train-iters", str(total), *diff,
                                     "--dump-state", str(tmp_path / "resumed")])  # fmt: skip

    def past_first_base():
        text = out.read_text() if out.exists() else ""
        return "saved checkpoint from iteration 5 " in text and " 8/" in text

    _wait(past_first_base, "the first base and iteration 8", out)
    victim = rank_process(1)
    victim.send_signal(signal.SIGKILL)
    _wait(lambda: "Restarts=1" in _show(slurm, job), "Slurm to requeue the job", out)
    assert "requeue 1 of 3" in out.read_text()

    # Slurm holds a requeued batch job back for a while. Release it once it is pending and
    # slurmd has finished the previous start's batch script and step (the node may look idle
    # to slurmctld before that; a start released sooner fails: "Job credential revoked").
    slurmd_log = Path(slurm["SLURM_CONF"]).parent / "slurmd.log"

    def requeued_and_node_free():
        done = slurmd_log.read_text()
        idle = subprocess.run(["sinfo", "-h", "-o", "%T"], env=slurm, capture_output=True,
                              text=True).stdout.strip() == "idle"  # fmt: skip
        show = _show(slurm, job)
        return (
            idle
            and f"[{job}.batch] done with job" in done
            and f"[{job}.0] done with job" in done
            and "JobState=PENDING" in show
            and "Restarts=1" in show
        )

    _wait(requeued_and_node_free, "the requeued job to pend on a free node", out)
    # slurmd refuses credentials of a requeued job issued in the same second as the revocation
    # (its timestamps have one-second resolution): release it in a later second.
    time.sleep(1.0 - time.time() % 1.0 + 0.2)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=slurm)
    _wait(lambda: _state(slurm, job) in FINAL, "the end", out)
    assert _state(slurm, job) == "COMPLETED", out.read_text()[-3000:]
    log = out.read_text()
    assert "start 2 (restarts so far 1 of 3)" in log and "resuming from" in log, log[-3000:]
    assert "recovered to iteration" in log and "training finished" in log, log[-3000:]
    straight, resumed = load_dumps(tmp_path / "straight", 2), load_dumps(tmp_path / "resumed", 2)
    for rank in range(2):
        assert_same_state(straight[rank], resumed[rank], rank)


def test_a_spent_retry_budget_ends_the_job(slurm, tmp_path):
    out = tmp_path / "job.out"
    # Layers not divisible by the pipeline: the training script exits with a usage error.
    bad = ["--train-iters", "2", "--num-layers", "3", "--pipeline-model-parallel-size", "2"]
    job = _submit(slurm, out, tmp_path / "ckpt", bad, DIFFCKPT_MAX_RESTARTS="0")
    _wait(lambda: _state(slurm, job) in FINAL, "the job to end", out)
    assert _state(slurm, job) == "FAILED"
    log = out.read_text()
    assert "the retry budget (0) is spent, giving up" in log, log[-3000:]
    assert "requeue" not in log.replace("requeue 1", "")


def test_ranks_restarted_in_the_allocation_recover_from_the_nodes_keeper(slurm, tmp_path):
    """DIFFCKPT_RANK_RESTARTS and DIFFCKPT_KEEPER_MIB: rank 1 dies (SIGKILL, at the fail point
    after it handed iteration 11 over) in the middle of a batch of 8; under --diffckpt-keeper
    auto the node's keeper writes the diff log, and the killed rank's part batch as its
    connection ends, so torchrun's restarted ranks (in the same allocation) recover 11 with
    nothing lost, every iteration from storage's log, and the job ends as an uninterrupted
    run."""
    common = [*TINY_GPT, "--use-distributed-optimizer", "--lr-decay-iters", "100"]
    total = 16
    run_gpt(2, *common, "--train-iters", str(total), "--dump-state", str(tmp_path / "straight"))
    out, save = tmp_path / "job.out", tmp_path / "ckpt"
    diff = ["--diffckpt-mode", "lowdiff", "--diffckpt-full-interval", "1000"]
    diff += ["--diffckpt-batch-size", "8"]
    args = [*common, "--train-iters", str(total), *diff, "--dump-state", str(tmp_path / "resumed")]
    job = _submit(slurm, out, save, args, DIFFCKPT_RANK_RESTARTS="1", DIFFCKPT_KEEPER_MIB="64",
                  DIFFCKPT_FAILPOINT="iteration-end:11@1")  # fmt: skip
    _wait(lambda: _state(slurm, job) in FINAL, "the end", out)
    log = out.read_text()
    assert _state(slurm, job) == "COMPLETED", log[-3000:]
    assert "requeue" not in log and "training finished" in log, log[-3000:]
    assert "failpoint iteration-end #11: SIGKILL of rank 1" in log, log[-3000:]
    recovered = re.search(r"recovered to iteration (\d+)", log)
    served = re.search(r"recovering to iteration 11 \(.*\): (.*)", log)
    assert int(recovered[1]) == 11 and served is not None, log[-3000:]
    assert served[1] == "1-11 from the diff log", served[0]
    straight, resumed = load_dumps(tmp_path / "straight", 2), load_dumps(tmp_path / "resumed", 2)
    for rank in range(2):
        assert_same_state(straight[rank], resumed[rank], rank)
