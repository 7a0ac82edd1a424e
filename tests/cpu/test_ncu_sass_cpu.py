"""tools/ncu_sass.py: reading an ncu SASS source export (no GPU, no ncu: a synthetic export)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import ncu_sass  # noqa: E402

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"Instructions Executed","stall_wait","stall_barrier","stall_wait (Not Issued)"\n')


def _export(tmp_path, kernels):
    text = ""
    for name, lines in kernels.items():
        text += f'"Kernel Name","{name}",\n' + HEADER
        for addr, src, samples, executed, wait, barrier in lines:
            text += f'"{addr}","{src}","{samples}","0","{executed}","{wait}","{barrier}","0"\n'
    path = tmp_path / "x.sass.csv"
    path.write_text(text)
    return str(path)


def test_opcodes_and_kernels(tmp_path):
    path = _export(tmp_path, {
        "small_kernel": [("0x10", "MOV R1, R2", "1", "10", "1", "0")],
        "main_kernel": [("0x20", "@!P0  ISETP.GE.AND P1, PT, R3, R4, PT", "5", "1,000", "3", "2"),
                        ("0x30", "LDG.E.128 R4, desc[UR4][R2.64]", "7", "500", "0", "7"),
                        ("0x40", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24", "2", "100", "2", "0")],
    })
    kernels = ncu_sass.read_kernels(path)
    assert set(kernels) == {"small_kernel", "main_kernel"}
    assert ncu_sass.pick(kernels, None) == "main_kernel"  # the most executed instructions
    assert ncu_sass.pick(kernels, "small") == "small_kernel"
    s = ncu_sass.summary(kernels["main_kernel"])
    assert s["ops"] == {"ISETP": 1000, "LDG.E": 500, "HGMMA": 100}  # predicate and modifiers dropped
    assert s["stalls"] == {"wait": 5, "barrier": 9} and s["total"] == 1600
    assert ncu_sass.main([path, path, "--top", "3"]) == 0


def test_by_opcode(tmp_path, capsys):
    """--by-opcode: stall samples per opcode and reason, the opcodes that differ most between the two
    files first."""
    a = _export(tmp_path, {"k": [("0x10", "MUFU.EX2 R1, R1", "9", "100", "8", "1"),
                                 ("0x20", "F2FP.BF16.F32.PACK_AB R2, R3, R4", "6", "100", "6", "0")]})
    s_a = ncu_sass.summary(ncu_sass.read_kernels(a)["k"])
    assert s_a["by_op"]["MUFU"] == {"wait": 8, "barrier": 1} and s_a["by_op"]["F2FP"] == {"wait": 6, "barrier": 0}
    b_dir = tmp_path / "b"
    b_dir.mkdir()
    b = _export(b_dir, {"k": [("0x10", "MUFU.EX2 R1, R1", "8", "100", "7", "1"),
                              ("0x20", "F2FP.BF16.F32.PACK_AB R2, R3, R4", "0", "100", "0", "0")]})
    assert ncu_sass.main([a, b, "--by-opcode", "--top", "2"]) == 0
    out = capsys.readouterr().out
    section = out.split("stall samples by opcode and reason")[1].split("hottest lines")[0].strip().splitlines()
    assert section[1].split()[:2] == ["F2FP", "6/0"] and section[2].split()[:2] == ["MUFU", "9/8"], section
    assert "wait=6/0" in section[1]


def test_same_kernel_profiled_twice(tmp_path):
    """One kernel name profiled for two configs (tools/ab_pages.py --ncu: contiguous / paged share the
    forward's name): each section kept, the later ones as "NAME #2", "NAME #3", in profile order."""
    text = ""
    for executed in ("10", "20", "30"):
        text += '"Kernel Name","fwd",\n' + HEADER + f'"0x10","MOV R1, R2","1","0","{executed}","1","0","0"\n'
    path = tmp_path / "twice.sass.csv"
    path.write_text(text)
    kernels = ncu_sass.read_kernels(str(path))
    assert list(kernels) == ["fwd", "fwd #2", "fwd #3"]
    assert [ncu_sass.summary(rows)["total"] for rows in kernels.values()] == [10, 20, 30]
    assert ncu_sass.pick(kernels, "fwd") == "fwd #3"
