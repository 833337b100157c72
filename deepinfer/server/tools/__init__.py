"""Tool calling: request validation, one output parser per model family, streaming deltas.

``request`` checks ``tools`` / ``tool_choice`` and the tool fields of messages; ``parsers``
holds the parser contract and the registry (``hermes``, ``llama3_json``), chosen from the checkpoint's
chat template unless ``--tool-call-parser`` names one; ``stream`` turns a growing reply into
OpenAI-shaped content and ``tool_calls`` deltas.
"""

from .parsers import (PARSERS, ToolCall, ToolOutput, ToolParser, detect_parser, get_parser,
                      number_calls, resolve_parser)
from .stream import ToolCallStream

__all__ = ["PARSERS", "ToolCall", "ToolCallStream", "ToolOutput", "ToolParser", "detect_parser",
           "get_parser", "number_calls", "resolve_parser"]
