"""gRPC method handlers that take requests as bytes and parse them themselves.

A request that fails protobuf parsing inside grpcio's own deserialization
path leaked about 16 KiB of server memory per call, never returned
(grpcio 1.85.1; reproduced on a bare grpcio server): 4,000 requests of
``b"\\x0a\\xff\\xff\\xff"`` took a parameter server from 56 to 119 MiB. So
every method of our services is registered with a bytes pass-through
(``request_deserializer=None``) and the handler parses the request here,
answering INVALID_ARGUMENT with what was wrong, before the servicer runs.

``add_service`` builds the handlers of a whole service from its generated
descriptor: a method added to a .proto file is covered with nothing to
write but its servicer method. ``overrides`` keeps hand-framed methods
(ParameterServerBulk) as their own handler functions.

This is also where a handler's error becomes a gRPC status, once for every
method (``guard``): handlers raise the typed errors of psserver.contract
and never abort a call themselves.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterator, Mapping

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError

from psserver import profiling
from psserver.errors import Internal, InvalidArgument, as_error
from psserver.link.grpc_common import grpc_code

log = logging.getLogger(__name__)


def _abort(context, exc: BaseException, fn) -> None:
    err = as_error(exc)
    if isinstance(err, Internal):   # a bug: its traceback in the server's log
        log.error("internal error in %s", getattr(fn, "__qualname__", fn), exc_info=exc)
    context.abort(grpc_code(err.code), str(err))


def guard(fn: Callable, server_streaming: bool = False) -> Callable:
    """``fn(request, context)`` whose exceptions end the call with the status
    of their typed error (psserver.errors.as_error)."""
    if server_streaming:
        def streaming(request, context):
            try:
                yield from fn(request, context)
            except Exception as exc:
                _abort(context, exc, fn)
        return streaming

    def unary(request, context):
        try:
            return profiling.served(fn, request, context)
        except Exception as exc:
            _abort(context, exc, fn)
    return unary


def _bad_request(cls, exc: Exception) -> str:
    return (f"the request is not a valid {cls.DESCRIPTOR.full_name} message "
            f"({type(exc).__name__}: {exc}); nothing was done. Use a client generated from "
            "protos/pstrain/v1 of the same pstrain version")


def parse(cls, raw: bytes):
    """``cls.FromString(raw)``; InvalidArgument (a PSError) when it is not one."""
    try:
        return cls.FromString(raw)
    except (DecodeError, ValueError, TypeError, RuntimeError) as exc:
        raise InvalidArgument(_bad_request(cls, exc)) from None


def _unary_request(fn: Callable, cls) -> Callable:
    def handler(raw, context):
        return fn(parse(cls, raw), context)
    return handler


def _stream_request(fn: Callable, cls) -> Callable:
    """Each frame parsed as it is read; a bad one raises InvalidArgument into
    the servicer (which answers it as any other bad request)."""
    def handler(raws: Iterator[bytes], context):
        return fn((parse(cls, raw) for raw in raws), context)
    return handler


def method_handlers(service, servicer, overrides: Mapping[str, Callable] = {}
                    ) -> dict[str, grpc.RpcMethodHandler]:
    """name -> handler for every method of ``service`` (a ServiceDescriptor)
    that ``servicer`` implements, requests parsed by the handler. An
    override takes the request's bytes and returns the reply's (or a message)."""
    out = {}
    for m in service.methods:
        fn = overrides.get(m.name) or getattr(servicer, m.name, None)
        if fn is None:
            continue
        req = message_factory.GetMessageClass(m.input_type)
        # a handler may frame its reply by hand (psserver/contract/wire.py): bytes pass as they are
        serialize = _bytes_or(message_factory.GetMessageClass(m.output_type).SerializeToString)
        if m.name in overrides:
            h = fn
        elif m.client_streaming:
            h = _stream_request(fn, req)
        else:
            h = _unary_request(fn, req)
        if m.client_streaming:
            make = (grpc.stream_stream_rpc_method_handler if m.server_streaming
                    else grpc.stream_unary_rpc_method_handler)
        else:
            make = (grpc.unary_stream_rpc_method_handler if m.server_streaming
                    else grpc.unary_unary_rpc_method_handler)
        out[m.name] = make(guard(h, m.server_streaming), request_deserializer=None,
                           response_serializer=serialize)
    return out


def _bytes_or(serialize: Callable) -> Callable:
    """A reply serializer that lets bytes a handler framed itself through."""
    return lambda reply: reply if isinstance(reply, (bytes, bytearray)) else serialize(reply)


def add_service(server: grpc.Server, service, servicer,
                overrides: Mapping[str, Callable] = {}) -> None:
    """Register every method of ``service`` (ServiceDescriptor) on ``server``."""
    handlers = method_handlers(service, servicer, overrides)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
