"""`shared.openapi`: request bodies decoded with msgspec appear in the app's OpenAPI schema."""

from __future__ import annotations

from typing import Literal

import msgspec
import pytest
from fastapi import FastAPI, Request

from shared.http import read_body
from shared.openapi import document_bodies, json_body

pytestmark = pytest.mark.unit


class Inner(msgspec.Struct):
    size: int


class OuterBody(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    inner: Inner
    mode: Literal["a", "b"] = "a"


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/things", openapi_extra=json_body(OuterBody))
    async def things(request: Request) -> dict:
        return {"name": (await read_body(request, OuterBody)).name}

    @app.post("/optional", openapi_extra=json_body(Inner, required=False))
    async def optional() -> dict:
        return {}

    document_bodies(app)
    return app


def test_declared_bodies_and_the_structs_they_nest_are_components():
    schema = _app().openapi()
    body = schema["paths"]["/things"]["post"]["requestBody"]
    assert body["required"] is True
    assert body["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/OuterBody"}
    assert schema["paths"]["/optional"]["post"]["requestBody"]["required"] is False
    components = schema["components"]["schemas"]
    outer = components["OuterBody"]
    assert outer["required"] == ["name", "inner"]
    assert outer["properties"]["inner"] == {"$ref": "#/components/schemas/Inner"}
    assert outer["properties"]["mode"]["enum"] == ["a", "b"]
    assert outer["additionalProperties"] is False
    assert components["Inner"]["properties"]["size"]["type"] == "integer"


def test_schema_is_stable_across_calls():
    app = _app()
    assert app.openapi() == app.openapi()


def test_two_body_structs_with_one_name_are_refused():
    json_body(Inner)
    OtherInner = msgspec.defstruct("Inner", [("x", int)])
    with pytest.raises(ValueError, match="named 'Inner'"):
        json_body(OtherInner)
