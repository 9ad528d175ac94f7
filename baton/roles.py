"""What an engine is for, as the engine, the router and the operator all name it."""

from __future__ import annotations

from typing import Literal

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")
