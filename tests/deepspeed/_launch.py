"""Start N gloo ranks of a worker script and collect their result files.

Each rank writes `<out>/rank<r>.json` before exiting, with "complete": true once every case ran.
About one two-process DeepSpeed run in thirteen aborts in interpreter teardown after training
finished ("terminate called without an active exception", SIGABRT). A non-zero exit is
accepted only when that rank's results are complete and that abort message is the last line
of its stderr; anything else fails with the rank's output.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
EXIT_ABORT = "terminate called without an active exception"


def exit_is_tolerated(returncode: int, stderr: str, result: dict | None) -> bool:
    """True for a clean exit, or for the known teardown abort after complete results."""
    if returncode == 0:
        return result is not None and result.get("complete") is True
    lines = [line for line in stderr.splitlines() if line.strip()]
    aborted = returncode in (-signal.SIGABRT, 128 + signal.SIGABRT)
    return bool(
        aborted and result is not None and result.get("complete") is True and lines and lines[-1].strip() == EXIT_ABORT
    )


def ranks_environment(world_size: int) -> dict[str, str]:
    """The environment shared by `world_size` local gloo ranks (each adds RANK and LOCAL_RANK)."""
    return {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }


def launch(script: Path, out: Path, args: list[str], world_size: int = 2, timeout: int = 900) -> list[dict]:
    """Run `script` as `world_size` ranks; the ranks' result dicts (asserting tolerated exits)."""
    out.mkdir(parents=True, exist_ok=True)
    env = ranks_environment(world_size)
    procs = []
    for rank in range(world_size):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), "--out", str(out), *args],
                cwd=ROOT,
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        outputs.append((proc.returncode, stdout, stderr))
    results = []
    for rank, (code, stdout, stderr) in enumerate(outputs):
        path = out / f"rank{rank}.json"
        result = json.loads(path.read_text()) if path.exists() else None
        assert exit_is_tolerated(code, stderr, result), (
            f"rank {rank} exited {code}, results complete: {bool(result and result.get('complete'))}\n"
            f"{stdout[-3000:]}\n{stderr[-6000:]}"
        )
        results.append(result)
    return results


def finish_rank(out: Path, result: dict) -> None:
    """In a worker: mark `result` complete, write it to `<out>/rank<r>.json`, and leave the group."""
    import torch.distributed as dist

    result["complete"] = True
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
