import os
from pathlib import Path

_BUILD = Path(__file__).resolve().parent.parent / "build"
os.environ.setdefault("HF_LOWPREC_CACHE", str(_BUILD / "cache"))
os.environ.setdefault("HF_HOME", str(_BUILD / "hf_home"))
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_BUILD / "torch_extensions"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
