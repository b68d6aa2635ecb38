import logging
import os

import torch

from tests.global_state import changes, restore, snapshot


def test_changes_name_each_setting_with_its_value_before_and_after_and_restore_puts_them_back(monkeypatch):
    # The leak that once failed 215 later tests: a BF16 autocast left on. With it, a default dtype,
    # a thread count, a logger level and an environment variable the test's own code changed.
    monkeypatch.delenv("HF_LOWPREC_GUARD_PROBE", raising=False)
    before = snapshot()
    threads = torch.get_num_threads()
    level = logging.getLogger("transformers").level
    try:
        torch.set_autocast_enabled("cpu", True)
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(threads + 1)
        logging.getLogger("transformers").setLevel(logging.CRITICAL)
        os.environ["HF_LOWPREC_GUARD_PROBE"] = "1"
        found = changes(before, snapshot())
    finally:
        restore(before)
    assert found == [
        "os.environ['HF_LOWPREC_GUARD_PROBE']: 'unset' before the test, '1' after",
        f"logging.getLogger('transformers').level: {level!r} before the test, {logging.CRITICAL!r} after",
        "torch.get_default_dtype(): torch.float32 before the test, torch.float64 after",
        f"torch.get_num_threads(): {threads} before the test, {threads + 1} after",
        "torch.is_autocast_enabled('cpu'): False before the test, True after",
    ]
    assert changes(before, snapshot()) == []
    assert "HF_LOWPREC_GUARD_PROBE" not in os.environ and not torch.is_autocast_enabled("cpu")


def test_an_unchanged_process_shows_no_change():
    assert changes(snapshot(), snapshot()) == []
