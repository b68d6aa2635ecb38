"""`hf_lowprec.compiling`: why compiled kernels cannot run on a device, never an exception; a
graph over a list of rows run in chunks."""

from __future__ import annotations

import torch
import torch.utils._triton as triton_utils

from hf_lowprec.compiling import LARGE_ROW, chunks_of, compiler_missing, gpu_paths, run_fused_rows
from hf_lowprec.testing.launches import Launches


def test_a_cuda_build_that_cannot_reach_its_device_gets_a_reason(monkeypatch):
    # A CUDA build of torch on a machine without the driver: Triton's check asks the device
    # for its properties and raises (seen with torch 2.11 under the fake CUDA device of tests/gpu).
    def unreachable() -> bool:
        raise RuntimeError("Found no NVIDIA driver on your system")

    monkeypatch.setattr(triton_utils, "has_triton", unreachable)
    compiler_missing.cache_clear()
    try:
        assert "Found no NVIDIA driver" in compiler_missing("cuda")
    finally:
        compiler_missing.cache_clear()


def _scaled_sums(rows, factor):
    return [(a * factor).sum() + b.sum() for a, b in rows]


def _rows():
    generator = torch.Generator().manual_seed(0)
    shapes = [((5 + i,), (3,)) for i in range(11)] + [((4, 3), (3,)), ((2, 5), (3,)), ((LARGE_ROW,), (3,))]
    rows = [tuple(torch.randn(shape, generator=generator) for shape in row) for row in shapes]
    return [*rows, (torch.randn(6, generator=generator).double(), torch.randn(3, generator=generator))]


def test_rows_run_in_chunks_grouped_by_rank_dtype_and_size_with_each_rows_entry_in_order():
    """On a GPU's path: eleven flat FP32 rows are chunks of 8, 2 and 1; the two matrices one chunk;
    the large row and the FP64 one a chunk each (a graph guards on ranks and dtypes, and a large
    row's reductions are split by its own size). Each entry is its row's, in the rows' order."""
    rows = _rows()
    expected = _scaled_sums(rows, 3.0)
    with gpu_paths(), torch.compiler.set_stance("force_eager"), Launches() as counted:
        got = run_fused_rows(_scaled_sums, rows, 3.0, like=rows[0][0])
    assert len(got) == len(rows)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    calls = sum(n for (_, name), n in counted.regions.items() if name == "_scaled_sums")
    assert sum(counted.regions.values()) == calls == len(chunks_of(11)) + 1 + 1 + 1 == 6, counted.summary()


def test_rows_on_the_cpu_path_are_one_call():
    rows = _rows()
    with Launches() as counted:
        got = run_fused_rows(_scaled_sums, rows, 3.0, like=rows[0][0])
    assert all(torch.equal(a, b) for a, b in zip(got, _scaled_sums(rows, 3.0)))
    assert sum(counted.regions.values()) == 1, counted.summary()


def _total(x):
    return x.sum()


def test_a_gpus_graph_of_one_tensor_is_built_per_size_class(monkeypatch):
    """Inductor splits a reduction over a whole tensor by the size its graph was built for: one
    built on a small tensor would reduce a large one in a single thread block. On a GPU's path a
    call on LARGE_ROW elements or more runs a graph of its own (a function of the same name, a
    code object of its own: dynamo keeps graphs per code object); on the CPU's, one graph serves
    every size. A chunk of rows takes its first tensor's class, its group's."""
    from hf_lowprec import compiling

    seen = []
    monkeypatch.setattr(compiling, "_run_compiled", lambda fn, device, *args: seen.append(fn) or fn(*args))
    small, large = torch.ones(100), torch.ones(LARGE_ROW)
    with gpu_paths():
        for x in (small, large, small, large):
            assert compiling.run_fused(_total, x, like=x) == x.numel()
    assert seen[0] is seen[2] is _total
    assert seen[1] is seen[3] and seen[1] is not _total and seen[1].__name__ == "_total"
    assert seen[1].__code__ is not _total.__code__
    seen.clear()
    compiling.run_fused(_total, large, like=large)
    assert seen == [_total]
    seen.clear()
    rows = _rows()
    with gpu_paths():
        run_fused_rows(_scaled_sums, rows, 3.0, like=rows[0][0])
    large_calls = [fn for fn in seen if fn is not _scaled_sums]
    assert len(large_calls) == 1 and len(seen) == 6
