"""Device endpoints called without FastAPI's per-request machinery.

A fleet sends the server a request per check-in, download and report; FastAPI's request handler
(dependency solving, telemetry, response validation) cost more per request than the service's
own check-in. A device endpoint that takes nothing but string path parameters and the request,
and returns a JSON object, a wire model or a ``Response``, needs none of that: ``add_direct_routes`` puts a
plain Starlette route in front of each such ``APIRoute`` that calls the same endpoint function.
The ``APIRoute`` stays where it was, for the OpenAPI schema; the app's middleware and exception
handlers apply to both alike, and the answer's bytes are FastAPI's (a test compares them)."""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.datastructures import DefaultPlaceholder
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

JSON = "application/json"
#: How FastAPI serializes an endpoint's ``-> dict`` answer (pydantic's JSON, not ``json.dumps``).
_JSON_OBJECT = TypeAdapter(dict)


class DirectRoute(Route):
    """A route calling ``endpoint`` with its path parameters (and the request, if it asks)."""

    def __init__(self, route: APIRoute, endpoint: Callable[..., Any], request_name: str | None) -> None:
        params = [p.name for p in route.dependant.path_params]

        async def direct(request: Request) -> Response:
            kwargs: dict[str, Any] = {name: request.path_params[name] for name in params}
            if request_name is not None:
                kwargs[request_name] = request
            answer = await endpoint(**kwargs)
            if isinstance(answer, Response):
                return answer
            if isinstance(answer, BaseModel):  # as the route's response_model (exclude_unset) sends it
                return Response(answer.__pydantic_serializer__.to_json(answer, exclude_unset=True), media_type=JSON)
            return Response(_JSON_OBJECT.dump_json(answer), media_type=JSON)

        super().__init__(
            route.path, direct, methods=list(route.methods or ()), name=route.name, include_in_schema=False
        )
        self.methods = set(route.methods or ())  # no HEAD where the APIRoute has none


def _directable(route: APIRoute) -> bool:
    """Whether calling the endpoint directly does all FastAPI would: no query, header, cookie or
    body parameters, no dependencies, string path parameters, the default status and response
    class (or ``Response`` for an endpoint that returns one), and an answer that is a ``dict``, a
    pydantic model (or a union of models) or a ``Response``. A declared ``response_model`` only
    documents the answer here: the model is sent as the service built it, unset fields left out
    (FastAPI's route would check it against the model again, with the same bytes)."""
    d = route.dependant
    if d.query_params or d.header_params or d.cookie_params or d.body_params or d.dependencies:
        return False
    if any(
        getattr(d, name, None)
        for name in (
            "websocket_param_name",
            "http_connection_param_name",
            "response_param_name",
            "background_tasks_param_name",
            "security_scopes_param_name",
        )
    ):
        return False
    if not inspect.iscoroutinefunction(route.endpoint) or route.status_code not in (None, 200):
        return False
    try:
        signature = inspect.signature(route.endpoint, eval_str=True)
    except (NameError, TypeError, SyntaxError):
        return False
    paths = {p.name for p in d.path_params}
    for name, param in signature.parameters.items():
        if name != d.request_param_name and (name not in paths or param.annotation is not str):
            return False
    returns = signature.return_annotation
    gives_response = inspect.isclass(returns) and issubclass(returns, Response)
    if not isinstance(route.response_class, DefaultPlaceholder):  # declared only to say the answer is binary
        return route.response_class is Response and gives_response
    return returns is dict or gives_response or _models(returns)


def _models(annotation: object) -> bool:
    """Whether ``annotation`` is a pydantic model class, or a union of them."""
    members = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return all(inspect.isclass(m) and issubclass(m, BaseModel) for m in members)


def add_direct_routes(app: FastAPI, tag: str) -> list[str]:
    """Put a ``DirectRoute`` just before every ``APIRoute`` tagged ``tag`` that can be called
    directly (just before: a request whose method no route takes is answered by the first route
    of its path, and its ``Allow`` header must stay that route's); returns their paths."""
    routes: list = []
    made: list[str] = []
    for route in app.router.routes:
        if isinstance(route, APIRoute) and tag in route.tags and _directable(route):
            routes.append(DirectRoute(route, route.endpoint, route.dependant.request_param_name))
            made.append(route.path)
        routes.append(route)
    app.router.routes[:] = routes
    return made
