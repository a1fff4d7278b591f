"""The engine handles implement the roles they have, and only those (issue 41): every handle answers the queries
verify needs (:class:`~hwsync.common.target.EngineQueries`); sync targets send (:class:`~hwsync.common.target.Engine`);
only handles on an in-process ``vllm.LLM`` generate (:class:`~hwsync.common.target.Generating`). No implementation
stands in a role it cannot play with a method that only raises."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

import hwsync
from hwsync.common.errors import UnsupportedSetupError
from hwsync.common.target import Engine, EngineQueries, Generating
from hwsync.engine.served import ServedEngine
from hwsync.engine.vllm.local import LocalEngine
from hwsync.trainer.client import RemoteEngine, _EngineView
from hwsync.trainer.transfer_backend import TransferBackendEngine
from hwsync.trainer.verify import _OnRank0

HANDLES = {
    LocalEngine: (Engine, Generating),
    TransferBackendEngine: (Engine, Generating),
    RemoteEngine: (Engine,),
    _EngineView: (EngineQueries,),
    ServedEngine: (EngineQueries,),
    _OnRank0: (EngineQueries,),
}
ROLE_METHODS = {EngineQueries: ("describe", "state", "logprobs"), Engine: ("send",), Generating: ("generate",)}


@pytest.mark.parametrize("cls", list(HANDLES), ids=lambda c: c.__name__)
def test_each_handle_has_its_roles_and_no_other(cls: type) -> None:
    roles = HANDLES[cls]
    assert all(issubclass(cls, r) for r in roles)
    for role in (Engine, Generating):
        if role not in roles:
            assert not issubclass(cls, role), f"{cls.__name__} is a {role.__name__} it cannot be"
    assert not inspect.isabstract(cls), f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)} unimplemented"


@pytest.mark.parametrize("cls", list(HANDLES), ids=lambda c: c.__name__)
def test_no_role_method_only_raises(cls: type) -> None:
    for role, names in ROLE_METHODS.items():
        if not issubclass(cls, role):
            continue
        for name in names:
            fn = getattr(cls, name)
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
            body = tree.body[0].body  # type: ignore[attr-defined]
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring
            assert not (len(body) == 1 and isinstance(body[0], ast.Raise)), f"{cls.__name__}.{name} only raises"


def test_generate_through_a_remote_handle_names_where_to_generate() -> None:
    remote = RemoteEngine.__new__(RemoteEngine)  # no server needed: refused before any connection is used
    with pytest.raises(UnsupportedSetupError, match=r"generates in its own process: call server\.generate"):
        hwsync.generate(remote, [{"prompt_token_ids": [1, 2, 3]}])


def test_verify_takes_a_view_as_it_is_and_sync_refuses_it() -> None:
    """A handle that only answers queries (one engine of several, rank 0's engine seen from every rank) is checked as
    it is (:func:`hwsync.trainer.api.as_queries`, what verify uses) and refused as a sync target."""
    from hwsync.common.errors import SyncError
    from hwsync.trainer.api import as_engine, as_queries

    view = _EngineView.__new__(_EngineView)
    assert as_queries(view) is view
    with pytest.raises(SyncError, match="cannot sync into a _EngineView"):
        as_engine(view)
