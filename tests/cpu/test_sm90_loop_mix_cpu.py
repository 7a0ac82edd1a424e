"""tools/sm90_loop_mix.py's pure SASS reading (the forward's key-block loop), on a synthetic listing."""

import sm90_loop_mix as tool

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0020*/                   FFMA R2, R2, UR8, -R3 ;
        /*0030*/                   FFMA R4, R4, UR8, -R3 ;
        /*0040*/                   MUFU.EX2 R2, R2 ;
        /*0050*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0060*/               @P0 BRA 0x10 ;
        /*0070*/                   FADD R5, R5, R6 ;
        /*0080*/               @P1 BRA 0x70 ;
        /*0090*/                   EXIT ;
"""


def test_key_block_loop_and_sequence():
    ins = tool.instructions(SASS)
    assert len(ins) == 10 and ins[1] == (0x10, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ")
    assert tool.opcode("@!P0 BRA 0x10") == "BRA" and tool.opcode("@!UP1 FADD R1, R2, R3") == "FADD"
    assert tool.loops(ins) == [(1, 6), (7, 8)]
    assert tool.key_block_loop(ins) == (1, 6)  # the FADD loop has no MUFU.EX2 / HGMMA
    assert tool.sequence(ins, 1, 6) == ("HGMMA.64x64x16.F32.BF16 FFMAx2 MUFU.EX2 WARPGROUP.DEPBAR.LE@0x50 "
                                        "BRA@0x60")
    assert tool.key_block_loop(ins[7:]) is None
