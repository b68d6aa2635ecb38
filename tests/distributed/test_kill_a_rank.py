"""A rank killed inside a save, by the test hook point `crash_point` (never by timing luck).

The Trainer (DDP, 2 gloo ranks, `save_total_limit=1`): rank 1 ends (`os._exit`, at the test hook point `save-rng-state`) inside the save of
checkpoint-4, before its `rng_state_1.pth` exists; rank 0 writes its files and
`trainer_state.json`. The new checkpoint must not count as complete (its marker is there, its
manifest is not), the previous one must not have been rotated away, rank 0 must stop with an
error that says another process stopped and which checkpoint is intact, and a resume with
`resume_from_checkpoint=True` must skip checkpoint-4 saying why, resume from checkpoint-2 and
end bit for bit where the uninterrupted run ends (losses, weights, optimizer state, schedule).

FSDP2's sharded checkpoint (`save_sharded`, coat on 2 ranks): rank 1 ends after writing its new
shards of a second save into the same directory. The directory must still hold the first save,
complete (a fresh model loads it, bit for bit); 64 bytes overwritten in a shard are refused on
both ranks naming the file; one rank loading the 2-rank coat checkpoint is refused naming the
world size it needs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_lowprec.checkpoints.manifest import CRASH_EXIT, MANIFEST
from hf_lowprec.checkpoints.resume import SAVE_MARKER
from tests.deepspeed._launch import exit_is_tolerated, ranks_environment

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TRAINER_WORKER = HERE / "_trainer_kill_worker.py"
SHARDED_WORKER = HERE / "_sharded_fault_worker.py"

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def launch_ranks(
    worker: Path, out: Path, phase: str, world_size: int = 2, timeout: int = 900, extra: tuple[str, ...] = ()
) -> list[tuple[int, str]]:
    """Run the worker's `phase` on `world_size` gloo ranks; each rank's (exit code, stderr)."""
    env = ranks_environment(world_size)
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), "--out", str(out), "--phase", phase, *extra],
            cwd=ROOT,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    try:
        return [(proc.wait(timeout=timeout), proc.stderr.read()) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()


def _finished(code: int, err: str, result_file: Path) -> bool:
    """A clean exit, or DeepSpeed's known abort at interpreter exit after the results were written."""
    result = json.loads(result_file.read_text()) if result_file.is_file() else None
    return exit_is_tolerated(code, err, result)


@pytest.mark.parametrize("engine", ["ddp", "deepspeed"])
def test_a_rank_killed_inside_the_save_loses_nothing(tmp_path, engine):
    """Under DDP rank 1 dies before its RNG file exists; under DeepSpeed ZeRO-2 too, after both
    ranks wrote their partitions of the checkpoint: either way the checkpoint has no manifest,
    the previous one was not rotated away, and a resume skips the torn one and continues bit for
    bit (weights, the strategy's optimizer state on each rank, losses, LR schedule)."""
    extra = ("--engine", engine)
    (code0, err0), (code1, err1) = launch_ranks(TRAINER_WORKER, tmp_path, "victim", extra=extra)
    assert code1 == CRASH_EXIT, err1[-3000:]
    assert code0 != 0, "rank 0 finished a save that rank 1 never wrote its part of"
    assert "saving checkpoint" in err0 and "checkpoint-4 failed" in err0, err0[-3000:]
    assert f"The previous checkpoint {tmp_path / 'run' / 'checkpoint-2'} is intact" in err0, err0[-3000:]

    run = tmp_path / "run"
    torn = run / "checkpoint-4"
    # What the stock Trainer would have called a checkpoint "saved before manifests": rank 0's
    # trainer_state.json, no rank 1 RNG file, no manifest. Rotation waited: checkpoint-2 is there.
    assert (torn / "trainer_state.json").is_file() and (torn / SAVE_MARKER).is_file()
    assert not (torn / "rng_state_1.pth").exists() and not (torn / MANIFEST).exists()
    assert (run / "checkpoint-2" / MANIFEST).is_file()
    manifest = json.loads((run / "checkpoint-2" / MANIFEST).read_text())
    assert manifest["world_size"] == 2 and {"rng_state_0.pth", "rng_state_1.pth"} <= set(manifest["files"])
    if engine == "deepspeed":  # each rank's ZeRO partition is in the manifest, checksummed
        partitions = [f for f in manifest["files"] if "zero_pp_rank_" in f]
        assert {f.split("zero_pp_rank_")[1][0] for f in partitions} == {"0", "1"}, manifest["files"]

    codes = launch_ranks(TRAINER_WORKER, tmp_path, "resume", extra=extra)
    assert all(_finished(code, err, tmp_path / f"resume-rank{rank}.json") for rank, (code, err) in enumerate(codes)), [
        err[-3000:] for _, err in codes
    ]
    for rank in range(2):
        result = json.loads((tmp_path / f"resume-rank{rank}.json").read_text())
        assert any(
            f"skipping incomplete checkpoint {torn}: {SAVE_MARKER} is there and {MANIFEST} is not" in m
            for m in result["warnings"]
        ), result["warnings"]
        reference, resumed = result["reference"], result["resumed"]
        assert resumed["global_step"] == reference["global_step"] == 6
        assert resumed["losses"] == reference["losses"] and len(reference["losses"]) == 6
        assert resumed["weights"] == reference["weights"], f"rank {rank}: weights differ"
        assert resumed["optimizer"] == reference["optimizer"], f"rank {rank}: optimizer state differs"
        assert resumed["scheduler"] == reference["scheduler"]
    # The resumed run saved checkpoint-4 and -6 completely; the limit of 1 left only the last.
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-6"]
    assert not (run / "checkpoint-6" / SAVE_MARKER).exists() and (run / "checkpoint-6" / MANIFEST).is_file()


def test_a_torn_or_damaged_sharded_checkpoint_is_never_loaded(tmp_path):
    (code0, _), (code1, err1) = launch_ranks(SHARDED_WORKER, tmp_path, "torn")
    assert code1 == CRASH_EXIT, err1[-3000:]
    assert code0 != 0, "rank 0 completed a save that rank 1 never finished"
    ckpt = tmp_path / "ckpt"
    assert (ckpt / MANIFEST).is_file() and (tmp_path / "ckpt.saving").is_dir()
    saved = [json.loads((tmp_path / f"torn-rank{r}.json").read_text()) for r in range(2)]

    codes = launch_ranks(SHARDED_WORKER, tmp_path, "check")
    assert [code for code, _ in codes] == [0, 0], [err[-3000:] for _, err in codes]
    checked = [json.loads((tmp_path / f"check-rank{r}.json").read_text()) for r in range(2)]
    shard = checked[0]["overwritten"]
    for rank in range(2):
        # The first save, whole: the second one never replaced it.
        assert checked[rank]["digest_loaded"] == saved[rank]["digest_step2"], f"rank {rank}"
        assert checked[rank]["refused"] is not None and checked[rank]["refused"].startswith(
            f"sharded checkpoint file {shard} is damaged (its CRC-32 differs from the manifest's"
        ), checked[rank]["refused"]
        assert "Nothing was loaded" in checked[rank]["refused"] and checked[rank]["unchanged"]

    codes = launch_ranks(SHARDED_WORKER, tmp_path, "one", world_size=1)
    assert [code for code, _ in codes] == [0], codes[0][1][-3000:]
    refused = json.loads((tmp_path / "one-rank0.json").read_text())["refused"]
    assert refused is not None and refused.startswith(f"sharded checkpoint {ckpt} was saved by 2 ranks"), refused
    assert "this run has 1" in refused and "torchrun --nproc_per_node 2" in refused
