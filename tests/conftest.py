import os
from pathlib import Path

_BUILD = Path(__file__).resolve().parent.parent / "build"
os.environ.setdefault("HF_LOWPREC_CACHE", str(_BUILD / "cache"))
os.environ.setdefault("HF_HOME", str(_BUILD / "hf_home"))
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_BUILD / "torch_extensions"))
# The compiled optimizer kernels (hf_lowprec.optim.dispatch) are built once and reused by every
# test process (and the subprocesses they start) from this cache, one per ATen CPU capability:
# a kernel cached by a process run with ATEN_CPU_CAPABILITY=avx2 segfaults when an AVX-512
# process on the same machine loads it (seen with torch 2.13).
_CAPABILITY = os.environ.get("ATEN_CPU_CAPABILITY", "default").lower()
os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(
    Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", _BUILD / "inductor")) / f"cpu-{_CAPABILITY}"
)
# Compile in-process: a pool of compile workers costs more CPU to start than these few kernels.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# A CPU without AVX-512 runs torch's BF16 and FP16 matrix products in a scalar loop, 15 to 50 times
# slower than FP32 ones: there the suite computes them as FP32 GEMMs of the exact upcasts rounded
# once (hf_lowprec/cpu_gemm.py; the processes the tests start inherit the setting). Set
# HF_LOWPREC_CPU_GEMM=native to run torch's own kernels instead.
os.environ.setdefault("HF_LOWPREC_CPU_GEMM", "auto")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models gain nothing from intra-op threads, and OpenMP threads spinning against other
# processes (the subprocess tests, a busy CI core) slow a step down by 10x or more.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import hf_lowprec  # noqa: E402, F401 (installs the FP32 GEMMs HF_LOWPREC_CPU_GEMM asks for)
from tests.global_state import changes, restore, snapshot  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Property tests: in CI (CI set, as .ci/run's environment has it) every run draws the same
# examples, so a failure in the log reproduces with the same command; locally they explore.
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")


@pytest.fixture(autouse=True)
def _global_state_guard():
    """Fail the test after which a process-global setting (autocast, default dtype, grad mode,
    deterministic algorithms, thread count, backend flags, logger levels, an environment variable)
    differs from before it, naming each one, then put the settings back: a leak fails where it
    happens, not in the later tests of the same process it would break."""
    before = snapshot()
    yield
    leaked = changes(before, snapshot())
    if leaked:
        restore(before)
        pytest.fail("the test left process-global state changed:\n  " + "\n  ".join(leaked), pytrace=False)


@pytest.fixture(autouse=True)
def _accelerate_environment(_global_state_guard):
    """Each test starts with the Accelerate settings of the environment it was given:
    `TrainingArguments(torch_compile=True)` writes ACCELERATE_DYNAMO_BACKEND into os.environ,
    which would compile every later `Accelerator()` of the same worker. Restored before the
    guard looks: that write is transformers' own, not a leak of the test's."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_")}
    yield
    for key in [k for k in os.environ if k.startswith("ACCELERATE_") and k not in saved]:
        del os.environ[key]
    os.environ.update(saved)


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of this process alone: `fully_shard` makes DTensor parameters (one
    shard each) without launching ranks, and FSDP2's collectives and the strategies' agreements
    over ranks run as on many ranks."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def pytest_collection_modifyitems(config, items):
    """Tests that compile optimizer steps run first, in their collected order. xdist's worksteal
    hands each worker a contiguous run of the list and steals from its tail, so these stay on
    the first worker, where each graph (about a minute for a grouped format on two cores) is
    compiled once and reused by the process instead of once per worker. Order only: every
    test still runs, and each test stands alone."""
    items.sort(key=lambda item: item.get_closest_marker("compiles_step") is None)
