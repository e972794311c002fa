"""Pydantic models the real-client tests ask the model for (structured outputs, tools).

Bounded strings keep a tiny model's constrained output short: a field without `max_length` lets it
run to the token limit, and the test would time out rather than check the protocol."""

from __future__ import annotations

from pydantic import BaseModel, Field


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(max_length=24)
