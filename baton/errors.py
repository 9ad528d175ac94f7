"""The errors Baton's HTTP servers answer, in one shape: OpenAI's error body with vLLM's
`object` (`{"object": "error", "error": {message, type, param, code}}`), so that a client cannot
tell an engine's error from the router's by its form."""

from __future__ import annotations

import json
import re
from http import HTTPStatus
from typing import Any

from starlette.responses import Response

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestEntityTooLarge",
    429: "TooManyRequests",
    500: "InternalServerError",
    502: "BadGateway",
    503: "ServiceUnavailable",
    504: "GatewayTimeout",
}


class APIError(Exception):
    """An error a client caused or must be told about; `param` names the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @classmethod
    def from_value_error(cls, error: ValueError, param: str | None = None) -> APIError:
        """A 400 for a `ValueError` whose message starts with the field it names."""
        match = re.match(r"(\w+)(\[\])? must", str(error))
        return cls(400, str(error), param or (match.group(1) if match else None))

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPES.get(self.status) or _type_of(self.status)
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.status}
        return {"object": "error", "error": error}

    def response(self) -> Response:
        return Response(
            json.dumps(self.body()), status_code=self.status, media_type="application/json"
        )

    def sse(self) -> bytes:
        """The error as a server-sent event, for a stream whose headers already went out."""
        return f"data: {json.dumps(self.body())}\n\n".encode()


def _type_of(status: int) -> str:
    """A status outside ERROR_TYPES by its HTTP phrase (405: MethodNotAllowed)."""
    try:
        return HTTPStatus(status).phrase.title().replace(" ", "").replace("-", "")
    except ValueError:
        return "InternalServerError" if status >= 500 else "BadRequestError"
