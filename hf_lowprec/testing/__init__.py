"""What the tests and the benchmarks share: the GPU rules checked on CPU, and the measures they read.

A training step runs well on a GPU when the host only queues kernels. These modules check that
on a CPU-only machine, as `tests/gpu` and `bench/bench_gpu_ready.py` do (docs/gpu.md):

- `syncs`: `DeviceTraffic`, the host syncs and host→device copies of a step, counted at the
  ATen dispatcher, each with the line it came from;
- `graphs`: graph breaks and recompilations of a compiled step, from dynamo's counters;
- `fake_cuda`: a fake CUDA device of a chosen compute capability, and one strategy step on it;
- `steps`: the step they are counted on (GPT-2 from config, a strategy's step, torch's AMP
  recipe as the anchor), also the model of the device check (`bench/device_check_steps.py`);
- `snr`: the SNR of a low-precision result against its FP64 reference.

Nothing else in `hf_lowprec` imports this package (it stands on the top floor,
docs/architecture.md).
"""

from .counted_step import (
    BATCH,
    N_EMBD,
    SEQ,
    VOCAB,
    anchor_step,
    anchor_syncs,
    gpt2,
    strategy_compiled_run,
    strategy_graph_breaks,
    strategy_step,
    strategy_syncs,
    token_batch,
)
from .fake_cuda import DEVICE, fake_cuda, fake_cuda_step, fp8_layer_forward_backward, to_fake_cuda
from .graphs import CompiledRun, compiled_run, count_graph_breaks, graph_breaks
from .snr import row_snr_db, snr_db
from .syncs import DeviceTraffic, Event

__all__ = [
    "BATCH",
    "DEVICE",
    "N_EMBD",
    "SEQ",
    "VOCAB",
    "CompiledRun",
    "DeviceTraffic",
    "Event",
    "anchor_step",
    "anchor_syncs",
    "compiled_run",
    "count_graph_breaks",
    "fake_cuda",
    "fake_cuda_step",
    "fp8_layer_forward_backward",
    "gpt2",
    "graph_breaks",
    "row_snr_db",
    "snr_db",
    "strategy_compiled_run",
    "strategy_graph_breaks",
    "strategy_step",
    "strategy_syncs",
    "to_fake_cuda",
    "token_batch",
]
