"""The errors the router itself answers, in the engines' OpenAI shape (`{"object": "error",
"error": {message, type, param, code}}`), so a client cannot tell a router error from an
engine error by its form."""

from __future__ import annotations

import json

from starlette.responses import Response

_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    413: "RequestEntityTooLarge",
    429: "TooManyRequests",
    502: "BadGateway",
    503: "ServiceUnavailable",
    504: "GatewayTimeout",
}


class RouterError(Exception):
    """A request the router cannot serve; becomes an OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, object]:
        kind = _TYPES.get(self.status, "InternalServerError")
        return {
            "object": "error",
            "error": {
                "message": self.message,
                "type": kind,
                "param": self.param,
                "code": self.status,
            },
        }

    def response(self) -> Response:
        return Response(
            json.dumps(self.body()), status_code=self.status, media_type="application/json"
        )

    def sse(self) -> bytes:
        """The error as a server-sent event, for a stream whose headers already went out."""
        return f"data: {json.dumps(self.body())}\n\n".encode()
