"""The op tables name ops the installed torch has: a misspelled overload would make a
rule that never fires."""

import importlib
import pkgutil

import pytest

import fx16
from fx16.ops import tables


def test_every_name_the_tables_give_resolves_on_this_torch():
    """Every module loaded (each defines its tables as it loads), then the list of names
    the tables skipped is empty: on an older torch it may name an op added since."""
    for module in pkgutil.walk_packages(fx16.__path__, "fx16."):
        if module.name != "fx16.__main__":  # which would run the command
            importlib.import_module(module.name)
    assert tables.UNRESOLVED == []


def test_a_name_that_does_not_resolve_raises_naming_it():
    with pytest.raises(LookupError, match="'sofmax.int' names no ATen op"):
        tables.overloads("softmax.int", "sofmax.int")
    with pytest.raises(LookupError, match="'no_such_packet'"):
        tables.every_overload("no_such_packet")


def test_an_optional_name_the_installed_torch_lacks_is_recorded_not_raised():
    before = len(tables.UNRESOLVED)
    try:
        found = tables.overloads("softmax.int", optional=("newer_op.default",))
        assert found == {tables.aten.softmax.int}
        assert tables.every_overload(optional=("no_such_packet",)) == frozenset()
        assert tables.UNRESOLVED[before:] == ["newer_op.default", "no_such_packet"]
    finally:
        del tables.UNRESOLVED[before:]
