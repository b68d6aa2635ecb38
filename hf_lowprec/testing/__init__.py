"""What the tests and the benchmarks share: the GPU rules checked on CPU (docs/gpu.md: the host
only queues kernels), and the measures they read: `syncs` (host syncs and host→device copies),
`graphs` (graph breaks and recompilations), `fake_cuda` (a fake CUDA device), `counted_step` (the
step they are counted on, also the device check's model), `snr` (against FP64), `moe` and `llama`
(tiny models). Nothing else in `hf_lowprec` imports this package (it stands on the top floor,
docs/architecture.md).
"""

from .counted_step import (
    BATCH,
    N_EMBD,
    SEQ,
    VOCAB,
    anchor_step,
    anchor_syncs,
    checked_strategy,
    gpt2,
    moe,
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
    "checked_strategy",
    "compiled_run",
    "count_graph_breaks",
    "fake_cuda",
    "fake_cuda_step",
    "fp8_layer_forward_backward",
    "gpt2",
    "moe",
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
