"""Which kernels run on which GPU: (pass, SM version) -> kernel class, and the family's configs.

A kernel family is a folder of kernels (flash4.kernels.sm90, ...) plus a config module
(flash4.config.sm90, ...) with its config classes and pure selection functions. This table is the
only place that maps SM versions to families: config selection (flash4.config.select_*), compiling
(flash4.compile.cache) and the API's support check (flash4.validate) all ask it, so a new family
adds a folder, a config module and an entry here, and touches no host module.

Dispatch is by exact SM version, never `arch >= n`: sm_100 kernels do not run on sm_103, sm_110 or
sm_120 (consumer Blackwell has no tensor memory), so each supported version is listed.

A family can be registered unverified (Family.verified False: compiled and checked on the CPU, never
run on its GPU): `kernel_class` still returns its kernels, so flash4.compile builds them, but
`family(arch)` refuses the arch unless asked with include_unverified=True, so config selection and
the API's support check treat that GPU as unsupported. An unverified family with `selftest_gated`
is served by `family(arch)` all the same, behind a gate instead: the host runs each of its configs
on its own archs only after flash4.selftest's first-use self-test passed on that GPU
(flash4.forward.launch / flash4.backward.launch call `selftest.require`, flash4.validate asks
`selftest.support_problem`). Each gated family names its own mode variable (Family.selftest_var,
read by flash4.env.selftest_mode: off | selftest | on): FLASH4_SM100 for sm100 (B200),
FLASH4_PORTABLE for the portable sm80 family on sm_80 / 86 / 89 / 120. This table is the only place
that says which archs are gated and by which variable (gated_archs, gate_family). A family run on
an arch of its `also_on` (the portable family on sm_90, forced by FLASH4_FAMILY=portable) is not
gated: the user asked for it.

SM versions that are close relatives of a supported one but a different GPU (sm_103 B300, sm_110
Thor, sm_121 GB10) are refused by name (REFUSED_ARCHS), never served by `arch >= n`.

Importing this module imports neither torch nor the CuTe DSL; kernel classes are imported when
asked for. The row-wise passes (backward preprocess, dQ postprocess, split-KV combine) use no
arch-specific instruction and serve every family (ROW_PASSES).
"""

from __future__ import annotations

import dataclasses
import importlib

# The passes a family provides: the attention forward and the backward main kernel.
PASSES = ("fwd", "bwd")

# Arch-neutral row-wise kernels (kernels/common): pass -> "module:Class".
ROW_PASSES = {
    "bwd_preprocess": "flash4.kernels.common.bwd_preprocess:BackwardPreprocess",
    "bwd_postprocess": "flash4.kernels.common.bwd_preprocess:BackwardPostprocess",
    "bwd_postprocess_accum_order": "flash4.kernels.common.bwd_preprocess:BackwardPostprocessAccumOrder",
    "fwd_combine": "flash4.kernels.common.fwd_combine:SplitKVCombine",
}


@dataclasses.dataclass(frozen=True)
class Family:
    """One kernel family.

    name:    its folder under flash4/kernels and module under flash4/config ("sm90").
    archs:   the SM versions it runs on by default (exact matches), e.g. (90,).
    gpus:    what users know those as, for error messages.
    kernels: pass ("fwd", "bwd") -> "module:Class" of the kernel.
    verified: False for a family that is compile-verified only (not run on its hardware yet):
             family() refuses it unless include_unverified=True.
    also_on: SM versions whose own family is the default but which run this one when asked for by
             name (family(arch, prefer=name)): the portable sm80 family on sm_90, for testing.
    selftest_gated: an unverified family that family() serves anyway, each config on the family's
             own archs behind flash4.selftest's first-use self-test on the GPU (those archs are
             gated_archs(), flash4.selftest.GATED_ARCHS).
    selftest_var: the gate's mode variable (FLASH4_SM100, FLASH4_PORTABLE: off | selftest | on,
             flash4.env.selftest_mode), for a selftest_gated family.
    selftest_what: how the gate's messages name the family's kernels ("the sm_100 kernels").
    """

    name: str
    archs: tuple
    gpus: str
    kernels: dict
    verified: bool = True
    also_on: tuple = ()
    selftest_gated: bool = False
    selftest_var: str | None = None
    selftest_what: str = ""

    def __post_init__(self):
        assert not self.selftest_gated or (self.selftest_var and self.selftest_what), (
            f"a self-test-gated family names its mode variable and its kernels: {self.name}")

    @property
    def usable(self) -> bool:
        """family() serves it: verified, or unverified behind the self-test gate."""
        return self.verified or self.selftest_gated

    def has_pass(self, pass_: str) -> bool:
        """The family has a kernel for `pass_` ("fwd", "bwd")."""
        return pass_ in self.kernels

    def config_module(self):
        """flash4.config.<name>: the family's config classes, select_fwd_config, select_bwd_config,
        shipped_fwd_configs, shipped_bwd_configs, and fwd_plan / bwd_plan (a flash4.request.Request ->
        flash4.config.FwdPlan / BwdPlan: what flash4.config.fwd_config / bwd_config ask)."""
        return importlib.import_module(f"flash4.config.{self.name}")

    def kernel_class(self, pass_: str):
        """The kernel class of `pass_` (imports the CuTe DSL). Raises ValueError for a pass the
        family does not have."""
        if pass_ not in self.kernels:
            raise ValueError(f"flash4: the {self.name} family has no '{pass_}' kernel (it has {sorted(self.kernels)})")
        return _load(self.kernels[pass_])


FAMILIES = (
    Family("sm90", (90,), "H100, H200, GH200", {
        "fwd": "flash4.kernels.sm90.fwd:FlashAttentionForwardSm90",
        "bwd": "flash4.kernels.sm90.bwd:FlashAttentionBackwardSm90",
    }),
    # Compile-verified on the CPU only (tests/cpu/test_sm100_*.py), never run on a B200: unverified,
    # served behind the first-use self-test (flash4.selftest). The backward is 1-CTA hd64/hd128 dense
    # (flash4.config.sm100.select_bwd_config names what it refuses).
    Family("sm100", (100,), "B200, GB200", {
        "fwd": "flash4.kernels.sm100.fwd:FlashAttentionForwardSm100",
        "bwd": "flash4.kernels.sm100.bwd:FlashAttentionBackwardSm100",
    }, verified=False, selftest_gated=True, selftest_var="FLASH4_SM100", selftest_what="the sm_100 kernels"),
    # The portable family (mma.sync, ldmatrix, cp.async): the default on sm_80 / 86 / 89 / 120, and on
    # sm_90 when asked for (prefer="sm80", or FLASH4_FAMILY=portable): the same instructions run
    # there, which is how its GPU tests run on the H200 (not gated there: the user asked for it).
    # Compile-verified for every target on the CPU (tests/cpu/test_sm80_*.py); on hardware, run on
    # sm_90a only (its own GPU test files pass on the H200 forced; docs/design/sm80_family.md): on
    # its own GPUs, served behind the first-use self-test (FLASH4_PORTABLE=off|selftest|on).
    Family("sm80", (80, 86, 89, 120), "A100, A10/A40/RTX 30xx, L4/L40/RTX 40xx, RTX 50xx/RTX PRO 6000", {
        "fwd": "flash4.kernels.sm80.fwd:FlashAttentionForwardSm80",
        "bwd": "flash4.kernels.sm80.bwd:FlashAttentionBackwardSm80",
    }, verified=False, also_on=(90,), selftest_gated=True, selftest_var="FLASH4_PORTABLE",
       selftest_what="the portable (sm80 family) kernels"),
)

# Other names of families (FLASH4_FAMILY, prefer=): what users call them -> the registry name.
ALIASES = {"portable": "sm80"}


# Relatives of a supported SM version that are different GPUs: refused by name (never `arch >= n`).
# sm_100a code (tcgen05, the arch-specific "a" target) loads only on sm_100.
REFUSED_ARCHS = {
    101: "Jetson Thor's former SM version (now sm_110); the sm_100a kernels do not run there",
    103: "B300 / GB300 (Blackwell Ultra): a different GPU from sm_100; the sm_100a kernels are not built for it "
         "(no sm_103a kernels yet)",
    110: "Jetson Thor: the sm_100a kernels do not run there (no sm_110a kernels yet)",
    121: "GB10 (DGX Spark): consumer Blackwell without tensor memory, not sm_100 (no sm_121 kernels yet)",
}


def supported_archs() -> tuple:
    """SM versions with verified kernel families (what the API runs without a gate)."""
    return tuple(a for f in FAMILIES if f.verified for a in f.archs)


def gated_archs() -> tuple:
    """SM versions served behind the first-use self-test (the own archs of unverified,
    selftest_gated families; never an also_on arch)."""
    return tuple(a for f in FAMILIES if f.selftest_gated and not f.verified for a in f.archs)


def gate_family(arch) -> Family | None:
    """The unverified, selftest_gated family whose own archs include `arch` (its configs for that
    arch run behind the self-test, by its selftest_var), or None: arch is not gated."""
    for fam in FAMILIES:
        if fam.selftest_gated and not fam.verified and arch in fam.archs:
            return fam
    return None


def selftest_vars() -> tuple:
    """The mode variables of the gated families (FLASH4_SM100, FLASH4_PORTABLE)."""
    return tuple(f.selftest_var for f in FAMILIES if f.selftest_gated and not f.verified)


def family(arch: int, prefer: str | None = None, include_unverified: bool = False) -> Family:
    """The family that runs on SM version `arch`: its default one, or the family named `prefer`
    where that family runs on `arch` (its archs or also_on; e.g. prefer="sm80" on sm_90). Raises
    ValueError naming the arch and the supported ones, or why `prefer` cannot run there, also for
    an unverified family unless include_unverified or the family is selftest_gated (its configs
    then run only once flash4.selftest passed them), and for REFUSED_ARCHS with their reason."""
    known = ", ".join(f"sm_{a} ({f.gpus}{'' if f.verified else ', behind a first-use self-test'})"
                      for f in FAMILIES if f.usable for a in f.archs)
    if prefer is not None:
        prefer = ALIASES.get(prefer, prefer)
        for fam in FAMILIES:
            if fam.name == prefer:
                if arch in fam.archs or arch in fam.also_on:
                    return fam
                runs_on = ", ".join(f"sm_{a}" for a in fam.archs + fam.also_on)
                raise ValueError(f"flash4: the {prefer} kernel family does not run on sm_{arch} (it runs on {runs_on})")
        names = ", ".join(f.name for f in FAMILIES)
        raise ValueError(f"flash4: no kernel family named {prefer!r} (families: {names})")
    if arch in REFUSED_ARCHS:
        raise ValueError(f"flash4 has no kernels for sm_{arch}: {REFUSED_ARCHS[arch]} (GPUs with kernels: {known})")
    for fam in FAMILIES:
        if arch in fam.archs:
            if fam.usable or include_unverified:
                return fam
            opt_in = (f"; FLASH4_FAMILY={alias} runs them anyway, unverified" if (alias := next(
                (a for a, n in ALIASES.items() if n == fam.name), None)) else "")
            raise ValueError(f"flash4's sm_{arch} ({fam.gpus}) kernels are compile-verified only, not yet run on "
                             f"that GPU, and are not enabled (GPUs with kernels: {known}){opt_in}")
    raise ValueError(f"flash4 has no kernels for sm_{arch} yet (GPUs with kernels: {known})")


def by_name(name: str) -> Family:
    """The family called `name` (a registry name or an ALIASES entry). Raises ValueError."""
    name = ALIASES.get(name, name)
    for fam in FAMILIES:
        if fam.name == name:
            return fam
    raise ValueError(f"flash4: no kernel family named {name!r} (families: {', '.join(f.name for f in FAMILIES)})")


def config_family(cfg) -> Family:
    """The family whose config module defines cfg's class (flash4.config.<name>): which kernel
    class compiles `cfg`, whatever arch it targets (an sm80 config for sm_90 runs the sm80 kernels)."""
    module = type(cfg).__module__
    for fam in FAMILIES:
        if module == f"flash4.config.{fam.name}":
            return fam
    # the shared FwdConfig / BwdConfig names re-exported by flash4.config are the sm90 family's
    raise ValueError(f"flash4: {type(cfg).__name__} ({module}) is no family's config class")


def kernel_class(pass_: str, arch: int, prefer: str | None = None):
    """The kernel class of `pass_` on SM version `arch` (family(arch, prefer).kernel_class),
    unverified families included: compiling needs no GPU."""
    return family(arch, prefer, include_unverified=True).kernel_class(pass_)


def row_pass_class(pass_: str):
    """The kernel class of an arch-neutral row-wise pass (ROW_PASSES)."""
    return _load(ROW_PASSES[pass_])


def _load(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
