"""Grammar-constrained decoding: what a request asks for (``spec``) and how it is enforced
(``grammar``: compiled once per spec, one matcher per sequence, a token mask per step)."""

from .spec import StructuredOutput

__all__ = ["StructuredOutput"]
