"""Tool calling: request validation, one output parser per model family, streaming deltas.

``request`` checks ``tools`` / ``tool_choice`` and the tool fields of messages; ``parsers``
holds the parser contract and the registry (``hermes``, ``llama3_json``), chosen from the
checkpoint's chat template unless ``--tool-call-parser`` names one; ``stream`` turns a growing
reply into OpenAI-shaped content and ``tool_calls`` deltas. DeepSeek-V4's DSML calls are parsed
by deepseek-recipe (``server/deepseek_encoding.py``, ``--tool-call-parser deepseek_v4``).
"""

from .parsers import (PARSERS, ToolCall, ToolOutput, ToolParser, detect_parser, get_parser,
                      number_calls, resolve_parser)
from .request import ToolRequest
from .stream import CallDelta, StreamPiece, ToolCallStream

__all__ = ["PARSERS", "CallDelta", "StreamPiece", "ToolCall", "ToolCallStream", "ToolOutput",
           "ToolParser", "ToolRequest", "detect_parser", "get_parser", "number_calls",
           "resolve_parser"]
