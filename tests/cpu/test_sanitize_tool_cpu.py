"""tools/sanitize.py on the CPU (its cases need a GPU): the case lists it prints are the ones it runs."""

import os
import subprocess
import sys

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "sanitize.py")
sys.path.insert(0, os.path.dirname(TOOL))

import sanitize  # noqa: E402


def _listed(*flags):
    out = subprocess.run([sys.executable, TOOL, "--list", *flags], capture_output=True, text=True, check=True).stdout
    return tuple(out.split())


def test_lists_every_case_once():
    assert _listed() == sanitize.CASE_NAMES and len(set(sanitize.CASE_NAMES)) == len(sanitize.CASE_NAMES)
    assert _listed("--bad") == sanitize.BAD_CASE_NAMES
    assert not set(sanitize.CASE_NAMES) & set(sanitize.BAD_CASE_NAMES)
    # every door and page path the serving issue names has a case
    for needed in ("dense", "varlen", "paged_1", "paged_4", "paged_16", "paged_64", "kvcache_dense_split4",
                   "kvcache_batch_idx", "kvcache_paged_1_split3"):
        assert needed in sanitize.CASE_NAMES
