"""The only reader of FLASH4_* environment settings.

| variable           | meaning                                              | default                    |
| ------------------ | ---------------------------------------------------- | -------------------------- |
| FLASH4_ARCH        | SM version to use instead of the device's, e.g. 90   | the device's (arch.py)     |
| FLASH4_NUM_SMS     | SM count to use instead of the device's              | the device's (arch.py)     |
| FLASH4_CACHE       | 0 disables the on-disk compile cache                 | on                         |
| FLASH4_CACHE_DIR   | directory of the on-disk compile cache               | $XDG_CACHE_HOME/flash4 or ~/.cache/flash4 |
| FLASH4_BWD_HEADS_PER_CTA | query heads per backward CTA under GQA/MQA (tuning) | flash4.config.bwd_heads_per_cta |
| FLASH4_PAGE_GATHER_MAX | paged K/V: gather pages of at most this many rows (0 = TMA pieces for every multiple of 8; A/B) | flash4.config.PAGE_GATHER_MAX |
| FLASH4_SMALL_PAGES | 0 refuses paged K/V whose page size is not a multiple of 8 (by default any page size >= 1 is served; those pages are gathered row by row) | on |
| FLASH4_PAGE_DIVIDE_FREE | 0 turns off: TMA page pieces that are whole pages find their page without dividing by the page size (FwdConfig.page_divide_free; A/B) | flash4.config.PAGE_DIVIDE_FREE (on) |
| FLASH4_PAGE_ROW_SHUFFLE | 0 turns off: the paged prefill's four-warp TMA pieces of pages holding several pieces shuffle their row block instead of dividing (below head dim 128, and 8-row pieces at every head dim), and 8-row pieces load by TMA instead of gathered below head dim 128 (FwdConfig.page_row_shuffle; A/B) | flash4.config.PAGE_ROW_SHUFFLE (on) |
| FLASH4_PAGE_PREFETCH | paged K/V by TMA pieces: read page-table entries two blocks ahead (0/1; A/B) | flash4.config.PAGE_PREFETCH |
| FLASH4_GATHER_ZERO_FILL | gathered paged K/V: the producer zero-fills rows past seqlen_k (0/1; A/B) | flash4.config.GATHER_ZERO_FILL |
| FLASH4_PAGED_KV_STAGES | paged prefill on sm90: K/V pipeline stages (2 or 3; 3 only where smem allows; A/B) | flash4.config.PAGED_KV_STAGES (3 for TMA pieces of <= 32 rows with the look-ahead) |
| FLASH4_SM100       | sm_100 kernels: off, selftest (run after passing flash4.selftest), on (unchecked) | selftest |
| FLASH4_PORTABLE    | the portable (sm80) family on its own GPUs (sm_80/86/89/120): off, selftest (run after passing flash4.selftest), on (unchecked); not read where it is forced (FLASH4_FAMILY=portable on sm_90) | selftest |
| FLASH4_SM100_2CTA  | 1 selects the 2-CTA sm_100 kernels (cluster of 2, M = 256 across the pair) where they are built: the forward at hd128 non-causal dense, the backward at hd128 and (192, 128) (full or causal, not deterministic, no window, dense); compile-verified, not run on hardware | off |
| FLASH4_RUNTIME_LOAD | 0 loads cached kernels through the CuTe DSL's loader instead of as shared libraries through TVM-FFI alone (no CuTe DSL import; docs/design/warm_start.md) | on |
| FLASH4_NARROW_HEADDIMS | 0 turns off: flash_attn_func without autograd, for a head dim flash4.headdim pads (32, 80, 112, ...), runs the padded kernel straight from the narrow tensors (TMA zero-fill, clipped O store; FwdConfig.tensor_hdims) instead of on zero-padded copies; same bits, 1.22-1.58x on the H200 (2026-12-04) | on |
| FLASH4_HEADDIM16   | 0 turns off: on sm_90, head dims that are multiples of 16 up to 128 (16, 32, 48, 80, 112) run on kernels of their own width instead of zero-padded to 64 / 96 / 128, in the forward and the backward, and the other multiples of 8 up to 128 pad to the next multiple of 16 (flash4.config.sm90.KERNEL_HEADDIMS; H200 2026-12-04 night: backward 1.03-1.64x) | on |
| FLASH4_CACHE_HEADDIM16 | a KV cache (flash_attn_with_kvcache) or a paged pool (flash_attn_varlen_func with page_table) may have any head dim the GPU's family has a kernel for (sm_90: every multiple of 16 up to 128, flash4.config.sm90.KERNEL_HEADDIMS, while FLASH4_HEADDIM16 is on) instead of 64 / 96 / 128 / 192 / 256 only; 0 refuses those (tests/gpu/test_cache_headdim16.py: 94 passed on an H100, 2026-12-05) | on |
| FLASH4_MEMO        | 0 turns off prepared calls (flash4.memo: a door's host path, and the dense backward's plan, kept per argument signature) | on |
| FLASH4_PACK_VIEWS  | 0 copies q / out / lse of a GQA-packed decode step instead of strided views | on |
| FLASH4_DECODE_COMBINE | 0 turns off: a split-KV decode step's combine merges with the split LSEs in registers and several splits' loads in flight, and is launched by programmatic dependent launch when the step has 4 splits or more (FwdConfig.combine_prefetch / pdl_combine; A/B) | flash4.config.COMBINE_PREFETCH, PDL_COMBINE_MIN_SPLITS (on) |
| FLASH4_DECODE_SCATTER | 0 turns off: flash_attn_varlen_func's decode step (paged, max_seqlen_q <= 8, out / lse allocated by flash4), when it splits the keys, has the split-KV combine write the varlen out / lse rows by cu_seqlens_q (no step buffers, no searchsorted or scatter); on since the H200 A/B (varlen_paged eager / graph 1.4 -> 1.0) | on |
| FLASH4_POSTPROCESS_WIDE | 0: the dQ postprocess's 8-byte stores instead of its 16-byte ones (A/B) | flash4.config.POSTPROCESS_WIDE_STORES (on) |
| FLASH4_FAMILY      | kernel family to run instead of the GPU's own: portable (= sm80: mma.sync, runs on sm_80..sm_120 and sm_90), or a family name (sm90, sm80, sm100) | the GPU's (flash4.kernels.registry) |
| FLASH4_BWD_SWITCHES | sm90 backward speed switches to turn on where they apply, comma-separated (dq_whole, dq_handoff_per_wg, lse_early, exp_before_dp_wait, mask_rel: flash4.constants.BWD_SPEED_SWITCHES; no_tail_guard, A/B only: leaks stale memory past a sequence's end); A/B and GPU tests of candidates | none |
| FLASH4_FWD_SWITCHES | sm90 forward speed switches to turn on, comma-separated (softmax_vote_first, lookahead_qk (Dv < D where it fits), mask_bits, rescale_always, pv_zero_init, flat_tile_order, split_row_max, softmax_branch_free (instead of softmax_vote_first), gather_clamp_late, gather_ptr_shuffle (gathered pages), page_pieces_all_warps (TMA page pieces with the look-ahead), pin_p_convert (P in registers), page_divide_free, page_row_shuffle (TMA page pieces), pdl_combine, combine_prefetch (split-KV decode: the combine by programmatic dependent launch; its merge with staged loads): flash4.constants.FWD_SPEED_SWITCHES; no_tail_guard, A/B only: leaks stale memory past a sequence's end); A/B and GPU tests of candidates | none |
| FLASH4_PORTABLE_BWD | the portable (sm80) backward's tiles where a candidate applies: coal, fa2, m128, fa2e, fa2s, fa2w, and the step-order switches fa2wq, fa2wp, fa2wpq, fa2sq, fa2sp, fa2spq and their one-buffer fa2w1, fa2wp1, fa2wpq1, fa2sp1, fa2spq1, the split-dP fa2wps, fa2wpqs, fa2sps, fa2spqs (flash4.config.sm80.BWD_CANDIDATES) or table (its table); A/B and GPU tests | fa2w (d64) / fa2s (d128; fa2 on sm_80) for plain dense problems (flash4.config.sm80.shipped_bwd_candidate), else the table |

Each function reads the environment when called (no caching), so a test can set a variable with
monkeypatch. A malformed value raises ValueError naming the variable, the value and what is allowed.
"""

from __future__ import annotations

import os


def _get(name: str) -> str | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip()


def arch_override() -> int | None:
    """SM version from FLASH4_ARCH, or None when unset.

    Accepts "90", "sm_90", "sm_90a", "sm90" and "9.0"; returns e.g. 90.
    """
    value = _get("FLASH4_ARCH")
    if value is None:
        return None
    text = value.lower().removeprefix("sm_").removeprefix("sm").rstrip("a")
    try:
        if "." in text:
            major, minor = text.split(".")
            arch = int(major) * 10 + int(minor)
        else:
            arch = int(text)
    except ValueError:
        arch = -1
    if arch < 10:
        raise ValueError(f"FLASH4_ARCH={value!r} is not an SM version; allowed forms: 90, sm_90, sm_90a, 9.0")
    return arch


def _positive_int(name: str, example: str) -> int | None:
    """The positive integer in variable `name`, None when unset; ValueError naming it otherwise."""
    value = _get(name)
    if value is None:
        return None
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer, e.g. {example}")
    return count


def num_sms_override() -> int | None:
    """SM count from FLASH4_NUM_SMS (a positive integer), or None when unset."""
    return _positive_int("FLASH4_NUM_SMS", "132")


def _flag(name: str) -> bool | None:
    """The boolean in variable `name` (0/1, true/false, on/off, yes/no), None when unset."""
    value = _get(name)
    if value is None:
        return None
    text = value.lower()
    if text in ("0", "false", "off", "no"):
        return False
    if text in ("1", "true", "on", "yes"):
        return True
    raise ValueError(f"{name}={value!r}: allowed 0/1, true/false, on/off, yes/no")


def disk_cache_enabled() -> bool:
    """False when FLASH4_CACHE is 0/false/off/no; True when unset or 1/true/on/yes."""
    value = _flag("FLASH4_CACHE")
    return True if value is None else value


def small_pages() -> bool:
    """FLASH4_SMALL_PAGES (0/1, true/false, on/off, yes/no; default on): paged K/V whose page size is not
    a multiple of 8 (pages of 1-7 rows, 12, 20, ...) run on the gathered path (FwdConfig.page_gather).
    Off, such page sizes are a ValueError. On by default since its GPU tests passed on the H200
    (tests/gpu/test_small_pages.py, 2026-12-02)."""
    value = _flag("FLASH4_SMALL_PAGES")
    return True if value is None else value


def narrow_headdims() -> bool:
    """FLASH4_NARROW_HEADDIMS (0/1, true/false, on/off, yes/no); on when unset: a no-grad dense
    forward of a padded head dim reads the narrow tensors (flash4.forward.launch_narrow) instead of
    zero-padded copies. Read per call (a flash4.env.PLAN_VARIABLES entry: the memo keys on it)."""
    value = _flag("FLASH4_NARROW_HEADDIMS")
    return True if value is None else value


def headdim16() -> bool:
    """FLASH4_HEADDIM16 (0/1, true/false, on/off, yes/no); on when unset: on sm_90, flash_attn_func /
    flash_attn_varlen_func run every head dim that is a multiple of 16 up to 128 (16, 32, 48, 80, 112)
    on kernels of that width instead of zero-padding it to 64 / 96 / 128 (other multiples of 8 pad to
    the next multiple of 16; flash4.config.sm90.KERNEL_HEADDIMS, flash4.headdim). Read per call (a
    flash4.env.PLAN_VARIABLES entry: the memo keys on it)."""
    return _flag("FLASH4_HEADDIM16") is not False


def cache_headdim16() -> bool:
    """FLASH4_CACHE_HEADDIM16 (0/1, true/false, on/off, yes/no); on when unset: a KV cache or a paged
    pool may have any head dim of the GPU family's kernels (flash4.headdim.cache_headdims: on sm_90
    every multiple of 16 up to 128), not only flash4.config.SUPPORTED_HEADDIMS; off, those are
    refused. On by default since its GPU tests (tests/gpu/test_cache_headdim16.py) passed on an H100
    (2026-12-05). Read per call (a PLAN_VARIABLES entry: the memo keys on it)."""
    return _flag("FLASH4_CACHE_HEADDIM16") is not False


def decode_combine() -> bool | None:
    """FLASH4_DECODE_COMBINE (0/1, true/false, on/off, yes/no), or None when unset: whether split-KV
    decode steps use the prefetching combine and its programmatic dependent launch
    (flash4.config.sm90.decode_combine_policy; on by default). Read per call (a PLAN_VARIABLES entry)."""
    return _flag("FLASH4_DECODE_COMBINE")


def page_prefetch() -> bool | None:
    """FLASH4_PAGE_PREFETCH (0/1, true/false, on/off, yes/no), or None when unset: paged K/V loaded by
    TMA page pieces read each block's page-table entries two loads ahead (FwdConfig.page_prefetch; on
    by default, flash4.config.PAGE_PREFETCH). For A/B measurements."""
    return _flag("FLASH4_PAGE_PREFETCH")


def page_divide_free() -> bool | None:
    """FLASH4_PAGE_DIVIDE_FREE (0/1, true/false, on/off, yes/no), or None when unset: whether TMA page
    pieces that are whole pages find their page without dividing by the page size
    (FwdConfig.page_divide_free; on by default, flash4.config.PAGE_DIVIDE_FREE)."""
    return _flag("FLASH4_PAGE_DIVIDE_FREE")


def page_row_shuffle() -> bool | None:
    """FLASH4_PAGE_ROW_SHUFFLE (0/1, true/false, on/off, yes/no), or None when unset: whether the paged
    prefill's four-warp TMA pieces of pages that hold several pieces take their row block from the
    lane that looked the piece up, and pieces of 8 rows load by TMA below head dim 128 instead of
    being gathered (FwdConfig.page_row_shuffle; on by default, flash4.config.PAGE_ROW_SHUFFLE)."""
    return _flag("FLASH4_PAGE_ROW_SHUFFLE")


def page_pieces_all_warps() -> bool | None:
    """FLASH4_PAGE_PIECES_ALL_WARPS (0/1, true/false, on/off, yes/no), or None when unset: the paged
    prefill loads pages that are multiples of 8 rows by TMA page pieces, pieces of at most 32 rows issued
    by all four producer warps (FwdConfig.page_pieces_all_warps; on by default,
    flash4.config.PAGE_PIECES_ALL_WARPS), instead of gathering pages of 8 and 16 rows and issuing every
    piece from one warp. For A/B measurements (a PLAN_VARIABLES entry: the memo keys on it)."""
    return _flag("FLASH4_PAGE_PIECES_ALL_WARPS")


def gather_zero_fill() -> bool | None:
    """FLASH4_GATHER_ZERO_FILL (0/1, true/false, on/off, yes/no), or None when unset: the gathered
    paged path's producer zero-fills K/V rows past seqlen_k (FwdConfig.gather_zero_fill). For A/B
    measurements."""
    return _flag("FLASH4_GATHER_ZERO_FILL")


def paged_kv_stages() -> int | None:
    """FLASH4_PAGED_KV_STAGES (2 or 3), or None when unset: K/V pipeline stages of the sm90 paged
    prefill forward (flash4.config.sm90.with_paged_kv_stages; 3 only where smem allows). For A/B
    measurements."""
    value = _get("FLASH4_PAGED_KV_STAGES")
    if value is None:
        return None
    if value not in ("2", "3"):
        raise ValueError(f"FLASH4_PAGED_KV_STAGES={value!r}: allowed 2 or 3")
    return int(value)


def postprocess_wide() -> bool | None:
    """FLASH4_POSTPROCESS_WIDE (0/1, true/false, on/off, yes/no), or None when unset: the dQ
    postprocess's 16-byte stores (flash4.config.POSTPROCESS_WIDE_STORES, on by default). For A/B
    measurements."""
    return _flag("FLASH4_POSTPROCESS_WIDE")


def portable_bwd_candidate() -> str | None:
    """FLASH4_PORTABLE_BWD (a name of flash4.config.sm80.BWD_CANDIDATES or "table", lowercase), or None
    when unset (the shipped choice): the portable backward runs that candidate where it applies, or
    its table (flash4.config.sm80.bwd_plan, which rejects an unknown name). For A/B measurements and
    GPU tests."""
    value = _get("FLASH4_PORTABLE_BWD")
    return None if value is None else value.lower()


def runtime_load_enabled() -> bool:
    """FLASH4_RUNTIME_LOAD: cached kernels are linked into shared libraries when stored and loaded
    through TVM-FFI alone, without importing the CuTe DSL (flash4.compile.disk_cache). On by
    default (0: every cached kernel through the CuTe DSL's loader): on the H200 a warm process's
    import flash4 + first forward and backward took 0.20-0.39 s with it, 3.4-3.8 s without
    (tools/warm_start.py, 2026-12-02, night)."""
    return _flag("FLASH4_RUNTIME_LOAD") is not False


def memo_enabled() -> bool:
    """FLASH4_MEMO: prepared calls (flash4.memo: a door's host path kept per argument signature; since
    2026-12-03 night also the dense backward's, flash4.backward.PreparedBackward: 449 + 322 GPU tests).
    On by default (0 turns it off): tests/gpu/test_memo.py and the door files passed with it on the
    H200 (2026-12-02, night), where it brought eager decode to 1.01-1.03x its CUDA-graph replay."""
    return _flag("FLASH4_MEMO") is not False


def pack_views_enabled() -> bool:
    """FLASH4_PACK_VIEWS: the GQA-packed decode step reads q and writes out / lse through strided
    views instead of copies (flash4.forward.PACK_VIEWS). On by default (0: copies): tests/gpu/test_memo.py's
    bitwise check passed on the H200 (2026-12-02, night)."""
    return _flag("FLASH4_PACK_VIEWS") is not False


def decode_scatter() -> bool:
    """FLASH4_DECODE_SCATTER (0/1, true/false, on/off, yes/no; default on): a varlen door's decode
    step (flash4.forward._packed_decode, flash4.memo's prepared varlen call) whose plan splits the
    keys, into out / lse that flash4 allocated, hands the combine kernel the varlen out / lse and
    cu_seqlens_q (its packed-rows variant, kernels/common/fwd_combine.py) instead of scattering the
    step's (B, Sq, H, Dv) buffers into them afterwards: two allocations, a searchsorted and two
    gathers fewer per call. On since its GPU A/B (H200, 2026-12-03 night: tests/gpu/test_decode_scatter.py
    65 passed, bitwise against off; tools/host_overhead.py --env FLASH4_DECODE_SCATTER=0,1: varlen_paged
    eager / graph 197.2 / 140.6 -> 138.5 / 136.3 us at batch 1 x 128k keys, 1.4 -> 1.0); 0 turns it off.
    Read per call (a flash4.env.PLAN_VARIABLES entry: the memo keys on it)."""
    return _flag("FLASH4_DECODE_SCATTER") is not False


def disk_cache_dir() -> str:
    """FLASH4_CACHE_DIR, else $XDG_CACHE_HOME/flash4, else ~/.cache/flash4 (not created here)."""
    value = _get("FLASH4_CACHE_DIR")
    if value is not None:
        return os.path.expanduser(value)
    base = _get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "flash4")


def bwd_heads_per_cta_override() -> int | None:
    """FLASH4_BWD_HEADS_PER_CTA (a positive integer), or None when unset: the GQA/MQA backward's
    query heads per CTA instead of flash4.config.bwd_heads_per_cta's choice (for measurements)."""
    return _positive_int("FLASH4_BWD_HEADS_PER_CTA", "1 or 4")


def page_gather_max() -> int | None:
    """FLASH4_PAGE_GATHER_MAX (an integer >= 0), or None when unset: paged K/V whose pages hold at most
    this many rows are gathered row by row instead of loaded by TMA page pieces (flash4.config.
    paged_layout; pages that are not multiples of 8 rows are always gathered). For A/B measurements."""
    value = _get("FLASH4_PAGE_GATHER_MAX")
    if value is None:
        return None
    try:
        rows = int(value)
    except ValueError:
        rows = -1
    if rows < 0:
        raise ValueError(f"FLASH4_PAGE_GATHER_MAX={value!r} must be an integer >= 0, e.g. 0 (off) or 32")
    return rows


# The modes of a self-test gate (flash4.selftest; the gated families and their variables are
# flash4.kernels.registry's: FLASH4_SM100, FLASH4_PORTABLE).
SELFTEST_MODES = ("off", "selftest", "on")
SM100_MODES = SELFTEST_MODES


def sm100_2cta() -> bool:
    """FLASH4_SM100_2CTA (0/1, true/false, on/off, yes/no; default off): the sm_100 kernels take their
    2-CTA variants (flash4.config.sm100: cta_group 2) for the problems they are built for (forward:
    head dim 128, non-causal, no window, dense batches; backward: hd128 and (192, 128), full or
    causal, not deterministic, no window, dense). Off, every sm_100 kernel is 1-CTA: the 2-CTA protocol
    (cluster barriers, leader-only MMA, pair-wide TMEM dealloc) is compile-verified only
    (BLACKWELL.md R3). Either way the self-test (FLASH4_SM100) gates the config it selects."""
    return bool(_flag("FLASH4_SM100_2CTA"))


def selftest_mode(name: str) -> str:
    """A self-test gate's mode variable `name` (Family.selftest_var): "off" (never run that family's
    kernels on its own GPUs), "selftest" (run each config only after its first-use self-test passed,
    flash4.selftest; the default) or "on" (run them unchecked). ValueError naming the variable."""
    value = _get(name)
    if value is None:
        return "selftest"
    if value.lower() not in SELFTEST_MODES:
        raise ValueError(f"{name}={value!r}: allowed {', '.join(SELFTEST_MODES)} (default selftest)")
    return value.lower()


def sm100_mode() -> str:
    """FLASH4_SM100: "off" (never run the sm_100 kernels), "selftest" (run each config only after its
    first-use self-test passed, flash4.selftest; the default) or "on" (run them unchecked)."""
    return selftest_mode("FLASH4_SM100")


def portable_mode() -> str:
    """FLASH4_PORTABLE: the same modes for the portable (sm80) family on its own GPUs (sm_80 / 86 / 89
    / 120); with FLASH4_FAMILY=portable on sm_90 it is forced by the user and not gated."""
    return selftest_mode("FLASH4_PORTABLE")


# FLASH4_FAMILY aliases: what users call a family -> its registry name (flash4.kernels.registry).
FAMILY_ALIASES = {"portable": "sm80"}


def family_override() -> str | None:
    """FLASH4_FAMILY as a family name (lowercase, aliases resolved: "portable" -> "sm80"), or None
    when unset. flash4.kernels.registry.family checks the name and whether it runs on the GPU."""
    value = _get("FLASH4_FAMILY")
    if value is None:
        return None
    name = value.lower()
    return FAMILY_ALIASES.get(name, name)


def force_family(name: str) -> None:
    """Set FLASH4_FAMILY for this process (e.g. "portable": `python -m flash4 bench --family portable`);
    every later config selection reads it (family_override)."""
    os.environ["FLASH4_FAMILY"] = name


def _speed_switches(variable: str, allowed: tuple) -> tuple:
    """The comma-separated switch names of `variable` as a tuple (() when unset); a name outside
    `allowed` raises ValueError naming the allowed ones."""
    value = _get(variable)
    if value is None:
        return ()
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    bad = [n for n in names if n not in allowed]
    if bad:
        raise ValueError(f"{variable}={value!r}: unknown switch {bad}; allowed: {', '.join(allowed)}")
    return names


def bwd_switches() -> tuple:
    """FLASH4_BWD_SWITCHES: the sm90 backward speed switches (flash4.constants.BWD_SPEED_SWITCHES)
    to turn on where each applies (flash4.config.sm90.with_bwd_switches), as a tuple of names; () when
    unset. For A/B runs and GPU tests of candidates. An unknown name raises ValueError."""
    from flash4.constants import BWD_SPEED_SWITCHES

    return _speed_switches("FLASH4_BWD_SWITCHES", BWD_SPEED_SWITCHES)


def fwd_switches() -> tuple:
    """FLASH4_FWD_SWITCHES: the sm90 forward speed switches (flash4.constants.FWD_SPEED_SWITCHES) to
    turn on (flash4.config.sm90.with_fwd_switches), as a tuple of names; () when unset. For A/B runs
    and GPU tests of candidates. An unknown name raises ValueError."""
    from flash4.constants import FWD_SPEED_SWITCHES

    return _speed_switches("FLASH4_FWD_SWITCHES", FWD_SPEED_SWITCHES)


# The variables a forward call's plan reads (SM version and count, family, page policy, self-test
# gates, the sm_100 2-CTA switch, the decode step's row scatter): flash4.memo keys its prepared
# calls on their raw values.
PLAN_VARIABLES = ("FLASH4_ARCH", "FLASH4_NUM_SMS", "FLASH4_FAMILY", "FLASH4_SMALL_PAGES", "FLASH4_PAGE_GATHER_MAX",
                  "FLASH4_PAGE_PREFETCH", "FLASH4_SM100", "FLASH4_PORTABLE", "FLASH4_SM100_2CTA",
                  "FLASH4_GATHER_ZERO_FILL", "FLASH4_PAGED_KV_STAGES", "FLASH4_BWD_SWITCHES",
                  "FLASH4_FWD_SWITCHES", "FLASH4_DECODE_SCATTER", "FLASH4_NARROW_HEADDIMS", "FLASH4_HEADDIM16",
                  "FLASH4_CACHE_HEADDIM16", "FLASH4_PAGE_PIECES_ALL_WARPS", "FLASH4_PAGE_DIVIDE_FREE",
                  "FLASH4_PAGE_ROW_SHUFFLE", "FLASH4_DECODE_COMBINE")
_PLAN_KEYS = tuple(os.environ.encodekey(name) for name in PLAN_VARIABLES)


# What the backward's plan reads besides PLAN_VARIABLES (flash4.memo.dense_backward_key keeps both).
BWD_PLAN_VARIABLES = ("FLASH4_BWD_HEADS_PER_CTA", "FLASH4_POSTPROCESS_WIDE", "FLASH4_PORTABLE_BWD")
_BWD_PLAN_KEYS = tuple(os.environ.encodekey(name) for name in BWD_PLAN_VARIABLES)


def bwd_plan_snapshot() -> tuple:
    """plan_snapshot() followed by the raw values of BWD_PLAN_VARIABLES (the same reads)."""
    data = getattr(os.environ, "_data", None)
    if data is None:
        return plan_snapshot() + tuple(os.environ.get(name) for name in BWD_PLAN_VARIABLES)
    return tuple(map(data.get, _PLAN_KEYS)) + tuple(map(data.get, _BWD_PLAN_KEYS))


def plan_snapshot() -> tuple:
    """The raw values (None when unset) of PLAN_VARIABLES, read now: one dict lookup each in the
    process environment's mapping (os.environ._data, which os.environ[...] = ... and
    monkeypatch.setenv update), about 1 us for all, where os.environ.get costs ~0.7 us each."""
    data = getattr(os.environ, "_data", None)
    if data is None:  # not CPython's os._Environ: the public (slower) reads
        return tuple(os.environ.get(name) for name in PLAN_VARIABLES)
    return tuple(map(data.get, _PLAN_KEYS))
