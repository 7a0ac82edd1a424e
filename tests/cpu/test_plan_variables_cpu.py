"""flash4.memo keys each prepared call by the environment the plan reads (flash4.env.PLAN_VARIABLES,
BWD_PLAN_VARIABLES): a variable that a plan function reads but the key leaves out lets a switch flipped
between two calls of the same shapes reach a stale plan (FLASH4_PAGE_PIECES_ALL_WARPS was such a case,
2026-12-05, found in review). This test reads the sources: every flash4.env reader called from the plan
modules (src/flash4/config/) reads only variables of the memo's key."""

import ast
import pathlib
import re

import flash4
from flash4 import env

SRC = pathlib.Path(flash4.__file__).parent


def _env_readers() -> dict:
    """{function name in flash4/env.py: the FLASH4_* names it reads, directly or through other env
    functions it calls}."""
    tree = ast.parse((SRC / "env.py").read_text())
    direct, calls = {}, {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            names = {n.value for n in ast.walk(node)  # variable names only, not docstrings or messages
                     if isinstance(n, ast.Constant) and isinstance(n.value, str)
                     and re.fullmatch(r"FLASH4_[A-Z0-9_]+", n.value)}
            direct[node.name] = names
            calls[node.name] = {n.func.id for n in ast.walk(node)
                                if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    out = {}
    for name in direct:
        seen, todo, names = set(), [name], set()
        while todo:
            f = todo.pop()
            if f in seen or f not in direct:
                continue
            seen.add(f)
            names |= direct[f]
            todo += list(calls[f])
        out[name] = names
    return out


def _plan_module_env_calls() -> set:
    """Names of the flash4.env functions the plan modules (flash4/config/*.py) call as env.<name>(...)."""
    out = set()
    for path in (SRC / "config").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "env"):
                out.add(node.func.attr)
    return out


def test_plan_readers_are_memo_keys():
    readers = _env_readers()
    keyed = set(env.PLAN_VARIABLES) | set(env.BWD_PLAN_VARIABLES)
    called = _plan_module_env_calls()
    assert called and called <= set(readers), called - set(readers)
    missing = {f: sorted(readers[f] - keyed) for f in called if readers[f] - keyed}
    assert not missing, f"plan readers whose variables the memo does not key on: {missing}"


def test_readers_found():
    """The source reader itself: known readers map to their variables."""
    readers = _env_readers()
    assert readers["page_pieces_all_warps"] == {"FLASH4_PAGE_PIECES_ALL_WARPS"}
    assert readers["page_row_shuffle"] == {"FLASH4_PAGE_ROW_SHUFFLE"}
    assert "page_row_shuffle" in _plan_module_env_calls()  # read by the plan (page_row_shuffle_policy)
    assert "FLASH4_FWD_SWITCHES" in readers["fwd_switches"]
