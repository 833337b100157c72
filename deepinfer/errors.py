"""Errors a caller can fix: each names the offending field so the server can answer 400 with it."""


class RequestError(ValueError):
    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.status = status
