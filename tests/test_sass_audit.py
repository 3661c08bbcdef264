"""scripts/sass_audit.py's reading of machine code (the compile itself needs a GPU): global loads and
stores by width, registers and stack bytes."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def audit():
    sys.path.insert(0, str(ROOT / "scripts"))  # for its ``import common``
    spec = importlib.util.spec_from_file_location("sass_audit", ROOT / "scripts" / "sass_audit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SASS = """
        /*0140*/                   LDG.E.U16 R4, desc[UR4][R2.64] ;
        /*0150*/                   LDG.E.128 R8, desc[UR4][R6.64] ;
        /*0160*/                   LDG.E.128.CONSTANT R12, desc[UR4][R6.64+0x10] ;
        /*0170*/                   LDG.E R3, desc[UR4][R10.64] ;
        /*0180*/                   LDG.E.64 R16, desc[UR4][R14.64] ;
        /*0190*/                   STG.E.U16 desc[UR4][R2.64], R5 ;
        /*01a0*/                   STG.E.128 desc[UR4][R6.64], R8 ;
        /*01b0*/                   LDGSTS.E.BYPASS.LTC128B.128 [R1], desc[UR4][R2.64] ;
        /*01c0*/                   LDS.128 R8, [R1] ;
"""


def test_global_accesses_are_counted_by_width(audit):
    got = audit.accesses(SASS)
    assert got == {("LDG", 2): 1, ("LDG", 16): 2, ("LDG", 4): 1, ("LDG", 8): 1, ("STG", 2): 1, ("STG", 16): 1,
                   ("LDGSTS", 16): 1}


def test_registers_and_stack_are_read_from_the_resource_usage(audit):
    usage = "Function _qk_norm_rope_fwd_kernel:\n  REG:62 STACK:0 SHARED:256 LOCAL:0 CONSTANT[0]:600"
    assert audit.resources(usage) == (62, 0)
