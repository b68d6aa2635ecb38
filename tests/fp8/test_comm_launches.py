"""Launches of FP8-LM's FP8 all-reduce (`fp8.comm.fp8_allreduce`: the DDP comm hook's and O3's
reduction) on the paths a GPU takes, in a one-rank gloo group (a rank issues the same operations
among N): a constant number per call, not two more per gradient segment (issue #66)."""

import math
import os

import torch
import torch.distributed as dist

from hf_lowprec.compiling import gpu_paths
from hf_lowprec.fp8.comm import fp8_allreduce
from hf_lowprec.testing.launches import Launches
from tests.helpers import bits_equal


def _segments(count, gen):
    """A flat gradient of `count` segments: one all zero, one holding ±inf and a NaN, the rest random."""
    parts = [torch.randn(17 + 5 * i, generator=gen) * 2.0 ** (i % 7 - 3) for i in range(count)]
    parts[1].zero_()
    parts[2][:3] = torch.tensor([math.inf, -math.inf, math.nan])
    return torch.cat(parts), [p.numel() for p in parts]


def test_the_fp8_allreduce_launches_the_same_for_any_number_of_segments_with_the_cpu_forms_bits(tmp_path):
    """The segments' amax was `abs` and `amax` per segment (119 launches for 28 segments, 167 for 52);
    on a GPU it is one multi-tensor inf-norm, the same values (a maximum is exact): the CPU form's
    payload and scales bit for bit, NaN and all-zero segments included."""
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp_path, "store"), 1), rank=0, world_size=1)
    try:
        gen = torch.Generator().manual_seed(0)
        totals = {}
        for count in (28, 52):
            flat, numels = _segments(count, gen)
            results = []
            for gpu in (False, True):
                with torch.compiler.set_stance("force_eager"), gpu_paths() if gpu else torch.no_grad(), Launches() as c:
                    out = fp8_allreduce(
                        flat, numels=numels, mu=torch.tensor(1.0), fp8_dtype=torch.float8_e5m2, margin=0
                    )
                results.append(out)
                if gpu:
                    totals[count] = c.total()
            cpu, gpu_out = results
            assert bits_equal(gpu_out.payload, cpu.payload) and bits_equal(gpu_out.scales, cpu.scales), count
        assert totals[28] == totals[52], totals
    finally:
        dist.destroy_process_group()


def test_an_empty_segment_takes_the_gpu_path_as_the_cpu_form(tmp_path):
    """A zero-size segment (the API allows it) has amax 0 on the GPU path too: the multi-tensor norm
    takes no empty tensor, so such a call computes each segment's amax as the CPU form does."""
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp_path, "store"), 1), rank=0, world_size=1)
    try:
        flat = torch.randn(8, generator=torch.Generator().manual_seed(1))
        results = []
        for gpu in (False, True):
            with gpu_paths() if gpu else torch.no_grad():
                results.append(fp8_allreduce(flat, numels=[0, 8], fp8_dtype=torch.float8_e4m3fn))
        cpu, gpu_out = results
        assert bits_equal(gpu_out.payload, cpu.payload) and bits_equal(gpu_out.scales, cpu.scales)
    finally:
        dist.destroy_process_group()
