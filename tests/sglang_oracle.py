"""SGLang's own Python code as a test oracle on CPU (issue 14 item 1).

The real ``sglang`` wheel (version ``SGLANG_VERSION`` of ``slime_lite.backends.sglang.launcher``, installed by
``scripts/setup.sh dev`` with ``pip install --no-deps`` plus its small pure-Python imports) is imported here with a
few GPU/notebook-only modules faked: exactly those in ``FAKED_MODULES`` (triton, IPython, torchvision, tvm_ffi,
xgrammar). The fakes live in ``sys.modules`` only while SGLang's modules import (``_fakes_installed``); they are
removed right after, so ``import triton`` elsewhere in the same process still fails as before, and torch's and
transformers' "is it installed" caches are primed with the real answers first. What SGLang's import sets
process-wide (environment variables, logging handlers and levels, warning filters) is put back. Import it as
``from tests import sglang_oracle as oracle``.

What it provides (each import is lazy and cached; ``pytest.importorskip``-style skip when sglang is missing):
- ``sglang_available()`` / ``require_sglang()``: is the pinned sglang importable here (skip the test if not).
- ``server_args_parser()``: SGLang's own argparse parser (``ServerArgs.add_cli_args``).
- ``parse_server_args(argv)``: ``prepare_server_args(argv)`` -> ``ServerArgs`` (no launch, no model read).
- ``validate_generate(body)``: a ``/generate`` JSON body checked as SGLang's server does: pydantic validation of
  ``GenerateReqInput``, ``generate_contract_error(body)`` (the JSON schema gate), ``normalize_batch_and_arguments()``;
  returns the normalized object.
- ``verify_sampling_params(d, vocab_size)``: ``SamplingParams(**d).verify(vocab_size)``; returns the object.
- ``serializer()``: ``MultiprocessingSerializer`` (``serialize(obj, output_str=True)`` / ``deserialize``).
- ``flattened_tensor_bucket()``: ``(FlattenedTensorBucket, FlattenedTensorMetadata)``.
- ``openai_protocol()``: the module ``sglang.srt.entrypoints.openai.protocol`` (``CompletionRequest``,
  ``ChatCompletionRequest``, response and stream models; ``.model_validate(json)``).
- ``route_table()``: ``{(METHOD, path)}`` of SGLang's FastAPI app, included routers walked.
- ``sglang_module(name)``: any other ``sglang.*`` module, imported under the same fakes.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
import types

import pytest

# The modules SGLang imports at module level that cannot run (or are not installed) on a CPU test machine.
FAKED_MODULES = ("triton", "IPython", "torchvision", "tvm_ffi", "xgrammar")


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


class _FakeMeta(type):
    """A faked attribute is a class: subclassable, callable (also as a decorator with or without arguments),
    subscriptable, and any attribute of it is another fake."""

    def __getattr__(cls, name):
        if _is_dunder(name):
            raise AttributeError(name)
        return _fake_class(f"{cls.__qualname__}.{name}")

    def __getitem__(cls, item):
        return cls

    def __call__(cls, *args, **kwargs):
        if "_sglang_oracle_fake" not in cls.__dict__:  # a real subclass SGLang defined on top of a fake
            return super().__call__(*args, **kwargs)
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # @fake used as a decorator
        return _fake_class(f"{cls.__qualname__}()")  # @fake(...) then decorates, or a fake value

    def __iter__(cls):
        return iter(())

    def __bool__(cls):
        return False


class _FakeBase(metaclass=_FakeMeta):
    _sglang_oracle_fake = True

    def __init__(self, *args, **kwargs):
        pass

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):  # usable as a pydantic field type
        from pydantic_core import core_schema

        return core_schema.any_schema()


def _fake_class(qualname: str) -> type:
    return _FakeMeta(qualname.rsplit(".", 1)[-1], (_FakeBase,), {"__qualname__": qualname,
                                                                  "_sglang_oracle_fake": True})


class _NoDriver:
    """``triton.runtime.driver``: any use raises, so SGLang takes its CPU paths."""

    def __getattr__(self, name):
        raise RuntimeError("fake triton (tests/sglang_oracle.py): no GPU driver")


class _FakeModule(types.ModuleType):
    def __getattr__(self, name):
        if _is_dunder(name):
            raise AttributeError(name)
        value = _fake_class(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _FakeFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of FAKED_MODULES (and their submodules) with fake modules, nothing else."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".", 1)[0] in FAKED_MODULES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _FakeModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+sglang-oracle-fake"
        if spec.name == "triton.runtime":
            module.driver = _NoDriver()
        return module

    def exec_module(self, module):
        if module.__name__ == "triton":
            importlib.import_module("triton.runtime")  # so triton.runtime.driver is the raising one


def _prime_real_answers() -> None:
    """Ask torch and transformers, before any fake exists, whether triton/torchvision are installed: both cache the
    answer, so a fake seen during SGLang's import cannot change what later tests in this process get."""
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from torch.utils import _triton
    from transformers.utils import import_utils

    _triton.has_triton_package()
    _triton.has_triton()
    for name in ("is_torchvision_available", "is_torchvision_v2_available", "is_triton_available",
                 "is_vision_available"):
        fn = getattr(import_utils, name, None)
        if fn is not None:
            fn()


@contextlib.contextmanager
def _fakes_installed():
    """The fakes, only for the imports inside; what SGLang's import changes process-wide (environment variables such
    as TRITON_CACHE_DIR, root logging handlers, logger levels, warning filters) is put back afterwards."""
    import logging
    import os
    import warnings

    _prime_real_answers()
    before = {name for name in sys.modules if name.split(".", 1)[0] in FAKED_MODULES}
    environ = dict(os.environ)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    levels = {name: lg.level for name, lg in logging.root.manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    finder = _FakeFinder()
    sys.meta_path.insert(0, finder)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SGLang warns about every GPU-only feature on CPU
            yield
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.split(".", 1)[0] in FAKED_MODULES and n not in before]:
            del sys.modules[name]
        os.environ.clear()
        os.environ.update(environ)
        root.handlers[:] = handlers
        root.setLevel(level)
        for name, lg in logging.root.manager.loggerDict.items():
            if isinstance(lg, logging.Logger):
                lg.setLevel(levels.get(name, logging.NOTSET))


@functools.cache
def sglang_module(name: str):
    """Import ``name`` (a ``sglang.*`` module) with the fakes in place; cached."""
    with _fakes_installed():
        return importlib.import_module(name)


@functools.cache
def sglang_available() -> bool:
    try:
        import importlib.metadata as md

        from slime_lite.backends.sglang.launcher import SGLANG_VERSION

        return md.version("sglang") == SGLANG_VERSION
    except Exception:
        return False


def require_sglang() -> None:
    if not sglang_available():
        pytest.skip("the pinned sglang is not installed here (bash scripts/setup.sh dev installs it)")


# ---------------------------------------------------------------- what the tests use
def server_args_parser():
    import argparse

    require_sglang()
    mod = sglang_module("sglang.srt.server_args")
    parser = argparse.ArgumentParser(exit_on_error=False)
    mod.ServerArgs.add_cli_args(parser)
    return parser


def parse_server_args(argv: list[str]):
    require_sglang()
    return sglang_module("sglang.srt.server_args").prepare_server_args(list(argv))


def validate_generate(body: dict):
    """Check a /generate JSON body the way SGLang's server does; raise on what it would refuse."""
    import pydantic

    require_sglang()
    io_struct = sglang_module("sglang.srt.managers.io_struct")
    contract = sglang_module("sglang.srt.entrypoints.api_contract")
    req = pydantic.TypeAdapter(io_struct.GenerateReqInput).validate_python(body)
    error = contract.generate_contract_error(body)  # SGLang checks the raw JSON body against its schema too
    if error is not None:
        raise ValueError(f"SGLang's generate contract refuses the body: {error}")
    req.normalize_batch_and_arguments()
    return req


def verify_sampling_params(params: dict, vocab_size: int):
    require_sglang()
    mod = sglang_module("sglang.srt.sampling.sampling_params")
    sp = mod.SamplingParams(**params)
    sp.verify(vocab_size)
    return sp


def serializer():
    require_sglang()
    return sglang_module("sglang.srt.utils.common").MultiprocessingSerializer


def flattened_tensor_bucket():
    require_sglang()
    mod = sglang_module("sglang.srt.weight_sync.tensor_bucket")
    return mod.FlattenedTensorBucket, mod.FlattenedTensorMetadata


def openai_protocol():
    require_sglang()
    return sglang_module("sglang.srt.entrypoints.openai.protocol")


@functools.cache
def route_table() -> frozenset[tuple[str, str]]:
    """{(METHOD, path)} of SGLang's HTTP server (HEAD left out), with the routes of included routers: FastAPI keeps
    an included router as one lazy route that holds the original router and its prefix."""
    require_sglang()
    app = sglang_module("sglang.srt.entrypoints.http_server").app
    routes: set[tuple[str, str]] = set()

    def walk(items, prefix: str) -> None:
        for route in items:
            included = getattr(route, "original_router", None)
            if included is not None:
                walk(included.routes, prefix + getattr(route.include_context, "prefix", ""))
                continue
            for method in getattr(route, "methods", None) or ():
                if method != "HEAD":
                    routes.add((method, prefix + route.path))

    walk(app.router.routes, "")
    if not any(path == "/v1/loads" for _, path in routes):
        raise AssertionError("SGLang's /v1/loads (an included router) was not found: this FastAPI keeps included "
                             "routers differently; update route_table() in tests/sglang_oracle.py")
    return frozenset(routes)
